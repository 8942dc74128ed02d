//! `GET /metrics` end to end: the page parses as Prometheus text, needs the token like
//! every route but health, its counters move as a prompt runs on the demo model, and an
//! event stream is counted while its client is there.

use keel_client::Client;
use keel_client::schema::api::{CreateSession, PromptRequest};
use keel_client::schema::event::DurableEvent;
use keel_tests::{Server, read_until};
use prometheus_parse::{Scrape, Value};

const TOKEN: &str = "metrics-test-token";

async fn scrape(server: &Server) -> Scrape {
    let page = reqwest::Client::new()
        .get(format!("{}/metrics", server.base_url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let text = page.text().await.unwrap();
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("the page parses")
}

/// The value of `name` with `labels` (all of them, or none given), 0 when absent.
fn value(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count),
            Value::Summary(_) => 0.0,
        })
        .sum()
}

#[tokio::test]
async fn the_metrics_page_parses_and_its_counters_move_as_a_prompt_runs() {
    // A short heartbeat: a log stream whose client left is found out at its next write.
    let server = Server::start(&["--token", TOKEN, "--heartbeat-ms", "100"]);
    let refused = reqwest::get(format!("{}/metrics", server.base_url))
        .await
        .unwrap();
    assert_eq!(refused.status(), 401, "the token guards the metrics");

    let client = Client::new(&server.base_url).unwrap().with_token(TOKEN);
    let session = client
        .create_session(&CreateSession {
            directory: Some(server.directory().to_string_lossy().into_owned()),
            ..CreateSession::default()
        })
        .await
        .unwrap()
        .id;
    let before = scrape(&server).await;
    assert_eq!(value(&before, "keel_executions_started_total", &[]), 0.0);
    assert_eq!(value(&before, "keel_sessions", &[("state", "idle")]), 1.0);

    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("What is here?"))
        .await
        .unwrap();
    read_until(&mut log, |e| {
        matches!(e.event, DurableEvent::ExecutionSettled(_))
    })
    .await;

    let after = scrape(&server).await;
    assert_eq!(value(&after, "keel_executions_started_total", &[]), 1.0);
    assert_eq!(
        value(
            &after,
            "keel_executions_settled_total",
            &[("outcome", "succeeded")]
        ),
        1.0
    );
    // The demo model lists the directory, then explains itself: two steps, one call.
    assert_eq!(value(&after, "keel_steps_total", &[("end", "ended")]), 2.0);
    assert_eq!(value(&after, "keel_step_seconds_count", &[]), 2.0);
    assert_eq!(
        value(
            &after,
            "keel_provider_requests_total",
            &[
                ("provider", "demo"),
                ("model", "scripted"),
                ("outcome", "ok")
            ]
        ),
        2.0
    );
    assert_eq!(
        value(
            &after,
            "keel_provider_first_token_seconds_count",
            &[("provider", "demo")]
        ),
        2.0
    );
    assert!(value(&after, "keel_provider_tokens_total", &[("kind", "output")]) > 0.0);
    assert_eq!(
        value(
            &after,
            "keel_tool_calls_total",
            &[("tool", "list"), ("outcome", "ok")]
        ),
        1.0
    );
    assert_eq!(
        value(&after, "keel_tool_seconds_count", &[("tool", "list")]),
        1.0
    );
    let commits = |s: &Scrape| value(s, "keel_store_commits_total", &[]);
    assert!(commits(&after) > commits(&before));
    assert_eq!(
        value(&after, "keel_store_batch_writes_count", &[]),
        commits(&after)
    );
    assert_eq!(value(&after, "keel_sessions", &[("state", "idle")]), 1.0);
    assert_eq!(value(&after, "keel_sessions", &[("state", "busy")]), 0.0);
    assert_eq!(value(&after, "keel_nodes", &[]), 1.0);
    assert!(value(&after, "keel_recovery_passes_total", &[]) >= 1.0);

    // The log stream is open until its client leaves, then counted out.
    assert_eq!(value(&after, "keel_stream_subscribers", &[]), 1.0);
    drop(log);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let open = value(&scrape(&server).await, "keel_stream_subscribers", &[]);
        if open == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a log stream whose client left is still open ({open})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
