//! A `keel serve` stopped in the middle of a step: killed with SIGKILL inside a write tool
//! or while the model streams, the restarted process takes the session over once the lease
//! runs out, fails the interrupted call instead of running it again, and the session
//! continues to the end; stopped with SIGTERM, it hands its claims back and the restarted
//! process takes over at once, even with a long lease. A step waiting for a permission
//! reply holds no claim: a kill leaves it waiting, and the reply after the restart runs
//! the tool once.

use futures::StreamExt;
use keel_client::schema::api::{LogItem, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::types::{InputSource, Outcome};
use keel_client::{Client, LogStream};
use keel_tests::Server;
use serde_json::json;
use std::time::Duration;

const CONFIG: &str = r#"
default_model = "test/scripted"
[provider.test]
kind = "scripted"
script = "script.json"
"#;

/// Reads durable events until `stop` says so, returning them all.
async fn read_until(log: &mut LogStream, stop: impl Fn(&Envelope) -> bool) -> Vec<Envelope> {
    let mut events = Vec::new();
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item.expect("the log stream reads") {
            let done = stop(&envelope);
            events.push(envelope);
            if done {
                return events;
            }
        }
    }
    panic!("the log ended early");
}

/// How long a test waits for the session to finish before failing (a guard against a
/// hang, not a performance bound).
const PATIENCE: Duration = Duration::from_secs(120);

/// The kinds of `events`, without the common prefix.
fn kinds(events: &[Envelope]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e.event.type_name().trim_start_matches("session.next."))
        .collect()
}

fn succeeded(envelope: &Envelope) -> bool {
    matches!(&envelope.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded)
}

#[tokio::test]
async fn a_killed_server_recovers_the_session_once_without_rerunning_the_write_tool() {
    // The bash call records each real run, then waits for a file that appears only
    // after the restart (or for the test's directory to go, so a call left over from the
    // killed server never outlives the test); the second answer comes after recovery.
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "echo ran >> runs.txt; while [ ! -e go ] && [ -e \"$PWD\" ]; do sleep 0.02; done"
        }}]},
        { "items": [{ "type": "text", "text": "Picked up after the crash." }] }
    ]})
    .to_string();
    let mut server = Server::start_with(
        &[("keel.toml", CONFIG), ("script.json", &script)],
        // A short lease, so the dead process's claim runs out quickly.
        &["--config", "keel.toml", "--lease-ms", "1000"],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("do the thing"))
        .await
        .unwrap();
    let before = read_until(&mut log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await;
    drop(log);

    server.kill_and_restart();
    let client = Client::new(&server.base_url).unwrap();
    let mut log = client.session_log(session, before.last().unwrap().seq);
    let after = tokio::time::timeout(PATIENCE, read_until(&mut log, succeeded))
        .await
        .expect("the session finishes after the restart");
    // Let a bash left over from the killed process finish.
    std::fs::write(server.directory().join("go"), "").unwrap();

    let kinds = kinds(&after);
    assert_eq!(kinds[0], "step.recovered", "{kinds:?}");
    assert_eq!(kinds[1], "execution.settled", "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "step.recovered").count(),
        1,
        "{kinds:?}"
    );
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery
    )));
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "Picked up after the crash."
    )));
    // The call the crash interrupted was never run again.
    assert!(!kinds.contains(&"tool.called"), "{kinds:?}");
    let runs = std::fs::read_to_string(server.directory().join("runs.txt")).unwrap_or_default();
    assert!(runs.lines().count() <= 1, "{runs}");
    let messages = serde_json::to_value(client.messages(session).await.unwrap()).unwrap();
    assert!(
        messages.to_string().contains("tool.interrupted-by-crash"),
        "{messages}"
    );
    let status = client.session_status(session).await.unwrap();
    assert!(!status.busy, "{status:?}");
    assert_eq!(status.pending_inputs, 0);
}

#[tokio::test]
async fn a_server_killed_while_the_model_streams_recovers_the_step_once() {
    // The first answer stops half way (a long pause between two texts); the process dies
    // there, with the step open.
    let script = json!({ "responses": [
        { "items": [
            { "type": "text", "text": "Half an answer", "chunks": 3 },
            { "type": "delay", "ms": 600000 },
            { "type": "text", "text": "never said" }
        ]},
        { "items": [{ "type": "text", "text": "Finished after the crash." }] }
    ]})
    .to_string();
    let mut server = Server::start_with(
        &[("keel.toml", CONFIG), ("script.json", &script)],
        &["--config", "keel.toml", "--lease-ms", "1000"],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("answer slowly"))
        .await
        .unwrap();
    let before = read_until(&mut log, |e| matches!(e.event, DurableEvent::TextEnded(_))).await;
    drop(log);

    server.kill_and_restart();
    let client = Client::new(&server.base_url).unwrap();
    let mut log = client.session_log(session, before.last().unwrap().seq);
    let after = tokio::time::timeout(PATIENCE, read_until(&mut log, succeeded))
        .await
        .expect("the session finishes after the restart");
    let kinds = kinds(&after);
    assert_eq!(
        kinds[..2],
        ["step.recovered", "execution.settled"],
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "step.recovered").count(),
        1,
        "{kinds:?}"
    );
    let said: Vec<&str> = after
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::TextEnded(t) => Some(t.text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(said, ["Finished after the crash."]);
    // The half answer stays in the transcript as a recovered step.
    let messages = serde_json::to_value(client.messages(session).await.unwrap()).unwrap();
    let text = messages.to_string();
    assert!(text.contains("Half an answer"), "{messages}");
    assert!(!text.contains("never said"), "{messages}");
    let status = client.session_status(session).await.unwrap();
    assert!(!status.busy, "{status:?}");
}

#[tokio::test]
async fn sigterm_hands_the_claims_back_so_a_restart_takes_over_at_once() {
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "while [ ! -e go ] && [ -e \"$PWD\" ]; do sleep 0.02; done"
        }}]},
        { "items": [{ "type": "text", "text": "Resumed without waiting for the lease." }] }
    ]})
    .to_string();
    // A ten-minute lease: only the handed-back claim lets the restart recover in time.
    let mut server = Server::start_with(
        &[("keel.toml", CONFIG), ("script.json", &script)],
        &["--config", "keel.toml", "--lease-ms", "600000"],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("wait for go"))
        .await
        .unwrap();
    let before = read_until(&mut log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await;
    drop(log);

    server.terminate_and_restart();
    std::fs::write(server.directory().join("go"), "").unwrap();
    assert!(server.logged("claims handed back"));
    let client = Client::new(&server.base_url).unwrap();
    let mut log = client.session_log(session, before.last().unwrap().seq);
    let after = tokio::time::timeout(PATIENCE, read_until(&mut log, succeeded))
        .await
        .expect("the restarted server takes the session over without waiting for the lease");
    let kinds = kinds(&after);
    assert_eq!(
        kinds.iter().filter(|k| **k == "step.recovered").count(),
        1,
        "{kinds:?}"
    );
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "Resumed without waiting for the lease."
    )));
}

#[tokio::test]
async fn a_permission_pending_across_a_kill_is_answered_after_the_restart_and_the_tool_runs_once() {
    let config = format!("{CONFIG}[agent.build.permissions]\nbash = \"ask\"\n");
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "echo ran >> runs.txt"
        }}]},
        { "items": [{ "type": "text", "text": "Ran it after the restart." }] }
    ]})
    .to_string();
    let mut server = Server::start_with(
        &[("keel.toml", &config), ("script.json", &script)],
        &["--config", "keel.toml", "--lease-ms", "1000"],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("run it"))
        .await
        .unwrap();
    let before = read_until(
        &mut log,
        |e| matches!(&e.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Awaiting),
    )
    .await;
    let request = before
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::PermissionRequested(r) => Some(r.request_id),
            _ => None,
        })
        .expect("the model asked for permission");
    drop(log);

    server.kill_and_restart();
    let client = Client::new(&server.base_url).unwrap();
    let status = client.session_status(session).await.unwrap();
    assert!(!status.busy, "{status:?}");
    assert_eq!(status.awaiting_replies, 1, "{status:?}");
    let mut log = client.session_log(session, before.last().unwrap().seq);
    let once = keel_client::schema::api::PermissionReply {
        decision: keel_client::schema::types::Decision::Once,
    };
    assert!(
        client
            .reply_permission(session, request, &once)
            .await
            .unwrap()
            .accepted
    );
    let after = tokio::time::timeout(PATIENCE, read_until(&mut log, succeeded))
        .await
        .expect("the reply resumes the step after the restart");
    let kinds = kinds(&after);
    assert!(!kinds.contains(&"step.recovered"), "{kinds:?}");
    assert_eq!(kinds[0], "permission.replied", "{kinds:?}");
    assert!(kinds.contains(&"tool.success"), "{kinds:?}");
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "Ran it after the restart."
    )));
    let runs = std::fs::read_to_string(server.directory().join("runs.txt")).unwrap();
    assert_eq!(runs.lines().count(), 1, "{runs}");
    let status = client.session_status(session).await.unwrap();
    assert_eq!(status.awaiting_replies, 0, "{status:?}");
}
