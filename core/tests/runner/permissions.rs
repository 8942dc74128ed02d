//! Permission policies and questions: durable requests, replies through the runner.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use keel_core::runner::{Agent, Live, Policy, Reply, Runner};
use keel_schema::event::DurableEvent;
use keel_schema::id::RequestId;
use keel_schema::types::{Decision, InterruptReason};
use serde_json::json;
use tokio::sync::broadcast;

use crate::support::{Harness, Setup, call, script, text};

fn asking(tool: &str, policy: Policy) -> Agent {
    Agent {
        permissions: HashMap::from([(tool.to_owned(), policy)]),
        ..Agent::default()
    }
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

fn spawn_run(
    runner: &Runner,
    session: keel_schema::id::SessionId,
) -> tokio::task::JoinHandle<bool> {
    let runner = runner.clone();
    tokio::spawn(async move { runner.run(session).await.is_ok() })
}

#[tokio::test]
async fn an_ask_policy_waits_for_the_reply_and_runs_the_tool_once_allowed() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let mut live = h.runner.subscribe();
    let run = spawn_run(&h.runner, session);
    let request = next_request(&mut live).await;
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 0);
    assert!(h.runner.reply(request, Reply::Permission(Decision::Once)));
    assert!(run.await.unwrap());
    assert_eq!(h.probe.runs.load(Ordering::SeqCst), 1);
    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .take(4)
        .collect();
    assert_eq!(
        tail,
        vec![
            "tool.called",
            "permission.requested",
            "permission.replied",
            "tool.success"
        ]
    );
}

#[tokio::test]
async fn a_rejected_permission_fails_the_tool_and_interrupts_the_continuation() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("never")],
        ])),
        agent: Some(asking("probe", Policy::Ask)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let mut live = h.runner.subscribe();
    let run = spawn_run(&h.runner, session);
    let request = next_request(&mut live).await;
    h.runner.reply(request, Reply::Permission(Decision::Reject));
    run.await.unwrap();
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
    let mut live = h.runner.subscribe();
    let run = spawn_run(&h.runner, session);
    let request = next_request(&mut live).await;
    h.runner.reply(request, Reply::Permission(Decision::Always));
    assert!(run.await.unwrap());
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
async fn a_question_is_answered_through_the_runner() {
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
    let mut live = h.runner.subscribe();
    let run = spawn_run(&h.runner, session);
    let request = next_request(&mut live).await;
    h.runner.reply(request, Reply::Answer("pin".into()));
    assert!(run.await.unwrap());
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
    let mut live = h.runner.subscribe();
    let run = spawn_run(&h.runner, session);
    let request = next_request(&mut live).await;
    h.runner.reply(request, Reply::Dismiss);
    run.await.unwrap();
    assert_eq!(h.recording.requests.lock().unwrap().len(), 1);
    let log = h.log(session).await;
    assert!(log.iter().any(|e| matches!(&e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::QuestionDismissed)));
}
