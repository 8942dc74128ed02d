//! keel-tests: end-to-end tests of Keel as users run it: the real `keel` binary, the
//! real client, real files. Helpers shared by the tests live here.

pub mod fake_provider;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use fake_provider::Canned;
use futures::StreamExt as _;
use keel_client::LogStream;
use keel_client::schema::api::LogItem;
use keel_client::schema::event::Envelope;

/// How long [`read_until`] waits for the awaited event: a guard against a hang, not a
/// performance bound.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// Reads a session log's durable events until `stop` accepts one; returns all it read.
/// Fails when the stream ends or errs first, or after [`PATIENCE`].
pub async fn read_until(log: &mut LogStream, stop: impl Fn(&Envelope) -> bool) -> Vec<Envelope> {
    let mut events = Vec::new();
    let read = async {
        while let Some(item) = log.next().await {
            if let LogItem::Durable(envelope) = item.expect("the log stream reads") {
                let done = stop(&envelope);
                events.push(envelope);
                if done {
                    return;
                }
            }
        }
        panic!("the log ended early");
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("the awaited event arrives");
    events
}

/// The workspace root.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("keel-tests lives one directory below the workspace root")
}

/// A recorded provider transcript from `tests/fixtures/providers/` (`openai/text.http`).
pub fn transcript(name: &str) -> Canned {
    Canned::file(&workspace_root().join("tests/fixtures/providers").join(name))
}

/// The `keel` binary of this checkout, built (once per test process) with the same cargo
/// that runs the tests, so a test never runs a stale binary.
pub fn keel_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| build(&["--package", "keel-core", "--bin", "keel"], "keel"))
}

/// The client's example `prompt`, built like [`keel_binary`].
pub fn client_example() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        build(
            &["--package", "keel-client", "--example", "prompt"],
            "prompt",
        )
    })
}

/// Builds one target with cargo and returns the executable cargo reports for `name`.
fn build(target: &[&str], name: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .current_dir(workspace_root())
        .args(["build", "--quiet", "--message-format=json"])
        .args(target)
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "building {name} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["target"]["name"] == name)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reports the {name} executable it built"))
}

/// A `keel serve` process on a free loopback port with its own SQLite database, killed
/// when dropped.
pub struct Server {
    pub base_url: String,
    child: std::process::Child,
    /// The `--db` URL.
    db: String,
    args: Vec<String>,
    /// `RUST_LOG` for the server.
    log_filter: String,
    /// More environment variables for the server.
    env: Vec<(String, String)>,
    /// Everything the server wrote to stderr so far (its log), across restarts.
    log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
    /// Where the SQLite database lives: outside the server's directory (the sessions'
    /// default), as a sandboxed `bash` needs.
    _data: tempfile::TempDir,
}

impl Server {
    /// Starts `keel serve` with `args` added, and waits until it listens.
    pub fn start(args: &[&str]) -> Self {
        Self::start_with(&[], args)
    }

    /// Writes `files` (name, content) into the server's directory, then starts it with
    /// `args` added: e.g. a `keel.toml` and `--config keel.toml`.
    pub fn start_with(files: &[(&str, &str)], args: &[&str]) -> Self {
        Self::start_on(None, files, args)
    }

    /// Like [`Server::start_with`], on the database `db` (a `postgres://` URL shared by
    /// several servers, say) instead of a SQLite file of its own.
    pub fn start_on(db: Option<&str>, files: &[(&str, &str)], args: &[&str]) -> Self {
        Self::start_full(db, files, args, "info", &[])
    }

    /// Like [`Server::start_with`], with `env` added to the server's environment.
    pub fn start_with_env(files: &[(&str, &str)], args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_full(None, files, args, "info", env)
    }

    /// Like [`Server::start`], its log filtered by `filter` (`RUST_LOG`) instead of `info`.
    pub fn start_logging(filter: &str, args: &[&str]) -> Self {
        Self::start_full(None, &[], args, filter, &[])
    }

    fn start_full(
        db: Option<&str>,
        files: &[(&str, &str)],
        args: &[&str],
        log_filter: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        for (name, content) in files {
            std::fs::write(dir.path().join(name), content).expect("a test file is written");
        }
        let data = tempfile::tempdir().expect("a temporary directory");
        let db = db.map_or_else(
            || format!("sqlite://{}", data.path().join("keel.db").display()),
            str::to_owned,
        );
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let log = Arc::new(Mutex::new(String::new()));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let (child, base_url) = spawn(dir.path(), &db, &args, (log_filter, &env), &log);
        Self {
            log_filter: log_filter.to_owned(),
            env,
            base_url,
            child,
            db,
            args,
            log,
            _dir: dir,
            _data: data,
        }
    }

    /// Sends `signal` to the server process.
    pub fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid fits pid_t");
        // SAFETY: kill(2) with a child's pid and a valid signal has no memory effects.
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(sent, 0, "signal {signal} is sent to keel");
    }

    /// Kills the server with SIGKILL and reaps it, for good.
    pub fn kill(&mut self) {
        self.child.kill().expect("keel is killed");
        self.child.wait().expect("keel is reaped");
    }

    /// Kills the server with SIGKILL (no shutdown, leases left to run out) and starts it
    /// again on the same database and directory. It listens on a new port.
    pub fn kill_and_restart(&mut self) {
        self.child.kill().expect("keel is killed");
        self.restart();
    }

    /// Stops the server with SIGTERM (a graceful shutdown, which hands its claims back),
    /// waits for it to exit, and starts it again on the same database and directory.
    pub fn terminate_and_restart(&mut self) {
        self.signal(libc::SIGTERM);
        self.restart();
    }

    /// Reaps the stopped process and starts a new one; it listens on a new port.
    fn restart(&mut self) {
        self.child.wait().expect("keel is reaped");
        let (child, base_url) = spawn(
            self._dir.path(),
            &self.db,
            &self.args,
            (&self.log_filter, &self.env),
            &self.log,
        );
        self.child = child;
        self.base_url = base_url;
    }

    /// Whether the server's log so far has a line containing `text`.
    pub fn logged(&self, text: &str) -> bool {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.lines().any(|line| line.contains(text))
    }

    /// The server's log so far, a line each.
    pub fn log_lines(&self) -> Vec<String> {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.lines().map(str::to_owned).collect()
    }

    /// The directory the server runs in (the default session directory).
    pub fn directory(&self) -> &Path {
        self._dir.path()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The process may already be gone; either way it must not outlive the test.
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

/// Starts `keel serve` in `dir` on the database `db`, appending its stderr to `log`, and
/// waits until it listens.
fn spawn(
    dir: &Path,
    db: &str,
    args: &[String],
    (log_filter, env): (&str, &[(String, String)]),
    log: &Arc<Mutex<String>>,
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(keel_binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--db", db])
        .args(args)
        .current_dir(dir)
        .env_remove("KEEL_TOKEN")
        .env_remove("KEEL_CONFIG")
        .env("RUST_LOG", log_filter)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("keel starts");
    let stderr = child.stderr.take().expect("piped stderr");
    std::thread::spawn({
        let log = log.clone();
        move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        }
    });
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("keel prints where it listens");
    let base_url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (child, base_url)
}

/// The variable naming the PostgreSQL server the tests may use.
pub const POSTGRES_ENV: &str = "KEEL_TEST_POSTGRES_URL";

/// A fresh database on the PostgreSQL server named by [`POSTGRES_ENV`], dropped with this
/// value.
pub struct PostgresDb {
    /// The database's URL.
    pub url: String,
    base: String,
    name: String,
}

impl PostgresDb {
    /// A new database, or `None` (saying so) when [`POSTGRES_ENV`] is not set. In CI
    /// (`CI=true`) a missing server is a failure, never a skip.
    pub fn fresh(test: &str) -> Option<Self> {
        let Ok(base) = std::env::var(POSTGRES_ENV) else {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{POSTGRES_ENV} must be set in CI: the PostgreSQL tests may not be skipped");
            }
            eprintln!("{test}: SKIPPED (set {POSTGRES_ENV} to run the PostgreSQL tests)");
            return None;
        };
        Some(Self::create(&base, "keel_e2e"))
    }

    /// A new database named `PREFIX_<ulid>` on the server of `base` (a URL naming any
    /// database there to connect to).
    pub fn create(base: &str, prefix: &str) -> Self {
        use diesel::{Connection, RunQueryDsl};
        let name = format!(
            "{prefix}_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let mut admin = diesel::PgConnection::establish(base)
            .unwrap_or_else(|e| panic!("connecting to {base}: {e}"));
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
        let (server, _) = base
            .rsplit_once('/')
            .unwrap_or_else(|| panic!("{base} has no database path"));
        Self {
            url: format!("{server}/{name}"),
            base: base.to_owned(),
            name,
        }
    }

    /// Keeps the database (for inspection after a failure) and returns its URL.
    pub fn keep(self) -> String {
        let url = self.url.clone();
        std::mem::forget(self);
        url
    }
}

impl PostgresDb {
    /// Ends every connection to the database, as a server restart would; returns how
    /// many there were.
    pub fn terminate_connections(&self) -> usize {
        use diesel::{Connection, RunQueryDsl};
        let mut admin = diesel::PgConnection::establish(&self.base)
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.base));
        diesel::sql_query(format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{}' \
             AND pid <> pg_backend_pid()",
            self.name
        ))
        .execute(&mut admin)
        .unwrap_or_else(|e| panic!("terminating the connections to {}: {e}", self.name))
    }
}

impl PostgresDb {
    /// Makes the database refuse new connections (`false`) or take them again (`true`),
    /// as a database that went away and came back would.
    pub fn allow_connections(&self, allow: bool) {
        use diesel::{Connection, RunQueryDsl};
        let mut admin = diesel::PgConnection::establish(&self.base)
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.base));
        diesel::sql_query(format!(
            "ALTER DATABASE {} WITH ALLOW_CONNECTIONS {allow}",
            self.name
        ))
        .execute(&mut admin)
        .unwrap_or_else(|e| panic!("changing the connections to {}: {e}", self.name));
    }
}

impl Drop for PostgresDb {
    fn drop(&mut self) {
        use diesel::{Connection, RunQueryDsl};
        match diesel::PgConnection::establish(&self.base) {
            Ok(mut admin) => {
                let drop_it = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
                if let Err(e) = diesel::sql_query(drop_it).execute(&mut admin) {
                    eprintln!("dropping test database {}: {e}", self.name);
                }
            }
            Err(e) => eprintln!("dropping test database {}: {e}", self.name),
        }
    }
}
