//! `bash` sandboxed by default, through the real `keel serve`: a session's command writes
//! in its directory and nowhere else and sees no keys; a database inside the session
//! directory makes Keel warn at start-up and refuse sandboxed calls there, while an agent
//! with `sandbox = "off"` runs them.

use keel_client::Client;
use keel_client::schema::api::{CreateSession, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::SessionId;
use keel_tests::{Server, read_until};
use serde_json::json;

const CONFIG: &str = r#"
default_model = "test/scripted"
[provider.test]
kind = "scripted"
script = "script.json"
[agent.build.permissions]
bash = "allow"
[agent.free]
sandbox = "off"
[agent.free.permissions]
bash = "allow"
"#;

/// One `bash` call of `command`, then a text answer.
fn script(command: &str) -> String {
    json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": { "command": command } }] },
        { "items": [{ "type": "text", "text": "done" }] }
    ]})
    .to_string()
}

/// Prompts a new session of `agent` and returns its events up to the settlement.
async fn run(client: &Client, agent: &str) -> (SessionId, Vec<Envelope>) {
    let session = client
        .create_session(&CreateSession {
            agent: Some(agent.into()),
            ..CreateSession::default()
        })
        .await
        .unwrap()
        .id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("run it"))
        .await
        .unwrap();
    let events = read_until(&mut log, |e| {
        matches!(e.event, DurableEvent::ExecutionSettled(_))
    })
    .await;
    (session, events)
}

#[tokio::test]
async fn a_sessions_command_writes_only_in_its_directory_and_sees_no_keys() {
    let server = Server::start_with_env(
        &[
            ("keel.toml", CONFIG),
            (
                "script.json",
                &script(
                    "echo \"key=${OPENAI_API_KEY-unset}\"; touch inside; \
                     ls \"$TMPDIR\" > /dev/null && echo temp-ok; touch ../escaped",
                ),
            ),
        ],
        &["--config", "keel.toml"],
        &[("OPENAI_API_KEY", "sk-not-for-commands")],
    );
    assert!(server.logged("bash runs sandboxed (Landlock)"));
    let client = Client::new(&server.base_url).unwrap();
    let (_, events) = run(&client, "build").await;
    let output = events
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolSuccess(s) => Some(s.structured.clone()),
            _ => None,
        })
        .expect("the command ran");
    let text = output["output"].as_str().unwrap();
    assert!(text.contains("key=unset"), "{text}");
    assert!(text.contains("temp-ok"), "{text}");
    assert!(text.contains("Permission denied"), "{text}");
    assert_eq!(
        output["sandbox"],
        json!({ "network": false, "blocked": true })
    );
    let directory = server.directory();
    assert!(directory.join("inside").exists());
    assert!(!directory.parent().unwrap().join("escaped").exists());
}

#[tokio::test]
async fn a_database_in_the_session_directory_refuses_sandboxed_calls_but_not_unsandboxed_ones() {
    let server = Server::start_on(
        Some("sqlite://keel.db"),
        &[
            ("keel.toml", CONFIG),
            ("script.json", &script("head -c 15 keel.db")),
        ],
        &["--config", "keel.toml"],
    );
    assert!(server.logged("the database is inside the sessions' root"));
    assert!(server.logged("the configuration is inside the sessions' root"));
    let client = Client::new(&server.base_url).unwrap();

    let (_, events) = run(&client, "build").await;
    let failed = events
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolFailed(f) => Some(f.error.clone()),
            _ => None,
        })
        .expect("the call failed");
    assert_eq!(failed.kind, "tool.sandbox");
    assert!(
        failed.message.starts_with("blocked by sandbox:"),
        "{}",
        failed.message
    );
    assert!(failed.message.contains("keel.db"), "{}", failed.message);

    let (_, events) = run(&client, "free").await;
    let output = events
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolSuccess(s) => Some(s.structured.clone()),
            _ => None,
        })
        .expect("the unsandboxed command ran");
    assert_eq!(output["output"], "SQLite format 3");
    assert!(output.get("sandbox").is_none(), "{output}");
}
