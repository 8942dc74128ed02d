//! Retries of failed provider requests: only before any output, with `retry.scheduled`
//! published before each wait, `retry-after` honoured, at most five attempts, and an
//! interrupt during the wait ending the step. Time is paused, so the waits (2 to 16 s)
//! pass as soon as the runtime is idle; nothing here depends on how long they take.

use keel_core::clock::Clock;
use keel_core::coordinator::RunError;
use keel_core::provider::{self, Event};
use keel_core::runner::{Error, Live};
use keel_schema::event::DurableEvent;
use keel_schema::types::{Delivery, Finish, Usage};

use crate::support::{Harness, Setup};

fn server_error() -> provider::Error {
    provider::Error::Server {
        status: 503,
        message: "busy".into(),
    }
}

/// Queues a stream that answers "ok" and finishes.
fn queue_answer(h: &Harness) {
    let stream = h.driven.queue();
    for event in [
        Event::TextStart,
        Event::TextDelta("ok".into()),
        Event::TextEnd,
        Event::Finish {
            finish: Finish::Stop,
            usage: Usage::default(),
        },
    ] {
        stream.send(Ok(event)).unwrap();
    }
}

/// Queues a stream that fails at once with `error`.
fn queue_failure(h: &Harness, error: provider::Error) {
    h.driven.queue().send(Err(error)).unwrap();
}

async fn driven_session(h: &Harness) -> keel_schema::id::SessionId {
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    session
}

fn retries(log: &[keel_schema::event::Envelope]) -> Vec<(u32, i64, String)> {
    log.iter()
        .filter_map(|e| match &e.event {
            DurableEvent::RetryScheduled(r) => Some((r.attempt, r.at, r.error.kind.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_rate_limited_request_is_retried_no_sooner_than_retry_after() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    queue_failure(
        &h,
        provider::Error::RateLimit {
            retry_after_ms: Some(3_000),
            message: "slow down".into(),
        },
    );
    queue_answer(&h);
    h.runner.run(session).await.unwrap();

    let log = h.log(session).await;
    // The floor (3 s) is above the first backoff's largest jitter (2.4 s).
    let now = h.clock.now_ms();
    assert_eq!(
        retries(&log),
        [(1, now + 3_000, "provider.rate_limit".to_owned())]
    );
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "retry.scheduled",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    assert_eq!(h.driven.requests.lock().unwrap().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn no_request_is_retried_after_output_began() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    let stream = h.driven.queue();
    stream.send(Ok(Event::TextStart)).unwrap();
    stream.send(Ok(Event::TextDelta("Half".into()))).unwrap();
    stream.send(Err(server_error())).unwrap();
    queue_answer(&h);
    let result = h.runner.run(session).await;
    assert!(
        matches!(result, Err(RunError::Failed(Error::StepFailed(ref e))) if e.kind == "provider.server"),
        "{result:?}"
    );
    assert!(retries(&h.log(session).await).is_empty());
    assert_eq!(h.driven.requests.lock().unwrap().len(), 1);
    assert!(h.kinds(session).await.contains(&"step.failed".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn a_request_is_sent_at_most_five_times() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    for _ in 0..6 {
        queue_failure(&h, server_error());
    }
    let result = h.runner.run(session).await;
    assert!(
        matches!(result, Err(RunError::Failed(Error::StepFailed(ref e))) if e.kind == "provider.server"),
        "{result:?}"
    );
    let scheduled: Vec<u32> = retries(&h.log(session).await)
        .into_iter()
        .map(|(attempt, ..)| attempt)
        .collect();
    assert_eq!(scheduled, [1, 2, 3, 4]);
    assert_eq!(h.driven.requests.lock().unwrap().len(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_ends_before_any_output_is_retried() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    drop(h.driven.queue());
    queue_answer(&h);
    h.runner.run(session).await.unwrap();
    let scheduled = retries(&h.log(session).await);
    assert_eq!(scheduled.len(), 1);
    assert_eq!(scheduled[0].2, "provider.incomplete");
}

#[tokio::test(start_paused = true)]
async fn errors_that_would_repeat_are_not_retried() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    queue_failure(&h, provider::Error::Auth("bad key".into()));
    queue_answer(&h);
    let result = h.runner.run(session).await;
    assert!(
        matches!(result, Err(RunError::Failed(Error::StepFailed(ref e))) if e.kind == "provider.auth"),
        "{result:?}"
    );
    assert!(retries(&h.log(session).await).is_empty());
}

#[tokio::test]
async fn an_interrupt_during_the_wait_stops_further_attempts() {
    let h = Harness::new(Setup::default()).await;
    let session = driven_session(&h).await;
    queue_failure(&h, server_error());
    queue_answer(&h);
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    // Real time: the wait is at least 1.6 s, and the interrupt comes as soon as the
    // retry is announced.
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::RetryScheduled(_))
        {
            break;
        }
    }
    assert!(h.runner.interrupt(session).await);
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "retry.scheduled").unwrap();
    assert_eq!(
        kinds[from..],
        ["retry.scheduled", "step.interrupted", "execution.settled"]
    );
    assert_eq!(h.driven.requests.lock().unwrap().len(), 1);
}
