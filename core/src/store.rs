//! The store: Keel's database, on SQLite (embedded, the default) or PostgreSQL.
//!
//! It owns the connection handling and nothing of the domain: the event log and its
//! projections live in [`crate::event`], the inbox in [`crate::inbox`]. They are written as
//! plain synchronous functions over a [`Conn`], which compose into one transaction, and
//! run through [`Store::write`] or [`Store::read`].
//!
//! Invariants:
//! - Blocking database work never runs on the async runtime's threads: writes run on one
//!   writer thread per store, reads on `spawn_blocking` with a pooled connection.
//! - Writes are group-committed: the writer takes every write waiting (up to a batch
//!   limit), runs each in its own savepoint inside one transaction, and commits once.
//!   Writes run in submission order, so one session's events are never reordered, and a
//!   failing write rolls back alone. A caller hears of its write only after the commit.
//! - Migrations are embedded and run on open, under a lock, so two processes opening a
//!   new database at once do not both migrate; a database migrated by a newer Keel is
//!   refused.

pub(crate) mod column;
mod conn;
mod deferred;
pub(crate) mod fixed;
mod migrate;
pub mod schema;
mod url;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use diesel::r2d2::Pool;
use keel_schema::event::DecodeError;
use keel_schema::id::{EventId, SessionId};

pub use conn::{Conn, Synchronous};
pub(crate) use conn::{Direct, is_in_savepoint, load_at_most, on_backend};
pub use deferred::Durable;
pub use url::DbUrl;
pub(crate) use writer::doubt_gathered;

use crate::clock::{SharedClock, SystemClock};

/// What can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "`{0}` is not a database URL: use sqlite://PATH (e.g. sqlite://keel.db) or \
         postgres://user@host:port/db"
    )]
    BadUrl(String),
    #[error("could not open the database at {url}: {message}")]
    Connect { url: String, message: String },
    #[error(
        "the database at {url} was migrated by a newer keel (it has schema migration {version}, \
         and this keel knows migrations up to {newest}): upgrade keel to open it"
    )]
    NewerSchema {
        url: String,
        version: String,
        newest: String,
    },
    #[error("migrating the database at {url} failed: {message}")]
    Migration { url: String, message: String },
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    #[error("the read pool has no connection to give: {0}")]
    Pool(#[source] diesel::r2d2::PoolError),
    #[error("a read's task failed: {0}")]
    ReadTask(#[source] tokio::task::JoinError),
    #[error("the write was not committed: {0}")]
    CommitFailed(String),
    #[error("the store's writer stopped before the write was made")]
    WriterGone,
    #[error("no session {0}")]
    SessionNotFound(SessionId),
    #[error("session {0} already exists")]
    SessionExists(SessionId),
    #[error("session {0} is deleted; its log takes no more events")]
    SessionDeleted(SessionId),
    #[error("event id {0} is already in the log")]
    DuplicateEventId(EventId),
    #[error("event {key} cannot be applied to session {session}: {reason}")]
    Projection {
        session: SessionId,
        key: String,
        reason: String,
    },
    #[error("event {seq} of session {session} cannot be read: {source}")]
    Decode {
        session: SessionId,
        seq: u64,
        #[source]
        source: DecodeError,
    },
    #[error("a stored row is not what Keel writes: {0}")]
    Corrupt(String),
}

impl Error {
    /// Whether the database could not be reached or the write not made, rather than the
    /// request being wrong: the same request may succeed later (HTTP 503).
    pub fn is_unavailable(&self) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as Db};
        match self {
            Self::Connect { .. } | Self::Pool(_) | Self::CommitFailed(_) | Self::WriterGone => true,
            Self::Database(Db::DatabaseError(kind, _)) => matches!(
                kind,
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand
            ),
            _ => false,
        }
    }
}

/// How to open a store.
#[derive(Debug, Clone)]
pub struct Options {
    /// SQLite's `synchronous` setting. `Full` (the default) survives power loss;
    /// `Normal` survives a killed process but may lose the last commits on power loss.
    pub synchronous: Synchronous,
    /// How long a SQLite connection waits for a lock before failing, in milliseconds.
    pub busy_timeout_ms: u32,
    /// Connections for reads.
    pub read_connections: u32,
    /// The most writes committed in one transaction.
    pub max_batch: usize,
    /// Time for event stamps.
    pub clock: SharedClock,
    /// Makes chosen commits fail, for fault-injection tests.
    pub failpoint: Option<Failpoint>,
    /// How long the writer waits, with a deferred commit not yet on disk, for a synced
    /// commit to take it along before syncing it itself ([`Store::write_deferred`]).
    pub flush_delay: std::time::Duration,
    /// Writer threads, each with its own connection, on PostgreSQL (SQLite has one: its
    /// database takes one writer at a time). A session's writes all go to the same one
    /// ([`Store::write_for`]), so several sessions commit at once, each batch a round
    /// trip per statement to the server, as several nodes' writers do. At most 64.
    pub pg_writers: usize,
}

/// Decides, given the ordinal of a commit (0, 1, 2 …), whether it fails. A failed commit
/// rolls its transaction back and fails every write in it, as a real commit failure would.
#[derive(Clone)]
pub struct Failpoint(pub Arc<dyn Fn(u64) -> bool + Send + Sync>);

impl std::fmt::Debug for Failpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Failpoint")
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::Full,
            busy_timeout_ms: 5_000,
            read_connections: 4,
            max_batch: 256,
            clock: Arc::new(SystemClock),
            failpoint: None,
            flush_delay: DEFAULT_FLUSH_DELAY,
            pg_writers: DEFAULT_PG_WRITERS,
        }
    }
}

/// The default [`Options::pg_writers`].
pub const DEFAULT_PG_WRITERS: usize = 4;

/// The default [`Options::flush_delay`]: longer than a runner takes from a step's
/// boundary to its first commit with a model that answers at once, far shorter than any
/// real model takes to answer.
pub const DEFAULT_FLUSH_DELAY: std::time::Duration = std::time::Duration::from_millis(2);

/// Counters of the writer's work, for benchmarks and logs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Transactions committed (or attempted).
    pub batches: AtomicU64,
    /// Writes run inside them.
    pub writes: AtomicU64,
    /// Commits that reached the disk before answering (at SQLite's `NORMAL`: that would
    /// have), and syncs of deferred commits.
    pub syncs: AtomicU64,
    /// Batches run again because a session's counter, remembered from an earlier batch,
    /// had moved outside it, or a write failed after events were numbered from one before
    /// any statement checked it (PostgreSQL, [`crate::event::counters`]).
    pub stale: AtomicU64,
}

/// A handle to an open store. Cheap to clone; the writer stops when the last handle goes.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    url: DbUrl,
    clock: SharedClock,
    /// The writers: one on SQLite, [`Options::pg_writers`] on PostgreSQL.
    writers: Vec<writer::Handle>,
    /// Events of deferred commits not yet on disk, held back from the log's readers.
    horizon: Arc<deferred::Horizon>,
    readers: Pool<conn::Manager>,
    stats: Arc<Stats>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("url", &self.inner.url)
            .finish()
    }
}

impl Store {
    /// Opens (creating and migrating as needed) the database at `url`.
    pub async fn open(url: DbUrl, options: Options) -> Result<Self, Error> {
        let shown = url.to_string();
        tokio::task::spawn_blocking(move || Self::open_blocking(url, options))
            .await
            .map_err(|e| Error::Connect {
                url: shown,
                message: format!("the opening task failed: {e}"),
            })?
    }

    fn open_blocking(url: DbUrl, options: Options) -> Result<Self, Error> {
        let settings = conn::Settings {
            url: url.clone(),
            synchronous: options.synchronous,
            busy_timeout_ms: options.busy_timeout_ms,
        };
        let mut connection = settings.establish()?;
        if let Conn::Sqlite(_) = connection {
            conn::enable_wal(&mut connection, &url, options.busy_timeout_ms)?;
        }
        migrate::run(&mut connection, &url)?;
        let readers = Pool::builder()
            .max_size(options.read_connections.max(1))
            .min_idle(Some(1))
            .build(conn::Manager(settings.clone()))
            .map_err(|e| Error::Connect {
                url: url.to_string(),
                message: e.to_string(),
            })?;
        let stats = Arc::new(Stats::default());
        let horizon = Arc::new(deferred::Horizon::default());
        // Deferring a sync is worth it only where commits wait for one: a SQLite file at
        // `FULL` (whose write-ahead log the writer then syncs itself).
        let wal = match &url {
            DbUrl::Sqlite(path) if options.synchronous == Synchronous::Full => {
                let mut wal = path.clone().into_os_string();
                wal.push("-wal");
                Some(std::path::PathBuf::from(wal))
            }
            _ => None,
        };
        let count = match &url {
            DbUrl::Sqlite(_) => 1,
            DbUrl::Postgres(_) => options.pg_writers.clamp(1, crate::metrics::WRITERS),
        };
        // The first writer takes the connection that migrated; only SQLite defers, and
        // it has one writer.
        let mut migrated = Some((connection, wal));
        let mut writers = Vec::with_capacity(count);
        for index in 0..count {
            let (connection, wal) = match migrated.take() {
                Some(first) => first,
                None => (settings.establish()?, None),
            };
            let deferral = writer::Deferral {
                wal,
                horizon: horizon.clone(),
                flush_delay: options.flush_delay,
            };
            writers.push(writer::spawn(
                index,
                connection,
                settings.clone(),
                options.max_batch,
                stats.clone(),
                options.failpoint.clone(),
                deferral,
            )?);
        }
        tracing::info!(%url, writers = count, "store open");
        Ok(Self {
            inner: Arc::new(Inner {
                url,
                clock: options.clock,
                writers,
                horizon,
                readers,
                stats,
            }),
        })
    }

    /// The database this store uses.
    pub fn url(&self) -> &DbUrl {
        &self.inner.url
    }

    /// The store's clock.
    pub fn clock(&self) -> &SharedClock {
        &self.inner.clock
    }

    /// The writer's counters.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.inner.stats.batches.load(Ordering::Relaxed),
            self.inner.stats.writes.load(Ordering::Relaxed),
        )
    }

    /// How many batches ran again for a remembered counter that had moved, or might have
    /// ([`Stats::stale`]).
    pub fn stale_reruns(&self) -> u64 {
        self.inner.stats.stale.load(Ordering::Relaxed)
    }

    /// How many times the writer waited for the disk ([`Stats::syncs`]).
    pub fn syncs(&self) -> u64 {
        self.inner.stats.syncs.load(Ordering::Relaxed)
    }

    /// Runs `write` on a writer thread, in a group-committed transaction. An `Err` undoes
    /// this write alone. Resolves after the commit. A write about one session goes
    /// through [`Store::write_for`] instead, which keeps it in order with the session's
    /// other writes; this one goes to the first writer.
    ///
    /// `write` may run more than once: on PostgreSQL, a batch the database aborts to
    /// resolve a conflict with another node's transaction runs again from its start. It
    /// must do nothing but its statements (no side effect outside the transaction).
    ///
    /// `write` is boxed into the writer's job when this is called and sent when the
    /// future is first polled; the future holds only the job and the reply's receiver.
    /// A future that held the closure would carry it in every caller that awaits it
    /// (an `async fn` keeps its own copy of what it was called with), and a runner's
    /// step, held as long as it streams, would pay for that in every session.
    pub fn write<T, E, F>(&self, write: F) -> impl Future<Output = Result<T, E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        self.inner.writers[0].submit(None, write)
    }

    /// [`Store::write`] for a write about `session`: every write of a session goes to the
    /// same writer, so they commit in the order they were submitted, while on PostgreSQL
    /// other sessions' writes commit at the same time on other writers.
    pub fn write_for<T, E, F>(
        &self,
        session: SessionId,
        write: F,
    ) -> impl Future<Output = Result<T, E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        self.writer_of(session).submit(Some(session), write)
    }

    /// How many writers commit this store's writes ([`Options::pg_writers`]).
    pub fn writers(&self) -> usize {
        self.inner.writers.len()
    }

    /// The writer of `session`'s writes.
    fn writer_of(&self, session: SessionId) -> &writer::Handle {
        let writers = &self.inner.writers;
        // The id's random part spreads sessions evenly.
        let index = session.ulid().random() % writers.len() as u128;
        &writers[usize::try_from(index).unwrap_or(0)]
    }

    /// Waits for an empty write to commit on every writer: whether all of them can.
    pub async fn check_writers(&self) -> Result<(), Error> {
        for writer in &self.inner.writers {
            writer.submit(None, |_| Ok::<_, Error>(())).await?;
        }
        Ok(())
    }

    /// Runs `write` for `session` like [`Store::write`], but answers once it is committed,
    /// before it is on disk: the [`Durable`] says when it gets there (see
    /// [`deferred`](self::deferred) for what holds meanwhile). Until then the session's
    /// events from this write on are held back from [`Store::read_log`].
    ///
    /// For a caller that must do something before the next commit that has to be
    /// durable, and nothing irreversible on this one's account: a runner's step boundary,
    /// followed by the model's request. Where commits do not wait for the disk (SQLite at
    /// `NORMAL`) or cannot be held back from readers (PostgreSQL), it is an ordinary write.
    pub fn write_deferred<T, E, F>(
        &self,
        session: SessionId,
        write: F,
    ) -> impl Future<Output = Result<(T, Durable), E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        self.writer_of(session).submit_deferred(session, write)
    }

    /// The last seq of `session` that [`Store::read_log`] shows while later events of it
    /// wait for the disk; `None` when none do.
    pub(crate) fn durable_limit(&self, session: SessionId) -> Option<u64> {
        self.inner.horizon.limit(session)
    }

    /// Runs `read` on a pooled connection off the async runtime's threads.
    pub async fn read<T, E, F>(&self, read: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + Send + 'static,
        F: FnOnce(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        let pool = self.inner.readers.clone();
        tokio::task::spawn_blocking(move || {
            let mut connection = pool.get().map_err(Error::Pool)?;
            read(&mut connection)
        })
        .await
        .map_err(|e| E::from(Error::ReadTask(e)))?
    }
}
