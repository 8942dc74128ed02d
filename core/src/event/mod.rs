//! The event log and its projections.
//!
//! - [`log`]: appending events (gapless per-session `seq`, projection in the same
//!   transaction) and reading them back.
//! - [`projector`]: the tables `session`, `session_message`, `session_tool` and
//!   `session_input`, each a pure function of the log.
//! - [`replay`]: rebuilding a session's projections from its log in another database.

pub mod log;
pub mod projector;
pub mod replay;
