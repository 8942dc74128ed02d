//! Interrupts of an execution another process runs: recorded on its claim before they
//! are acknowledged, so neither a lost message nor the owner's death can undo them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::coordinator::RunError;
use keel_core::execution;
use keel_core::recovery::Recovery;
use keel_core::runner::{Agent, Error, Forwarder, Permissions, Policy, Rule, Runner};
use keel_schema::event::DurableEvent;
use keel_schema::id::{ExecutionId, OwnerId, SessionId};
use keel_schema::types::{InterruptReason, Phase};
use serde_json::json;

use crate::support::{Harness, Hold, LEASE, Setup, call, script, text};

async fn phase(h: &Harness, session: SessionId) -> Option<Phase> {
    h.store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .map(|row| row.phase)
}

/// The step's end: exactly one `step.interrupted`, by the user, and the claim released.
async fn interrupted_by_the_user(h: &Harness, session: SessionId) {
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
        log.last().map(|e| e.event.type_name()),
        Some("session.next.execution.settled")
    );
    assert!(!h.claim_exists(session).await);
}

/// The run's outcome; a run that never stops fails the test instead of hanging it.
async fn stopped(
    run: tokio::task::JoinHandle<Result<(), RunError<Error>>>,
) -> Result<(), RunError<Error>> {
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the owner never stopped")
        .unwrap()
}

fn gated() -> Setup {
    Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Must not run.")],
        ])),
        ..Setup::default()
    }
}

#[tokio::test]
async fn an_interrupt_for_another_owner_is_durable_when_acknowledged_and_honoured_at_the_owners_renewal()
 {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;

    // A process that does not run the session: nothing to stop here, so the interrupt
    // is recorded on the claim, and only then acknowledged.
    let elsewhere = h.other_runner();
    assert!(!elsewhere.interrupt(session).await);
    assert!(elsewhere.interrupt_elsewhere(session).await.unwrap());
    assert_eq!(phase(&h, session).await, Some(Phase::Cancelling));

    // No message reached the owner (no forwarder here): its next renewal finds the
    // interrupt and stops the step.
    h.runner.renew().await.unwrap();
    assert_outcome!(
        stopped(run).await,
        Err(RunError::Failed(Error::Interrupted))
    );
    interrupted_by_the_user(&h, session).await;
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
}

/// Hands interrupts straight to the owning runner, as the cluster bus does.
struct Direct {
    owner: Runner,
    sent: Mutex<Vec<(OwnerId, SessionId)>>,
}

impl Forwarder for Direct {
    fn forward_wake(&self, _: OwnerId, _: SessionId) {}

    fn forward_interrupt(&self, owner: OwnerId, session: SessionId, execution: ExecutionId) {
        self.sent.lock().unwrap().push((owner, session));
        self.owner.stop_cancelled(session, execution);
    }
}

#[tokio::test]
async fn an_interrupt_sent_to_the_owner_stops_it_without_waiting_for_a_renewal() {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    let elsewhere = h.other_runner();
    let direct = Arc::new(Direct {
        owner: h.runner.clone(),
        sent: Mutex::new(Vec::new()),
    });
    elsewhere.forward_through(direct.clone());

    assert!(elsewhere.interrupt_elsewhere(session).await.unwrap());
    assert_eq!(
        *direct.sent.lock().unwrap(),
        [(h.runner.owner(), session)],
        "the interrupt goes to the claim's owner"
    );
    assert_outcome!(
        stopped(run).await,
        Err(RunError::Failed(Error::Interrupted))
    );
    interrupted_by_the_user(&h, session).await;
}

#[tokio::test]
async fn an_interrupt_recorded_before_the_owner_dies_is_settled_by_recovery_and_never_continued() {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let _abandoned = h.run_to_gate(session).await;
    let elsewhere = h.other_runner();
    assert!(elsewhere.interrupt_elsewhere(session).await.unwrap());

    // The owner dies before it hears of it; its lease runs out.
    h.clock.advance(LEASE + 1);
    assert_eq!(
        Recovery::default()
            .pass(&elsewhere)
            .await
            .unwrap()
            .recovered,
        vec![session]
    );
    h.until_idle(&elsewhere, session).await;
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.recovered").unwrap();
    assert_eq!(
        kinds[from..from + 2],
        ["step.recovered", "execution.settled"]
    );
    assert!(
        !kinds[from..]
            .iter()
            .any(|k| k == "prompt.admitted" || k == "step.started"),
        "the stopped work is not continued: {kinds:?}"
    );
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn an_interrupt_with_no_execution_anywhere_records_nothing() {
    let h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let before = h.log(session).await.len();
    let elsewhere = h.other_runner();
    assert!(!elsewhere.interrupt_elsewhere(session).await.unwrap());
    assert_eq!(h.log(session).await.len(), before);
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn an_interrupt_whose_caller_goes_away_during_its_write_still_stops_the_execution() {
    let (mut hold, failpoint) = Hold::new();
    let mut h = Harness::new(Setup {
        failpoint: Some(failpoint),
        ..gated()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;

    // The interrupt's `cancelling` write is pending when its caller (an HTTP client
    // that disconnects, say) goes away: the write lands, the cancellation it was
    // about to hand to the execution does not.
    hold.at(h.store.stats().0);
    let runner = h.runner.clone();
    let interrupt = tokio::spawn(async move { runner.interrupt(session).await });
    hold.reached().await;
    interrupt.abort();
    hold.release();
    tokio::time::timeout(Duration::from_secs(30), async {
        while phase(&h, session).await != Some(Phase::Cancelling) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the interrupt's write never landed");
    assert!(!run.is_finished());

    // The owner's next renewal finds the recorded interrupt and carries it out.
    h.runner.renew().await.unwrap();
    assert_outcome!(
        stopped(run).await,
        Err(RunError::Failed(Error::Interrupted))
    );
    interrupted_by_the_user(&h, session).await;
}

#[tokio::test]
async fn a_late_interrupt_for_an_earlier_execution_never_stops_the_one_running_now() {
    let mut h = Harness::new(gated()).await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    // A message about an execution that ended (delivered late, or twice) is ignored.
    assert!(!h.runner.stop_cancelled(session, ExecutionId::new()));
    tokio::task::yield_now().await;
    assert!(h.runner.is_busy(session) && !run.is_finished());
    // The one about this execution stops it.
    let running = h
        .store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap()
        .claim
        .id;
    assert!(h.runner.stop_cancelled(session, running));
    assert_outcome!(
        stopped(run).await,
        Err(RunError::Failed(Error::Interrupted))
    );
}

#[tokio::test]
async fn an_interrupt_recorded_as_the_step_starts_waiting_ends_the_step_instead_of_leaving_it_waiting()
 {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Must not run.")],
        ])),
        agent: Some(Agent {
            permissions: Permissions::allow_all().with("probe", Rule::Policy(Policy::Ask)),
            ..Agent::default()
        }),
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    // The commits of the run: the claim, the boundary that starts the step, the burst
    // with `tool.called` and `permission.requested` (held here), then the boundary that
    // would hand the waiting step back.
    hold.at(h.store.stats().0 + 2);
    let run = h.spawn_run(session);
    hold.reached().await;
    // Another node records an interrupt now: its write is queued before the boundary's.
    let elsewhere = h.other_runner();
    let mut interrupt = Box::pin(elsewhere.interrupt_elsewhere(session));
    assert!(futures::poll!(&mut interrupt).is_pending());
    hold.release();
    assert!(interrupt.await.unwrap(), "acknowledged: there was a claim");
    stopped(run).await.unwrap();

    // The boundary found the interrupt: the step ends as the user's, nothing waits.
    interrupted_by_the_user(&h, session).await;
    let status = h
        .store
        .read(move |c| keel_core::request::open(c, session))
        .await
        .unwrap();
    assert!(status.is_empty(), "no request is left waiting: {status:?}");
    assert_eq!(h.probe.runs.load(std::sync::atomic::Ordering::SeqCst), 0);
}
