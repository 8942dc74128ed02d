//! The run coordinator: at most one drain per key (session) at a time.
//!
//! A *busy period* is one execution: the `started` hook (claiming the session), one or
//! more drains, then the `settled` hook. Behaviour (SPEC section 7; each line is a test):
//!
//! - [`Coordinator::run`] when idle starts a drain with `force = true`; when a drain runs
//!   it joins it; while stopping (cleanup after an interrupt) or settling it waits, then
//!   starts fresh.
//! - [`Coordinator::wake`] when idle starts a drain with `force = false`; when active it
//!   rings a doorbell. Wakes coalesce (scope `Input` wins over `Steer`) into exactly one
//!   follow-up drain, which takes the doorbell's scope.
//! - Joining a wake-started execution never forces a successor.
//! - [`Coordinator::interrupt`] is a no-op returning false when idle or already stopping;
//!   otherwise it clears the doorbell, cancels the drain and returns before cleanup
//!   finishes. After the drain returns, the `cleanup` hook runs; a wake during cleanup
//!   starts one successor afterwards, a run during cleanup starts one with `force = true`.
//! - A joined caller receives exactly the outcome of the drain it joined; a wake racing a
//!   failure still gets its successor. After a failure that ends the busy period
//!   ([`Work::ends_busy_period`]: the claim was lost), that successor is a new busy
//!   period, which claims afresh, not a follow-up drain of the lost one.
//! - Dropping a waiting caller never cancels the execution.
//! - Different keys run concurrently.
//! - Follow-up drains run in a loop, never by recursion: a drain that wakes itself
//!   synchronously 20,000 times runs 20,000 times with a flat stack.
//! - `started` and `settled` run once per busy period; waiters resolve only after
//!   `settled`.
//!
//! In-memory state here is only a cache of who is running what; the claim in the
//! database is the truth, and a lost wake is redriven by recovery.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// What a wake asks a drain to look at. `Input` wins over `Steer` when wakes coalesce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// A steering input arrived: it is promoted at the next step boundary.
    Steer,
    /// An input arrived that may need a new turn.
    Input,
}

/// How a drain was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `true` for an explicit run (resume): drive the session even with nothing pending.
    pub force: bool,
    /// The coalesced scope of the wakes that asked for this drain, if any did.
    pub scope: Option<Scope>,
}

/// A boxed future borrowing the work.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the coordinator runs.
pub trait Work: Send + Sync + 'static {
    type Key: Clone + Eq + Hash + Send + Sync + Debug + 'static;
    type Error: Clone + Send + Sync + Debug + 'static;

    /// Begins a busy period (claims the key's execution).
    fn started<'a>(&'a self, key: &'a Self::Key) -> BoxFuture<'a, Result<(), Self::Error>>;
    /// Runs one drain. `cancel` is cancelled by an interrupt; the drain then stops at its
    /// next await point and finishes its own cleanup before returning.
    fn drain<'a>(
        &'a self,
        key: &'a Self::Key,
        request: Request,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<(), Self::Error>>;
    /// Runs after an interrupted drain (and its finalizers) returned.
    fn cleanup<'a>(&'a self, key: &'a Self::Key) -> BoxFuture<'a, Result<(), Self::Error>>;
    /// Ends a busy period with the outcome of its last drain (or of `started` or `cleanup`).
    fn settled<'a>(
        &'a self,
        key: &'a Self::Key,
        outcome: &'a Result<(), Self::Error>,
    ) -> BoxFuture<'a, ()>;
    /// Whether a drain that failed with `error` leaves its busy period unable to go on
    /// (the runner's claim was taken over, say). A wake that came meanwhile then starts a
    /// new busy period, which begins with `started` again, instead of a follow-up drain
    /// of this one. None does by default.
    fn ends_busy_period(&self, error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// Why [`Coordinator::run`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError<E: Debug> {
    /// The drain the caller joined (or `started`/`cleanup`) failed.
    #[error("execution failed: {0:?}")]
    Failed(E),
    /// The coordinator's task ended without an outcome (it panicked).
    #[error("the execution was abandoned without an outcome")]
    Abandoned,
}

type Waiter<E> = oneshot::Sender<Result<(), E>>;

/// Waiters of finished drains with their outcomes, answered once the busy period settled.
type Delivered<E> = Vec<(Waiter<E>, Result<(), E>)>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Running,
    /// Interrupted: the drain is finishing, then cleanup runs.
    Stopping,
    /// The busy period is ending (`settled` runs).
    Settling,
}

struct Entry<E> {
    stage: Stage,
    cancel: CancellationToken,
    doorbell: Option<Scope>,
    /// A run registered while stopping or settling: the next drain is forced.
    resume: bool,
    /// Callers waiting on the current drain.
    joined: Vec<Waiter<E>>,
    /// Callers waiting on the next busy period (registered while stopping or settling).
    next: Vec<Waiter<E>>,
}

impl<E> Entry<E> {
    fn new(joined: Vec<Waiter<E>>) -> Self {
        Self {
            stage: Stage::Running,
            cancel: CancellationToken::new(),
            doorbell: None,
            resume: false,
            joined,
            next: Vec::new(),
        }
    }
}

fn ring(doorbell: &mut Option<Scope>, scope: Scope) {
    *doorbell = Some(doorbell.map_or(scope, |old| old.max(scope)));
}

type Table<W> = Mutex<HashMap<<W as Work>::Key, Entry<<W as Work>::Error>>>;

/// Runs [`Work`] per key. Cheap to clone.
pub struct Coordinator<W: Work> {
    work: Arc<W>,
    table: Arc<Table<W>>,
}

impl<W: Work> Clone for Coordinator<W> {
    fn clone(&self) -> Self {
        Self {
            work: self.work.clone(),
            table: self.table.clone(),
        }
    }
}

impl<W: Work> Coordinator<W> {
    pub fn new(work: W) -> Self {
        Self {
            work: Arc::new(work),
            table: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    pub fn work(&self) -> &Arc<W> {
        &self.work
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<W::Key, Entry<W::Error>>> {
        lock(&self.table)
    }

    /// Runs the key's execution (forced) or joins the running drain; resolves with that
    /// drain's outcome once its busy period has settled.
    pub fn run(
        &self,
        key: W::Key,
    ) -> impl Future<Output = Result<(), RunError<W::Error>>> + Send + 'static {
        let (waiter, outcome) = oneshot::channel();
        let start = {
            let mut table = self.lock();
            match table.get_mut(&key) {
                None => {
                    let entry = Entry::new(vec![waiter]);
                    let cancel = entry.cancel.clone();
                    table.insert(key.clone(), entry);
                    Some(cancel)
                }
                Some(entry) if entry.stage == Stage::Running => {
                    entry.joined.push(waiter);
                    None
                }
                Some(entry) => {
                    entry.resume = true;
                    entry.next.push(waiter);
                    None
                }
            }
        };
        if let Some(cancel) = start {
            self.spawn(
                key,
                Request {
                    force: true,
                    scope: None,
                },
                cancel,
            );
        }
        async move {
            match outcome.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(RunError::Failed(e)),
                Err(_) => Err(RunError::Abandoned),
            }
        }
    }

    /// Asks for a drain: starts one when idle, else rings the doorbell.
    pub fn wake(&self, key: W::Key, scope: Scope) {
        let start = {
            let mut table = self.lock();
            match table.get_mut(&key) {
                None => {
                    let entry = Entry::new(Vec::new());
                    let cancel = entry.cancel.clone();
                    table.insert(key.clone(), entry);
                    Some(cancel)
                }
                Some(entry) => {
                    ring(&mut entry.doorbell, scope);
                    None
                }
            }
        };
        if let Some(cancel) = start {
            self.spawn(
                key,
                Request {
                    force: false,
                    scope: Some(scope),
                },
                cancel,
            );
        }
    }

    /// Interrupts the running drain. False when idle, already stopping, or settling.
    pub fn interrupt(&self, key: &W::Key) -> bool {
        let mut table = self.lock();
        match table.get_mut(key) {
            Some(entry) if entry.stage == Stage::Running => {
                entry.stage = Stage::Stopping;
                entry.doorbell = None;
                entry.cancel.cancel();
                true
            }
            Some(_) | None => false,
        }
    }

    /// Whether the key has a busy period in progress.
    pub fn is_busy(&self, key: &W::Key) -> bool {
        self.lock().contains_key(key)
    }

    fn spawn(&self, key: W::Key, first: Request, cancel: CancellationToken) {
        let work = self.work.clone();
        let table = self.table.clone();
        tokio::spawn(async move {
            let guard = Guard::<W> {
                table: table.clone(),
                key: key.clone(),
                done: false,
            };
            drive::<W>(&work, &table, &key, first, cancel).await;
            guard.finish();
        });
    }
}

fn lock<K, V>(table: &Mutex<HashMap<K, V>>) -> MutexGuard<'_, HashMap<K, V>> {
    // A panic while holding this lock can only come from a bug in this module; the map
    // is still consistent (every update is a single assignment), so keep using it.
    table
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Removes the key's entry if the driver task ends without doing so (a panic in a hook
/// or drain), so the key never stays busy forever; its waiters hear `Abandoned`.
struct Guard<W: Work> {
    table: Arc<Table<W>>,
    key: W::Key,
    done: bool,
}

impl<W: Work> Guard<W> {
    fn finish(mut self) {
        self.done = true;
    }
}

impl<W: Work> Drop for Guard<W> {
    fn drop(&mut self) {
        if !self.done {
            tracing::error!(key = ?self.key, "an execution task ended abnormally");
            lock(&self.table).remove(&self.key);
        }
    }
}

/// One key's busy periods, back to back, until nothing is asked of it.
async fn drive<W: Work>(
    work: &W,
    table: &Table<W>,
    key: &W::Key,
    mut first: Request,
    mut cancel: CancellationToken,
) {
    loop {
        let mut delivered: Delivered<W::Error> = Vec::new();
        let outcome = busy_period(work, table, key, first, cancel, &mut delivered).await;
        work.settled(key, &outcome).await;
        for (waiter, result) in delivered {
            // A caller that stopped waiting needs no answer; the execution is unaffected.
            drop(waiter.send(result));
        }
        let mut map = lock(table);
        let Some(entry) = map.get_mut(key) else {
            return;
        };
        if !entry.resume && entry.doorbell.is_none() {
            // Nothing asked while settling: idle. Waiters registered for a next period
            // exist only with `resume`, so none are left behind.
            map.remove(key);
            return;
        }
        first = Request {
            force: std::mem::take(&mut entry.resume),
            scope: entry.doorbell.take(),
        };
        entry.stage = Stage::Running;
        entry.cancel = CancellationToken::new();
        cancel = entry.cancel.clone();
        entry.joined = std::mem::take(&mut entry.next);
    }
}

/// `started`, drains while the doorbell rings, and cleanup after an interrupt. Returns
/// the busy period's outcome; the waiters of each drain are queued in `delivered`.
async fn busy_period<W: Work>(
    work: &W,
    table: &Table<W>,
    key: &W::Key,
    first: Request,
    cancel: CancellationToken,
    delivered: &mut Delivered<W::Error>,
) -> Result<(), W::Error> {
    let take_joined = |delivered: &mut Vec<_>, result: &Result<(), W::Error>| -> Stage {
        let mut map = lock(table);
        let Some(entry) = map.get_mut(key) else {
            return Stage::Settling;
        };
        for waiter in entry.joined.drain(..) {
            delivered.push((waiter, result.clone()));
        }
        entry.stage
    };
    if let Err(e) = work.started(key).await {
        let result = Err(e);
        take_joined(delivered, &result);
        settle_stage::<W>(table, key);
        return result;
    }
    let mut request = first;
    loop {
        let result = work.drain(key, request, cancel.clone()).await;
        match take_joined(delivered, &result) {
            Stage::Stopping => {
                let cleaned = work.cleanup(key).await;
                settle_stage::<W>(table, key);
                return match (result, cleaned) {
                    (_, Err(e)) => Err(e),
                    (result, Ok(())) => result,
                };
            }
            Stage::Running | Stage::Settling => {
                let mut map = lock(table);
                let Some(entry) = map.get_mut(key) else {
                    return result;
                };
                let over = matches!(&result, Err(e) if work.ends_busy_period(e));
                match entry.doorbell {
                    // The doorbell stays rung for the next busy period (see `drive`).
                    Some(scope) if !over => {
                        entry.doorbell = None;
                        request = Request {
                            force: false,
                            scope: Some(scope),
                        };
                    }
                    Some(_) | None => {
                        entry.stage = Stage::Settling;
                        return result;
                    }
                }
            }
        }
    }
}

fn settle_stage<W: Work>(table: &Table<W>, key: &W::Key) {
    if let Some(entry) = lock(table).get_mut(key) {
        entry.stage = Stage::Settling;
    }
}

#[cfg(test)]
mod tests;
