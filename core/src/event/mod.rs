//! The event log and its projections.
//!
//! - [`log`]: appending events (gapless per-session `seq`, projection in the same
//!   transaction) and reading them back.
//! - [`projector`]: writing the tables `session`, `session_message`, `session_tool` and
//!   `session_input`, each a pure function of the log.
//! - [`view`]: reading those tables: sessions, inputs, the transcript, unresolved calls.
//! - [`replay`]: rebuilding a session's projections from its log in another database.

pub(crate) mod counters;
pub mod log;
pub mod projector;
pub mod replay;
pub(crate) mod rows;
pub mod view;
