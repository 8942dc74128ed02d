//! Permission policies and questions: durable requests, durable replies, and a step that
//! waits for a person with no process holding its session.

use std::sync::atomic::Ordering;

use keel_core::request;
use keel_core::runner::{Agent, Live, Permissions, Policy, Reply, Rule, Runner};
use keel_schema::event::DurableEvent;
use keel_schema::id::{RequestId, SessionId};
use keel_schema::types::{Decision, InterruptReason, Outcome};
use serde_json::json;
use tokio::sync::broadcast;

use crate::support::{Harness, Setup, call, script, text};

fn asking(tool: &str, policy: Policy) -> Agent {
    Agent {
        permissions: Permissions::allow_all().with(tool, Rule::Policy(policy)),
        ..Agent::default()
    }
}

/// A harness whose model calls the probe (policy `ask`), then answers `then`.
async fn asking_probe(then: Vec<keel_core::provider::scripted::Item>) -> Harness {
    Harness::new(Setup {
        script: Some(script(vec![vec![call("probe", json!({}))], then])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await
}

/// Waits for the next permission request or question and returns its id.
async fn next_request(live: &mut broadcast::Receiver<Live>) -> RequestId {
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap() {
            match e.event {
                DurableEvent::PermissionRequested(p) => return p.request_id,
                DurableEvent::QuestionAsked(q) => return q.request_id,
                _ => {}
            }
        }
    }
}

/// Runs the session until its step waits for a person; returns the request it waits on.
async fn until_waiting(h: &Harness, session: SessionId) -> RequestId {
    let mut live = h.runner.subscribe();
    h.runner.run(session).await.unwrap();
    let request = next_request(&mut live).await;
    // Nothing holds the session while it waits.
    assert!(!h.claim_exists(session).await);
    request
}

/// Replies through `runner`, then waits for the execution the reply woke to settle.
async fn reply(runner: &Runner, session: SessionId, request: RequestId, reply: Reply) {
    runner.reply(session, request, reply).await.unwrap();
    runner.run(session).await.unwrap();
}

#[tokio::test]
async fn an_ask_policy_hands_the_session_back_and_the_reply_runs_the_tool_once() {
    let h = asking_probe(vec![text("Done.")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    assert_eq!(h.runner.held(), 0);
    reply(
        &h.runner,
        session,
        request,
        Reply::Permission(Decision::Once),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .take(8)
        .collect();
    assert_eq!(
        tail,
        vec![
            "tool.called",
            "permission.requested",
            "step.awaiting",
            "execution.settled",
            "permission.replied",
            "execution.started",
            "tool.success",
            "step.ended",
        ]
    );
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Awaiting)));
    // The continuation after the tool ran: the model saw its result.
    assert_eq!(h.recording.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_pending_permission_survives_a_restart_and_the_reply_after_it_runs_the_tool_once() {
    let h = asking_probe(vec![text("Done.")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    // A new process on the same database, with nothing in memory: recovery finds no
    // claim to take, and the reply through the new process resumes the step.
    let restarted = h.other_runner();
    let mut recovery = keel_core::recovery::Recovery::default();
    let report = recovery.pass(&restarted).await.unwrap();
    assert!(report.recovered.is_empty() && report.redriven.is_empty());
    reply(
        &restarted,
        session,
        request,
        Reply::Permission(Decision::Once),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
    let log = h.log(session).await;
    assert!(
        !log.iter()
            .any(|e| matches!(&e.event, DurableEvent::StepRecovered(_)))
    );
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepEnded(s) if s.finish == keel_schema::types::Finish::ToolCalls)));
}

#[tokio::test]
async fn a_reply_whose_wake_was_lost_is_redriven_by_recovery() {
    let h = asking_probe(vec![text("Done.")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    // The reply committed, and the process died before its wake: only the log knows.
    let clock = h.store.clock().clone();
    let reply = Reply::Permission(Decision::Once);
    h.store
        .write(move |c| request::answer(c, clock.now_ms(), session, request, &reply))
        .await
        .unwrap();
    let restarted = h.other_runner();
    let report = keel_core::recovery::Recovery::default()
        .pass(&restarted)
        .await
        .unwrap();
    assert_eq!(report.redriven, vec![session]);
    restarted.run(session).await.unwrap();
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_reply_of_the_wrong_kind_is_refused_and_the_call_still_waits() {
    let h = asking_probe(vec![text("Done.")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    let before = h.kinds(session).await.len();
    let refused = h
        .runner
        .reply(session, request, Reply::Answer("yes".into()))
        .await;
    assert!(
        matches!(refused, Err(request::Error::WrongKind { .. })),
        "{refused:?}"
    );
    let other = h.session().await;
    let refused = h
        .runner
        .reply(other, request, Reply::Permission(Decision::Once))
        .await;
    assert!(
        matches!(refused, Err(request::Error::Unknown(_))),
        "{refused:?}"
    );
    let refused = h
        .runner
        .reply(session, RequestId::new(), Reply::Permission(Decision::Once))
        .await;
    assert!(
        matches!(refused, Err(request::Error::Unknown(_))),
        "{refused:?}"
    );
    assert_eq!(
        h.kinds(session).await.len(),
        before,
        "a refused reply wrote nothing"
    );
    // The call still waits, and the right reply still runs it.
    reply(
        &h.runner,
        session,
        request,
        Reply::Permission(Decision::Once),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
    let again = h
        .runner
        .reply(session, request, Reply::Permission(Decision::Once))
        .await;
    assert!(
        matches!(again, Err(request::Error::Answered(_))),
        "{again:?}"
    );
}

#[tokio::test]
async fn a_rejected_permission_fails_the_tool_and_interrupts_the_continuation() {
    let h = asking_probe(vec![text("never")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    reply(
        &h.runner,
        session,
        request,
        Reply::Permission(Decision::Reject),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ToolFailed(f) if f.error.kind == "tool.permission-rejected")));
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::PermissionRejected)));
}

#[tokio::test]
async fn always_is_remembered_for_the_session() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    reply(
        &h.runner,
        session,
        request,
        Reply::Permission(Decision::Always),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 2);
    let asked = h
        .kinds(session)
        .await
        .iter()
        .filter(|k| *k == "permission.requested")
        .count();
    assert_eq!(asked, 1);
}

#[tokio::test]
async fn always_for_one_call_lets_a_sibling_waiting_on_the_same_tool_run() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![
                call("probe", json!({"n": 1})),
                call("probe", json!({"n": 2})),
            ],
            vec![text("Done.")],
        ])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let mut live = h.runner.subscribe();
    h.runner.run(session).await.unwrap();
    let first = next_request(&mut live).await;
    let _second = next_request(&mut live).await;
    reply(
        &h.runner,
        session,
        first,
        Reply::Permission(Decision::Always),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 2);
    assert!(!h.claim_exists(session).await);
    assert_eq!(h.recording.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_denied_tool_fails_without_running() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Ok.")],
        ])),
        agent: Some(asking("probe", Policy::Deny)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    h.runner.run(session).await.unwrap();
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::ToolFailed(f) if f.error.kind == "tool.permission-denied")));
}

#[tokio::test]
async fn a_question_is_answered_durably_and_the_model_sees_the_answer() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call(
                "question",
                json!({"question": "Pin or retry?", "options": ["pin", "retry"]}),
            )],
            vec![text("Pinning.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    let refused = h
        .runner
        .reply(session, request, Reply::Permission(Decision::Once))
        .await;
    assert!(
        matches!(refused, Err(request::Error::WrongKind { .. })),
        "{refused:?}"
    );
    reply(&h.runner, session, request, Reply::Answer("pin".into())).await;
    let requests = h.recording.requests.lock().unwrap().clone();
    assert!(format!("{:?}", requests[1].turns.last()).contains("pin"));
}

#[tokio::test]
async fn a_dismissed_question_interrupts_the_continuation() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("question", json!({"question": "Pin or retry?"}))],
            vec![text("never")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    reply(&h.runner, session, request, Reply::Dismiss).await;
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::QuestionDismissed)));
}

#[tokio::test]
async fn an_interrupt_ends_a_step_that_waits_for_a_person() {
    let h = asking_probe(vec![text("never")]).await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    assert!(h.runner.interrupt(session).await);
    assert!(!h.claim_exists(session).await);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::User)));
    let refused = h
        .runner
        .reply(session, request, Reply::Permission(Decision::Once))
        .await;
    assert!(
        matches!(refused, Err(request::Error::Answered(_))),
        "{refused:?}"
    );
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    // Nothing is left waiting: a second interrupt has nothing to stop.
    assert!(!h.runner.interrupt(session).await);
}

#[tokio::test]
async fn a_prompt_sent_while_a_step_waits_runs_after_the_step_ends() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
            vec![text("And the next.")],
        ])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let request = until_waiting(&h, session).await;
    h.admit(session, "next", keel_schema::types::Delivery::Queue)
        .await;
    h.runner.run(session).await.unwrap();
    // The prompt waits for the step: no model request, the session handed back again.
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    assert!(!h.claim_exists(session).await);
    let report = keel_core::recovery::Recovery::default()
        .pass(&h.runner)
        .await
        .unwrap();
    assert!(
        report.redriven.is_empty(),
        "a waiting step's prompt is not redriven"
    );
    reply(
        &h.runner,
        session,
        request,
        Reply::Permission(Decision::Once),
    )
    .await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.recording.requests.lock().unwrap().len(), 3);
}
