//! After ownership changes, the runner makes no provider request, starts no tool, and
//! publishes nothing, durable or ephemeral. Ownership changes the way it does in life:
//! the lease runs out (the manual clock moves past it) and another owner takes the claim.

use std::sync::atomic::Ordering;

use keel_core::clock::Clock;
use keel_core::coordinator::RunError;
use keel_core::provider::Event;
use keel_core::runner::{Error, Live};
use keel_schema::event::EphemeralEvent;
use keel_schema::id::SessionId;
use keel_schema::types::{Delivery, Finish, Usage};
use serde_json::json;

use crate::support::{Harness, Hold, LEASE, Setup, call, script, text};

async fn lose_ownership(h: &Harness, session: SessionId) {
    h.clock.advance(LEASE + 1);
    h.steal(session).await;
}

#[tokio::test]
async fn no_provider_request_is_dispatched_after_ownership_changes() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("never")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    lose_ownership(&h, session).await;
    let before = h.kinds(session).await;
    h.release.notify_one();
    assert_outcome!(run.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    // The finished tool's result was not published, nor anything after it.
    assert_eq!(h.kinds(session).await, before);
    assert!(h.claim_exists(session).await, "the new owner's claim stays");
}

#[tokio::test]
async fn no_provider_request_is_dispatched_when_ownership_changes_while_step_started_commits() {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    // Commits: the claim, then the first boundary, which carries `step.started`; the
    // lease runs out while that one is held.
    hold.at(h.store.stats().0 + 1);
    let run = h.spawn_run(session);
    hold.reached().await;
    let before = h.kinds(session).await;
    h.clock.advance(LEASE + 1);
    hold.release();
    assert_outcome!(run.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert!(h.recording.requests.lock().unwrap().is_empty());
    assert_eq!(h.kinds(session).await, before, "the step never started");
    assert!(
        h.claim_exists(session).await,
        "the claim is left to recovery"
    );
}

#[tokio::test]
async fn output_of_a_stream_that_began_before_ownership_changed_is_not_published_afterwards() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    stream.send(Ok(Event::TextStart)).unwrap();
    stream.send(Ok(Event::TextDelta("before".into()))).unwrap();
    // The delta goes out as read, its fragment's start once committed, in either order:
    // ownership changes once both are out, with the step still reading its stream.
    let (mut delta, mut started) = (false, false);
    while !(delta && started) {
        match live.recv().await.unwrap() {
            Live::Ephemeral(e) if matches!(e.event, EphemeralEvent::TextDelta(_)) => delta = true,
            Live::Durable(e) if e.event.type_name() == "session.next.text.started" => {
                started = true;
            }
            _ => {}
        }
    }
    lose_ownership(&h, session).await;
    let before = h.kinds(session).await;
    stream.send(Ok(Event::TextDelta("after".into()))).unwrap();
    stream.send(Ok(Event::TextEnd)).unwrap();
    stream
        .send(Ok(Event::Finish {
            finish: Finish::Stop,
            usage: Usage::default(),
        }))
        .unwrap();
    assert_outcome!(run.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, before);
    while let Ok(item) = live.try_recv() {
        if let Live::Ephemeral(e) = item {
            panic!("published after ownership changed: {e:?}");
        }
    }
}

#[tokio::test]
async fn no_local_tool_starts_after_ownership_changes() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    stream.send(Ok(Event::TextStart)).unwrap();
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && e.event.type_name() == "session.next.text.started"
        {
            break;
        }
    }
    lose_ownership(&h, session).await;
    stream.send(Ok(Event::TextEnd)).unwrap();
    stream
        .send(Ok(Event::ToolCall {
            id: "c1".into(),
            name: "probe".into(),
            input: "{}".into(),
            provider_executed: false,
        }))
        .unwrap();
    drop(stream);
    assert_outcome!(run.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    assert!(!h.kinds(session).await.contains(&"tool.called".to_owned()));
}

#[tokio::test]
async fn interrupted_tool_reconciliation_publishes_nothing_after_ownership_changes() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![vec![call("gate", json!({}))]])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    lose_ownership(&h, session).await;
    let before = h.kinds(session).await;
    assert!(h.runner.interrupt(session).await);
    assert_outcome!(run.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, before);
}

#[tokio::test(start_paused = true)]
async fn the_renewal_loop_extends_the_lease_of_a_running_execution() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Done.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let renewing = {
        let runner = h.runner.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move { runner.renew_leases(shutdown).await })
    };
    // Two thirds of the lease pass without a write; the loop must renew before it ends.
    h.clock.advance(LEASE * 2 / 3);
    let target = h.clock.now_ms() + LEASE;
    let mut renewed = false;
    for _ in 0..100 {
        // Paused time: this lets the renewal timer fire without waiting in real time.
        tokio::time::sleep(std::time::Duration::from_millis(
            u64::try_from(LEASE / 3).unwrap(),
        ))
        .await;
        let claim = h
            .store
            .read(move |c| keel_core::execution::get(c, session))
            .await
            .unwrap()
            .unwrap();
        if claim.expires_at == target {
            renewed = true;
            break;
        }
    }
    assert!(renewed, "the lease was not renewed");
    // Past the original lease the execution still owns its session and finishes.
    h.clock.advance(LEASE / 2);
    h.release.notify_one();
    run.await.unwrap().unwrap();
    shutdown.cancel();
    renewing.await.unwrap();
    assert!(!h.claim_exists(session).await);
}
