//! OpenTelemetry export (feature `otlp`): a node runs a prompt while its spans go to a
//! collector on loopback, which must receive the execution, step, model request and tool
//! call as spans carrying the session's id, nested as they ran.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use futures::StreamExt;
use keel_client::Client;
use keel_client::schema::api::{CreateSession, LogItem, PromptRequest};
use keel_client::schema::event::DurableEvent;
use keel_core::config::Config;
use keel_core::node::{Node, Options};
use keel_core::store::DbUrl;
use keel_core::telemetry::{Export, Protocol};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::prelude::*;

/// A collector: every body posted to `/v1/traces`, parsed.
fn collector(runtime: &tokio::runtime::Runtime) -> (String, Arc<Mutex<Vec<Value>>>) {
    let received = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&received);
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let kept = Arc::clone(&kept);
            async move {
                let parsed = serde_json::from_slice(&body).expect("the export is JSON");
                kept.lock().expect("collector lock").push(parsed);
                "{}"
            }
        }),
    );
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("a loopback port");
    let address = listener.local_addr().expect("its address");
    runtime.spawn(async move { axum::serve(listener, app).await });
    (format!("http://{address}"), received)
}

/// Every span in the bodies received: (name, span id, parent span id, attributes).
fn spans(bodies: &[Value]) -> Vec<(String, String, String, Value)> {
    let mut out = Vec::new();
    for body in bodies {
        for resource in body["resourceSpans"].as_array().into_iter().flatten() {
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    out.push((
                        span["name"].as_str().unwrap_or_default().to_owned(),
                        span["spanId"].as_str().unwrap_or_default().to_owned(),
                        span["parentSpanId"].as_str().unwrap_or_default().to_owned(),
                        span["attributes"].clone(),
                    ));
                }
            }
        }
    }
    out
}

/// The string value of attribute `key`.
fn attribute(attributes: &Value, key: &str) -> Option<String> {
    attributes.as_array()?.iter().find_map(|a| {
        (a["key"] == key).then(|| a["value"]["stringValue"].as_str().map(str::to_owned))?
    })
}

#[test]
fn a_prompt_s_spans_reach_the_collector_with_their_ids_and_nesting() {
    let background = tokio::runtime::Runtime::new().expect("a runtime for the collector");
    let (endpoint, received) = collector(&background);
    let export = Export::start(&endpoint, Protocol::Json).expect("the export starts");
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(export.layer())
        .init();

    let dir = tempfile::tempdir().expect("a temporary directory");
    let runtime = tokio::runtime::Runtime::new().expect("a runtime for the node");
    let session = runtime.block_on(async {
        let node = Node::start(Options {
            listen: "127.0.0.1:0".parse().expect("a socket address"),
            root: Some(dir.path().to_path_buf()),
            ..Options::new(DbUrl::Sqlite(dir.path().join("keel.db")), Config::default())
        })
        .await
        .expect("the node starts");
        let client = Client::new(format!("http://{}", node.address())).expect("a client");
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(node.run(shutdown.clone()));
        let session = client
            .create_session(&CreateSession {
                directory: Some(dir.path().display().to_string()),
                ..CreateSession::default()
            })
            .await
            .expect("the session is created");
        client
            .prompt(session.id, &PromptRequest::text("What is here?"))
            .await
            .expect("the prompt is admitted");
        let mut log = client.session_log(session.id, 0);
        while let Some(item) = log.next().await {
            if let LogItem::Durable(envelope) = item.expect("the log streams")
                && matches!(envelope.event, DurableEvent::ExecutionSettled(_))
            {
                break;
            }
        }
        shutdown.cancel();
        running
            .await
            .expect("the node's task")
            .expect("a clean stop");
        session.id
    });
    drop(runtime);
    // Sends what the batch still holds.
    export.shutdown();

    let bodies = received.lock().expect("collector lock").clone();
    let spans = spans(&bodies);
    let named = |name: &'static str| spans.iter().filter(move |s| s.0 == name);
    let execution = named("execution")
        .find(|s| attribute(&s.3, "session").as_deref() == Some(&session.to_string()))
        .unwrap_or_else(|| panic!("no execution span for {session} in {bodies:#?}"));
    let steps: Vec<_> = named("step").filter(|s| s.2 == execution.1).collect();
    assert!(
        !steps.is_empty(),
        "the steps nest in the execution: {spans:#?}"
    );
    let under_a_step = |name: &'static str| {
        named(name)
            .filter(|s| steps.iter().any(|step| step.1 == s.2))
            .count()
    };
    assert!(under_a_step("provider_request") >= 1, "{spans:#?}");
    let tools: Vec<_> = named("tool").collect();
    assert!(
        tools
            .iter()
            .any(|t| attribute(&t.3, "tool").as_deref() == Some("list")),
        "the demo model's `list` call is a span: {spans:#?}"
    );
    assert!(
        named("request").any(|s| attribute(&s.3, "path").is_some()),
        "HTTP requests are spans: {spans:#?}"
    );
}
