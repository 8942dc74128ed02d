//! Runs steered from outside while they are under way, through the real `keel serve`:
//! an interrupt mid-stream, a steering prompt, a permission answered through the API, and
//! a subscriber of `/api/event` that reads nothing while others keep up.
//!
//! The scripted model plays `script.json` from the server's directory; a script step
//! blocks (a long `delay`, or a `bash` call waiting for a file the test creates) where
//! the test needs the run to be in the middle of something.

use std::collections::HashMap;

use futures::StreamExt;
use keel_client::schema::api::{
    CreateSession, ErrorType, InputStatus, LogItem, Message, PermissionReply, PromptRequest,
};
use keel_client::schema::event::{DurableEvent, Envelope, EphemeralEvent};
use keel_client::schema::id::SessionId;
use keel_client::schema::types::{Decision, Delivery, Outcome};
use keel_client::{Client, Error, LogOptions, LogStream};
use keel_tests::Server;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONFIG: &str = r#"
default_model = "test/scripted"
[provider.test]
kind = "scripted"
script = "script.json"
[agent.build.permissions]
write = "ask"
bash = "allow"
"#;

/// A server playing `script` (a list of responses, each a list of items).
fn scripted(script: serde_json::Value) -> Server {
    let script = json!({ "responses": script }).to_string();
    Server::start_with(
        &[("keel.toml", CONFIG), ("script.json", &script)],
        &["--config", "keel.toml"],
    )
}

/// Reads durable events until one of type `until` (without the `session.next.` prefix),
/// returning them all.
async fn read_until(log: &mut LogStream, until: &str) -> Vec<Envelope> {
    let mut events = Vec::new();
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item.expect("the log stream reads") {
            let done = kind(&envelope) == until;
            events.push(envelope);
            if done {
                return events;
            }
        }
    }
    panic!("the log ended before `{until}`");
}

fn kind(envelope: &Envelope) -> &'static str {
    let name = envelope.event.type_name();
    name.strip_prefix("session.next.").unwrap_or(name)
}

fn position(events: &[Envelope], matches: impl Fn(&DurableEvent) -> bool) -> usize {
    events
        .iter()
        .position(|e| matches(&e.event))
        .expect("the event is in the log")
}

async fn new_session(client: &Client, directory: Option<String>) -> SessionId {
    client
        .create_session(&CreateSession {
            directory,
            ..CreateSession::default()
        })
        .await
        .unwrap()
        .id
}

#[tokio::test]
async fn an_interrupt_mid_stream_ends_the_step_and_the_session_takes_the_next_prompt() {
    let server = scripted(json!([
        { "items": [
            { "type": "text", "text": "Counting slowly" },
            { "type": "delay", "ms": 600_000 },
            { "type": "text", "text": "never said" }
        ]},
        { "items": [{ "type": "text", "text": "back again" }] }
    ]));
    let client = Client::new(&server.base_url).unwrap();
    let session = new_session(&client, None).await;
    let options = LogOptions {
        ephemeral: true,
        ..LogOptions::default()
    };
    let mut log = client.session_log_with(session, options);
    // Deltas are live only: the stream must be following before the model speaks.
    loop {
        if let LogItem::Synced(_) = log.next().await.unwrap().unwrap() {
            break;
        }
    }
    client
        .prompt(session, &PromptRequest::text("count"))
        .await
        .unwrap();

    // The model has streamed its first words and is in the middle of its answer.
    loop {
        match log.next().await.unwrap().unwrap() {
            LogItem::Ephemeral(delta) if matches!(delta.event, EphemeralEvent::TextDelta(_)) => {
                break;
            }
            _ => {}
        }
    }
    assert!(client.session_status(session).await.unwrap().busy);
    assert!(client.interrupt(session).await.unwrap().interrupted);
    let events = read_until(&mut log, "execution.settled").await;
    let kinds: Vec<&str> = events.iter().map(kind).collect();
    assert!(kinds.contains(&"step.interrupted"), "{kinds:?}");
    assert!(!kinds.contains(&"step.ended"), "{kinds:?}");
    match &events.last().unwrap().event {
        DurableEvent::ExecutionSettled(settled) => {
            assert_eq!(settled.outcome, Outcome::Interrupted);
        }
        other => panic!("{other:?}"),
    }
    let text: String = events
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::TextEnded(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect();
    assert!(!text.contains("never said"), "{text}");
    let status = client.session_status(session).await.unwrap();
    assert!(!status.busy && status.execution.is_none(), "{status:?}");
    assert!(!client.interrupt(session).await.unwrap().interrupted);

    // Not stuck: the next prompt runs to the end.
    client
        .prompt(session, &PromptRequest::text("go on"))
        .await
        .unwrap();
    let events = read_until(&mut log, "execution.settled").await;
    match &events.last().unwrap().event {
        DurableEvent::ExecutionSettled(settled) => {
            assert_eq!(settled.outcome, Outcome::Succeeded);
        }
        other => panic!("{other:?}"),
    }
    assert!(events.iter().any(|e| matches!(
        &e.event,
        DurableEvent::TextEnded(t) if t.text == "back again"
    )));
}

#[tokio::test]
async fn a_steering_prompt_joins_the_run_at_the_next_step() {
    let server = scripted(json!([
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "while [ ! -e go ] && [ -e \"$PWD\" ]; do sleep 0.02; done; echo released"
        }}]},
        { "items": [{ "type": "text", "text": "steered" }] }
    ]));
    let client = Client::new(&server.base_url).unwrap();
    let session = new_session(&client, None).await;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("wait for go"))
        .await
        .unwrap();
    read_until(&mut log, "tool.called").await;

    // The tool is running; the steering prompt waits for the step boundary.
    let steer = PromptRequest {
        delivery: Some(Delivery::Steer),
        ..PromptRequest::text("and then say steered")
    };
    let admitted = client.prompt(session, &steer).await.unwrap();
    assert_eq!(admitted.input.status, InputStatus::Pending);
    let status = client.session_status(session).await.unwrap();
    assert!(status.busy);
    assert_eq!(status.pending_inputs, 1);

    std::fs::write(server.directory().join("go"), "").unwrap();
    let events = read_until(&mut log, "execution.settled").await;
    let tool_done = position(&events, |e| matches!(e, DurableEvent::ToolSuccess(_)));
    let steered = position(
        &events,
        |e| matches!(e, DurableEvent::Prompted(p) if p.input_id == admitted.input.id),
    );
    let second_step = position(
        &events,
        |e| matches!(e, DurableEvent::StepStarted(s) if s.step == 2),
    );
    assert!(tool_done < steered && steered < second_step, "{events:#?}");
    // One execution carried both prompts.
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, DurableEvent::ExecutionStarted(_)))
    );
    let messages = client.messages(session).await.unwrap();
    let roles: Vec<&str> = messages
        .items
        .iter()
        .map(|m| match m {
            Message::User { .. } => "user",
            Message::Assistant { .. } => "assistant",
            Message::Synthetic { .. } => "synthetic",
            Message::System { .. } => "system",
            Message::Summary { .. } => "summary",
        })
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
}

#[tokio::test]
async fn a_permission_answered_through_the_api_lets_the_tool_run_or_fails_it() {
    let server = scripted(json!([
        { "items": [{ "type": "tool_call", "name": "write", "input": {
            "path": "note.txt", "content": "from the model"
        }}]},
        { "items": [{ "type": "text", "text": "written" }] }
    ]));
    let client = Client::new(&server.base_url).unwrap();

    // Allowed once: the write happens and the model continues.
    let allowed = new_session(&client, None).await;
    let mut log = client.session_log(allowed, 0);
    client
        .prompt(allowed, &PromptRequest::text("write a note"))
        .await
        .unwrap();
    let events = read_until(&mut log, "permission.requested").await;
    let DurableEvent::PermissionRequested(request) = &events.last().unwrap().event else {
        unreachable!()
    };
    assert_eq!(request.tool, "write");
    assert!(!server.directory().join("note.txt").exists());
    // A reply of the wrong kind is a conflict, and the call still waits.
    let wrong = client
        .reply_question(
            allowed,
            request.request_id,
            &keel_client::schema::api::QuestionReply::Answer {
                answer: "yes".into(),
            },
        )
        .await;
    assert!(
        matches!(
            wrong,
            Err(Error::Api {
                kind: ErrorType::Conflict,
                ..
            })
        ),
        "{wrong:?}"
    );
    let status = client.session_status(allowed).await.unwrap();
    assert_eq!(status.awaiting_replies, 1, "{status:?}");
    let once = PermissionReply {
        decision: Decision::Once,
    };
    client
        .reply_permission(allowed, request.request_id, &once)
        .await
        .unwrap();
    let events = read_until(&mut log, "step.ended").await;
    let kinds: Vec<&str> = events.iter().map(kind).collect();
    assert!(kinds.contains(&"permission.replied"), "{kinds:?}");
    assert!(kinds.contains(&"tool.success"), "{kinds:?}");
    assert_eq!(
        std::fs::read_to_string(server.directory().join("note.txt")).unwrap(),
        "from the model"
    );
    // The request is answered: answering again is refused and changes nothing.
    let again = client
        .reply_permission(allowed, request.request_id, &once)
        .await;
    assert!(
        matches!(
            again,
            Err(Error::Api {
                kind: ErrorType::Conflict,
                ..
            })
        ),
        "{again:?}"
    );

    // Rejected: the tool fails, nothing is written, and the run stops.
    std::fs::create_dir(server.directory().join("rejected")).unwrap();
    let directory = server.directory().join("rejected").display().to_string();
    let rejected = new_session(&client, Some(directory)).await;
    let mut log = client.session_log(rejected, 0);
    client
        .prompt(rejected, &PromptRequest::text("write a note"))
        .await
        .unwrap();
    let events = read_until(&mut log, "permission.requested").await;
    let DurableEvent::PermissionRequested(request) = &events.last().unwrap().event else {
        unreachable!()
    };
    let reject = PermissionReply {
        decision: Decision::Reject,
    };
    client
        .reply_permission(rejected, request.request_id, &reject)
        .await
        .unwrap();
    let events = read_until(&mut log, "step.interrupted").await;
    let failed = events
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolFailed(failed) => Some(failed.error.kind.clone()),
            _ => None,
        })
        .expect("the rejected call failed");
    assert_eq!(failed, "tool.permission-rejected");
    assert!(!server.directory().join("rejected/note.txt").exists());
}

/// One SSE message: its `event:` name (if any) and its `data:`.
fn messages(text: &str) -> Vec<(Option<String>, String)> {
    text.split("\n\n")
        .filter_map(|message| {
            let data = message.lines().find_map(|l| l.strip_prefix("data: "))?;
            let name = message
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .map(str::to_owned);
            Some((name, data.to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn a_subscriber_that_reads_nothing_is_disconnected_while_others_keep_up() {
    const SESSIONS: usize = 8;
    // Enough to fill any sane socket buffer many times over; the loop stops far earlier.
    const MAX_ROUNDS: usize = 200;
    let server = Server::start(&[]);
    let client = Client::new(&server.base_url).unwrap();
    let address = server.base_url.trim_start_matches("http://").to_owned();

    // The slow subscriber: a small receive buffer, and it reads nothing for now.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(address.parse().unwrap()).await.unwrap();
    slow.write_all(format!("GET /api/event HTTP/1.0\r\nhost: {address}\r\n\r\n").as_bytes())
        .await
        .unwrap();

    // The fast subscriber reads everything, reporting each durable event it sees.
    let response = reqwest::get(format!("{}/api/event", server.base_url))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut body = response.bytes_stream();
        let mut buffer = String::new();
        while let Some(Ok(chunk)) = body.next().await {
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find("\n\n") {
                let message: String = buffer.drain(..end + 2).collect();
                for (name, data) in messages(&message) {
                    let value: serde_json::Value = serde_json::from_str(&data).unwrap();
                    if name.as_deref() == Some("lagged") || value.get("seq").is_some() {
                        drop(seen_tx.send((name, value)));
                    }
                }
            }
        }
    });

    let mut sessions = Vec::new();
    for _ in 0..SESSIONS {
        sessions.push(new_session(&client, None).await);
    }
    // Large prompts make the events large, so the slow subscriber's socket buffers (the
    // kernel's, several MiB) fill and its queue on the server has to take the rest. Rounds
    // go on until the server reports the subscriber fell behind.
    let prompt = "lorem ipsum ".repeat(128 * 1024 / 12);
    let mut rounds = 0;
    while !server.logged("subscriber fell behind") {
        rounds += 1;
        assert!(
            rounds <= MAX_ROUNDS,
            "the slow subscriber was never cut off"
        );
        let mut logs = Vec::new();
        for &session in &sessions {
            let last = client.get_session(session).await.unwrap().last_seq;
            logs.push(client.session_log(session, last));
            client
                .prompt(session, &PromptRequest::text(prompt.as_str()))
                .await
                .unwrap();
        }
        for log in &mut logs {
            read_until(log, "execution.settled").await;
        }
    }
    let mut total = 0;
    for &session in &sessions {
        total += client.get_session(session).await.unwrap().last_seq;
    }

    // The fast subscriber saw every durable event of every session, in order.
    let mut last: HashMap<String, u64> = HashMap::new();
    for _ in 0..total {
        let (name, event) = seen.recv().await.unwrap();
        assert_eq!(name, None, "the fast subscriber was dropped: {event}");
        let session = event["session_id"].as_str().unwrap().to_owned();
        let seq = event["seq"].as_u64().unwrap();
        let previous = last.insert(session, seq).unwrap_or(0);
        assert_eq!(seq, previous + 1);
    }

    // The slow one gets what was queued for it, then `lagged`, then the end: every
    // durable event it did get is gapless per session (from whenever its subscription
    // started).
    let mut received = Vec::new();
    slow.read_to_end(&mut received).await.unwrap();
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.0 200"), "{received:.200}");
    let messages = messages(&received);
    let (name, data) = messages.last().unwrap();
    assert_eq!(name.as_deref(), Some("lagged"), "{data}");
    assert!(data.contains("disconnected"), "{data}");
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut durable = 0;
    for (name, data) in &messages[..messages.len() - 1] {
        assert_eq!(name, &None);
        let event: serde_json::Value = serde_json::from_str(data).unwrap();
        if let Some(seq) = event["seq"].as_u64() {
            durable += 1;
            let session = event["session_id"].as_str().unwrap().to_owned();
            if let Some(previous) = last.insert(session, seq) {
                assert_eq!(seq, previous + 1, "an event was skipped silently");
            }
        }
    }
    assert!(durable < total, "the slow subscriber was not behind");
}
