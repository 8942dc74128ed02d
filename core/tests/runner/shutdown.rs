//! A planned shutdown: no new execution is claimed, a step that reaches its boundary
//! within the grace ends normally, one still running after it is stopped as `shutdown`,
//! and either way the continuation for after the restart is durable.

use std::time::Duration;

use keel_core::recovery::Recovery;
use keel_core::runner::Error;
use keel_schema::event::DurableEvent;
use keel_schema::types::{Finish, InputSource, InterruptReason, Outcome};
use serde_json::json;

use crate::support::{Harness, Setup, call, script, text};

fn gated() -> Setup {
    Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Continued after the restart.")],
        ])),
        ..Setup::default()
    }
}

/// The continuation the shutdown left, if any, and whether it asks for execution.
fn continuation(log: &[keel_schema::event::Envelope]) -> Option<bool> {
    log.iter().find_map(|e| match &e.event {
        DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery => {
            Some(p.request_execution)
        }
        _ => None,
    })
}

#[tokio::test]
async fn a_step_still_running_after_the_grace_is_stopped_as_shutdown_and_continues_after_a_restart()
{
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    let stopped = h
        .runner
        .shut_down(Duration::from_millis(20), Duration::from_secs(30))
        .await;
    assert_eq!(stopped, 1);
    assert!(matches!(
        run.await.unwrap(),
        Err(keel_core::coordinator::RunError::Failed(Error::Interrupted))
    ));
    assert!(!h.claim_exists(session).await);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::Shutdown)));
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Interrupted
            && s.error.as_ref().is_some_and(|e| e.kind == "execution.shutdown"))));
    assert_eq!(continuation(&log), Some(true));
    // The stopping process claims nothing more.
    assert!(h.runner.run(session).await.is_err());
    // The restarted process finds the continuation through the redrive of lost wakes.
    let restarted = h.other_runner();
    let report = Recovery::default().pass(&restarted).await.unwrap();
    assert_eq!(report.redriven, vec![session]);
    restarted.run(session).await.unwrap();
    let log = h.log(session).await;
    assert!(
        !log.iter()
            .any(|e| matches!(&e.event, DurableEvent::StepRecovered(_)))
    );
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::TextEnded(t) if t.text == "Continued after the restart.")));
}

#[tokio::test]
async fn a_step_that_reaches_its_boundary_within_the_grace_ends_normally_and_continues_after_a_restart()
 {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    let mut stopping = Box::pin(
        h.runner
            .shut_down(Duration::from_secs(60), Duration::from_secs(30)),
    );
    // The shutdown has begun (its first poll sets it going) when the call finishes.
    assert!(futures::poll!(&mut stopping).is_pending());
    h.release.notify_one();
    assert_eq!(stopping.await, 0);
    assert!(matches!(
        run.await.unwrap(),
        Err(keel_core::coordinator::RunError::Failed(
            Error::ShuttingDown
        ))
    ));
    assert!(!h.claim_exists(session).await);
    let log = h.log(session).await;
    assert!(
        !log.iter()
            .any(|e| matches!(&e.event, DurableEvent::StepInterrupted(_)))
    );
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepEnded(s) if s.finish == Finish::ToolCalls)));
    assert_eq!(continuation(&log), Some(true));
    let restarted = h.other_runner();
    Recovery::default().pass(&restarted).await.unwrap();
    restarted.run(session).await.unwrap();
    assert!(h.log(session).await.iter().any(|e| matches!(&e.event,
        DurableEvent::TextEnded(t) if t.text == "Continued after the restart.")));
}

#[tokio::test]
async fn a_shutdown_between_executions_leaves_no_continuation() {
    let h = Harness::new(Setup::default()).await;
    let session = h.prompted("go").await;
    h.runner.run(session).await.unwrap();
    assert_eq!(
        h.runner
            .shut_down(Duration::from_millis(20), Duration::from_secs(1))
            .await,
        0
    );
    assert_eq!(continuation(&h.log(session).await), None);
}

#[tokio::test]
async fn a_users_interrupt_during_the_grace_stops_the_step_as_the_users_and_is_not_continued() {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    let mut stopping = Box::pin(
        h.runner
            .shut_down(Duration::from_secs(60), Duration::from_secs(30)),
    );
    assert!(futures::poll!(&mut stopping).is_pending());
    // The user stops the step while the shutdown waits for it.
    assert!(h.runner.interrupt(session).await);
    assert_eq!(stopping.await, 0);
    assert!(matches!(
        run.await.unwrap(),
        Err(keel_core::coordinator::RunError::Failed(Error::Interrupted))
    ));
    let log = h.log(session).await;
    let reasons: Vec<InterruptReason> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepInterrupted(i) => Some(i.reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons, [InterruptReason::User]);
    assert_eq!(
        continuation(&log),
        None,
        "what the user stopped stays stopped"
    );
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Interrupted && s.error.is_none())));
    assert!(!h.claim_exists(session).await);
}
