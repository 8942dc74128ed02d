//! A `keel serve` killed with SIGKILL in the middle of a write tool: the restarted
//! process takes the session over once its lease runs out, fails the interrupted call
//! instead of running it again, and the session continues to the end.

use futures::StreamExt;
use keel_client::schema::api::{LogItem, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::types::{InputSource, Outcome};
use keel_client::{Client, LogStream};
use keel_tests::Server;
use serde_json::json;

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

#[tokio::test]
async fn a_killed_server_recovers_the_session_once_without_rerunning_the_write_tool() {
    // The bash call records each real run, then waits for a file that appears only
    // after the restart; the second answer comes after recovery.
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "echo ran >> runs.txt; while [ ! -e go ]; do sleep 0.02; done"
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
    let after = read_until(&mut log, |e| {
        matches!(&e.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded)
    })
    .await;
    // Let a bash left over from the killed process finish.
    std::fs::write(server.directory().join("go"), "").unwrap();

    let kinds: Vec<&str> = after
        .iter()
        .map(|e| e.event.type_name().trim_start_matches("session.next."))
        .collect();
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
