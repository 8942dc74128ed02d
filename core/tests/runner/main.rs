//! The runner end to end inside one process: a real store (SQLite), the coordinator, the
//! scripted provider or a provider the test drives through a channel, and test tools that
//! report to the test. Nothing sleeps: tests wait on channels and on `Runner::run`.

/// Asserts that a run's outcome matches a pattern: runner errors carry their causes, so
/// they are matched, not compared.
macro_rules! assert_outcome {
    ($outcome:expr, $($pattern:tt)+) => {{
        let outcome = $outcome;
        assert!(matches!(outcome, $($pattern)+), "unexpected outcome: {outcome:?}");
    }};
}

mod support;

mod agents;
mod anthropic;
mod cancellation;
mod compaction;
mod epochs;
mod faults;
mod openai;
mod ownership;
mod permissions;
mod recovery;
mod retries;
mod routed;
mod shutdown;
mod steps;
