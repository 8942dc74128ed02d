//! keel-core: Keel's engine, as a library. The `keel` binary (feature `cli`, on by
//! default) lives in `src/bin/keel/`; `default-features = false` builds this library alone.
//!
//! Modules, from the database up (docs/architecture.md draws them):
//! - [`clock`]: injectable time, so tests never sleep.
//! - [`config`]: `keel.toml`: providers, models and agents.
//! - [`store`]: the database (SQLite or PostgreSQL), migrations, group-committed writes.
//! - [`event`]: the event log, the projections written from it and the views read from them.
//! - [`epoch`]: context epochs: the system prompt a session's requests start with.
//! - [`instructions`]: a project's instruction files (`AGENTS.md`), added to the prompt.
//! - [`inbox`]: admission of inputs and their promotion into the transcript.
//! - [`execution`]: claims, leases and the fence.
//! - [`coordinator`]: at most one drain per session; wakes, joins, interrupts.
//! - [`provider`]: model requests as streams of LLM events; one adapter per API.
//! - [`tool`]: the tools the model can call, confined to the session directory.
//! - [`mcp`]: MCP tool servers, whose tools are offered beside the built-in ones.
//! - [`permission`]: an agent's permission rules: allow, ask or deny, by tool and pattern.
//! - [`request`]: permission requests and questions: durable waits for a person.
//! - [`runner`]: drains a session through the model and its tools, fenced.
//! - [`recovery`]: takes over the executions of dead owners, exactly once.
//! - [`cluster`]: several nodes on one database: the node table, LISTEN/NOTIFY.
//! - [`server`]: the HTTP routes and event streams.
//! - [`metrics`]: Prometheus metrics of the process (`GET /metrics`).
//! - [`node`]: one serving process, all of the above wired together and run.

pub mod clock;
pub mod cluster;
pub mod config;
pub mod coordinator;
pub mod epoch;
pub mod event;
pub mod execution;
pub mod inbox;
pub mod instructions;
pub mod mcp;
pub mod metrics;
pub mod node;
pub mod permission;
pub mod provider;
pub mod recovery;
pub mod request;
pub mod runner;
pub mod server;
pub mod store;
#[cfg(feature = "otlp")]
pub mod telemetry;
pub mod tool;
