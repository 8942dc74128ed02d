//! What the benchmark binaries share: the plan's size, where the database lives, the
//! statistics, and the `BENCH {json}` line `cargo xtask bench` collects.

#![allow(dead_code)] // Each bench binary uses its own part of this module.

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use keel_core::event::log;
use keel_core::execution::{self, Claim};
use keel_core::inbox::{self, Admission, Boundary};
use keel_core::store::{self, DbUrl, Options, Store, Synchronous};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{MessageId, OwnerId, SessionId};
use keel_schema::types::{ModelRef, Phase};
use serde_json::json;

/// The PostgreSQL server `--postgres` measures: trust authentication on loopback.
/// `KEEL_BENCH_POSTGRES` overrides it (a URL to the maintenance database).
const POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Which backend a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite(Synchronous),
    Postgres,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Postgres => "postgres",
        }
    }

    /// The settings column of the table.
    pub fn settings(self) -> &'static str {
        match self {
            Self::Sqlite(Synchronous::Full) => "synchronous=FULL, WAL",
            Self::Sqlite(Synchronous::Normal) => "synchronous=NORMAL, WAL",
            Self::Postgres => "fsync as the server is configured",
        }
    }

    /// The backends a bench binary measures: SQLite at both settings, and PostgreSQL
    /// only when `--postgres` was given; `--backend full|normal|postgres` picks one (to
    /// profile it alone).
    pub fn chosen(postgres: bool) -> Vec<Backend> {
        let mut backends = vec![
            Backend::Sqlite(Synchronous::Full),
            Backend::Sqlite(Synchronous::Normal),
        ];
        if postgres {
            backends.push(Backend::Postgres);
        }
        match option("--backend").as_deref() {
            None => backends,
            Some("full") => vec![Backend::Sqlite(Synchronous::Full)],
            Some("normal") => vec![Backend::Sqlite(Synchronous::Normal)],
            Some("postgres") => vec![Backend::Postgres],
            Some(other) => panic!("--backend takes full, normal or postgres, not `{other}`"),
        }
    }
}

/// A fresh, empty database for one run; removed when dropped.
pub struct Database {
    pub url: DbUrl,
    synchronous: Synchronous,
    _dir: Option<tempfile::TempDir>,
    postgres: Option<(String, String)>,
}

impl Database {
    pub fn new(backend: Backend) -> Self {
        match backend {
            Backend::Sqlite(synchronous) => {
                let dir = tempfile::tempdir().expect("a temporary directory for the database");
                Self {
                    url: DbUrl::Sqlite(dir.path().join("keel.db")),
                    synchronous,
                    _dir: Some(dir),
                    postgres: None,
                }
            }
            Backend::Postgres => {
                let admin =
                    std::env::var("KEEL_BENCH_POSTGRES").unwrap_or_else(|_| POSTGRES.into());
                let name = format!(
                    "keel_bench_{}",
                    ulid::Ulid::generate().to_string().to_lowercase()
                );
                let mut connection = PgConnection::establish(&admin).unwrap_or_else(|e| {
                    panic!("--postgres needs a PostgreSQL server at {admin}: {e}")
                });
                connection
                    .batch_execute(&format!("CREATE DATABASE {name}"))
                    .expect("creating the benchmark database");
                let (base, _) = admin
                    .rsplit_once('/')
                    .expect("the PostgreSQL URL names a database");
                Self {
                    url: DbUrl::Postgres(format!("{base}/{name}")),
                    synchronous: Synchronous::Full,
                    _dir: None,
                    postgres: Some((admin, name)),
                }
            }
        }
    }

    pub async fn open(&self) -> Store {
        Store::open(
            self.url.clone(),
            Options {
                synchronous: self.synchronous,
                // `--pg-writers N` measures PostgreSQL with other than the default.
                pg_writers: option("--pg-writers").map_or(store::DEFAULT_PG_WRITERS, |n| {
                    n.parse().expect("--pg-writers takes a number")
                }),
                ..Options::default()
            },
        )
        .await
        .expect("opening the benchmark database")
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        if let Some((admin, name)) = &self.postgres
            && let Ok(mut connection) = PgConnection::establish(admin)
        {
            // A database left behind is only litter; the next run makes its own.
            drop(connection.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")));
        }
    }
}

/// Whether this binary was asked for the short plan, and for PostgreSQL.
pub fn flags() -> (bool, bool) {
    let args: Vec<String> = std::env::args().collect();
    (
        args.iter().any(|a| a == "--quick"),
        args.iter().any(|a| a == "--postgres"),
    )
}

/// The value after `name` on the command line.
pub fn option(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone())
}

pub fn median(values: &[f64]) -> f64 {
    percentile(values, 0.5)
}

/// The nearest-rank percentile `p` (0 < p <= 1) of `values`.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    assert!(!values.is_empty(), "a percentile of no samples");
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Prints one figure for `cargo xtask bench` to collect.
pub fn report(figure: &str, value: f64, unit: &str, backend: Backend, runs: usize, settings: &str) {
    let settings = if settings.is_empty() {
        backend.settings().to_owned()
    } else {
        format!("{}, {settings}", backend.settings())
    };
    let rounded = if value.abs() >= 100.0 {
        value.round()
    } else {
        (value * 1000.0).round() / 1000.0
    };
    println!(
        "BENCH {}",
        json!({
            "figure": figure,
            "value": rounded,
            "unit": unit,
            "backend": backend.name(),
            "runs": runs,
            "settings": settings,
        })
    );
}

/// A runtime like the server's on this machine: two worker threads.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("starting the benchmark runtime")
}

/// Writes a new session as a runner leaves it one step in: `created`, `prompt` admitted
/// and promoted, a claim of `owner` (lease `lease_ms`) in phase `running`, and its first
/// step started with `model`. Returns the session, the claim and the step's assistant
/// message, for the caller to go on from (an abandoned step, a finished one).
pub fn start_first_step(
    c: &mut store::Conn,
    now: i64,
    lease_ms: i64,
    owner: OwnerId,
    created: DurableEvent,
    prompt: Admission,
    model: ModelRef,
) -> Result<(SessionId, Claim, MessageId), store::Error> {
    let failed = |e: &dyn std::fmt::Display| store::Error::Corrupt(e.to_string());
    let session = SessionId::new();
    log::append(c, now, session, vec![created])?;
    inbox::admit(c, now, session, prompt).map_err(|e| failed(&e))?;
    let (claim, _) = execution::acquire(c, now, lease_ms, session, owner)?
        .ok_or_else(|| failed(&"a new session has no claim yet"))?;
    inbox::promote(c, now, session, Boundary::Idle).map_err(|e| failed(&e))?;
    let assistant = MessageId::new();
    let started = log::append(
        c,
        now,
        session,
        vec![DurableEvent::StepStarted(payload::StepStarted {
            assistant_message_id: assistant,
            step: 1,
            agent: "build".into(),
            model,
        })],
    )?;
    execution::set_phase(c, &claim, Phase::Running, Some((assistant, started[0].seq)))
        .map_err(|e| failed(&e))?;
    Ok((session, claim, assistant))
}
