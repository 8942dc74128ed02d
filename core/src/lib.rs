//! keel-core: Keel's engine.
//!
//! - [`store`]: the database (SQLite or PostgreSQL), migrations, group-committed writes.
//! - [`event`]: the event log and the projections built from it.
//! - [`execution`]: claims, leases and the fence.
//! - [`coordinator`]: at most one drain per session; wakes, joins, interrupts.
//! - [`inbox`]: admission of inputs and their promotion into the transcript.
//! - [`tool`]: the tools the model can call, confined to the session directory.
//! - [`clock`]: injectable time.
//! - [`cluster`]: several nodes on one database: the node table, LISTEN/NOTIFY.

pub mod clock;
pub mod cluster;
pub mod config;
pub mod coordinator;
pub mod event;
pub mod execution;
pub mod inbox;
pub mod provider;
pub mod recovery;
pub mod runner;
pub mod server;
pub mod store;
pub mod tool;
