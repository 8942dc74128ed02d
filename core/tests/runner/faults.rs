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
