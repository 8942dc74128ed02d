//! Several `keel serve` nodes on one PostgreSQL database (a fresh one per test, on the
//! server `KEEL_TEST_POSTGRES_URL` names; skipped, saying so, without it): sessions
//! admitted through different nodes, the node running them killed mid-step and taken
//! over exactly once by a survivor, a client following the log through a third node
//! seeing every event once, a paused owner fenced out when it resumes, an interrupt and
//! a permission reply sent through a node that does not run the session, and a node
//! that loses every database connection mid-run going on without losing anything.

use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_client::schema::api::{ErrorType, LogItem, PermissionReply, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::{OwnerId, SessionId};
use keel_client::schema::types::{Decision, Delivery, Outcome};
use keel_client::{Client, Error, LogOptions, LogStream};
use keel_tests::{PATIENCE, PostgresDb, Server, read_until};
use serde_json::json;

const CONFIG: &str = r#"
default_model = "test/scripted"
[provider.test]
kind = "scripted"
script = "script.json"
[agent.build.permissions]
"*" = "allow"
"#;

/// The first answer runs `bash` until a `go` file appears in the session directory; the
/// next answers are text.
fn script() -> String {
    json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "bash", "input": {
            "command": "echo \"$KEEL_CALL_ID\" >> runs.txt; while [ ! -e go ] && [ -e \"$PWD\" ]; do sleep 0.02; done"
        }}]},
        { "items": [{ "type": "text", "text": "Recovered." }] },
        { "items": [{ "type": "text", "text": "Second prompt answered." }] }
    ]})
    .to_string()
}

/// A node on `db` with a short lease.
fn node(db: &PostgresDb, script: &str) -> Server {
    Server::start_on(
        Some(&db.url),
        &[("keel.toml", CONFIG), ("script.json", script)],
        &["--config", "keel.toml", "--lease-ms", "1500"],
    )
}

fn text_ended(envelope: &Envelope, text: &str) -> bool {
    matches!(&envelope.event, DurableEvent::TextEnded(t) if t.text == text)
}

fn succeeded(envelope: &Envelope) -> bool {
    matches!(&envelope.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded)
}

/// The owner that started the session's last execution.
fn last_owner(events: &[Envelope]) -> Option<OwnerId> {
    events.iter().rev().find_map(|e| match &e.event {
        DurableEvent::ExecutionStarted(s) => Some(s.owner_id),
        _ => None,
    })
}

/// The session's whole log as it stands.
async fn whole_log(client: &Client, session: SessionId) -> Vec<Envelope> {
    let options = LogOptions {
        follow: false,
        ..LogOptions::default()
    };
    let mut log = client.session_log_with(session, options);
    let mut events = Vec::new();
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item.expect("the log reads") {
            events.push(envelope);
        }
    }
    events
}

/// Checks the events one client saw of a session against the session's whole log: every
/// event once, in order, none missing.
async fn assert_seen_once(seen: &[Envelope], through: &Client, session: SessionId) {
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, expected, "every event once, in order");
    let full = whole_log(through, session).await;
    assert_eq!(full.len(), seen.len(), "nothing committed was missed");
}

#[tokio::test]
async fn sessions_complete_exactly_once_on_a_survivor_when_their_node_dies() {
    let Some(db) = PostgresDb::fresh("sessions_complete_exactly_once_on_a_survivor") else {
        return;
    };
    let script = script();
    let mut first = node(&db, &script);
    let second = node(&db, &script);
    let third = node(&db, &script);
    let (c1, c2, c3) = (
        Client::new(&first.base_url).unwrap(),
        Client::new(&second.base_url).unwrap(),
        Client::new(&third.base_url).unwrap(),
    );

    // Two sessions created and prompted through the first node, which runs them.
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let id = c1.create_session(&Default::default()).await.unwrap().id;
        c1.prompt(id, &PromptRequest::text("work")).await.unwrap();
        sessions.push(id);
    }
    // A client follows both through the third node.
    let mut logs: Vec<LogStream> = sessions.iter().map(|s| c3.session_log(*s, 0)).collect();
    let mut seen: Vec<Vec<Envelope>> = Vec::new();
    for log in &mut logs {
        seen.push(read_until(log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await);
    }
    let dead = last_owner(&seen[0]).unwrap();
    assert_eq!(last_owner(&seen[1]), Some(dead), "the first node runs both");

    // A second prompt for the first session, admitted through the second node while the
    // first still runs it: queued behind the running step.
    let queued = PromptRequest {
        delivery: Some(Delivery::Queue),
        ..PromptRequest::text("and then this")
    };
    c2.prompt(sessions[0], &queued).await.unwrap();
    let nodes = c2.nodes().await.unwrap().items;
    assert_eq!(nodes.len(), 3, "{nodes:?}");

    first.kill();
    // A survivor takes both over once the lease ran out.
    seen[0].extend(read_until(&mut logs[0], |e| text_ended(e, "Second prompt answered.")).await);
    seen[0].extend(read_until(&mut logs[0], succeeded).await);
    seen[1].extend(read_until(&mut logs[1], |e| text_ended(e, "Recovered.")).await);
    seen[1].extend(read_until(&mut logs[1], succeeded).await);
    std::fs::write(first.directory().join("go"), "").unwrap();

    for (session, events) in sessions.iter().zip(&seen) {
        assert_seen_once(events, &c2, *session).await;
        let recovered = events
            .iter()
            .filter(|e| matches!(e.event, DurableEvent::StepRecovered(_)))
            .count();
        assert_eq!(recovered, 1, "taken over exactly once");
        let calls = events
            .iter()
            .filter(|e| matches!(e.event, DurableEvent::ToolCalled(_)))
            .count();
        assert_eq!(calls, 1, "the interrupted bash call is not run again");
        let survivor = last_owner(events).unwrap();
        assert_ne!(survivor, dead);
        let status = c3.session_status(*session).await.unwrap();
        assert!(!status.busy && status.pending_inputs == 0, "{status:?}");
    }
    let runs = std::fs::read_to_string(first.directory().join("runs.txt")).unwrap_or_default();
    assert_eq!(runs.lines().count(), 2, "each bash call ran once: {runs}");
    drop((second, third));
}

#[tokio::test]
async fn a_paused_owner_is_fenced_out_when_it_resumes() {
    let Some(db) = PostgresDb::fresh("a_paused_owner_is_fenced_out") else {
        return;
    };
    let script = script();
    let first = node(&db, &script);
    let second = node(&db, &script);
    let (c1, c2) = (
        Client::new(&first.base_url).unwrap(),
        Client::new(&second.base_url).unwrap(),
    );
    let session = c1.create_session(&Default::default()).await.unwrap().id;
    let mut log = c2.session_log(session, 0);
    c1.prompt(session, &PromptRequest::text("work"))
        .await
        .unwrap();
    let mut seen = read_until(&mut log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await;
    let paused = last_owner(&seen).unwrap();

    // Paused past its lease: the second node takes the session over and finishes it.
    first.signal(libc::SIGSTOP);
    seen.extend(read_until(&mut log, succeeded).await);
    assert_ne!(last_owner(&seen), Some(paused));

    // Resumed, the first node's bash call finishes; its result is refused by the fence.
    std::fs::write(first.directory().join("go"), "").unwrap();
    first.signal(libc::SIGCONT);
    let fenced = async {
        while !first.logged("ownership lost") {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(PATIENCE, fenced)
        .await
        .expect("the resumed node notices it lost the session");

    let full = whole_log(&c2, session).await;
    assert_eq!(full.len(), seen.len(), "the resumed node wrote nothing");
    let results = full
        .iter()
        .filter(|e| {
            matches!(
                e.event,
                DurableEvent::ToolSuccess(_) | DurableEvent::ToolFailed(_)
            )
        })
        .count();
    assert_eq!(
        results, 0,
        "the interrupted call's result is in step.recovered's projection"
    );
    let messages = serde_json::to_string(&c2.messages(session).await.unwrap()).unwrap();
    assert!(messages.contains("tool.interrupted-by-crash"), "{messages}");
    drop(second);
}

#[tokio::test]
async fn a_database_restart_mid_run_costs_retries_not_data() {
    let Some(db) = PostgresDb::fresh("a_database_restart_mid_run_costs_retries_not_data") else {
        return;
    };
    let script = script();
    let only = Server::start_on(
        Some(&db.url),
        &[("keel.toml", CONFIG), ("script.json", &script)],
        &["--config", "keel.toml", "--lease-ms", "5000"],
    );
    let client = Client::new(&only.base_url).unwrap();
    let session = client.create_session(&Default::default()).await.unwrap().id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("work"))
        .await
        .unwrap();
    let mut seen = read_until(&mut log, |e| matches!(e.event, DurableEvent::ToolCalled(_))).await;

    // Every connection of the node (writer, readers, bus) is cut while the tool runs.
    assert!(db.terminate_connections() > 0);
    std::fs::write(only.directory().join("go"), "").unwrap();
    seen.extend(read_until(&mut log, succeeded).await);
    assert_seen_once(&seen, &client, session).await;
    let results: Vec<bool> = seen
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ToolSuccess(_) => Some(true),
            DurableEvent::ToolFailed(_) => Some(false),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [true],
        "the call's one result was committed after reconnecting"
    );
}

#[tokio::test]
async fn an_interrupt_through_another_node_reaches_the_node_running_the_session() {
    let Some(db) = PostgresDb::fresh("an_interrupt_through_another_node") else {
        return;
    };
    // One long answer: a text, then a ten-minute pause.
    let script = json!({ "responses": [{ "items": [
        { "type": "text", "text": "Thinking" },
        { "type": "delay", "ms": 600000 },
        { "type": "text", "text": "never said" }
    ]}]})
    .to_string();
    let first = node(&db, &script);
    let second = node(&db, &script);
    let (c1, c2) = (
        Client::new(&first.base_url).unwrap(),
        Client::new(&second.base_url).unwrap(),
    );
    let session = c1.create_session(&Default::default()).await.unwrap().id;
    let mut log = c2.session_log(session, 0);
    c1.prompt(session, &PromptRequest::text("think"))
        .await
        .unwrap();
    let mut seen = read_until(&mut log, |e| text_ended(e, "Thinking")).await;
    let runner = last_owner(&seen).unwrap();

    assert!(c2.interrupt(session).await.unwrap().interrupted);
    seen.extend(
        read_until(&mut log, |e| {
            matches!(&e.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Interrupted)
        })
        .await,
    );
    assert!(
        seen.iter()
            .any(|e| matches!(e.event, DurableEvent::StepInterrupted(_))),
        "the step was interrupted by the node running it"
    );
    assert_eq!(last_owner(&seen), Some(runner));
    let status = c2.session_status(session).await.unwrap();
    assert!(!status.busy, "{status:?}");
    drop((first, second));
}

#[tokio::test]
async fn a_permission_answered_through_another_node_resumes_the_waiting_step() {
    let Some(db) = PostgresDb::fresh("a_permission_answered_through_another_node") else {
        return;
    };
    let config = format!("{CONFIG}write = \"ask\"\n");
    let script = json!({ "responses": [
        { "items": [{ "type": "tool_call", "name": "write", "input": {
            "path": "note.txt", "content": "approved elsewhere"
        }}]},
        { "items": [{ "type": "text", "text": "Written." }] }
    ]})
    .to_string();
    let start = || {
        Server::start_on(
            Some(&db.url),
            &[("keel.toml", &config), ("script.json", &script)],
            &["--config", "keel.toml", "--lease-ms", "1500"],
        )
    };
    let (first, second) = (start(), start());
    let (c1, c2) = (
        Client::new(&first.base_url).unwrap(),
        Client::new(&second.base_url).unwrap(),
    );
    let session = c1.create_session(&Default::default()).await.unwrap().id;
    let mut log = c2.session_log(session, 0);
    c1.prompt(session, &PromptRequest::text("write it"))
        .await
        .unwrap();
    let seen = read_until(&mut log, |e| {
        matches!(e.event, DurableEvent::PermissionRequested(_))
    })
    .await;
    let request = seen
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::PermissionRequested(r) => Some(r.request_id),
            _ => None,
        })
        .unwrap();
    let once = PermissionReply {
        decision: Decision::Once,
    };
    assert!(
        c2.reply_permission(session, request, &once)
            .await
            .unwrap()
            .accepted
    );
    read_until(&mut log, |e| text_ended(e, "Written.")).await;
    assert_eq!(
        std::fs::read_to_string(first.directory().join("note.txt")).unwrap(),
        "approved elsewhere"
    );
    // Answered: a second reply, through either node, is a conflict.
    for client in [&c1, &c2] {
        let again = client.reply_permission(session, request, &once).await;
        assert!(
            matches!(
                again,
                Err(keel_client::Error::Api {
                    kind: keel_client::schema::api::ErrorType::Conflict,
                    ..
                })
            ),
            "{again:?}"
        );
    }
    drop(second);
}

#[tokio::test]
async fn readiness_fails_with_the_reason_while_the_database_is_away_and_recovers_by_itself() {
    let Some(db) = PostgresDb::fresh("readiness_fails_while_the_database_is_away") else {
        return;
    };
    let server = node(&db, &script());
    let client = Client::new(&server.base_url).unwrap();
    // The node is listening for the others once its bus has connected.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = loop {
        match client.ready().await {
            Ok(ready) => break ready,
            Err(e) => assert!(Instant::now() < deadline, "never ready: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ready.checks, ["database", "writer", "notifications"]);

    // The database goes away: readiness answers 503 and says what failed.
    db.allow_connections(false);
    db.terminate_connections();
    match client.ready().await {
        Err(Error::Api {
            status: 503,
            kind: ErrorType::Unavailable,
            message,
        }) => assert!(
            message.contains("database") || message.contains("writer") || message.contains("nodes"),
            "{message}"
        ),
        other => panic!("expected 503 while the database is away, got {other:?}"),
    }

    // It comes back: the node recovers by itself.
    db.allow_connections(true);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match client.ready().await {
            Ok(ready) if ready.checks.len() == 3 => break,
            other => assert!(Instant::now() < deadline, "never ready again: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn an_unreachable_database_at_start_is_a_clear_error() {
    // Port 1 on the loopback: nothing listens there.
    let output = std::process::Command::new(keel_tests::keel_binary())
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--db", "postgres://keel@127.0.0.1:1/keel"])
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("keel runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("could not open the database at postgres://keel@127.0.0.1:1/keel")
            && stderr.contains("Connection refused"),
        "{stderr}"
    );
}
