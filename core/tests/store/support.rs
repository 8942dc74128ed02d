//! Test databases for both backends.

use std::io::Write;
use std::sync::{Arc, Once};

use diesel::{Connection, PgConnection, RunQueryDsl};
use keel_core::clock::ManualClock;
use keel_core::store::{DbUrl, Options, Store};
use keel_schema::event::DurableEvent;
use keel_schema::event::payload;
use keel_schema::id::SessionId;
use keel_schema::types::ModelRef;

/// The start of every test's manual clock.
pub const T0: i64 = 1_764_690_000_000;

/// The environment variable naming the PostgreSQL server for tests.
pub const POSTGRES_ENV: &str = "KEEL_TEST_POSTGRES_URL";

/// A database that exists for one test.
pub struct TestDb {
    pub url: DbUrl,
    pub clock: Arc<ManualClock>,
    _dir: Option<tempfile::TempDir>,
    postgres: Option<(String, String)>,
}

impl TestDb {
    /// A new SQLite file in a temporary directory.
    pub fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Self {
            url: DbUrl::Sqlite(dir.path().join("keel.db")),
            clock: Arc::new(ManualClock::new(T0)),
            _dir: Some(dir),
            postgres: None,
        }
    }

    /// A new database on the PostgreSQL server named by `KEEL_TEST_POSTGRES_URL`, or
    /// `None` (saying so once, past the test harness's capture) when it is not set. In CI
    /// a missing server is a failure, never a skip.
    pub fn postgres() -> Option<Self> {
        let Ok(base) = std::env::var(POSTGRES_ENV) else {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{POSTGRES_ENV} must be set in CI: the PostgreSQL suite may not be skipped");
            }
            static NOTE: Once = Once::new();
            NOTE.call_once(|| {
                // Written to stderr directly so the note shows even when output is captured.
                let note = format!(
                    "\nnote: the PostgreSQL store suite is SKIPPED: set {POSTGRES_ENV} \
                     (e.g. postgres://postgres@127.0.0.1:5432/test) to run it\n"
                );
                drop(std::io::stderr().write_all(note.as_bytes()));
            });
            return None;
        };
        let name = format!(
            "keel_test_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let mut admin = PgConnection::establish(&base)
            .unwrap_or_else(|e| panic!("connecting to {POSTGRES_ENV}={base}: {e}"));
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
        let (prefix, _) = base
            .rsplit_once('/')
            .unwrap_or_else(|| panic!("{POSTGRES_ENV}={base} has no database path"));
        Some(Self {
            url: DbUrl::Postgres(format!("{prefix}/{name}")),
            clock: Arc::new(ManualClock::new(T0)),
            _dir: None,
            postgres: Some((base, name)),
        })
    }

    pub fn options(&self) -> Options {
        Options {
            clock: self.clock.clone(),
            ..Options::default()
        }
    }

    pub async fn open(&self) -> Store {
        Store::open(self.url.clone(), self.options())
            .await
            .unwrap_or_else(|e| panic!("opening {}: {e}", self.url))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((base, name)) = &self.postgres {
            match PgConnection::establish(base) {
                Ok(mut admin) => {
                    if let Err(e) =
                        diesel::sql_query(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                            .execute(&mut admin)
                    {
                        eprintln!("dropping test database {name}: {e}");
                    }
                }
                Err(e) => eprintln!("dropping test database {name}: {e}"),
            }
        }
    }
}

/// Generates each listed `async fn name(db: TestDb)` as a test per backend.
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::TestDb::sqlite()).await
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if let Some(db) = $crate::support::TestDb::postgres() {
                        super::$name(db).await
                    }
                }
            )+
        }
    };
}

pub fn model() -> ModelRef {
    ModelRef {
        provider: "scripted".into(),
        id: "demo".into(),
    }
}

pub fn created(title: &str) -> DurableEvent {
    DurableEvent::Created(payload::Created {
        title: Some(title.into()),
        directory: "/work".into(),
        agent: "build".into(),
        model: model(),
        metadata: None,
    })
}

/// Creates `count` sessions and returns their ids.
pub async fn new_sessions(store: &Store, count: usize) -> Vec<SessionId> {
    let mut sessions = Vec::with_capacity(count);
    for _ in 0..count {
        sessions.push(new_session(store).await);
    }
    sessions
}

/// Creates a session and returns its id.
pub async fn new_session(store: &Store) -> SessionId {
    let id = SessionId::new();
    store
        .append(id, vec![created("test")])
        .await
        .expect("creating a session");
    id
}
