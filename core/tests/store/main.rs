//! The store suite: the event log, projections, replay, the inbox and migrations, run
//! against SQLite and, when `KEEL_TEST_POSTGRES_URL` is set, PostgreSQL (a fresh database
//! per test). Every test is generated once per backend: `sqlite::name`, `postgres::name`.

mod support;

mod conflict;
mod deferred;
mod epoch;
mod execution;
mod inbox;
mod lifecycle;
mod log;
mod migrate;
mod projector;
mod properties;
mod replay;
