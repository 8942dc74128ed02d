//! A node run inside the test process: built from options, serving through keel-client,
//! stopped by its shutdown signal. (`keel serve` runs the same node; the end-to-end tests
//! drive it as a process.)

use std::time::Duration;

use futures::StreamExt;
use keel_client::Client;
use keel_client::schema::api::{CreateSession, InputSource, LogItem, PromptRequest};
use keel_client::schema::event::DurableEvent;
use keel_client::schema::id::SessionId;
use keel_client::schema::types::{Outcome, Part};
use keel_core::config::Config;
use keel_core::node::{self, Node, Options};
use keel_core::store::{DbUrl, Store};
use keel_core::{cluster, execution, inbox};
use tokio_util::sync::CancellationToken;

/// Options for a node on a fresh SQLite database in `dir`, on a free loopback port.
fn options(dir: &std::path::Path, config: Config) -> Options {
    Options {
        listen: "127.0.0.1:0".parse().expect("a socket address"),
        root: Some(dir.to_path_buf()),
        ..Options::new(DbUrl::Sqlite(dir.join("keel.db")), config)
    }
}

/// A session in `dir` prompted with `text`; returns it once the prompt is admitted.
async fn prompted(client: &Client, dir: &std::path::Path, text: &str) -> SessionId {
    let session = client
        .create_session(&CreateSession {
            directory: Some(dir.display().to_string()),
            ..CreateSession::default()
        })
        .await
        .expect("the session is created");
    client
        .prompt(
            session.id,
            &PromptRequest {
                id: None,
                parts: vec![Part::Text { text: text.into() }],
                delivery: None,
                request_execution: None,
            },
        )
        .await
        .expect("the prompt is admitted");
    session.id
}

/// Follows the session's log until an event matches `wanted`, and returns it.
async fn until(
    client: &Client,
    session: SessionId,
    wanted: impl Fn(&DurableEvent) -> bool,
) -> DurableEvent {
    let mut log = client.session_log(session, 0);
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item.expect("the log streams")
            && wanted(&envelope.event)
        {
            return envelope.event;
        }
    }
    panic!("the log ended before the awaited event");
}

#[tokio::test]
async fn a_node_runs_a_prompt_and_leaves_the_node_list_when_stopped() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let node = Node::start(options(dir.path(), Config::default()))
        .await
        .expect("the node starts");
    let (store, owner) = (node.store().clone(), node.owner());
    let client = Client::new(format!("http://{}", node.address())).expect("a client");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(node.run(shutdown.clone()));

    let session = prompted(&client, dir.path(), "What is here?").await;
    let settled = until(&client, session, |e| {
        matches!(e, DurableEvent::ExecutionSettled(_))
    })
    .await;
    let DurableEvent::ExecutionSettled(settled) = settled else {
        unreachable!("until returns the event it waited for");
    };
    assert_eq!(settled.outcome, Outcome::Succeeded);
    let nodes = client.nodes().await.expect("the nodes are listed");
    assert_eq!(
        nodes.items.iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![owner]
    );

    shutdown.cancel();
    running
        .await
        .expect("the node's task ends")
        .expect("the node stops cleanly");
    let listed = store
        .read(|c| cluster::list(c, 0))
        .await
        .expect("the node table is read");
    assert!(listed.is_empty(), "a stopped node unregisters: {listed:?}");
}

#[tokio::test]
async fn a_stopped_node_stops_its_running_step_releases_the_claim_and_leaves_a_continuation() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    // The model says something, then takes a minute: the session is busy at shutdown.
    std::fs::write(
        dir.path().join("script.json"),
        r#"{"responses": [{"items": [{"type": "text", "text": "Thinking."},
                                      {"type": "delay", "ms": 60000}]}]}"#,
    )
    .expect("the script is written");
    std::fs::write(
        dir.path().join("keel.toml"),
        "default_model = \"slow/model\"\n[provider.slow]\nkind = \"scripted\"\nscript = \"script.json\"\n",
    )
    .expect("the configuration is written");
    let config = Config::load(Some(&dir.path().join("keel.toml"))).expect("keel.toml loads");
    let node = Node::start(Options {
        // Long enough that only the release can end the claim during the test.
        lease_ms: 600_000,
        grace: Duration::ZERO,
        // The step cannot reach a boundary by itself: the grace runs out.
        step_grace: Duration::from_millis(100),
        ..options(dir.path(), config)
    })
    .await
    .expect("the node starts");
    let store: Store = node.store().clone();
    let client = Client::new(format!("http://{}", node.address())).expect("a client");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(node.run(shutdown.clone()));

    let session = prompted(&client, dir.path(), "Take your time.").await;
    until(&client, session, |e| {
        matches!(e, DurableEvent::TextEnded(_))
    })
    .await;
    shutdown.cancel();
    running
        .await
        .expect("the node's task ends")
        .expect("the node stops cleanly");

    let claim = store
        .read(move |c| execution::get(c, session))
        .await
        .expect("the claim is read");
    assert!(
        claim.is_none(),
        "the stopped step released its claim: {claim:?}"
    );
    let pending = store
        .read(move |c| inbox::pending(c, session))
        .await
        .expect("the inbox is read");
    assert!(
        pending
            .iter()
            .any(|input| input.source == InputSource::Recovery && input.request_execution),
        "the work goes on after a restart: {pending:?}"
    );
}

#[tokio::test]
async fn a_node_refuses_options_that_are_unsafe_or_unusable() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let open = Options {
        listen: "0.0.0.0:0".parse().expect("a socket address"),
        ..options(dir.path(), Config::default())
    };
    assert!(matches!(
        Node::start(open).await,
        Err(node::Error::TokenRequired(_))
    ));
    let short = Options {
        lease_ms: node::MIN_LEASE_MS - 1,
        ..options(dir.path(), Config::default())
    };
    let Err(node::Error::Invalid(message)) = Node::start(short).await else {
        panic!("a lease under the minimum is refused");
    };
    assert!(message.contains("lease"), "{message}");
    // An empty token (KEEL_TOKEN= in an environment, say) would guard nothing.
    let empty = Options {
        token: Some(String::new()),
        ..options(dir.path(), Config::default())
    };
    let Err(node::Error::Invalid(message)) = Node::start(empty).await else {
        panic!("an empty token is refused");
    };
    assert!(message.contains("token"), "{message}");
    assert!(
        !dir.path().join("keel.db").exists(),
        "refused options open no database"
    );
}

#[tokio::test]
async fn a_metrics_address_serves_the_metrics_alone_without_the_token() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let node = Node::start(Options {
        token: Some("secret".into()),
        metrics_listen: Some("127.0.0.1:0".parse().expect("a socket address")),
        ..options(dir.path(), Config::default())
    })
    .await
    .expect("the node starts");
    let (address, metrics) = (
        node.address(),
        node.metrics_address().expect("a metrics address"),
    );
    assert_ne!(address, metrics);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(node.run(shutdown.clone()));
    let http = reqwest::Client::new();
    let get = |url: String| {
        let http = http.clone();
        async move { http.get(url).send().await.expect("an answer") }
    };

    let scraped = get(format!("http://{metrics}/metrics")).await;
    assert_eq!(scraped.status(), 200);
    let page = scraped.text().await.expect("the page");
    assert!(page.contains("keel_sessions"), "{page}");
    assert!(page.ends_with("# EOF\n"), "an OpenMetrics page: {page}");
    // Only the metrics: the API is not reachable through the token-free address.
    assert_eq!(
        get(format!("http://{metrics}/api/session")).await.status(),
        404
    );
    // The main address keeps asking for the token, for /metrics too.
    assert_eq!(get(format!("http://{address}/metrics")).await.status(), 401);

    shutdown.cancel();
    running
        .await
        .expect("the node's task ends")
        .expect("the node stops cleanly");
    assert!(
        tokio::net::TcpStream::connect(metrics).await.is_err(),
        "the metrics address closes with the node"
    );
}
