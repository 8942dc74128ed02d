//! `keel serve`: the node's options from flags, environment and `keel.toml`, then the
//! node itself until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use keel_core::config::Config;
use keel_core::node::{self, Node, Options};
use keel_core::server::{Limits, tls};
use keel_core::store::{self, DbUrl};
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct Serve {
    /// keel.toml; without one, the built-in scripted demo model is served.
    #[arg(long, env = "KEEL_CONFIG")]
    config: Option<PathBuf>,
    /// sqlite://PATH (taken literally) or postgres://user@host:port/db; by default
    /// keel.db in Keel's data directory ($KEEL_DATA_HOME, $XDG_DATA_HOME/keel or
    /// ~/.local/share/keel).
    #[arg(long, env = "KEEL_DB")]
    db: Option<String>,
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, env = "KEEL_LISTEN", default_value = "127.0.0.1:4096")]
    listen: SocketAddr,
    /// Bearer token required on every route but health.
    #[arg(long, env = "KEEL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Request bodies over this many bytes are refused with 413.
    #[arg(long, env = "KEEL_BODY_LIMIT", default_value_t = 16 * 1024 * 1024)]
    body_limit: usize,
    /// Lease of an execution claim, in milliseconds.
    #[arg(long, env = "KEEL_LEASE_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(i64).range(node::MIN_LEASE_MS..))]
    lease_ms: i64,
    /// Interval of the comment heartbeat on event streams, in milliseconds.
    #[arg(long, env = "KEEL_HEARTBEAT_MS", default_value_t = 15_000,
          value_parser = clap::value_parser!(u64).range(node::MIN_HEARTBEAT_MS..))]
    heartbeat_ms: u64,
    /// After SIGTERM or Ctrl-C, how long running steps get to reach a boundary before they
    /// are stopped (`step.interrupted` with reason `shutdown`); the session continues when
    /// Keel starts again. In milliseconds.
    #[arg(long, env = "KEEL_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    shutdown_grace_ms: u64,
    /// Pooled read connections to the database (besides the writer's one and, on
    /// PostgreSQL, one for the other nodes' notifications).
    #[arg(long, env = "KEEL_DB_READERS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..))]
    db_readers: u32,
    /// On PostgreSQL, writer connections, each committing its share of the sessions'
    /// writes (a session's writes all go to one, in order); SQLite has one writer.
    #[arg(long, env = "KEEL_DB_WRITERS", default_value_t = store::DEFAULT_PG_WRITERS as u32,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    db_writers: u32,
    /// Sessions may only work in this directory and below it (default: the working
    /// directory); a session asking for a directory outside is refused with 400.
    #[arg(long, env = "KEEL_ROOT")]
    root: Option<PathBuf>,
    /// How the log on stderr is written: `text` for people (coloured on a terminal) or
    /// `json`, one object per line, for log collectors.
    #[arg(long, env = "KEEL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Serve HTTPS with this PEM certificate chain (the server's certificate first);
    /// needs --tls-key.
    #[arg(long, env = "KEEL_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "KEEL_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Let pages from this origin (scheme://host[:port]) call Keel from a browser; repeat
    /// for several, or separate them with commas. Off by default.
    #[arg(long = "cors-origin", env = "KEEL_CORS_ORIGIN", value_delimiter = ',',
          value_parser = keel_core::server::cors::parse_origin)]
    cors_origins: Vec<axum::http::HeaderValue>,
    /// Also serve `GET /metrics` on this address, without the token (for a Prometheus
    /// scraper that should not hold it); `/metrics` on --listen keeps asking for it.
    #[arg(long, env = "KEEL_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Send the spans to an OpenTelemetry collector at this base URL (for example
    /// http://127.0.0.1:4318; spans go to /v1/traces). Needs a keel built with the `otlp`
    /// cargo feature.
    #[arg(long, env = "KEEL_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// How spans are encoded for the collector: `protobuf` or `json`.
    #[arg(long, env = "KEEL_OTLP_PROTOCOL", value_enum, default_value_t = OtlpProtocol::Protobuf)]
    otlp_protocol: OtlpProtocol,
}

/// How `keel serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// How spans are encoded for an OpenTelemetry collector (OTLP over HTTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    Protobuf,
    Json,
}

/// What must outlive the service for its spans to reach the collector: the running OTLP
/// export, when there is one; call [`Telemetry::finish`] once the runtime is gone.
#[must_use]
pub struct Telemetry {
    #[cfg(feature = "otlp")]
    export: Option<keel_core::telemetry::Export>,
}

impl Telemetry {
    /// Sends the spans still buffered.
    pub fn finish(self) {
        #[cfg(feature = "otlp")]
        if let Some(export) = self.export {
            export.shutdown();
        }
    }
}

/// Installs the log on stderr in the chosen format and, when asked for, the OTLP export.
/// Called before the async runtime starts (the exporter runs its own thread).
pub fn init_logging(args: &Serve) -> Result<Telemetry, String> {
    use tracing_subscriber::prelude::*;

    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // Colours only for a person at a terminal, never into a log file.
    let text = (args.log_format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
    });
    let json = (args.log_format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .json()
    });
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json);
    #[cfg(feature = "otlp")]
    {
        use keel_core::telemetry::{Export, Protocol};
        let protocol = match args.otlp_protocol {
            OtlpProtocol::Protobuf => Protocol::Protobuf,
            OtlpProtocol::Json => Protocol::Json,
        };
        let export = args
            .otlp_endpoint
            .as_deref()
            .map(|endpoint| Export::start(endpoint, protocol))
            .transpose()?;
        registry.with(export.as_ref().map(Export::layer)).init();
        if let Some(endpoint) = &args.otlp_endpoint {
            tracing::info!(%endpoint, "spans are exported over OTLP");
        }
        Ok(Telemetry { export })
    }
    #[cfg(not(feature = "otlp"))]
    {
        if args.otlp_endpoint.is_some() {
            return Err("--otlp-endpoint needs a keel built with OTLP export: \
                        cargo build --release -p keel-core --features otlp"
                .into());
        }
        registry.init();
        Ok(Telemetry {})
    }
}

pub async fn serve(args: Serve) -> Result<()> {
    let config = Config::load(args.config.as_deref())?;
    let db: DbUrl = match &args.db {
        Some(db) => db.parse()?,
        None => default_db()?,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tls::load(cert, key).map_err(anyhow::Error::msg)?),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let options = Options {
        store: store::Options {
            read_connections: args.db_readers,
            pg_writers: args.db_writers as usize,
            ..store::Options::default()
        },
        listen: args.listen,
        token: args.token,
        limits: Limits {
            body_bytes: args.body_limit,
        },
        lease_ms: args.lease_ms,
        heartbeat: Duration::from_millis(args.heartbeat_ms),
        step_grace: Duration::from_millis(args.shutdown_grace_ms),
        root: args.root,
        metrics_listen: args.metrics_listen,
        tls,
        cors_origins: args.cors_origins,
        ..Options::new(db.clone(), config)
    };
    let node = Node::start(options).await?;
    // Tests, benchmarks and scripts read where the node listens from this first line.
    println!(
        "keel listening on {scheme}://{} (database {db}, owner {})",
        node.address(),
        node.owner()
    );
    let shutdown = CancellationToken::new();
    let signalled = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        signalled.cancel();
    });
    node.run(shutdown).await?;
    Ok(())
}

/// keel.db in Keel's data directory, which is created if missing.
fn default_db() -> Result<DbUrl> {
    let dir = keel_core::config::data_dir().ok_or_else(|| {
        anyhow::anyhow!("no place for the database: set --db, KEEL_DATA_HOME or HOME")
    })?;
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("could not create {}: {e}", dir.display()))?;
    Ok(DbUrl::Sqlite(dir.join("keel.db")))
}

async fn wait_for_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}
