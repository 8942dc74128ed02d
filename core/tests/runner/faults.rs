//! Fault injection: the store fails one commit at a time, at every commit boundary of a
//! full tool-using step, and the session never ends with a stranded claim, a tool left
//! pending or running, or a step without exactly one terminal event.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use diesel::prelude::*;
use keel_core::store::schema::session_tool;
use keel_core::store::{self, Failpoint};
use keel_schema::event::DurableEvent;
use keel_schema::id::{MessageId, SessionId};
use serde_json::json;

use crate::support::{Harness, Setup, call, script, text};

const NEVER: u64 = u64::MAX;

async fn harness(fail_at: Arc<AtomicU64>) -> Harness {
    let failpoint = Failpoint(Arc::new(move |ordinal| {
        ordinal == fail_at.load(Ordering::SeqCst)
    }));
    Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Looking."), call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await
}

/// Creates the session and admits the prompt; returns it and the commit count so far.
async fn prepare(h: &Harness) -> (SessionId, u64) {
    let session = h.prompted("go").await;
    (session, h.store.stats().0)
}

async fn check_invariants(h: &Harness, session: SessionId, label: &str) {
    assert!(
        !h.claim_exists(session).await,
        "{label}: the claim is stranded"
    );
    let open: Vec<String> = h
        .store
        .read(move |c| {
            session_tool::table
                .filter(session_tool::session_id.eq(session.to_string()))
                .filter(session_tool::status.eq_any(["pending", "running"]))
                .select(session_tool::call_id)
                .load(c)
                .map_err(store::Error::from)
        })
        .await
        .unwrap();
    assert_eq!(
        open,
        Vec::<String>::new(),
        "{label}: a tool is left unresolved"
    );
    let mut terminals: HashMap<MessageId, usize> = HashMap::new();
    for event in h.log(session).await {
        match event.event {
            DurableEvent::StepStarted(s) => {
                terminals.entry(s.assistant_message_id).or_insert(0);
            }
            DurableEvent::StepEnded(e) => {
                *terminals.entry(e.assistant_message_id).or_insert(0) += 1
            }
            DurableEvent::StepFailed(e) => {
                *terminals.entry(e.assistant_message_id).or_insert(0) += 1
            }
            DurableEvent::StepInterrupted(e) => {
                *terminals.entry(e.assistant_message_id).or_insert(0) += 1
            }
            DurableEvent::StepRecovered(e) => {
                *terminals.entry(e.assistant_message_id).or_insert(0) += 1
            }
            _ => {}
        }
    }
    for (message, count) in terminals {
        assert_eq!(
            count, 1,
            "{label}: step {message} has {count} terminal events"
        );
    }
}

#[tokio::test]
async fn a_failed_commit_at_any_boundary_of_a_tool_using_step_leaves_no_stranded_state() {
    // A clean run first, to count the commits the execution makes.
    let fail_at = Arc::new(AtomicU64::new(NEVER));
    let clean = harness(fail_at.clone()).await;
    let (session, before) = prepare(&clean).await;
    clean.runner.run(session).await.unwrap();
    let commits = clean.store.stats().0 - before;
    check_invariants(&clean, session, "clean run").await;
    // The claim, each boundary (with the previous step's end and the next step's start),
    // each step's burst of output, the release.
    assert!(
        commits >= 7,
        "a tool-using execution makes several commits ({commits})"
    );

    let (mut failed_runs, mut failed_steps) = (0, 0);
    for k in 0..commits {
        let fail_at = Arc::new(AtomicU64::new(NEVER));
        let h = harness(fail_at.clone()).await;
        let (session, base) = prepare(&h).await;
        fail_at.store(base + k, Ordering::SeqCst);
        // The execution may fail or recover; either way it must end cleanly.
        let outcome = h.runner.run(session).await;
        check_invariants(&h, session, &format!("commit {k} failed ({outcome:?})")).await;
        failed_runs += usize::from(outcome.is_err());
        failed_steps += h
            .log(session)
            .await
            .iter()
            .filter(|e| matches!(&e.event, DurableEvent::StepFailed(_)))
            .count();
    }
    // The failpoint really fired: executions failed, and broken steps were settled.
    assert!(
        failed_runs > 0 && failed_steps > 0,
        "{failed_runs} {failed_steps}"
    );
}

/// A tool whose work cannot be stopped midway (a file write, say): cancelled, it says so,
/// then finishes only when the test lets it.
struct Stubborn {
    started: tokio::sync::mpsc::UnboundedSender<()>,
    cancelled: tokio::sync::mpsc::UnboundedSender<()>,
    finish: Arc<tokio::sync::Notify>,
    finished: Arc<std::sync::atomic::AtomicBool>,
}

impl keel_core::tool::Tool for Stubborn {
    fn name(&self) -> &'static str {
        "stubborn"
    }
    fn description(&self) -> &'static str {
        "Finishes its work even when cancelled."
    }
    fn effect(&self) -> keel_schema::types::Effect {
        keel_schema::types::Effect::Write
    }
    fn input_schema(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    fn permission_pattern(&self, _: &serde_json::Value, _: &std::path::Path) -> String {
        "stubborn".into()
    }
    fn run<'a>(
        &'a self,
        _: serde_json::Value,
        context: &'a keel_core::tool::Context,
    ) -> keel_core::tool::Run<'a> {
        Box::pin(async move {
            self.started.send(()).unwrap();
            context.cancel.cancelled().await;
            self.cancelled.send(()).unwrap();
            self.finish.notified().await;
            self.finished.store(true, Ordering::SeqCst);
            Err(keel_core::tool::Error::Interrupted)
        })
    }
}

#[tokio::test]
async fn a_step_that_breaks_off_joins_its_running_calls_before_step_failed() {
    use keel_core::provider::Event;
    use keel_core::runner::Live;
    use keel_schema::types::Delivery;
    use tokio::sync::{Notify, mpsc};

    let fail_at = Arc::new(AtomicU64::new(NEVER));
    let threshold = fail_at.clone();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let (cancelled_tx, mut cancelled) = mpsc::unbounded_channel();
    let finish = Arc::new(Notify::new());
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = Harness::new(Setup {
        failpoint: Some(Failpoint(Arc::new(move |ordinal| {
            ordinal == threshold.load(Ordering::SeqCst)
        }))),
        tools: vec![Arc::new(Stubborn {
            started: started_tx,
            cancelled: cancelled_tx,
            finish: finish.clone(),
            finished: finished.clone(),
        })],
        ..Setup::default()
    })
    .await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    stream
        .send(Ok(Event::ToolCall {
            id: "c1".into(),
            name: "stubborn".into(),
            input: "{}".into(),
            provider_executed: false,
        }))
        .unwrap();
    started.recv().await.unwrap();
    // The next commit (the text the model goes on with) fails: the step breaks off while
    // the call still works.
    fail_at.store(h.store.stats().0, Ordering::SeqCst);
    stream.send(Ok(Event::TextStart)).unwrap();
    cancelled.recv().await.unwrap();
    let step_failed = |live: &mut tokio::sync::broadcast::Receiver<Live>| {
        let mut live = live.resubscribe();
        async move {
            loop {
                if let Live::Durable(e) = live.recv().await.unwrap()
                    && matches!(e.event, DurableEvent::StepFailed(_))
                {
                    return;
                }
            }
        }
    };
    // A step that did not wait for its calls would write its end now, within
    // milliseconds; one that joins them cannot, however long this waits. (A bound on
    // the wait, not a measure of speed.)
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(500),
        step_failed(&mut live),
    )
    .await;
    assert!(
        early.is_err(),
        "step.failed was written while a call still worked"
    );
    let written = step_failed(&mut live);
    finish.notify_one();
    written.await;
    assert!(finished.load(Ordering::SeqCst));
    drop(stream);
    assert!(run.await.unwrap().is_err());
    assert!(!h.claim_exists(session).await);
}
