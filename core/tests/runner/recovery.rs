//! Recovery takes over an execution whose owner stopped renewing its lease: exactly once,
//! without running its tools again, and without being held up by rows it cannot trust.
//! A dead owner is an owner whose lease ran out on the manual clock; its process may still
//! be paused in a tool (the gate), and the fence keeps it from writing afterwards.

use diesel::RunQueryDsl;
use keel_core::clock::Clock;
use keel_core::coordinator::RunError;
use keel_core::execution;
use keel_core::recovery::{self, BATCH_SIZE, CONTINUATION, MAX_ATTEMPTS, Recovery};
use keel_core::runner::Error;
use keel_core::store;
use keel_schema::api::{AssistantPart, Message, ToolStatus};
use keel_schema::event::DurableEvent;
use keel_schema::id::{ExecutionId, InputId, MessageId, OwnerId, SessionId};
use keel_schema::types::{Delivery, InputSource, Outcome};
use serde_json::json;

use crate::support::{Harness, LEASE, Setup, call, script, text};

/// Inserts a claim held by an owner that no longer exists, as a killed process leaves it.
async fn abandon(
    h: &Harness,
    session: SessionId,
    assistant: Option<MessageId>,
    phase: &str,
    expires_at: i64,
) -> ExecutionId {
    let id = ExecutionId::new();
    let owner = OwnerId::new();
    let assistant = assistant.map_or("NULL".to_owned(), |a| format!("'{a}'"));
    let phase = phase.to_owned();
    h.store
        .write(move |c| {
            diesel::sql_query(format!(
                "INSERT INTO session_execution (id, session_id, owner_id, assistant_message_id, \
                 phase, time_created, expires_at) VALUES ('{id}', '{session}', '{owner}', \
                 {assistant}, '{phase}', {expires_at}, {expires_at})"
            ))
            .execute(c)
            .map(|_| ())
            .map_err(store::Error::from)
        })
        .await
        .unwrap();
    id
}

async fn recovery_error(h: &Harness, session: SessionId) -> Option<String> {
    h.store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .expect("the claim is still there")
        .recovery_error
}

#[tokio::test]
async fn an_abandoned_execution_is_recovered_once_and_continued_by_another_owner() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Working."), call("gate", json!({}))],
            vec![text("Continued after the restart.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let first = h.run_to_gate(session).await;

    // The first owner stops renewing (it is paused inside the tool); its lease runs out.
    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    assert!(report.quarantined.is_empty() && report.exhausted.is_empty());
    h.until_idle(&other, session).await;

    let log = h.log(session).await;
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.recovered").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.recovered",
            "execution.settled",
            "prompt.admitted",
            "prompt.execution_requested",
            "execution.started",
            "prompted",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let settled: Vec<Outcome> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ExecutionSettled(s) => Some(s.outcome),
            _ => None,
        })
        .collect();
    assert_eq!(settled, [Outcome::Recovered, Outcome::Succeeded]);
    let dead = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::StepRecovered(r) => Some(r.execution_id),
            _ => None,
        })
        .unwrap();
    let continuation = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery => {
                Some(p.input_id)
            }
            _ => None,
        })
        .unwrap();
    assert_eq!(continuation, InputId::from_ulid(dead.ulid()));
    assert!(log.iter().any(|e| matches!(
        &e.event,
        DurableEvent::ExecutionStarted(s) if s.owner_id == other.owner()
    )));

    // The tool that was running is failed, not run again, and the model was told.
    let messages = h
        .store
        .read(move |c| keel_core::event::view::messages(c, session))
        .await
        .unwrap();
    let failed = messages
        .iter()
        .find_map(|m| match m {
            Message::Assistant { parts, .. } => parts.iter().find_map(|p| match p {
                AssistantPart::Tool { status, error, .. } => Some((*status, error.clone())),
                _ => None,
            }),
            _ => None,
        })
        .unwrap();
    assert_eq!(failed.0, ToolStatus::Error);
    assert_eq!(failed.1.unwrap().kind, "tool.interrupted-by-crash");
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let seen = format!("{:?}", requests[1]);
    assert!(seen.contains("tool.interrupted-by-crash") || seen.contains("did not run it again"));
    assert!(seen.contains(&CONTINUATION[..40]));

    // A second pass finds nothing: each abandoned execution is recovered once.
    assert!(Recovery::default().pass(&other).await.unwrap().is_empty());

    // The paused first owner wakes up and can write nothing.
    let before = h.kinds(session).await;
    h.release.notify_one();
    assert_outcome!(first.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, before);
}

#[tokio::test]
async fn a_live_lease_is_never_recovered() {
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
    h.clock.advance(LEASE - 1);
    let other = h.other_runner();
    assert!(Recovery::default().pass(&other).await.unwrap().is_empty());
    assert!(
        !h.kinds(session)
            .await
            .contains(&"step.recovered".to_owned())
    );
    h.release.notify_one();
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_recovered_continuation_never_waits_for_the_next_redrive_pass() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Working."), call("gate", json!({}))],
            vec![text("Continued.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let first = h.run_to_gate(session).await;
    // The lease runs out while the step waits in its tool, and this same process's
    // recovery takes the execution over (as after a pause): the continuation's wake rings
    // the doorbell of the busy period whose claim is gone.
    h.clock.advance(LEASE + 1);
    let mut live = h.runner.subscribe();
    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    h.release.notify_one();
    assert_outcome!(
        first.await.unwrap(),
        Err(RunError::Failed(Error::OwnershipLost(id))) if id == session
    );
    // Without another pass, that wake claims the session afresh and continues it.
    let continued = async {
        loop {
            if let Ok(keel_core::runner::Live::Durable(e)) = live.recv().await
                && matches!(
                    &e.event,
                    DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded
                )
            {
                return;
            }
        }
    };
    // A bound against hanging, not a measure of speed.
    tokio::time::timeout(std::time::Duration::from_secs(60), continued)
        .await
        .expect("the continuation ran without another recovery pass");
    assert!(!h.claim_exists(session).await);
    let kinds = h.kinds(session).await;
    let from = kinds
        .iter()
        .rposition(|k| k == "execution.started")
        .unwrap();
    assert_eq!(
        kinds[from..],
        [
            "execution.started",
            "prompted",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
}

#[tokio::test]
async fn max_steps_counts_the_execution_s_steps_across_a_recovery() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Done.")],
        ])),
        agent: Some(keel_core::runner::Agent {
            max_steps: 2,
            ..crate::support::trusting()
        }),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _first = h.run_to_gate(session).await;
    // The owner dies inside step 1's tool; another takes the execution over.
    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    h.until_idle(&other, session).await;
    let steps: Vec<u32> = h
        .log(session)
        .await
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepStarted(s) => Some(s.step),
            _ => None,
        })
        .collect();
    // The continuation is step 2 of the same execution: the agent's last, without tools.
    assert_eq!(steps, [1, 2]);
    let requests = h.recording.requests.lock().unwrap();
    assert_eq!(
        requests.last().map(|r| r.tool_choice),
        Some(keel_core::provider::ToolChoice::None)
    );
}

#[tokio::test]
async fn a_claim_whose_release_failed_is_not_renewed_and_recovery_takes_it() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use keel_core::store::Failpoint;

    let failing = Arc::new(AtomicBool::new(false));
    let fail = failing.clone();
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Done.")],
        ])),
        failpoint: Some(Failpoint(Arc::new(move |_| fail.load(Ordering::SeqCst)))),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let run = h.run_to_gate(session).await;
    // From here every commit fails: the tool's result, the step's failure, the release.
    failing.store(true, Ordering::SeqCst);
    h.release.notify_one();
    let outcome = run.await.unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    failing.store(false, Ordering::SeqCst);
    let claim = |h: &Harness| {
        let store = h.store.clone();
        async move {
            store
                .read(move |c| execution::get(c, session))
                .await
                .unwrap()
        }
    };
    let stranded = claim(&h)
        .await
        .expect("the release failed: the claim stays");
    // This process no longer runs the execution, so it does not keep its lease alive.
    assert!(!h.runner.is_busy(session));
    h.clock.advance(LEASE / 2);
    assert_eq!(h.runner.renew().await.unwrap(), 0);
    assert_eq!(
        claim(&h).await.expect("still there").expires_at,
        stranded.expires_at
    );
    // Once the lease ran out, recovery takes the execution over and the session goes on.
    h.clock.advance(LEASE);
    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    h.runner.run(session).await.unwrap();
    assert!(claim(&h).await.is_none(), "the session is idle");
    let kinds = h.kinds(session).await;
    assert!(kinds.contains(&"step.recovered".to_owned()), "{kinds:?}");
    assert_eq!(kinds.last().unwrap(), "execution.settled");
}

#[tokio::test]
async fn recovery_never_redrives_the_lost_wake_of_a_deleted_session() {
    let h = Harness::new(Setup::default()).await;
    // Admitted with execution requested, never woken, then deleted.
    let session = h.prompted("hello").await;
    h.store
        .append(
            session,
            vec![DurableEvent::Deleted(
                keel_schema::event::payload::Deleted {},
            )],
        )
        .await
        .unwrap();
    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert!(report.redriven.is_empty(), "{report:?}");
    assert_eq!(h.kinds(session).await.last().unwrap(), "deleted");
}

#[tokio::test]
async fn a_lost_wake_is_redriven() {
    let h = Harness::new(Setup::default()).await;
    // Admitted with execution requested, but nothing woke the session.
    let session = h.prompted("hello").await;
    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(report.redriven, vec![session]);
    h.runner.run(session).await.unwrap();
    let kinds = h.kinds(session).await;
    assert_eq!(kinds.last().unwrap(), "execution.settled");
    assert!(kinds.contains(&"step.ended".to_owned()));
    assert!(
        Recovery::default()
            .pass(&h.runner)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn an_explicit_resume_is_recorded_durably_before_pending_input_is_promoted() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session().await;
    // Admitted without execution intent: nothing would ever run it by itself.
    let clock = h.store.clock().clone();
    let admission = keel_core::inbox::Admission {
        request_execution: false,
        ..keel_core::inbox::Admission::prompt(vec![keel_schema::types::Part::Text {
            text: "hello".into(),
        }])
    };
    h.store
        .write(move |c| keel_core::inbox::admit(c, clock.now_ms(), session, admission.clone()))
        .await
        .unwrap();
    assert!(
        Recovery::default()
            .pass(&h.runner)
            .await
            .unwrap()
            .is_empty()
    );
    // The resume is recorded, and its run is lost with its process.
    h.runner.record_resume(session).await.unwrap();
    let kinds = h.kinds(session).await;
    assert_eq!(kinds.last().unwrap(), "prompt.execution_requested");
    assert!(!kinds.contains(&"prompted".to_owned()));
    let restarted = h.other_runner();
    let report = Recovery::default().pass(&restarted).await.unwrap();
    assert_eq!(report.redriven, vec![session]);
    restarted.run(session).await.unwrap();
    let kinds = h.kinds(session).await;
    let requested = kinds.iter().position(|k| k == "prompt.execution_requested");
    let prompted = kinds.iter().position(|k| k == "prompted");
    assert!(requested < prompted && prompted.is_some(), "{kinds:?}");
    assert!(kinds.contains(&"step.ended".to_owned()));
}

#[tokio::test]
async fn poison_claims_are_quarantined_and_valid_work_behind_a_full_batch_still_wakes() {
    let h = Harness::new(Setup::default()).await;
    // A finished session whose assistant message the poison rows point at.
    let donor = h.prompted("hello").await;
    h.runner.run(donor).await.unwrap();
    let foreign = h
        .log(donor)
        .await
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::StepStarted(s) => Some(s.assistant_message_id),
            _ => None,
        })
        .unwrap();

    let now = h.clock.now_ms();
    let mut poisoned = Vec::new();
    for i in 0..=BATCH_SIZE {
        let session = h.session().await;
        // Older than the valid row: each batch is full of poison first.
        abandon(&h, session, Some(foreign), "running", now - 1_000_000 + i).await;
        poisoned.push(session);
    }
    let valid = h.prompted("recover me").await;
    abandon(&h, valid, None, "claimed", now - 1).await;

    let first = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(
        first.quarantined.len(),
        usize::try_from(BATCH_SIZE).unwrap()
    );
    assert!(first.recovered.is_empty());
    let second = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(second.quarantined.len(), 1);
    assert_eq!(second.recovered, vec![valid]);
    h.runner.run(valid).await.unwrap();
    let kinds = h.kinds(valid).await;
    assert_eq!(kinds.last().unwrap(), "execution.settled");
    assert!(kinds.contains(&"step.ended".to_owned()));

    for session in poisoned {
        let error = recovery_error(&h, session).await.expect("quarantined");
        assert!(error.contains("belongs to session"), "{error}");
        assert!(
            !h.kinds(session)
                .await
                .contains(&"execution.settled".to_owned())
        );
    }
    // Quarantined rows are not examined again.
    assert!(
        Recovery::default()
            .pass(&h.runner)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn an_unknown_phase_or_a_superseded_assistant_is_quarantined() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        ..Setup::default()
    })
    .await;
    // Two finished steps: a claim naming the first assistant is stale.
    let session = h.prompted("hello").await;
    h.runner.run(session).await.unwrap();
    let first_assistant = h
        .log(session)
        .await
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::StepStarted(s) => Some(s.assistant_message_id),
            _ => None,
        })
        .unwrap();
    let now = h.clock.now_ms();
    abandon(&h, session, Some(first_assistant), "running", now - 1).await;

    // SQLite's CHECK keeps unknown phases out, so the row is corrupted around it.
    let odd = h.session().await;
    abandon(&h, odd, None, "running", now - 1).await;
    h.store
        .write(move |c| {
            diesel::sql_query("PRAGMA ignore_check_constraints = ON").execute(c)?;
            diesel::sql_query(format!(
                "UPDATE session_execution SET phase = 'dancing' WHERE session_id = '{odd}'"
            ))
            .execute(c)?;
            diesel::sql_query("PRAGMA ignore_check_constraints = OFF").execute(c)?;
            Ok::<_, store::Error>(())
        })
        .await
        .unwrap();

    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(report.quarantined.len(), 2, "{report:?}");
    let superseded = recovery_error(&h, session).await.unwrap();
    assert!(superseded.contains("superseded"), "{superseded}");
    let reasons: Vec<&str> = report
        .quarantined
        .iter()
        .map(|q| q.reason.as_str())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("unknown phase")),
        "{reasons:?}"
    );
}

#[tokio::test]
async fn a_session_abandoned_too_often_in_a_row_fails_instead_of_looping() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session().await;
    let now = h.clock.now_ms();
    for attempt in 1..=MAX_ATTEMPTS {
        abandon(&h, session, None, "claimed", now - 1).await;
        // Settle without waking: each continuation is abandoned again before it runs.
        let report = recovery::settle_abandoned(&h.store, |_| {}).await.unwrap();
        if attempt < MAX_ATTEMPTS {
            assert_eq!(report.recovered, vec![session], "attempt {attempt}");
        } else {
            assert_eq!(report.exhausted, vec![session]);
        }
    }
    let last = h.log(session).await.pop().unwrap();
    match last.event {
        DurableEvent::ExecutionSettled(settled) => {
            assert_eq!(settled.outcome, Outcome::Failed);
            assert_eq!(settled.error.unwrap().kind, "recovery.attempts-exhausted");
        }
        other => panic!("{other:?}"),
    }
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn the_continuation_is_promoted_alone_before_input_that_waited_behind_the_crash() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Continued.")],
            vec![text("Now the steer.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _paused = h.run_to_gate(session).await;
    let steer = h.admit(session, "and also this", Delivery::Steer).await;
    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    assert_eq!(
        Recovery::default().pass(&other).await.unwrap().recovered,
        vec![session]
    );
    h.until_idle(&other, session).await;

    let log = h.log(session).await;
    let promoted: Vec<(usize, InputId)> = log
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match &e.event {
            DurableEvent::Prompted(p) => Some((i, p.input_id)),
            _ => None,
        })
        .collect();
    let continuation = promoted
        .iter()
        .find(|(_, id)| *id != steer && log.iter().any(|e| matches!(
            &e.event,
            DurableEvent::PromptAdmitted(a) if a.input_id == *id && a.source == InputSource::Recovery
        )))
        .copied()
        .expect("the continuation was promoted");
    let steered = promoted
        .iter()
        .find(|(_, id)| *id == steer)
        .copied()
        .unwrap();
    // A step ran on the continuation alone before the steer joined.
    let between = &log[continuation.0..steered.0];
    assert!(
        between
            .iter()
            .any(|e| matches!(e.event, DurableEvent::StepStarted(_))),
        "{:?}",
        h.kinds(session).await
    );
    assert_eq!(
        h.kinds(session).await.last().map(String::as_str),
        Some("execution.settled")
    );
}

#[tokio::test]
async fn a_claim_that_died_before_its_first_step_is_released_without_a_continuation() {
    let h = Harness::new(Setup::default()).await;
    let session = h.prompted("first").await;
    // The owner claimed the session and died before promoting anything; another prompt
    // commits at that boundary.
    abandon(&h, session, None, "claimed", h.clock.now_ms() - 1).await;
    h.admit(session, "second", Delivery::Queue).await;

    let other = h.other_runner();
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    h.until_idle(&other, session).await;

    let log = h.log(session).await;
    assert!(!log.iter().any(|e| matches!(
        &e.event,
        DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery
    )));
    assert!(
        !log.iter()
            .any(|e| matches!(e.event, DurableEvent::StepRecovered(_)))
    );
    let prompted = log
        .iter()
        .filter(|e| matches!(e.event, DurableEvent::Prompted(_)))
        .count();
    assert_eq!(prompted, 2, "both prompts are answered as ordinary work");
    let requests = h.recording.requests.lock().unwrap().clone();
    assert!(
        requests
            .iter()
            .all(|r| !format!("{r:?}").contains(&CONTINUATION[..40])),
        "the model never hears of a restart it was not part of"
    );
    assert_eq!(
        h.kinds(session).await.last().map(String::as_str),
        Some("execution.settled")
    );
    assert!(!h.claim_exists(session).await);
}

#[tokio::test]
async fn an_execution_abandoned_while_cancelling_is_settled_and_not_continued() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Must not run.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _paused = h.run_to_gate(session).await;
    // The owner was carrying out an interrupt when it died.
    h.store
        .write(move |c| {
            diesel::sql_query(format!(
                "UPDATE session_execution SET phase = 'cancelling' WHERE session_id = '{session}'"
            ))
            .execute(c)
            .map(|_| ())
            .map_err(store::Error::from)
        })
        .await
        .unwrap();
    h.clock.advance(LEASE + 1);

    let other = h.other_runner();
    assert_eq!(
        Recovery::default().pass(&other).await.unwrap().recovered,
        vec![session]
    );
    h.until_idle(&other, session).await;
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
        "{kinds:?}"
    );
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    assert!(!h.claim_exists(session).await);
}

/// Waits until `runner` publishes a successful settlement of `session`'s execution.
async fn succeeded(
    live: &mut tokio::sync::broadcast::Receiver<keel_core::runner::Live>,
    session: SessionId,
) {
    let settled = async {
        loop {
            if let Ok(keel_core::runner::Live::Durable(e)) = live.recv().await
                && e.session_id == session
                && matches!(
                    &e.event,
                    DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded
                )
            {
                return;
            }
        }
    };
    // A bound against hanging, not a measure of speed.
    tokio::time::timeout(std::time::Duration::from_secs(60), settled)
        .await
        .expect("the session's execution succeeded");
}

/// The session's admissions of source `recovery`, and how often each was promoted.
async fn continuations(h: &Harness, session: SessionId) -> Vec<(InputId, usize)> {
    let log = h.log(session).await;
    log.iter()
        .filter_map(|e| match &e.event {
            DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery => {
                Some(p.input_id)
            }
            _ => None,
        })
        .map(|id| {
            let promoted = log
                .iter()
                .filter(|e| matches!(&e.event, DurableEvent::Prompted(p) if p.input_id == id))
                .count();
            (id, promoted)
        })
        .collect()
}

#[tokio::test]
async fn the_lost_wake_of_a_recovery_continuation_is_redriven_by_a_later_pass() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Working."), call("gate", json!({}))],
            vec![text("Continued after the restart.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _paused = h.run_to_gate(session).await;
    h.clock.advance(LEASE + 1);
    // The recovering process commits the settlement and the continuation, then dies
    // before its wake.
    let settled = recovery::settle_abandoned(&h.store, |_| {}).await.unwrap();
    assert_eq!(settled.recovered, vec![session]);
    assert!(!h.claim_exists(session).await);
    assert_eq!(continuations(&h, session).await.len(), 1);

    let restarted = h.other_runner();
    let mut live = restarted.subscribe();
    let report = Recovery::default().pass(&restarted).await.unwrap();
    assert!(report.recovered.is_empty(), "{report:?}");
    assert_eq!(report.redriven, vec![session]);
    succeeded(&mut live, session).await;

    let [(_, promoted)] = continuations(&h, session).await[..] else {
        panic!("one continuation");
    };
    assert_eq!(promoted, 1);
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    assert!(format!("{:?}", requests[1]).contains(&CONTINUATION[..40]));
}

#[tokio::test]
async fn a_pass_behind_a_full_batch_of_abandoned_claims_still_redrives_ordinary_lost_wakes() {
    let h = Harness::new(Setup::default()).await;
    let now = h.clock.now_ms();
    let mut abandoned = Vec::new();
    for i in 0..=BATCH_SIZE {
        let session = h.session().await;
        abandon(&h, session, None, "claimed", now - 1_000_000 + i).await;
        abandoned.push(session);
    }
    // Ordinary work whose wake was lost, behind the backlog of abandoned claims.
    let ordinary = [h.prompted("first").await, h.prompted("second").await];

    let first = Recovery::default().pass(&h.runner).await.unwrap();
    assert!(first.backlog);
    // The oldest deadlines first: one full batch of the abandoned claims.
    assert_eq!(
        first.recovered,
        abandoned[..usize::try_from(BATCH_SIZE).unwrap()]
    );
    let mut redriven = first.redriven.clone();
    redriven.sort_by_key(ToString::to_string);
    let mut expected = ordinary.to_vec();
    expected.sort_by_key(ToString::to_string);
    assert_eq!(
        redriven, expected,
        "ordinary work is not held up by the backlog"
    );

    let second = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(
        second.recovered,
        abandoned[usize::try_from(BATCH_SIZE).unwrap()..]
    );
    assert!(!second.backlog);
    for session in ordinary {
        h.runner.run(session).await.unwrap();
        assert!(h.kinds(session).await.contains(&"step.ended".to_owned()));
    }
}

#[tokio::test]
async fn a_continuation_whose_id_another_session_holds_quarantines_the_claim() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Working."), call("gate", json!({}))],
            vec![text("Must not run.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _paused = h.run_to_gate(session).await;
    let execution_id = h
        .store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap()
        .claim
        .id;
    // The id the continuation derives from the execution is already another session's.
    let elsewhere = h.session().await;
    let clock = h.store.clock().clone();
    let squatter = keel_core::inbox::Admission {
        id: Some(InputId::from_ulid(execution_id.ulid())),
        request_execution: false,
        ..keel_core::inbox::Admission::prompt(vec![keel_schema::types::Part::Text {
            text: "mine".into(),
        }])
    };
    h.store
        .write(move |c| keel_core::inbox::admit(c, clock.now_ms(), elsewhere, squatter.clone()))
        .await
        .unwrap();
    let before = h.kinds(session).await;
    h.clock.advance(LEASE + 1);

    let other = h.other_runner();
    let report = Recovery::default().pass(&other).await.unwrap();
    assert!(
        report.recovered.is_empty() && report.redriven.is_empty(),
        "{report:?}"
    );
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    assert_eq!(report.quarantined[0].claim, execution_id.to_string());
    let reason = recovery_error(&h, session).await.expect("quarantined");
    assert_eq!(reason, report.quarantined[0].reason);
    assert!(reason.starts_with("recovering failed"), "{reason}");
    assert!(
        reason.contains("conflicts with an earlier admission"),
        "{reason}"
    );
    // The whole settlement rolled back: nothing was appended, no continuation exists in
    // this session, and the other session's input is untouched.
    assert_eq!(h.kinds(session).await, before);
    assert!(continuations(&h, session).await.is_empty());
    assert!(!other.is_busy(session));
    let kinds = h.kinds(elsewhere).await;
    assert_eq!(kinds, ["created", "prompt.admitted"]);
}

#[tokio::test]
async fn a_replacement_claim_that_dies_before_promotion_redrives_the_one_existing_continuation() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![text("Working."), call("gate", json!({}))],
            vec![text("Continued after the restarts.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _paused = h.run_to_gate(session).await;
    h.clock.advance(LEASE + 1);
    let first = recovery::settle_abandoned(&h.store, |_| {}).await.unwrap();
    assert_eq!(first.recovered, vec![session]);
    // The replacement claims the session and dies before it promotes the continuation.
    abandon(&h, session, None, "claimed", h.clock.now_ms() - 1).await;

    let other = h.other_runner();
    let mut live = other.subscribe();
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    succeeded(&mut live, session).await;

    let [(_, promoted)] = continuations(&h, session).await[..] else {
        panic!("exactly one continuation: {:?}", h.kinds(session).await);
    };
    assert_eq!(promoted, 1);
    let settled: Vec<Outcome> = h
        .log(session)
        .await
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ExecutionSettled(s) => Some(s.outcome),
            _ => None,
        })
        .collect();
    assert_eq!(
        settled,
        [Outcome::Recovered, Outcome::Recovered, Outcome::Succeeded]
    );
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let seen = format!("{:?}", requests[1]);
    assert_eq!(seen.matches(&CONTINUATION[..40]).count(), 1, "{seen}");
}

#[tokio::test]
async fn a_claim_behind_a_newer_assistant_is_quarantined_and_its_session_never_promotes_a_continuation()
 {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
            vec![text("Answered the steer.")],
        ])),
        ..Setup::default()
    })
    .await;
    // Two finished steps: a claim naming the first assistant is behind the second.
    let session = h.prompted("hello").await;
    h.runner.run(session).await.unwrap();
    let first_assistant = h
        .log(session)
        .await
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::StepStarted(s) => Some(s.assistant_message_id),
            _ => None,
        })
        .unwrap();
    abandon(
        &h,
        session,
        Some(first_assistant),
        "running",
        h.clock.now_ms() - 1,
    )
    .await;
    let before = h.kinds(session).await;

    let report = Recovery::default().pass(&h.runner).await.unwrap();
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    assert!(
        report.quarantined[0].reason.contains("superseded"),
        "{report:?}"
    );
    // Not settled, not continued, not woken.
    assert!(report.recovered.is_empty() && report.redriven.is_empty());
    assert!(!h.runner.is_busy(session));
    assert_eq!(h.kinds(session).await, before);
    assert!(continuations(&h, session).await.is_empty());

    // A steer waits behind the quarantined claim; an operator then deletes the claim and
    // the session runs again: only the steer is promoted, and the model never hears of a
    // restart.
    let steer = h.admit(session, "go on", Delivery::Steer).await;
    assert!(
        Recovery::default()
            .pass(&h.runner)
            .await
            .unwrap()
            .redriven
            .is_empty(),
        "the quarantined claim holds the session"
    );
    h.store
        .write(move |c| {
            diesel::sql_query(format!(
                "DELETE FROM session_execution WHERE session_id = '{session}'"
            ))
            .execute(c)
            .map(|_| ())
            .map_err(store::Error::from)
        })
        .await
        .unwrap();
    h.runner.run(session).await.unwrap();
    let promoted: Vec<InputId> = h
        .log(session)
        .await
        .iter()
        .skip(before.len())
        .filter_map(|e| match &e.event {
            DurableEvent::Prompted(p) => Some(p.input_id),
            _ => None,
        })
        .collect();
    assert_eq!(promoted, vec![steer]);
    assert!(continuations(&h, session).await.is_empty());
    let requests = h.recording.requests.lock().unwrap().clone();
    assert!(
        requests
            .iter()
            .all(|r| !format!("{r:?}").contains(&CONTINUATION[..40])),
        "the model never hears of a restart"
    );
}

/// A read-only tool whose first `holds` runs report their start and never finish (a
/// process cut off inside it); later runs answer at once. Counts every run.
struct Reader {
    holds: usize,
    runs: std::sync::atomic::AtomicUsize,
    started: tokio::sync::mpsc::UnboundedSender<usize>,
}

impl keel_core::tool::Tool for Reader {
    fn name(&self) -> &str {
        "reader"
    }
    fn description(&self) -> &str {
        "Reads something slowly."
    }
    fn effect(&self) -> keel_schema::types::Effect {
        keel_schema::types::Effect::Read
    }
    fn input_schema(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    fn permission_pattern(&self, _: &serde_json::Value, _: &std::path::Path) -> String {
        String::new()
    }
    fn run<'a>(
        &'a self,
        _: serde_json::Value,
        _: &'a keel_core::tool::Context,
    ) -> keel_core::tool::Run<'a> {
        Box::pin(async move {
            let run = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if run <= self.holds {
                // The test may have stopped listening; the run holds all the same.
                self.started.send(run).ok();
                std::future::pending::<()>().await;
            }
            Ok(keel_core::tool::Output {
                structured: json!({"run": run}),
                content: vec![keel_schema::types::ToolContent::Text {
                    text: format!("read on run {run}"),
                }],
            })
        })
    }
}

/// A harness whose model calls `reader` (holding its first `holds` runs), then answers.
async fn reading(
    holds: usize,
) -> (
    Harness,
    std::sync::Arc<Reader>,
    tokio::sync::mpsc::UnboundedReceiver<usize>,
) {
    let (started, runs) = tokio::sync::mpsc::unbounded_channel();
    let reader = std::sync::Arc::new(Reader {
        holds,
        runs: std::sync::atomic::AtomicUsize::new(0),
        started,
    });
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("reader", json!({}))],
            vec![text("Read it.")],
        ])),
        tools: vec![reader.clone()],
        ..Setup::default()
    })
    .await;
    (h, reader, runs)
}

/// The `step.recovered` events of the session's log, and its `reader` call's id.
async fn recovered(
    h: &Harness,
    session: SessionId,
) -> (Vec<Vec<keel_schema::id::CallId>>, keel_schema::id::CallId) {
    let log = h.log(session).await;
    let reruns = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepRecovered(r) => Some(r.rerun.clone()),
            _ => None,
        })
        .collect();
    let call = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolCalled(c) if c.name == "reader" => {
                assert!(c.rerun, "a read-only call may run again");
                Some(c.call_id)
            }
            _ => None,
        })
        .unwrap();
    (reruns, call)
}

#[tokio::test]
async fn a_read_only_call_cut_off_by_a_crash_runs_again_once_before_the_model_continues() {
    let (h, reader, mut started) = reading(1).await;
    let session = h.prompted("go").await;
    let _stuck = h.spawn_run(session);
    assert_eq!(started.recv().await, Some(1));

    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    assert_eq!(
        Recovery::default().pass(&other).await.unwrap().recovered,
        vec![session]
    );
    h.until_idle(&other, session).await;

    let (reruns, call) = recovered(&h, session).await;
    assert_eq!(reruns, vec![vec![call]]);
    assert_eq!(reader.runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let log = h.log(session).await;
    let results: Vec<&DurableEvent> = log
        .iter()
        .map(|e| &e.event)
        .filter(|e| {
            matches!(
                e,
                DurableEvent::ToolSuccess(_) | DurableEvent::ToolFailed(_)
            )
        })
        .collect();
    assert!(
        matches!(results[..], [DurableEvent::ToolSuccess(s)] if s.call_id == call),
        "{results:?}"
    );
    // The result came before the model was asked again, and the model saw it.
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    assert!(format!("{:?}", requests[1]).contains("read on run 2"));
    assert!(matches!(&log.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded));
}

#[tokio::test]
async fn a_call_run_again_and_cut_off_again_fails_and_never_runs_a_third_time() {
    let (h, reader, mut started) = reading(2).await;
    let session = h.prompted("go").await;
    let _stuck = h.spawn_run(session);
    assert_eq!(started.recv().await, Some(1));
    h.clock.advance(LEASE + 1);
    let second = h.other_runner();
    Recovery::default().pass(&second).await.unwrap();
    // The continuation runs the call again, and that process is cut off inside it too.
    assert_eq!(started.recv().await, Some(2));
    h.clock.advance(LEASE + 1);
    let third = h.other_runner();
    assert_eq!(
        Recovery::default().pass(&third).await.unwrap().recovered,
        vec![session]
    );
    h.until_idle(&third, session).await;

    assert_eq!(reader.runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let (reruns, call) = recovered(&h, session).await;
    assert_eq!(
        reruns,
        vec![vec![call]],
        "the second recovery has no open step"
    );
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ToolFailed(f) if f.call_id == call && f.error.kind == "tool.interrupted-by-crash")));
    assert!(
        !log.iter()
            .any(|e| matches!(&e.event, DurableEvent::ToolSuccess(_)))
    );
    assert!(matches!(&log.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded));
}

#[tokio::test]
async fn a_call_that_may_change_something_is_never_run_again_after_a_crash() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Told.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let _stuck = h.run_to_gate(session).await;
    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    Recovery::default().pass(&other).await.unwrap();
    h.until_idle(&other, session).await;
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepRecovered(r) if r.rerun.is_empty())));
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ToolFailed(f) if f.error.kind == "tool.interrupted-by-crash")
        || matches!(&e.event, DurableEvent::StepRecovered(_))));
    assert!(
        h.gate_started.try_recv().is_err(),
        "the gate never ran again"
    );
}
