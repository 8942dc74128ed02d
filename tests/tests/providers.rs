//! A real provider adapter end to end: `keel serve`, configured only by its `keel.toml`,
//! talks to a fake OpenAI-compatible server on 127.0.0.1 that plays recorded Chat
//! Completions transcripts. Prompt → streamed text → tool call → tool result → a second
//! turn that replays the call → stop.

use futures::StreamExt;
use keel_client::Client;
use keel_client::schema::api::{LogItem, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::types::Outcome;
use keel_tests::fake_provider::FakeProvider;
use keel_tests::{Server, transcript};
use serde_json::{Value, json};

#[tokio::test]
async fn a_session_runs_against_an_openai_compatible_server_configured_by_keel_toml() {
    let fake = FakeProvider::start(vec![
        transcript("openai/tool_call.http"),
        transcript("openai/answer.http"),
    ])
    .await;
    let config = format!(
        r#"
default_model = "local/llama-3.1-8b"
[provider.local]
kind = "openai"
base_url = "{}/v1"
[model."local/llama-3.1-8b".price]
input = 2.0
output = 10.0
"#,
        fake.base_url
    );
    let server = Server::start_with(&[("keel.toml", &config)], &["--config", "keel.toml"]);
    std::fs::create_dir_all(server.directory().join("notes")).unwrap();
    std::fs::write(
        server.directory().join("notes/todo.md"),
        "- ship recovery\n- write docs\n",
    )
    .unwrap();

    let client = Client::new(&server.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("What is in notes/todo.md?"))
        .await
        .unwrap();
    let mut events: Vec<Envelope> = Vec::new();
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item.unwrap() {
            let settled = matches!(envelope.event, DurableEvent::ExecutionSettled(_));
            events.push(envelope);
            if settled {
                break;
            }
        }
    }
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e.event.type_name().trim_start_matches("session.next."))
        .collect();
    let from = kinds.iter().position(|k| *k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "text.started",
            "text.ended",
            "tool.input.started",
            "tool.input.ended",
            "tool.called",
            "tool.success",
            "step.ended",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    assert!(matches!(
        &events.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded
    ));

    // Each step's cost comes from the usage the server reported and the configured
    // prices; the status route sums them.
    let mut expected = 0.0;
    for envelope in &events {
        if let DurableEvent::StepEnded(s) = &envelope.event {
            // Cached input costs the input price: the file sets no `cache_read`.
            let input = (s.usage.input + s.usage.cache_read) as f64;
            let cost = (input * 2.0 + s.usage.output as f64 * 10.0) / 1e6;
            assert!(s.usage.input > 0 && (s.cost - cost).abs() < 1e-12, "{s:?}");
            expected += cost;
        }
    }
    let status = client.session_status(session).await.unwrap();
    assert!((status.cost - expected).abs() < 1e-12, "{status:?}");

    let received = fake.received();
    assert_eq!(received.len(), 2);
    assert_eq!(received[0].path, "/v1/chat/completions");
    assert_eq!(received[0].body["model"], "llama-3.1-8b");
    assert_eq!(
        received[0].header("authorization"),
        None,
        "no key configured"
    );
    // The second turn replays the call and its result.
    let messages = received[1].body["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    let call = &messages[2]["tool_calls"][0];
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"path": "notes/todo.md", "offset": 1}));
    assert_eq!(messages[3]["tool_call_id"], call["id"]);
    assert!(
        messages[3]["content"]
            .as_str()
            .unwrap()
            .contains("write docs")
    );

    let answer = client.messages(session).await.unwrap();
    let answer = serde_json::to_string(&answer).unwrap();
    assert!(answer.contains("The file lists two tasks."), "{answer}");
}
