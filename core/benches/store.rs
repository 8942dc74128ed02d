//! Store benchmarks: durable events per second on SQLite.
//!
//! Run through `cargo xtask bench`, which collects the `BENCH {json}` lines this prints.
//! Each figure is the median of several runs; the raw SQLite figures use the same driver
//! and the same durability settings, so Keel's figures can be read as a share of them.

use std::sync::Arc;
use std::time::Instant;

use diesel::connection::SimpleConnection;
use diesel::{Connection, RunQueryDsl, SqliteConnection};
use keel_core::store::{DbUrl, Options, Store, Synchronous};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::SessionId;
use keel_schema::types::ModelRef;
use serde_json::json;

struct Plan {
    runs: usize,
    single_events: usize,
    group_sessions: usize,
    group_events_per_session: usize,
}

fn created() -> DurableEvent {
    DurableEvent::Created(payload::Created {
        title: None,
        directory: "/bench".into(),
        agent: "build".into(),
        model: ModelRef {
            provider: "scripted".into(),
            id: "demo".into(),
        },
        metadata: None,
    })
}

fn renamed(n: usize) -> DurableEvent {
    DurableEvent::Renamed(payload::Renamed {
        title: format!("title {n}"),
    })
}

async fn open(dir: &tempfile::TempDir, synchronous: Synchronous) -> Store {
    Store::open(
        DbUrl::Sqlite(dir.path().join("keel.db")),
        Options {
            synchronous,
            ..Options::default()
        },
    )
    .await
    .expect("opening the bench database")
}

/// Events per second appending one event at a time, each awaited (one commit each).
async fn single(plan: &Plan, synchronous: Synchronous) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, synchronous).await;
    let session = SessionId::new();
    store.append(session, vec![created()]).await.unwrap();
    let start = Instant::now();
    for n in 0..plan.single_events {
        store.append(session, vec![renamed(n)]).await.unwrap();
    }
    plan.single_events as f64 / start.elapsed().as_secs_f64()
}

/// Events per second with one task per session appending one event at a time, all at once:
/// the writer commits what is waiting together.
async fn group(plan: &Plan, synchronous: Synchronous) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, synchronous).await;
    let mut sessions = Vec::new();
    for _ in 0..plan.group_sessions {
        let session = SessionId::new();
        store.append(session, vec![created()]).await.unwrap();
        sessions.push(session);
    }
    let (batches_before, writes_before) = store.stats();
    let per_session = plan.group_events_per_session;
    let start = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|session| {
            let store = store.clone();
            tokio::spawn(async move {
                for n in 0..per_session {
                    store.append(session, vec![renamed(n)]).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (batches, writes) = store.stats();
    let per_batch = (writes - writes_before) as f64 / (batches - batches_before) as f64;
    (
        (plan.group_sessions * per_session) as f64 / elapsed,
        per_batch,
    )
}

/// Rows per second inserted through diesel's SQLite driver with Keel's pragmas and an
/// event-sized row, `per_commit` rows per transaction: the ceiling for the same durability.
fn raw(synchronous: Synchronous, per_commit: usize, total: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.db");
    let mut connection = SqliteConnection::establish(path.to_str().unwrap()).unwrap();
    let sync = match synchronous {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    };
    connection
        .batch_execute(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; PRAGMA busy_timeout = 5000;
             CREATE TABLE event (session_id TEXT NOT NULL, seq BIGINT NOT NULL, id TEXT NOT NULL
               UNIQUE, type TEXT NOT NULL, version INTEGER NOT NULL, data TEXT NOT NULL,
               time BIGINT NOT NULL, PRIMARY KEY (session_id, seq));"
        ))
        .unwrap();
    let data = json!({"title": "title 1"}).to_string();
    let start = Instant::now();
    let mut seq = 0i64;
    while (seq as usize) < total {
        connection
            .immediate_transaction::<_, diesel::result::Error, _>(|c| {
                for _ in 0..per_commit {
                    seq += 1;
                    diesel::sql_query(
                        "INSERT INTO event (session_id, seq, id, type, version, data, time) \
                         VALUES ('ses_bench', ?, ?, 'session.next.renamed', 1, ?, 0)",
                    )
                    .bind::<diesel::sql_types::BigInt, _>(seq)
                    .bind::<diesel::sql_types::Text, _>(format!("evt_{seq}"))
                    .bind::<diesel::sql_types::Text, _>(&data)
                    .execute(c)?;
                }
                Ok(())
            })
            .unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn report(figure: &str, value: f64, unit: &str, runs: usize, settings: &str) {
    println!(
        "BENCH {}",
        json!({
            "figure": figure,
            "value": (value * 10.0).round() / 10.0,
            "unit": unit,
            "backend": "sqlite",
            "runs": runs,
            "settings": settings,
        })
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let plan = if quick {
        Plan {
            runs: 3,
            single_events: 200,
            group_sessions: 64,
            group_events_per_session: 20,
        }
    } else {
        Plan {
            runs: 5,
            single_events: 1_000,
            group_sessions: 64,
            group_events_per_session: 50,
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let runtime = Arc::new(runtime);
    let group_total = plan.group_sessions * plan.group_events_per_session;
    for synchronous in [Synchronous::Full, Synchronous::Normal] {
        let settings = match synchronous {
            Synchronous::Full => "synchronous=FULL, WAL",
            Synchronous::Normal => "synchronous=NORMAL, WAL",
        };
        let singles: Vec<f64> = (0..plan.runs)
            .map(|_| runtime.block_on(single(&plan, synchronous)))
            .collect();
        report(
            "append, one event per commit",
            median(singles),
            "events/s",
            plan.runs,
            settings,
        );

        let groups: Vec<(f64, f64)> = (0..plan.runs)
            .map(|_| runtime.block_on(group(&plan, synchronous)))
            .collect();
        let group_rate = median(groups.iter().map(|g| g.0).collect());
        let per_batch = median(groups.iter().map(|g| g.1).collect());
        report(
            &format!(
                "append, group commit across {} sessions",
                plan.group_sessions
            ),
            group_rate,
            "events/s",
            plan.runs,
            settings,
        );
        report(
            "group commit, writes per transaction",
            per_batch,
            "writes",
            plan.runs,
            settings,
        );

        let raw_single = median(
            (0..plan.runs)
                .map(|_| raw(synchronous, 1, plan.single_events))
                .collect(),
        );
        report(
            "raw SQLite insert, one per commit",
            raw_single,
            "rows/s",
            plan.runs,
            settings,
        );
        let raw_group = median(
            (0..plan.runs)
                .map(|_| raw(synchronous, plan.group_sessions, group_total))
                .collect(),
        );
        report(
            &format!("raw SQLite insert, {} per commit", plan.group_sessions),
            raw_group,
            "rows/s",
            plan.runs,
            settings,
        );
        report(
            "group commit / raw batched ceiling",
            100.0 * group_rate / raw_group,
            "%",
            plan.runs,
            settings,
        );
    }
}
