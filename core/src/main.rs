//! The `keel` binary: `keel serve` runs the service; `keel prompt|sessions|tail|interrupt`
//! talk to a running one (see `cli`); `keel events` prints the catalog.

mod cli;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use keel_core::clock::{Clock, SystemClock};
use keel_core::cluster::{self, Bus};
use keel_core::config::Config;
use keel_core::execution;
use keel_core::runner::{Runner, Settings};
use keel_core::server::{self, Limits, Shared};
use keel_core::store::{DbUrl, Options, Store};
use keel_core::tool;
use keel_schema::id::OwnerId;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "keel",
    version,
    about = "A durable session engine for AI coding agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service.
    Serve(Serve),
    /// Prompt a session and stream the answer until the session is idle.
    Prompt(cli::Prompt),
    /// List the newest sessions.
    Sessions(cli::Sessions),
    /// Print a session's durable log, then follow it.
    Tail(cli::Tail),
    /// Interrupt a session's running execution.
    Interrupt(cli::Interrupt),
    /// Print the event catalog: every event type, version and durability.
    Events,
}

#[derive(clap::Args)]
struct Serve {
    /// keel.toml; without one, the built-in scripted demo model is served.
    #[arg(long, env = "KEEL_CONFIG")]
    config: Option<PathBuf>,
    /// sqlite://PATH (taken literally) or postgres://user@host:port/db.
    #[arg(long, env = "KEEL_DB", default_value = "sqlite://keel.db")]
    db: String,
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
    #[arg(long, env = "KEEL_LEASE_MS", default_value_t = 30_000)]
    lease_ms: i64,
    /// Interval of the comment heartbeat on event streams, in milliseconds.
    #[arg(long, env = "KEEL_HEARTBEAT_MS", default_value_t = 15_000)]
    heartbeat_ms: u64,
    /// Pooled read connections to the database (besides the writer's one and, on
    /// PostgreSQL, one for the other nodes' notifications).
    #[arg(long, env = "KEEL_DB_READERS", default_value_t = 4)]
    db_readers: u32,
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    if let Command::Events = command {
        for entry in keel_schema::event::catalog() {
            let latest = if entry.latest { "" } else { " (read only)" };
            println!(
                "{:<48} v{} {:?}{latest}",
                entry.type_name, entry.version, entry.durability
            );
        }
        return ExitCode::SUCCESS;
    }
    if let Command::Serve(_) = command {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = runtime.block_on(async move {
        match command {
            Command::Serve(serve) => run(serve).await,
            Command::Prompt(args) => cli::prompt(args).await,
            Command::Sessions(args) => cli::sessions(args).await,
            Command::Tail(args) => cli::tail(args).await,
            Command::Interrupt(args) => cli::interrupt(args).await,
            Command::Events => Ok(()),
        }
    });
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(serve: Serve) -> Result<()> {
    if !serve.listen.ip().is_loopback() && serve.token.is_none() {
        bail!(
            "refusing to listen on {} without a token: set KEEL_TOKEN (or --token), or listen \
             on a loopback address",
            serve.listen
        );
    }
    if serve.lease_ms < 100 {
        bail!(
            "KEEL_LEASE_MS must be at least 100 (got {})",
            serve.lease_ms
        );
    }
    if serve.heartbeat_ms < 10 {
        bail!(
            "KEEL_HEARTBEAT_MS must be at least 10 (got {})",
            serve.heartbeat_ms
        );
    }
    let config = Config::load(serve.config.as_deref())?;
    let url: DbUrl = serve.db.parse()?;
    if serve.db_readers == 0 {
        bail!("KEEL_DB_READERS must be at least 1");
    }
    let options = Options {
        read_connections: serve.db_readers,
        ..Options::default()
    };
    let store = Store::open(url.clone(), options).await?;
    let owner = OwnerId::new();
    let runner = Runner::new(
        store.clone(),
        Settings {
            owner,
            lease_ms: serve.lease_ms,
            agents: config.agents()?,
            providers: config.providers()?,
            tools: tool::builtins(),
            limits: tool::Limits::default(),
            retry: keel_core::runner::RetryPolicy::default(),
            models: config.models(),
        },
    );
    let shutdown = CancellationToken::new();
    let renewing = tokio::spawn({
        let runner = runner.clone();
        let shutdown = shutdown.clone();
        async move { runner.renew_leases(shutdown).await }
    });
    // Executions abandoned by a dead process (or by this one, before a restart) are
    // taken over now and every half lease.
    let recovering = tokio::spawn(keel_core::recovery::run(
        runner.clone(),
        serve.lease_ms,
        shutdown.clone(),
    ));
    let registered = tokio::spawn(cluster::keep_registered(
        store.clone(),
        cluster::NodeInfo::this_process(owner, SystemClock.now_ms()),
        serve.lease_ms,
        shutdown.clone(),
    ));
    // On PostgreSQL the nodes share wakes and commits through LISTEN/NOTIFY.
    let bus = match &url {
        DbUrl::Postgres(address) => {
            let bus = Bus::start(
                address.clone(),
                runner.clone(),
                store.clone(),
                shutdown.clone(),
            );
            runner.route_through(Arc::new(bus.clone()));
            Some(bus)
        }
        DbUrl::Sqlite(_) => None,
    };
    let listener = tokio::net::TcpListener::bind(serve.listen)
        .await
        .with_context(|| format!("binding {}", serve.listen))?;
    let address = listener.local_addr()?;
    let state = Arc::new(Shared {
        store: store.clone(),
        runner,
        config,
        token: serve.token,
        heartbeat: Duration::from_millis(serve.heartbeat_ms),
        started_at: SystemClock.now_ms(),
        lease_ms: serve.lease_ms,
        bus,
    });
    let app = server::router(
        state,
        &Limits {
            body_bytes: serve.body_limit,
        },
    );
    println!("keel listening on http://{address} (database {url}, owner {owner})");

    let signalled = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        signalled.cancel();
    });
    let stopped = shutdown.clone();
    let serving = axum::serve(listener, app).with_graceful_shutdown(async move {
        stopped.cancelled().await;
    });
    tokio::select! {
        served = serving => served.context("serving HTTP")?,
        // Open event streams never end by themselves; give requests a moment, then go.
        () = async { shutdown.cancelled().await; tokio::time::sleep(Duration::from_secs(3)).await } => {}
    }
    renewing.abort();
    recovering.abort();
    // The node leaves the list (bounded: a database that does not answer must not hold
    // the shutdown).
    drop(tokio::time::timeout(Duration::from_secs(2), registered).await);
    // Hand the claims back at once, so a restarted keel recovers them without waiting.
    let expired = store
        .write(move |c| execution::expire_all(c, SystemClock.now_ms(), owner))
        .await?;
    tracing::info!(expired, "claims handed back");
    Ok(())
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
