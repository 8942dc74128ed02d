//! Deferred durability: a commit that is visible at once and reaches the disk with the
//! next one that must.
//!
//! At `synchronous = FULL` every SQLite commit waits for the write-ahead log's fsync. Some
//! commits need not: nothing acts on them irreversibly before the next commit that must
//! be durable anyway. A runner's step boundary is such a commit: the step's model request
//! follows it, and the next thing that must be on disk, the model's tool call, is
//! committed before the tool runs. Deferring the boundary's sync makes a tool-using step
//! one fsync instead of two.
//!
//! What stays true:
//! - A deferred commit survives a killed process at once: its pages are in the write-ahead
//!   log, in the kernel's cache. Only a power loss (or a kernel crash) before its sync can
//!   lose it, and then it is lost with everything after it, never with a hole: the log is
//!   replayed up to its last intact commit, so a durable commit implies every earlier one.
//! - It becomes durable with the writer's next synced commit that writes anything, or by
//!   a sync of the log file after [`Options::flush_delay`](super::Options) with no such
//!   commit, whichever comes first. [`Durable`] tells its caller when.
//! - Until then its events are held back from readers of the log ([`Horizon`], used by
//!   [`Store::read_log`](super::Store::read_log)), and the runner publishes them live only
//!   once durable, so no client is ever shown an event a power loss could take back.
//!
//! Only a SQLite file at `synchronous = FULL` defers. On PostgreSQL every commit is
//! durable when it answers (other nodes read the rows at once, so they cannot be held
//! back), and at `NORMAL` no commit waits for the disk: there a deferred write is an
//! ordinary one, durable as soon as it answers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use keel_schema::id::SessionId;
use tokio::sync::oneshot;

use super::{Error, Stats};

/// Told to a deferred write's caller once its commit is on disk, or why it is not.
pub(super) type SyncWaiter = oneshot::Sender<Result<(), String>>;

/// When a deferred write reaches the disk.
#[derive(Debug)]
pub struct Durable(Option<oneshot::Receiver<Result<(), String>>>);

impl Durable {
    /// A write that was durable when it answered.
    pub(crate) fn now() -> Self {
        Self(None)
    }

    pub(crate) fn later(receiver: oneshot::Receiver<Result<(), String>>) -> Self {
        Self(Some(receiver))
    }

    /// Whether the write is known to be durable already.
    pub fn is_durable(&mut self) -> bool {
        match &mut self.0 {
            None => true,
            Some(receiver) => {
                if matches!(receiver.try_recv(), Ok(Ok(()))) {
                    self.0 = None;
                    true
                } else {
                    false
                }
            }
        }
    }

    /// Waits until the write is on disk. An error means the sync failed: the write is
    /// committed, but a power loss may still take it back.
    pub async fn wait(self) -> Result<(), Error> {
        let Some(receiver) = self.0 else {
            return Ok(());
        };
        match receiver.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(message)) => Err(Error::CommitFailed(message)),
            Err(_) => Err(Error::WriterGone),
        }
    }
}

/// Per session, the last seq known to be on disk while later events of it are not:
/// readers of the log stop there.
#[derive(Debug, Default)]
pub(super) struct Horizon(Mutex<HashMap<SessionId, u64>>);

impl Horizon {
    /// The last seq of `session` a reader may be shown, if any of its events wait for a
    /// sync.
    pub(super) fn limit(&self, session: SessionId) -> Option<u64> {
        self.lock().get(&session).copied()
    }

    /// Holds `session`'s events after `durable` back, unless an earlier hold stands.
    pub(super) fn hold(&self, session: SessionId, durable: u64) {
        self.lock().entry(session).or_insert(durable);
    }

    /// Everything committed is on disk.
    pub(super) fn release_all(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, u64>> {
        // The map is valid after any panic: every operation is one call on it.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The writer's deferred commits that are not yet on disk.
pub(super) struct Unsynced {
    /// The write-ahead log to sync, when this store defers at all.
    wal: Option<PathBuf>,
    horizon: Arc<Horizon>,
    /// The callers of deferred writes, to tell when their commit is on disk.
    waiting: Vec<SyncWaiter>,
}

impl Unsynced {
    pub(super) fn new(wal: Option<PathBuf>, horizon: Arc<Horizon>) -> Self {
        Self {
            wal,
            horizon,
            waiting: Vec::new(),
        }
    }

    /// Whether this store defers syncs (a SQLite file at `FULL`).
    pub(super) fn defers(&self) -> bool {
        self.wal.is_some()
    }

    pub(super) fn horizon(&self) -> &Horizon {
        &self.horizon
    }

    /// Whether a deferred commit waits for its sync.
    pub(super) fn pending(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// A deferred commit's caller, to tell once it is on disk.
    pub(super) fn wait_for_sync(&mut self, caller: SyncWaiter) {
        self.waiting.push(caller);
    }

    /// A synced commit that wrote to the log reached the disk, and with it every earlier
    /// commit.
    pub(super) fn synced(&mut self) {
        self.horizon.release_all();
        for caller in self.waiting.drain(..) {
            // A caller that stopped waiting needs no answer.
            drop(caller.send(Ok(())));
        }
    }

    /// Syncs the write-ahead log: every deferred commit is then on disk (counted in
    /// `stats`). A failure is
    /// told to the callers and logged; the holds stay, so readers are still not shown the
    /// events, until a later synced commit succeeds.
    pub(super) fn sync(&mut self, stats: &Stats) {
        let Some(wal) = &self.wal else {
            return;
        };
        // fsync works on the file, whichever descriptor asks: SQLite's own writes, made
        // through its descriptor, are flushed by this one.
        let synced = std::fs::File::open(wal).and_then(|file| file.sync_data());
        match synced {
            Ok(()) => {
                // Counted before anyone hears of it.
                stats.syncs.fetch_add(1, Ordering::Relaxed);
                self.synced();
            }
            Err(e) => {
                let message = format!("syncing the write-ahead log {} failed: {e}", wal.display());
                tracing::error!(%message, commits = self.waiting.len(), "deferred commits are not on disk");
                for caller in self.waiting.drain(..) {
                    drop(caller.send(Err(message.clone())));
                }
            }
        }
    }
}
