//! A `keel serve` stopped in the middle of a step: killed with SIGKILL inside a write tool
//! or while the model streams, the restarted process takes the session over once the lease
//! runs out, fails the interrupted call instead of running it again, and the session
//! continues to the end; stopped with SIGTERM, a step that finishes within the shutdown
//! grace finishes, one that does not is stopped as `shutdown`, and either way the
//! restarted process continues the session at once, even with a long lease, with no crash
//! reported. A step waiting for a permission reply holds no claim: a kill leaves it
//! waiting, and the reply after the restart runs the tool once.

use keel_client::Client;
use keel_client::schema::api::PromptRequest;
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::SessionId;
use keel_client::schema::types::{Finish, InputSource, InterruptReason, Outcome};
use keel_tests::{PATIENCE, Server, read_until};
use serde_json::json;

const CONFIG: &str = r#"
default_model = "test/scripted"
[provider.test]
kind = "scripted"
script = "script.json"
[agent.build.permissions]
"*" = "allow"
"#;

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

/// Starts a server on `script` with a ten-minute lease (so only what a shutdown leaves
/// behind, never an expired lease, can let the restart go on) and the given shutdown
/// grace; prompts a session and reads its log until the model's call has started.
async fn running_a_call(script: &str, grace_ms: &str) -> (Server, SessionId, u64) {
    let server = Server::start_with(
        &[("keel.toml", CONFIG), ("script.json", script)],
        &[
            "--config",
            "keel.toml",
            "--lease-ms",
            "600000",
            "--shutdown-grace-ms",
            grace_ms,
        ],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("run it"))
        .await
        .unwrap();
    let before = read_until(&mut log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await;
    (server, session, before.last().unwrap().seq)
}

/// Reads the session's log through the restarted `server` from after `seq` until the
/// execution that continued it succeeded.
async fn after_restart(server: &Server, session: SessionId, seq: u64) -> Vec<Envelope> {
    let client = Client::new(&server.base_url).unwrap();
    let mut log = client.session_log(session, seq);
    tokio::time::timeout(PATIENCE, read_until(&mut log, succeeded))
        .await
        .expect("the restarted server continues the session without waiting for the lease")
}

#[tokio::test]
async fn sigterm_mid_step_stops_it_as_shutdown_and_the_restart_continues_without_a_crash_report() {
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "echo ran >> runs.txt; while [ ! -e go ] && [ -e \"$PWD\" ]; do sleep 0.02; done"
        }}]},
        { "items": [{ "type": "text", "text": "Continued after the shutdown." }] }
    ]})
    .to_string();
    // The call never finishes by itself: the grace runs out and the step is stopped.
    let (mut server, session, seq) = running_a_call(&script, "300").await;
    server.terminate_and_restart();
    let after = after_restart(&server, session, seq).await;
    let kinds = kinds(&after);
    assert!(!kinds.contains(&"step.recovered"), "{kinds:?}");
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::StepInterrupted(i) if i.reason == InterruptReason::Shutdown
    )));
    // The stopped call's result, as the model sees it, says why.
    let client = Client::new(&server.base_url).unwrap();
    let messages = serde_json::to_value(client.messages(session).await.unwrap()).unwrap();
    assert!(
        messages.to_string().contains("interrupted (shutdown)"),
        "{messages}"
    );
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Interrupted
            && s.error.as_ref().is_some_and(|e| e.kind == "execution.shutdown")
    )));
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::PromptAdmitted(p) if p.source == InputSource::Recovery
    )));
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "Continued after the shutdown."
    )));
    // The stopped call was not run again.
    assert_eq!(
        kinds.iter().filter(|k| **k == "tool.called").count(),
        0,
        "{kinds:?}"
    );
    let runs = std::fs::read_to_string(server.directory().join("runs.txt")).unwrap();
    assert_eq!(runs.lines().count(), 1, "{runs}");
}

#[tokio::test]
async fn sigterm_lets_a_step_finish_within_the_grace_and_the_restart_continues_from_its_boundary() {
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "sleep 0.5; echo done > finished.txt"
        }}]},
        { "items": [{ "type": "text", "text": "Continued from the boundary." }] }
    ]})
    .to_string();
    let (mut server, session, seq) = running_a_call(&script, "20000").await;
    server.terminate_and_restart();
    assert!(server.directory().join("finished.txt").exists());
    let after = after_restart(&server, session, seq).await;
    let kinds = kinds(&after);
    assert!(!kinds.contains(&"step.recovered"), "{kinds:?}");
    assert!(!kinds.contains(&"step.interrupted"), "{kinds:?}");
    assert!(kinds.contains(&"tool.success"), "{kinds:?}");
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::StepEnded(s) if s.finish == Finish::ToolCalls
    )));
    assert!(after.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "Continued from the boundary."
    )));
}

#[tokio::test]
async fn a_permission_pending_across_a_kill_is_answered_after_the_restart_and_the_tool_runs_once() {
    let config = format!("{CONFIG}bash = \"ask\"\n");
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
