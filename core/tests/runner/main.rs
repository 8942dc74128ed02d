//! The runner end to end inside one process: a real store (SQLite), the coordinator, the
//! scripted provider or a provider the test drives through a channel, and test tools that
//! report to the test. Nothing sleeps: tests wait on channels and on `Runner::run`.

mod support;

mod anthropic;
mod cancellation;
mod compaction;
mod faults;
mod openai;
mod ownership;
mod permissions;
mod recovery;
mod retries;
mod steps;
