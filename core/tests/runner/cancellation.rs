//! Interrupts: the running tool fails durably, the step gets exactly one
//! `step.interrupted`, the claim is released, and input arriving meanwhile stays pending.

use std::time::Duration;

use keel_core::coordinator::RunError;
use keel_core::inbox;
use keel_core::provider::Event;
use keel_core::runner::Error;
use keel_schema::api::{AssistantPart, Message, ToolStatus};
use keel_schema::event::DurableEvent;
use keel_schema::types::{Delivery, InterruptReason, Outcome};
use serde_json::json;

use crate::support::{Harness, Hold, Setup, call, script, text};

#[tokio::test]
async fn interrupting_a_running_tool_fails_it_durably_with_exactly_one_step_interrupted() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![vec![call("gate", json!({}))]])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    assert!(h.runner.interrupt(session).await);
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );

    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .collect();
    assert_eq!(
        tail,
        vec!["tool.called", "step.interrupted", "execution.settled"]
    );
    let log = h.log(session).await;
    let DurableEvent::ExecutionSettled(settled) = &log.last().unwrap().event else {
        panic!()
    };
    assert_eq!(settled.outcome, Outcome::Interrupted);
    let tools = h
        .store
        .read(move |c| keel_core::event::view::messages(c, session))
        .await
        .unwrap();
    let text = format!("{tools:?}");
    assert!(text.contains("tool.interrupted"), "{text}");
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn interrupting_a_streaming_step_publishes_one_step_interrupted_and_clears_the_claim() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    stream.send(Ok(Event::TextStart)).unwrap();
    loop {
        if let keel_core::runner::Live::Durable(e) = live.recv().await.unwrap()
            && e.event.type_name() == "session.next.text.started"
        {
            break;
        }
    }
    assert!(h.runner.interrupt(session).await);
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );
    let log = h.log(session).await;
    let interrupted: Vec<InterruptReason> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepInterrupted(i) => Some(i.reason),
            _ => None,
        })
        .collect();
    assert_eq!(interrupted, vec![InterruptReason::User]);
    assert!(!h.claim_exists(session).await);
    drop(stream);
}

#[tokio::test]
async fn interrupt_when_idle_returns_false() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session().await;
    assert!(!h.runner.interrupt(session).await);
}

#[tokio::test]
async fn input_arriving_during_an_interruption_stays_pending_for_a_later_run() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Later.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    assert!(h.runner.interrupt(session).await);
    h.admit(session, "steer", Delivery::Steer).await;
    h.admit(session, "queued", Delivery::Queue).await;
    run.await.unwrap().unwrap_err();
    let pending = h
        .store
        .read(move |c| inbox::pending(c, session))
        .await
        .unwrap();
    assert_eq!(pending.len(), 2);
    h.runner.run(session).await.unwrap();
    let pending = h
        .store
        .read(move |c| inbox::pending(c, session))
        .await
        .unwrap();
    assert_eq!(pending, vec![]);
}

#[tokio::test]
async fn a_failed_cleanup_keeps_the_claim_cancelling_and_surfaces_the_cause() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use keel_core::store::Failpoint;
    use keel_schema::types::Phase;

    let from = Arc::new(AtomicU64::new(u64::MAX));
    let threshold = from.clone();
    let mut h = Harness::new(Setup {
        script: Some(script(vec![vec![call("gate", json!({}))]])),
        failpoint: Some(Failpoint(Arc::new(move |ordinal| {
            ordinal >= threshold.load(Ordering::SeqCst)
        }))),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    assert!(h.runner.interrupt(session).await);
    // From now on the database refuses every commit.
    from.store(h.store.stats().0, Ordering::SeqCst);
    let outcome = run.await.unwrap();
    let Err(RunError::Failed(Error::Store(cause))) = outcome else {
        panic!("expected the cleanup's failure, got {outcome:?}")
    };
    assert!(cause.to_string().contains("failpoint"), "{cause}");
    let claim = h
        .store
        .read(move |c| keel_core::execution::get(c, session))
        .await
        .unwrap()
        .expect("the claim stays for recovery");
    assert_eq!(claim.phase, Phase::Cancelling);
}

#[tokio::test]
async fn an_interrupt_before_the_first_step_only_releases_the_claim() {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    // The claim's commit is held: the execution has begun, and no step can have.
    hold.at(h.store.stats().0);
    let run = h.spawn_run(session);
    hold.reached().await;
    assert!(h.runner.interrupt(session).await);
    hold.release();
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );

    assert_eq!(
        h.kinds(session).await,
        vec![
            "created",
            "prompt.admitted",
            "prompt.execution_requested",
            "execution.started",
            "execution.settled",
        ]
    );
    let log = h.log(session).await;
    let DurableEvent::ExecutionSettled(settled) = &log.last().unwrap().event else {
        panic!()
    };
    assert_eq!(settled.outcome, Outcome::Interrupted);
    assert!(!h.claim_exists(session).await);
    assert!(h.recording.requests.lock().unwrap().is_empty());
    // The prompt was never promoted: it waits for a later run.
    let pending = h
        .store
        .read(move |c| inbox::pending(c, session))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1);
}

#[tokio::test]
async fn an_interrupt_landing_while_step_started_commits_is_settled_by_cleanup_in_one_transaction()
{
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    // Commits: the claim, then the first boundary, which carries `step.started`; that one
    // is held while the interrupt lands.
    hold.at(h.store.stats().0 + 1);
    let run = h.spawn_run(session);
    hold.reached().await;
    let writes = h.store.stats().1;
    // A shutdown's interrupt cancels without a write of its own, so it lands exactly here
    // (a user's interrupt first marks the claim `cancelling`, which a racing step start
    // leaves alone: `core/tests/store/execution.rs`).
    let mut shutting_down =
        std::pin::pin!(h.runner.shut_down(Duration::ZERO, Duration::from_secs(60)));
    assert!(futures::poll!(&mut shutting_down).is_pending());
    hold.release();
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );
    assert_eq!(shutting_down.await, 1);

    // The step started and no request went out; cleanup wrote its one `step.interrupted`
    // and the release (with the shutdown's continuation) in one write.
    assert!(h.recording.requests.lock().unwrap().is_empty());
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "step.interrupted",
            "prompt.admitted",
            "prompt.execution_requested",
            "execution.settled",
        ]
    );
    assert_eq!(h.store.stats().1 - writes, 2, "the boundary, then cleanup");
    let log = h.log(session).await;
    let interrupted: Vec<InterruptReason> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepInterrupted(i) => Some(i.reason),
            _ => None,
        })
        .collect();
    assert_eq!(interrupted, vec![InterruptReason::Shutdown]);
    let DurableEvent::ExecutionSettled(settled) = &log.last().unwrap().event else {
        panic!()
    };
    assert_eq!(settled.outcome, Outcome::Interrupted);
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn a_failed_write_of_an_interrupted_step_s_end_is_closed_by_a_later_write() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use keel_core::store::Failpoint;

    let fail_at = Arc::new(AtomicU64::new(u64::MAX));
    let target = fail_at.clone();
    let mut h = Harness::new(Setup {
        script: Some(script(vec![vec![call("gate", json!({}))]])),
        failpoint: Some(Failpoint(Arc::new(move |ordinal| {
            ordinal == target.load(Ordering::SeqCst)
        }))),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    assert!(h.runner.interrupt(session).await);
    // The next commit is the step's `step.interrupted`, after the tool stopped: it fails.
    fail_at.store(h.store.stats().0, Ordering::SeqCst);
    let outcome = run.await.unwrap();
    let Err(RunError::Failed(Error::Store(cause))) = outcome else {
        panic!("expected the failed write, got {outcome:?}")
    };
    assert!(cause.to_string().contains("failpoint"), "{cause}");

    // The step is closed by the next write (its calls failed, then `step.failed`), and the
    // interrupt's cleanup releases the claim.
    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .collect();
    assert_eq!(
        tail,
        vec![
            "tool.called",
            "tool.failed",
            "step.failed",
            "execution.settled"
        ]
    );
    let log = h.log(session).await;
    let DurableEvent::ExecutionSettled(settled) = &log.last().unwrap().event else {
        panic!()
    };
    assert_eq!(settled.outcome, Outcome::Interrupted);
    let messages = h
        .store
        .read(move |c| keel_core::event::view::messages(c, session))
        .await
        .unwrap();
    let status = messages
        .iter()
        .find_map(|m| match m {
            Message::Assistant { parts, .. } => parts.iter().find_map(|p| match p {
                AssistantPart::Tool { status, .. } => Some(*status),
                _ => None,
            }),
            _ => None,
        })
        .unwrap();
    assert_eq!(status, ToolStatus::Error);
    assert!(!h.claim_exists(session).await);
}
