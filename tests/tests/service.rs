//! The real `keel serve` driven through keel-client and raw HTTP.

use futures::StreamExt;
use keel_client::{Client, Error};
use keel_schema::api::{CreateSession, ErrorType, PromptRequest};
use keel_schema::event::Envelope;
use keel_schema::id::InputId;
use keel_schema::types::Part;
use keel_tests::Server;

/// Follows the session's log until `execution.settled`, returning every durable event.
async fn follow_to_idle(server: &Server, session: &str) -> Vec<Envelope> {
    let response = reqwest::get(format!("{}/api/session/{session}/log", server.base_url))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // A buffering reverse proxy is told to pass the events on at once.
    assert_eq!(
        response
            .headers()
            .get("x-accel-buffering")
            .and_then(|v| v.to_str().ok()),
        Some("no")
    );
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(chunk) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(end) = buffer.find("\n\n") {
            let message: String = buffer.drain(..end + 2).collect();
            let Some(data) = message.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if message.lines().any(|l| l.starts_with("id: ")) {
                let envelope: Envelope = serde_json::from_str(data).unwrap();
                let settled = envelope.event.type_name() == "session.next.execution.settled";
                events.push(envelope);
                if settled {
                    return events;
                }
            }
        }
    }
    panic!("the log stream ended before the session went idle");
}

fn text(t: &str) -> Vec<Part> {
    vec![Part::Text { text: t.into() }]
}

#[tokio::test]
async fn the_demo_model_answers_a_prompt_with_a_tool_call_in_the_documented_order() {
    let server = Server::start(&[]);
    let client = Client::new(&server.base_url).unwrap();
    assert!(client.health().await.unwrap().ok);
    let session = client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::canonicalize(&session.directory).unwrap(),
        std::fs::canonicalize(server.directory()).unwrap()
    );
    let prompted = client
        .prompt(
            session.id,
            &PromptRequest {
                id: None,
                parts: text("What is here?"),
                delivery: None,
                request_execution: None,
            },
        )
        .await
        .unwrap();
    assert!(!prompted.replayed);
    let events = follow_to_idle(&server, &session.id.to_string()).await;
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e.event.type_name().trim_start_matches("session.next."))
        .collect();
    assert_eq!(
        &kinds[..7],
        &[
            "created",
            "prompt.admitted",
            "prompt.execution_requested",
            "execution.started",
            "prompted",
            "context.epoch_started",
            "step.started"
        ]
    );
    assert!(kinds.contains(&"tool.called") && kinds.contains(&"tool.success"));
    assert_eq!(kinds.last(), Some(&"execution.settled"));
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let status = client.session_status(session.id).await.unwrap();
    assert!(!status.busy);
}

#[tokio::test]
async fn a_retried_prompt_is_replayed_and_a_conflicting_one_is_a_409() {
    let server = Server::start(&[]);
    let client = Client::new(&server.base_url).unwrap();
    let session = client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    // An `inp_` id is the input's own id; any other key maps to an id Keel derives.
    let own_id = InputId::new();
    for key in [own_id.to_string(), "retry: order #42 / attempt".to_string()] {
        let request = PromptRequest {
            id: Some(key.clone()),
            parts: text(&format!("once for {key}")),
            delivery: None,
            request_execution: Some(false),
        };
        let first = client.prompt(session.id, &request).await.unwrap();
        assert!(!first.replayed);
        if key == own_id.to_string() {
            assert_eq!(first.input.id, own_id);
        }
        let again = client.prompt(session.id, &request).await.unwrap();
        assert!(again.replayed, "the same key and content replay ({key})");
        assert_eq!(again.input, first.input);
        let conflicting = PromptRequest {
            parts: text("other"),
            ..request
        };
        let err = client.prompt(session.id, &conflicting).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::Api {
                    status: 409,
                    kind: ErrorType::Conflict,
                    ..
                }
            ),
            "{err}"
        );
    }
    let status = client.session_status(session.id).await.unwrap();
    assert_eq!(status.pending_inputs, 2, "each key admitted its input once");
}

#[tokio::test]
async fn the_idempotency_key_header_replays_and_bad_keys_are_refused_without_a_write() {
    let server = Server::start(&[]);
    let client = Client::new(&server.base_url).unwrap();
    let session = client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/api/session/{}/prompt", server.base_url, session.id);
    let body = r#"{"parts": [{"type": "text", "text": "hi"}], "request_execution": false}"#;
    let send = |key: Option<&str>, body: String| {
        let mut request = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.send()
    };
    let first: serde_json::Value = send(Some("k-1"), body.into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(first["replayed"], false);
    // The header and the body's `id` name the same key.
    let same_in_body =
        r#"{"id": "k-1", "parts": [{"type": "text", "text": "hi"}], "request_execution": false}"#;
    let again: serde_json::Value = send(None, same_in_body.into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["replayed"], true, "{again}");
    assert_eq!(again["input"], first["input"]);
    let other_content =
        r#"{"parts": [{"type": "text", "text": "bye"}], "request_execution": false}"#;
    assert_eq!(
        send(Some("k-1"), other_content.into())
            .await
            .unwrap()
            .status(),
        409
    );

    let too_long = "k".repeat(129);
    let bad = [
        (Some("k-2"), same_in_body.to_string()), // header and body differ
        (
            None,
            format!(r#"{{"id": "{too_long}", "parts": [{{"type": "text", "text": "x"}}]}}"#),
        ),
        (
            None,
            r#"{"id": "", "parts": [{"type": "text", "text": "x"}]}"#.to_string(),
        ),
        (
            None,
            r#"{"id": "a\u0007b", "parts": [{"type": "text", "text": "x"}]}"#.to_string(),
        ),
    ];
    for (key, body) in bad {
        let response = send(key, body.clone()).await.unwrap();
        assert_eq!(response.status(), 422, "{key:?} {body}");
        let error: serde_json::Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "unprocessable", "{error}");
    }
    let status = client.session_status(session.id).await.unwrap();
    assert_eq!(status.pending_inputs, 1, "a refused key admits nothing");
}

#[tokio::test]
async fn bad_requests_get_the_documented_errors_and_change_nothing() {
    let server = Server::start(&["--body-limit", "4096"]);
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", server.base_url);
    let cases = [
        (
            http.post(url("/api/session"))
                .header("content-type", "application/json")
                .body("{bad"),
            400,
        ),
        (
            http.post(url("/api/session"))
                .header("content-type", "application/json")
                .body(r#"{"title": 7}"#),
            400,
        ),
        (
            http.post(url("/api/session"))
                .header("content-type", "application/json")
                .body(r#"{"directory": "/no/such/dir"}"#),
            400,
        ),
        (
            http.post(url("/api/session"))
                .header("content-type", "application/json")
                .body(r#"{"model": "nobody/x"}"#),
            422,
        ),
        (
            http.get(url("/api/session/ses_01KBFVGY400000000000000001")),
            404,
        ),
        // A path that names nothing is a 404, well-formed id or not.
        (http.get(url("/api/session/not-an-id")), 404),
        (http.get(url("/api/session/not-an-id/log")), 404),
        // The session is looked up before the body is read: unknown beats malformed.
        (
            http.post(url("/api/session/ses_01KBFVGY400000000000000001/prompt"))
                .header("content-type", "application/json")
                .body("{bad"),
            404,
        ),
        (
            http.post(url(
                "/api/session/ses_01KBFVGY400000000000000001/permission/not-a-request",
            ))
            .header("content-type", "application/json")
            .body(r#"{"decision": "once"}"#),
            404,
        ),
        (http.get(url("/api/nowhere")), 404),
        (
            http.post(url("/api/session"))
                .header("content-type", "application/json")
                .body(format!(r#"{{"title": "{}"}}"#, "x".repeat(8 * 1024))),
            413,
        ),
    ];
    for (request, status) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        let body: serde_json::Value = response.json().await.unwrap();
        assert!(
            body["error"]["type"].is_string() && body["error"]["message"].is_string(),
            "{body}"
        );
    }
    let list: serde_json::Value = http
        .get(url("/api/session"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["items"], serde_json::json!([]));
}

#[tokio::test]
async fn a_token_guards_everything_but_health() {
    let server = Server::start(&["--token", "s3cret"]);
    let anonymous = Client::new(&server.base_url).unwrap();
    assert!(anonymous.health().await.unwrap().ok);
    let err = anonymous
        .list_sessions(&Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Api { status: 401, .. }), "{err}");
    let wrong = Client::new(&server.base_url).unwrap().with_token("nope");
    assert!(wrong.list_sessions(&Default::default()).await.is_err());
    // A refusal says how to authenticate, and the failures are logged with the address.
    let refused = reqwest::Client::new()
        .get(format!("{}/api/session", server.base_url))
        .bearer_auth("s3cre")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(
        refused.headers()["www-authenticate"],
        "Bearer realm=\"keel\""
    );
    // The first failure from the address and the second (counts that are powers of two).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !(server.logged("peer=127.0.0.1 failures=1") && server.logged("failures=2")) {
        assert!(
            std::time::Instant::now() < deadline,
            "the failures were not logged"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let right = Client::new(&server.base_url).unwrap().with_token("s3cret");
    assert!(
        right
            .list_sessions(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn readiness_checks_the_database_and_the_writer_and_needs_no_token() {
    let server = Server::start(&["--token", "s3cret"]);
    let anonymous = Client::new(&server.base_url).unwrap();
    let ready = anonymous.ready().await.unwrap();
    assert!(ready.ok);
    assert_eq!(ready.checks, ["database", "writer"]);
}

#[tokio::test]
async fn the_log_can_be_json_one_object_per_line() {
    let server = Server::start(&["--log-format", "json"]);
    let client = Client::new(&server.base_url).unwrap();
    client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server.logged(r#""fields":{"message":"store open""#) {
        assert!(std::time::Instant::now() < deadline, "no JSON log line");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(server.logged(r#""level":"INFO""#));
    assert!(!server.logged("\u{1b}["), "no colours in a JSON log");
}

#[test]
fn serving_a_non_loopback_address_without_a_token_is_refused() {
    let output = std::process::Command::new(keel_tests::keel_binary())
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--db",
            "sqlite:///nonexistent/x.db",
        ])
        .env_remove("KEEL_TOKEN")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("without a token"), "{stderr}");
}

/// The durable events of a finished session's log after `after`, read with `follow=false`
/// and, when given, `Last-Event-ID`.
async fn read_log(
    server: &Server,
    session: &str,
    query: &str,
    last_event_id: Option<u64>,
) -> Vec<u64> {
    let mut request = reqwest::Client::new().get(format!(
        "{}/api/session/{session}/log?follow=false{query}",
        server.base_url
    ));
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id.to_string());
    }
    let body = request.send().await.unwrap().text().await.unwrap();
    assert!(body.contains("event: synced"), "{body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .map(|id| id.parse().unwrap())
        .collect()
}

#[tokio::test]
async fn reconnecting_at_every_seq_of_a_finished_session_yields_the_rest_exactly_once() {
    let server = Server::start(&[]);
    let client = Client::new(&server.base_url).unwrap();
    let session = client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    client
        .prompt(
            session.id,
            &PromptRequest {
                id: None,
                parts: text("go"),
                delivery: None,
                request_execution: None,
            },
        )
        .await
        .unwrap();
    let all = follow_to_idle(&server, &session.id.to_string()).await;
    let last = all.last().unwrap().seq;
    for k in 0..=last {
        let rest: Vec<u64> = ((k + 1)..=last).collect();
        let id = session.id.to_string();
        assert_eq!(
            read_log(&server, &id, "", Some(k)).await,
            rest,
            "Last-Event-ID {k}"
        );
        assert_eq!(
            read_log(&server, &id, &format!("&after={k}"), None).await,
            rest,
            "after={k}"
        );
        // Last-Event-ID wins over after.
        assert_eq!(read_log(&server, &id, "&after=0", Some(k)).await, rest);
    }
}

#[tokio::test]
async fn every_route_of_the_contract_is_served() {
    let server = Server::start(&[]);
    let contract: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(keel_tests::workspace_root().join("contracts/openapi.json"))
            .unwrap(),
    )
    .unwrap();
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap();
    let mut checked = 0;
    for (path, item) in contract["paths"].as_object().unwrap() {
        let concrete = path
            .replace("{id}", "ses_01KBFVGY400000000000000001")
            .replace("{request_id}", "req_01KBFVGY400000000000000008");
        for method in item.as_object().unwrap().keys() {
            let url = format!("{}{concrete}?follow=false", server.base_url);
            let request = match method.as_str() {
                "get" => http.get(&url),
                "post" => http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body("{}"),
                "patch" => http
                    .patch(&url)
                    .header("content-type", "application/json")
                    .body("{}"),
                "delete" => http.delete(&url),
                other => panic!("unexpected method {other}"),
            };
            let response = request
                .send()
                .await
                .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
            let status = response.status().as_u16();
            assert_ne!(status, 405, "{method} {path} is not served");
            let streaming = response
                .headers()
                .get("content-type")
                .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
            if !streaming {
                // An open event stream never ends; its 200 and content type say enough.
                let body = response.text().await.unwrap();
                assert!(
                    !body.contains("no such route"),
                    "{method} {path} is not served"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 23);
}

#[tokio::test]
async fn a_session_directory_outside_the_root_is_refused_and_creates_nothing() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("project")).unwrap();
    let outside = tempfile::tempdir().unwrap();
    // A symlink inside the root that leads outside is outside.
    std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
    let server = Server::start(&["--root", root.path().to_str().unwrap()]);
    let client = Client::new(&server.base_url).unwrap();
    let create = |directory: std::path::PathBuf| {
        let client = client.clone();
        async move {
            client
                .create_session(&CreateSession {
                    directory: Some(directory.to_string_lossy().into_owned()),
                    ..CreateSession::default()
                })
                .await
        }
    };
    for refused in [
        outside.path().to_path_buf(),
        root.path().join("escape"),
        root.path().join("project/../.."),
        // The server's own directory (its database, its config) is not inside either.
        server.directory().to_path_buf(),
    ] {
        let answer = create(refused.clone()).await;
        assert!(
            matches!(&answer, Err(Error::Api { kind: ErrorType::BadRequest, message, .. })
                if message.contains("outside")),
            "{refused:?}: {answer:?}"
        );
    }
    let missing = create(root.path().join("nope")).await;
    assert!(
        matches!(&missing, Err(Error::Api { kind: ErrorType::BadRequest, message, .. })
            if message.contains("does not exist")),
        "{missing:?}"
    );
    assert!(
        client
            .list_sessions(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let made = create(root.path().join("project")).await.unwrap();
    assert!(made.directory.ends_with("project"));
    // Without a directory, a session works in the root.
    let default = client
        .create_session(&CreateSession::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::canonicalize(&default.directory).unwrap(),
        std::fs::canonicalize(root.path()).unwrap()
    );
}

#[tokio::test]
async fn log_lines_carry_the_spans_of_their_request_execution_step_and_tool() {
    let server = Server::start_logging("info,keel_core=debug", &["--log-format", "json"]);
    let client = Client::new(&server.base_url).unwrap();
    let session = client
        .create_session(&CreateSession {
            directory: Some(server.directory().to_string_lossy().into_owned()),
            ..CreateSession::default()
        })
        .await
        .unwrap()
        .id;
    client
        .prompt(session, &PromptRequest::text("What is here?"))
        .await
        .unwrap();
    follow_to_idle(&server, &session.to_string()).await;
    // The demo model's `list` call ran inside its tool, step and execution spans.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let line = loop {
        let found = server
            .log_lines()
            .into_iter()
            .find(|line| line.contains("tool call ended"));
        if let Some(line) = found {
            break line;
        }
        assert!(std::time::Instant::now() < deadline, "no tool line logged");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let line: serde_json::Value = serde_json::from_str(&line).unwrap();
    let spans = line["spans"].as_array().unwrap();
    let named = |name: &str| spans.iter().find(|s| s["name"] == name).cloned();
    let execution = named("execution").expect("an execution span");
    assert_eq!(execution["session"], session.to_string());
    assert!(execution["execution"].as_str().unwrap().starts_with("exe_"));
    assert_eq!(named("step").expect("a step span")["number"], 1);
    assert_eq!(named("tool").expect("a tool span")["tool"], "list");
    assert_eq!(line["fields"]["outcome"], "ok");
    // Each HTTP request is answered inside its own span.
    assert!(server.log_lines().iter().any(|line| {
        line.contains(r#""message":"answered""#)
            && line.contains(r#""name":"request""#)
            && line.contains(r#""path":"/api/session""#)
    }));
}

/// One bad request of [`every_error_a_route_answers_is_listed_in_its_contract`].
struct Case<'a> {
    what: &'static str,
    /// The session id in the path, if the path has one.
    id: &'a str,
    token: Option<&'static str>,
    /// Whether the body is sent as `application/json`.
    json: bool,
    body: String,
    query: String,
}

/// Every answer a route gives to a bad request (no or a wrong token, an unknown, malformed
/// or deleted session, a malformed, mistyped, non-object or oversized body, no content
/// type, a bad query) is a status its operation lists in the contract, with the
/// documented error body.
#[tokio::test]
async fn every_error_a_route_answers_is_listed_in_its_contract() {
    const TOKEN: &str = "contract-walk";
    let server = Server::start(&["--token", TOKEN, "--body-limit", "1024"]);
    let contract: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(keel_tests::workspace_root().join("contracts/openapi.json"))
            .unwrap(),
    )
    .unwrap();
    let client = Client::new(&server.base_url).unwrap().with_token(TOKEN);
    let deleted = client
        .create_session(&CreateSession::default())
        .await
        .unwrap()
        .id;
    client.delete_session(deleted).await.unwrap();
    let deleted = deleted.to_string();

    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for (path, item) in contract["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let documented: Vec<u16> = operation["responses"]
                .as_object()
                .unwrap()
                .keys()
                .map(|s| s.parse().unwrap())
                .collect();
            let secured = operation.get("security") != Some(&serde_json::json!([]));
            let has_body = operation.get("requestBody").is_some();
            let queries: Vec<&str> = operation["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "query")
                .map(|p| p["name"].as_str().unwrap())
                .collect();
            let unknown = "ses_01KBFVGY400000000000000001";
            let good_body = if has_body { "{}" } else { "" };
            let case = |what, id, token| Case {
                what,
                id,
                token,
                json: true,
                body: good_body.to_owned(),
                query: String::new(),
            };
            let mut cases = vec![];
            if secured {
                cases.push(case("no token", unknown, None));
                cases.push(case("a wrong token", unknown, Some("nope")));
            }
            if path.contains("{id}") {
                cases.push(case("an unknown session", unknown, Some(TOKEN)));
                cases.push(case("no session id", "nope", Some(TOKEN)));
                cases.push(case("a deleted session", &deleted, Some(TOKEN)));
            }
            // What is left to refuse is the body or the query.
            let target = if path.contains("{id}") { unknown } else { "" };
            if has_body {
                for (what, body) in [
                    ("malformed JSON", "{".to_owned()),
                    ("an array body", "[null, null]".to_owned()),
                    ("an unknown field", r#"{"bogus": 1}"#.to_owned()),
                    (
                        "an oversized body",
                        format!(r#"{{"title": "{}"}}"#, "x".repeat(4096)),
                    ),
                ] {
                    cases.push(Case {
                        body,
                        ..case(what, target, Some(TOKEN))
                    });
                }
                cases.push(Case {
                    json: false,
                    ..case("no content type", target, Some(TOKEN))
                });
            }
            if !queries.is_empty() {
                let bad: Vec<String> = queries.iter().map(|q| format!("{q}=%FF%FE")).collect();
                cases.push(Case {
                    query: bad.join("&"),
                    ..case("a bad query", target, Some(TOKEN))
                });
            }
            for Case {
                what,
                id,
                token,
                json,
                body,
                query,
            } in cases
            {
                let concrete = path
                    .replace("{id}", id)
                    .replace("{request_id}", "req_01KBFVGY400000000000000008");
                let query = if query.is_empty() {
                    "follow=false".to_owned()
                } else {
                    query
                };
                let url = format!("{}{concrete}?{query}", server.base_url);
                let mut request = http.request(method.to_uppercase().parse().unwrap(), &url);
                if let Some(token) = token {
                    request = request.bearer_auth(token);
                }
                if json {
                    request = request.header("content-type", "application/json");
                }
                if !body.is_empty() {
                    request = request.body(body);
                }
                let response = request.send().await.unwrap();
                let status = response.status().as_u16();
                assert!(
                    documented.contains(&status),
                    "{method} {path} with {what} answered {status}, which its contract \
                     does not list ({documented:?})"
                );
                seen.insert(status);
                // Every case is a bad request, but for a deleted session's log, which is
                // kept and readable.
                let kept_log = what == "a deleted session" && path.ends_with("/log");
                assert!(
                    status >= 400 || kept_log,
                    "{method} {path} with {what} was accepted ({status})"
                );
                if status >= 400 {
                    let error: serde_json::Value = response.json().await.unwrap();
                    assert!(
                        error["error"]["type"].is_string() && error["error"]["message"].is_string(),
                        "{method} {path} with {what}: {error}"
                    );
                }
            }
        }
    }
    // The walk reached every kind of refusal it provokes.
    for status in [400, 401, 404, 413] {
        assert!(seen.contains(&status), "no {status} in {seen:?}");
    }
}

/// The read cookie: `POST /api/login` with the token sets it (HttpOnly, SameSite=Strict,
/// not the token itself); it then opens reads, the log stream included, but no write;
/// a wrong token gets none; logout clears it.
#[tokio::test]
async fn a_login_cookie_opens_reads_and_streams_but_no_writes() {
    let server = Server::start(&["--token", "s3cret"]);
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", server.base_url);
    let login = |token: &'static str| {
        http.post(url("/api/login"))
            .header("content-type", "application/json")
            .body(serde_json::json!({ "token": token }).to_string())
            .send()
    };

    let refused = login("wrong").await.unwrap();
    assert_eq!(refused.status(), 401);
    assert!(refused.headers().get("set-cookie").is_none());

    let accepted = login("s3cret").await.unwrap();
    assert_eq!(accepted.status(), 204);
    let set = accepted.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(set.starts_with("keel_read="), "{set}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attribute), "{attribute} in {set}");
    }
    assert!(
        !set.contains("s3cret"),
        "the cookie is not the token: {set}"
    );
    let cookie = set.split(';').next().unwrap().to_owned();

    let client = Client::new(&server.base_url).unwrap().with_token("s3cret");
    let session = client
        .create_session(&CreateSession::default())
        .await
        .unwrap()
        .id;
    let read = http
        .get(url(&format!("/api/session/{session}")))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    let stream = http
        .get(url(&format!("/api/session/{session}/log?follow=false")))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.text().await.unwrap().contains("event: synced"));
    // A write with the cookie alone is refused, and nothing is written.
    let write = http
        .post(url(&format!("/api/session/{session}/prompt")))
        .header("cookie", &cookie)
        .header("content-type", "application/json")
        .body(r#"{"parts":[{"type":"text","text":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(write.status(), 401);
    assert_eq!(client.get_session(session).await.unwrap().last_seq, 1);
    // A made-up cookie opens nothing.
    let forged = http
        .get(url("/api/session"))
        .header("cookie", "keel_read=s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 401);

    let out = http.post(url("/api/logout")).send().await.unwrap();
    assert_eq!(out.status(), 204);
    let cleared = out.headers()["set-cookie"].to_str().unwrap();
    assert!(
        cleared.starts_with("keel_read=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );
}

/// `--cors-origin`: a listed origin's preflight is answered without the token and every
/// answer names the origin; any other origin gets no CORS header; `*` is refused at start.
#[tokio::test]
async fn cross_origin_calls_are_allowed_only_from_the_listed_origins() {
    const CONSOLE: &str = "http://console.test:5173";
    let server = Server::start(&["--token", "t", "--cors-origin", CONSOLE]);
    let http = reqwest::Client::new();
    let url = format!("{}/api/session", server.base_url);
    let preflight = |origin: &'static str| {
        http.request(reqwest::Method::OPTIONS, &url)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .send()
    };
    let allow = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_owned())
    };

    let answered = preflight(CONSOLE).await.unwrap();
    assert_eq!(answered.status(), 204);
    assert_eq!(allow(&answered).as_deref(), Some(CONSOLE));
    let headers = answered.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap();
    assert!(
        headers.contains("authorization") && headers.contains("last-event-id"),
        "{headers}"
    );

    let listed = http
        .get(&url)
        .header("origin", CONSOLE)
        .bearer_auth("t")
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    assert_eq!(allow(&listed).as_deref(), Some(CONSOLE));
    // A refusal is readable by the page too, so it can ask for the token.
    let refused = http
        .get(&url)
        .header("origin", CONSOLE)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(allow(&refused).as_deref(), Some(CONSOLE));

    let elsewhere = preflight("http://elsewhere.test").await.unwrap();
    assert_ne!(elsewhere.status(), 204);
    assert_eq!(allow(&elsewhere), None);
    let elsewhere = http
        .get(&url)
        .header("origin", "http://elsewhere.test")
        .bearer_auth("t")
        .send()
        .await
        .unwrap();
    assert_eq!(allow(&elsewhere), None);

    let wildcard = std::process::Command::new(keel_tests::keel_binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--cors-origin", "*"])
        .output()
        .unwrap();
    assert!(!wildcard.status.success());
    let stderr = String::from_utf8_lossy(&wildcard.stderr);
    assert!(stderr.contains("no wildcard"), "{stderr}");
}

#[tokio::test]
async fn the_console_is_served_without_the_token_under_a_strict_policy() {
    let server = Server::start(&["--token", "s3cret"]);
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", server.base_url);
    for (path, mime, marker) in [
        ("/", "text/html", "/console/console.js"),
        ("/console/console.js", "text/javascript", "keel.token"),
        ("/console/console.css", "text/css", ".tool-call"),
    ] {
        let answer = http.get(url(path)).send().await.unwrap();
        assert_eq!(answer.status(), 200, "{path}");
        let headers = answer.headers().clone();
        let content_type = headers["content-type"].to_str().unwrap();
        assert!(content_type.starts_with(mime), "{path}: {content_type}");
        let policy = headers["content-security-policy"].to_str().unwrap();
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(
                policy.contains(directive),
                "{path}: {directive} in {policy}"
            );
        }
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert!(answer.text().await.unwrap().contains(marker), "{path}");
    }
    // Only the console's own files are open: the API and other paths still need the token.
    for path in [
        "/console/",
        "/console/other.js",
        "/index.html",
        "/api/session",
    ] {
        let answer = http.get(url(path)).send().await.unwrap();
        assert_eq!(answer.status(), 401, "{path}");
    }
    let posted = http.post(url("/")).send().await.unwrap();
    assert_eq!(posted.status(), 405, "the console is read-only");
}
