//! Sessions at rest: what many stored sessions cost a node that is not running them.
//!
//! The database is filled with idle sessions that each have a history (created, a prompt
//! admitted and promoted, one step that streamed a text and ended, the execution settled),
//! written in large transactions straight through the store, as the runner would have
//! left them. Then, on that database:
//! - start-up: `Node::start` (open and migrate the store, register the node, bind the
//!   listener: everything `keel serve` does before it answers);
//! - a recovery pass with nothing to recover, as a running node makes every half lease;
//! - `GET /api/session` (the newest page of 50) through keel-client;
//! - `GET /metrics` through keel-client's HTTP client;
//! - the database's size per session (after a checkpoint).
//!
//! `--quick` stores 10,000 sessions, the full plan 10,000 and 100,000. Run through
//! `cargo xtask bench`, which collects the `BENCH {json}` lines this prints.

mod common;

use std::time::Instant;

use common::{Backend, flags, median, option, report, runtime};
use keel_client::Client;
use keel_client::schema::api::ListSessionsQuery;
use keel_core::config::Config;
use keel_core::event::log;
use keel_core::execution;
use keel_core::inbox::Admission;
use keel_core::node::{self, Node};
use keel_core::recovery::Recovery;
use keel_core::store::{self, DbUrl, Store, Synchronous};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::OwnerId;
use keel_schema::types::{Finish, ModelRef, Outcome, Part, Usage};
use tokio_util::sync::CancellationToken;

const LEASE_MS: i64 = 30_000;
/// Sessions written per transaction while filling the database.
const CHUNK: usize = 500;
/// Repeats of each timed request or pass.
const SAMPLES: usize = 20;

const BACKEND: Backend = Backend::Sqlite(Synchronous::Full);

fn main() {
    let (quick, _) = flags();
    let counts: Vec<usize> = match option("--sessions") {
        Some(list) => list
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .expect("--sessions takes numbers, e.g. 10000")
            })
            .collect(),
        None if quick => vec![10_000],
        None => vec![10_000, 100_000],
    };
    let runtime = runtime();
    for count in counts {
        runtime.block_on(stored(count));
    }
}

async fn stored(count: usize) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("keel.db");
    let url = DbUrl::Sqlite(path.clone());

    let filling = Instant::now();
    fill(&url, dir.path(), count).await;
    eprintln!(
        "stored: {count} sessions written in {:.1} s",
        filling.elapsed().as_secs_f64()
    );
    let bytes = ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| {
            let mut file = path.clone().into_os_string();
            file.push(suffix);
            std::fs::metadata(file).ok().map(|m| m.len())
        })
        .sum::<u64>();

    let options = node::Options {
        listen: "127.0.0.1:0".parse().expect("a socket address"),
        root: Some(dir.path().to_path_buf()),
        ..node::Options::new(url, Config::default())
    };
    let start = Instant::now();
    let node = Node::start(options).await.expect("the node starts");
    let started = start.elapsed().as_secs_f64() * 1000.0;

    let mut recovery = Recovery::default();
    let mut passes = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let start = Instant::now();
        let report = recovery.pass(node.runner()).await.expect("a recovery pass");
        passes.push(start.elapsed().as_secs_f64() * 1000.0);
        assert!(
            report.recovered.is_empty() && report.redriven.is_empty(),
            "nothing to recover: {report:?}"
        );
    }

    let address = node.address();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(node.run(shutdown.clone()));
    let client = Client::new(format!("http://{address}")).expect("a client");
    let query = ListSessionsQuery {
        limit: Some(50),
        ..ListSessionsQuery::default()
    };
    let mut lists = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let start = Instant::now();
        let page = client
            .list_sessions(&query)
            .await
            .expect("the sessions are listed");
        lists.push(start.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(page.items.len(), 50, "a full page");
    }
    let http = reqwest::Client::new();
    let mut scrapes = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let start = Instant::now();
        let metrics = http
            .get(format!("http://{address}/metrics"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .expect("the metrics are served");
        metrics.text().await.expect("the metrics are read");
        scrapes.push(start.elapsed().as_secs_f64() * 1000.0);
    }
    shutdown.cancel();
    running
        .await
        .expect("the node's task ends")
        .expect("the node stops");

    let settings = format!("{count} idle sessions with history");
    let figure = |what: &str| format!("{count} stored sessions, {what}");
    report(&figure("start-up"), started, "ms", BACKEND, 1, &settings);
    let repeated = format!("{settings}, median of {SAMPLES}");
    let pass = "recovery pass, nothing to recover";
    report(&figure(pass), median(&passes), "ms", BACKEND, 1, &repeated);
    let list = "GET /api/session, newest 50";
    report(&figure(list), median(&lists), "ms", BACKEND, 1, &repeated);
    let scrape = "GET /metrics";
    report(
        &figure(scrape),
        median(&scrapes),
        "ms",
        BACKEND,
        1,
        &repeated,
    );
    let size = bytes as f64 / 1024.0 / count as f64;
    report(
        &figure("database per session"),
        size,
        "KiB",
        BACKEND,
        1,
        &settings,
    );
}

/// Writes `count` idle sessions with history into a new database at `url`, and
/// checkpoints it so that its size is the database file's.
async fn fill(url: &DbUrl, directory: &std::path::Path, count: usize) {
    let store = Store::open(url.clone(), store::Options::default())
        .await
        .expect("opening the database");
    let owner = OwnerId::new();
    let directory = directory.to_string_lossy().into_owned();
    let mut left = count;
    while left > 0 {
        let chunk = left.min(CHUNK);
        left -= chunk;
        let clock = store.clock().clone();
        let directory = directory.clone();
        store
            .write(move |c| {
                for _ in 0..chunk {
                    idle_one(c, clock.now_ms(), owner, &directory)?;
                }
                Ok::<_, store::Error>(())
            })
            .await
            .expect("writing stored sessions");
    }
    drop(store);
    // The writer's connection may still be closing: the checkpoint waits for its lock.
    use diesel::Connection;
    use diesel::connection::SimpleConnection;
    let DbUrl::Sqlite(path) = url else {
        unreachable!("the stored sessions are on SQLite")
    };
    let mut connection = diesel::SqliteConnection::establish(&path.to_string_lossy())
        .expect("opening the database to checkpoint it");
    connection
        .batch_execute("PRAGMA busy_timeout = 10000; PRAGMA wal_checkpoint(TRUNCATE);")
        .expect("checkpointing the database");
}

/// One session as a finished first prompt leaves it.
fn idle_one(
    c: &mut store::Conn,
    now: i64,
    owner: OwnerId,
    directory: &str,
) -> Result<(), store::Error> {
    let model = ModelRef {
        provider: "demo".into(),
        id: "demo".into(),
    };
    let created = DurableEvent::Created(payload::Created {
        title: Some("A stored session".into()),
        directory: directory.to_owned(),
        agent: "build".into(),
        model: model.clone(),
        metadata: None,
    });
    let prompt = Admission::prompt(vec![Part::Text {
        text: "Explain what this project does and where to start reading.".into(),
    }]);
    let (session, claim, assistant) =
        common::start_first_step(c, now, LEASE_MS, owner, created, prompt, model)?;
    let answer = "This project is a durable session engine. Start with the README, then \
                  the architecture document, then the runner's drain and step modules.";
    log::append(
        c,
        now,
        session,
        vec![
            DurableEvent::TextStarted(payload::TextStarted {
                assistant_message_id: assistant,
                ordinal: 0,
            }),
            DurableEvent::TextEnded(payload::TextEnded {
                assistant_message_id: assistant,
                ordinal: 0,
                text: answer.into(),
            }),
            DurableEvent::StepEnded(payload::StepEnded {
                assistant_message_id: assistant,
                finish: Finish::Stop,
                usage: Usage::default(),
                cost: 0.0,
            }),
        ],
    )?;
    execution::release(c, now, LEASE_MS, &claim, Outcome::Succeeded, None)
        .map_err(|e| store::Error::Corrupt(e.to_string()))?;
    Ok(())
}
