//! A node: one Keel service process, its parts wired together.
//!
//! [`Node::start`] checks the [`Options`], opens the store, builds the runner and binds the
//! listener; [`Node::run`] then runs everything a serving process needs until its
//! shutdown signal: lease renewal, recovery (at once and every half lease), the node's
//! registration and heartbeat, on PostgreSQL the cluster bus, and the HTTP server. After
//! the signal it gives open requests a grace period, unregisters the node and hands its
//! claims back, so a restarted or surviving node recovers them without waiting for their
//! leases to run out.
//!
//! The `keel serve` command, the end-to-end tests (through that command) and the server
//! benchmarks all run a node this way; nothing else wires these parts by hand.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_schema::id::OwnerId;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, SystemClock};
use crate::cluster::{self, Bus};
use crate::config::{self, Config};
use crate::execution;
use crate::runner::{RetryPolicy, Runner, Settings};
use crate::server::{self, Limits, Shared};
use crate::store::{self, DbUrl, Store};
use crate::{recovery, tool};

/// How long steps stopped at the end of the shutdown grace get to write their end (they
/// join their tools first; a `bash` process group is killed).
const STOP_SETTLE: Duration = Duration::from_secs(5);

/// The shortest lease a node accepts: renewal runs every third of it.
pub const MIN_LEASE_MS: i64 = 100;

/// The shortest heartbeat interval of event streams a node accepts, in milliseconds.
pub const MIN_HEARTBEAT_MS: u64 = 10;

/// Why a node could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listening beyond loopback without a token would hand the service to anyone who
    /// can reach the address.
    #[error(
        "refusing to listen on {0} without a token: set a token, or listen on a loopback \
         address"
    )]
    TokenRequired(SocketAddr),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Config(#[from] config::Error),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error("binding {address}: {source}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Cluster(#[from] cluster::Error),
    #[error("serving HTTP: {0}")]
    Serve(#[source] std::io::Error),
}

/// How to build a node.
#[derive(Debug, Clone)]
pub struct Options {
    pub db: DbUrl,
    /// Connections, durability and the clock of the store.
    pub store: store::Options,
    /// Providers, models and agents (`keel.toml`).
    pub config: Config,
    /// Where the HTTP server listens; port 0 picks a free port ([`Node::address`]).
    pub listen: SocketAddr,
    /// The bearer token every route but health requires; required beyond loopback.
    pub token: Option<String>,
    pub limits: Limits,
    /// The lease of an execution claim, in milliseconds.
    pub lease_ms: i64,
    /// The interval of the comment heartbeat on event streams.
    pub heartbeat: Duration,
    /// How long open requests (event streams never end by themselves) get after the
    /// shutdown signal before the node stops serving.
    pub grace: Duration,
    /// How long running steps get after the shutdown signal to reach a boundary before
    /// they are stopped as `shutdown` (see `runner::shutdown`).
    pub step_grace: Duration,
    /// The directory sessions' directories must be inside (the working directory when
    /// `None`); a session asking for one outside it is refused.
    pub root: Option<PathBuf>,
    /// A second address serving `GET /metrics` alone, without the token, for a scraper
    /// that should not hold it ([`Node::metrics_address`]).
    pub metrics_listen: Option<SocketAddr>,
    /// Serve HTTPS with this configuration ([`server::tls::load`]) instead of plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Origins whose pages may call Keel from a browser ([`server::cors::parse_origin`]).
    pub cors_origins: Vec<axum::http::HeaderValue>,
}

impl Options {
    /// The defaults of `keel serve` on `db` with `config`.
    pub fn new(db: DbUrl, config: Config) -> Self {
        Self {
            db,
            store: store::Options::default(),
            config,
            listen: SocketAddr::from(([127, 0, 0, 1], 4096)),
            token: None,
            limits: Limits::default(),
            lease_ms: 30_000,
            heartbeat: Duration::from_secs(15),
            grace: Duration::from_secs(3),
            step_grace: Duration::from_secs(10),
            root: None,
            metrics_listen: None,
            tls: None,
            cors_origins: Vec::new(),
        }
    }

    fn check(&self) -> Result<(), Error> {
        if self.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(Error::Invalid(
                "the token is empty: set a real one, or none (KEEL_TOKEN unset)".into(),
            ));
        }
        if !self.listen.ip().is_loopback() && self.token.is_none() {
            return Err(Error::TokenRequired(self.listen));
        }
        if self.lease_ms < MIN_LEASE_MS {
            return Err(Error::Invalid(format!(
                "the lease must be at least {MIN_LEASE_MS} ms (got {})",
                self.lease_ms
            )));
        }
        if self.heartbeat < Duration::from_millis(MIN_HEARTBEAT_MS) {
            return Err(Error::Invalid(format!(
                "the stream heartbeat must be at least {MIN_HEARTBEAT_MS} ms (got {})",
                self.heartbeat.as_millis()
            )));
        }
        if self.store.read_connections == 0 {
            return Err(Error::Invalid(
                "the store needs at least one read connection".into(),
            ));
        }
        Ok(())
    }
}

/// A started node: its store open, its runner built, its listener bound.
pub struct Node {
    options: Options,
    store: Store,
    runner: Runner,
    listener: TcpListener,
    address: SocketAddr,
    /// The listener of `/metrics` alone, when asked for, and its address.
    metrics: Option<(TcpListener, SocketAddr)>,
    /// The sessions' root, canonical.
    root: PathBuf,
}

impl Node {
    /// Checks `options`, opens (and migrates) the store, builds the runner from the
    /// configuration and binds the listener. Nothing runs until [`Node::run`].
    pub async fn start(options: Options) -> Result<Self, Error> {
        options.check()?;
        let root = match &options.root {
            Some(root) => root.clone(),
            None => std::env::current_dir().map_err(|e| {
                Error::Invalid(format!("no working directory for the sessions' root: {e}"))
            })?,
        };
        let root = std::fs::canonicalize(&root)
            .ok()
            .filter(|r| r.is_dir())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "the sessions' root {} is not a directory",
                    root.display()
                ))
            })?;

        let agents = options.config.agents()?;
        let protected = Arc::new(tool::sandbox::Protected::new(
            match &options.db {
                DbUrl::Sqlite(path) => Some(path.as_path()),
                DbUrl::Postgres(_) => None,
            },
            options.config.path.as_deref(),
            options.config.key_variables(),
        ));
        report_sandbox(&agents, &protected, &root);
        let settings = Settings {
            owner: OwnerId::new(),
            lease_ms: options.lease_ms,
            agents,
            providers: options.config.providers()?,
            tools: tool::builtins(),
            limits: tool::Limits::default(),
            retry: RetryPolicy::default(),
            models: options.config.models(),
            instructions: options.config.instructions(),
            prices: options.config.prices(),
            mcp: Arc::new(crate::mcp::Servers::new(options.config.mcp_servers()?)),
            protected,
        };
        let store = Store::open(options.db.clone(), options.store.clone()).await?;
        let runner = Runner::new(store.clone(), settings);
        let listener = TcpListener::bind(options.listen)
            .await
            .map_err(|source| Error::Bind {
                address: options.listen,
                source,
            })?;
        let address = local_address(&listener, options.listen)?;
        let metrics = match options.metrics_listen {
            Some(wanted) => {
                let bind = |source| Error::Bind {
                    address: wanted,
                    source,
                };
                let listener = TcpListener::bind(wanted).await.map_err(bind)?;
                let address = local_address(&listener, wanted)?;
                Some((listener, address))
            }
            None => None,
        };
        Ok(Self {
            options,
            store,
            runner,
            listener,
            address,
            metrics,
            root,
        })
    }

    /// Where the node listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Where `/metrics` is served without the token, when [`Options::metrics_listen`] asked.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|(_, address)| *address)
    }

    /// This node's owner id, the name its claims carry.
    pub fn owner(&self) -> OwnerId {
        self.runner.owner()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    /// Serves until `shutdown` is cancelled, then stops: a grace period for open requests
    /// and one for running steps (those still running then are stopped as `shutdown`),
    /// the node unregistered, whatever claim is left handed back.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let Self {
            options,
            store,
            runner,
            listener,
            address: _,
            metrics,
            root,
        } = self;
        let owner = runner.owner();
        let lease_ms = options.lease_ms;
        // The node's own parts stop with the signal, or when serving fails.
        let stop = shutdown.child_token();
        // On PostgreSQL the nodes share wakes and commits through LISTEN/NOTIFY. Started
        // first: a bus that cannot start fails the node before anything else runs.
        let bus = match &options.db {
            DbUrl::Postgres(address) => {
                let bus = Bus::start(address.clone(), runner.clone(), store.clone(), stop.clone())?;
                runner.forward_through(Arc::new(bus.clone()));
                Some(bus)
            }
            DbUrl::Sqlite(_) => None,
        };
        // Leases are renewed until the runner has stopped, after the signal.
        let renewal = CancellationToken::new();
        let renewing = tokio::spawn({
            let runner = runner.clone();
            let renewal = renewal.clone();
            async move { runner.renew_leases(renewal).await }
        });
        // At the signal, running steps get their grace, then are stopped as `shutdown`.
        let stopping = tokio::spawn({
            let (runner, stop, grace) = (runner.clone(), stop.clone(), options.step_grace);
            async move {
                stop.cancelled().await;
                runner.shut_down(grace, STOP_SETTLE).await
            }
        });
        // MCP servers configured to start with the node; the others start on first use.
        let mcp = runner.mcp().clone();
        tokio::spawn(async move { mcp.start_eager().await });
        // Executions abandoned by a dead process (or by this one, before a restart) are
        // taken over now and every half lease.
        let recovering = tokio::spawn(recovery::run(runner.clone(), lease_ms, stop.clone()));
        let registered = tokio::spawn(cluster::keep_registered(
            store.clone(),
            cluster::NodeInfo::this_process(owner, SystemClock.now_ms()),
            lease_ms,
            stop.clone(),
        ));
        let mcp_servers = runner.mcp().clone();
        let state = Arc::new(Shared {
            store: store.clone(),
            runner,
            config: options.config,
            token: options.token,
            heartbeat: options.heartbeat,
            started_at: SystemClock.now_ms(),
            lease_ms,
            bus,
            auth_failures: server::AuthFailures::default(),
            root,
            tls: options.tls.is_some(),
            cors: options.cors_origins,
        });
        if let Some((listener, address)) = metrics {
            tracing::info!(%address, "metrics served without the token on /metrics");
            let app = server::metrics_router(state.clone());
            let stopped = stop.clone();
            tokio::spawn(async move {
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(async move { stopped.cancelled().await })
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "serving the metrics failed");
                }
            });
        }
        let app = server::router(state, &options.limits);
        let stopped = stop.clone();
        let until_stopped = async move { stopped.cancelled().await };
        let serving = async move {
            match options.tls {
                None => serve(listener, app, until_stopped).await,
                Some(config) => {
                    let listener = server::tls::Listener::new(listener, config)?;
                    // Tapped so the peer address reaches the handlers as for plain HTTP.
                    let listener = axum::serve::ListenerExt::tap_io(listener, |_| {});
                    serve(listener, app, until_stopped).await
                }
            }
        };
        let grace = options.grace;
        let served = tokio::select! {
            served = serving => served.map_err(Error::Serve),
            // Open event streams never end by themselves; give requests a moment, then go.
            () = async { stop.cancelled().await; tokio::time::sleep(grace).await } => Ok(()),
        };
        stop.cancel();
        recovering.abort();
        match stopping.await {
            Ok(0) => {}
            Ok(stopped) => {
                tracing::info!(stopped, "steps still running after the grace were stopped")
            }
            Err(e) => tracing::warn!(error = %e, "stopping the runner failed"),
        }
        renewal.cancel();
        renewing.abort();
        // No step runs any more: the MCP servers can go (child processes are killed).
        mcp_servers.shut_down().await;
        // The node leaves the list (bounded: a database that does not answer must not hold
        // the shutdown).
        drop(tokio::time::timeout(Duration::from_secs(2), registered).await);
        // Hand the claims back at once, so a restarted keel recovers them without waiting.
        let expired = store
            .write(move |c| execution::expire_all(c, SystemClock.now_ms(), owner))
            .await?;
        tracing::info!(expired, "claims handed back");
        served
    }
}

/// Serves `app` on `listener` until `stop` resolves, with the peer's address available to
/// the handlers (`ConnectInfo<SocketAddr>`).
async fn serve<L>(
    listener: L,
    app: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
    SocketAddr: for<'a> axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, L>>,
{
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
}

/// The address `listener` (bound for `wanted`) really has.
fn local_address(listener: &TcpListener, wanted: SocketAddr) -> Result<SocketAddr, Error> {
    listener.local_addr().map_err(|source| Error::Bind {
        address: wanted,
        source,
    })
}

/// Says at start-up how sandboxed commands will fare: refused everywhere when the kernel
/// cannot sandbox, or in the session directories that hold Keel's own files.
fn report_sandbox(
    agents: &HashMap<String, crate::runner::Agent>,
    protected: &tool::sandbox::Protected,
    root: &Path,
) {
    let sandboxed: Vec<&str> = agents
        .iter()
        .filter(|(_, a)| a.sandbox != tool::sandbox::Mode::Off)
        .map(|(name, _)| name.as_str())
        .collect();
    if sandboxed.is_empty() {
        tracing::warn!("every agent has sandbox = \"off\": bash runs with Keel's own rights");
        return;
    }
    match tool::sandbox::status() {
        Ok(abi) => tracing::info!(landlock_abi = abi, "bash runs sandboxed (Landlock)"),
        Err(reason) => tracing::warn!(
            agents = ?sandboxed,
            "bash cannot be sandboxed here ({reason}), so the bash calls of these agents \
             will be refused; give an agent sandbox = \"off\" in keel.toml to run its \
             commands unconfined"
        ),
    }
    if let Some(db) = protected.database.last().filter(|p| p.starts_with(root)) {
        tracing::warn!(
            database = %db.display(),
            "the database is inside the sessions' root: sandboxed bash calls will be \
             refused in session directories that hold it; keep it elsewhere (--db)"
        );
    }
    if let Some(config) = protected.config.as_ref().filter(|p| p.starts_with(root)) {
        tracing::warn!(
            config = %config.display(),
            "the configuration is inside the sessions' root: sandboxed commands in a \
             session directory that holds it can read and change it"
        );
    }
}
