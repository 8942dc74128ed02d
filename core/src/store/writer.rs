//! The writer thread: group commit.
//!
//! Writes arrive on a bounded channel. The thread takes the first, then every write
//! already waiting (up to the batch limit), begins one transaction (`BEGIN IMMEDIATE` on
//! SQLite, so it never fails to upgrade a read lock), runs the writes, commits, and only
//! then tells each caller its result. A write whose closure fails leaves the others
//! intact; a failed commit fails them all.
//!
//! Writes rarely fail, so a batch first runs them plainly, one after another, the event
//! rows they append gathered and inserted together before the commit
//! ([`crate::event::rows`]) and, on PostgreSQL, the counters of the sessions they are for
//! moved in memory and written back together ([`crate::event::counters`]). What a write
//! does inside a savepoint of its own is not gathered; should gathered rows or counters
//! be written inside one, the batch runs again gathering nothing, since rolling that
//! savepoint back would have undone them unseen. Should a write fail (or the gathered
//! rows be refused), the transaction is rolled back (undoing whatever had been done),
//! and the batch runs again with each write in its own savepoint (prepared statements,
//! see [`in_savepoint`]) and its rows inserted and counters moved as it appends, where a
//! failing write rolls back to its savepoint alone. A savepoint's two statements are a
//! good share of a write (an append is three or four), so they are paid only by a batch
//! that needs them; a batch of one write never does: rolling the transaction back undoes
//! exactly that write. Running a batch again relies on what conflicts rely on too
//! (below): a write is a closure that may run more than once.

//! When the transaction cannot even begin (the database dropped the connection: a
//! restart, a failover), no write has run, so the writer reconnects, waiting for the
//! database as long as it takes, and tries the same writes once more.
//!
//! On PostgreSQL, a batch can conflict with another node's: two batches that lock the
//! same sessions in opposite orders deadlock, and the database aborts one of them. Such a
//! conflict says nothing about the writes themselves, so the whole batch is rolled back
//! and run again, after a short randomised pause, up to [`CONFLICT_ATTEMPTS`] times; only
//! then do its writes fail. Rolling back the whole batch (not only the write that hit
//! the conflict) is what releases the locks the other transaction waits for. This is why
//! a write is a closure that may run more than once (`FnMut`): it must do nothing but its
//! statements.
//!
//! Any failed statement ends a PostgreSQL transaction, whose `COMMIT` then rolls back
//! without an error; a write that goes on past one outside a savepoint of its own would
//! have its whole batch told it committed. So after a failed statement in a plain batch
//! the writer asks once whether the transaction can still commit ([`can_commit`]), and
//! if not runs the batch again with savepoints, where that write fails alone.
//!
//! A write may also be deferred ([`super::deferred`]): a batch of nothing but deferred
//! writes commits without waiting for the disk, and its callers hear when it gets there,
//! with the next synced commit that writes anything or when the log is synced after a
//! quiet [`flush_delay`](super::Options::flush_delay).

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use diesel::Connection;
use diesel::connection::{
    AnsiTransactionManager, Instrumentation, InstrumentationEvent, TransactionDepthChange,
    TransactionManager, TransactionManagerStatus,
};
use futures::FutureExt;
use keel_schema::id::SessionId;
use tokio::sync::{mpsc, oneshot};

use super::conn::{Settings, transaction_depth};
use super::deferred::{Durable, Horizon, SyncWaiter, Unsynced};
use super::fixed::fixed_query;
use super::{Conn, Error, Failpoint, Stats};
use crate::event::{counters, rows};

/// One write waiting for the writer.
trait Write: Send {
    /// Runs inside the batch transaction, in its own savepoint when `savepoint`, and keeps
    /// the result for [`Write::finish`]; returns whether it succeeded. Without a savepoint,
    /// a failed write leaves the transaction for the caller to roll back. Running again
    /// (after a conflict rolled the batch back) replaces the kept result.
    fn run(&mut self, connection: &mut Conn, savepoint: bool) -> bool;
    /// Reports the result of the last run, once the batch's commit is known:
    /// `Some(message)` means the commit failed and the write did not happen.
    fn finish(self: Box<Self>, commit_failure: Option<&str>);
    /// Reports that the write never took effect.
    fn fail(self: Box<Self>, message: &str);
    /// The session the write is for, when its caller named one.
    fn session(&self) -> Option<SessionId>;
    /// The session of a deferred write; `None` for a write that must be on disk before
    /// its caller hears of it.
    fn deferred(&self) -> Option<SessionId>;
    /// Where a deferred write's caller waits to hear that its commit is on disk.
    fn take_sync_waiter(&mut self) -> Option<SyncWaiter>;
}

type Job = Box<dyn Write>;

struct Pending<F, T, E> {
    write: F,
    result: Option<Result<T, E>>,
    reply: oneshot::Sender<Result<T, E>>,
    session: Option<SessionId>,
    deferred: Option<(SessionId, Option<SyncWaiter>)>,
}

impl<F, T, E> Write for Pending<F, T, E>
where
    T: Send + 'static,
    E: From<Error> + From<diesel::result::Error> + Send + 'static,
    F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
{
    fn run(&mut self, connection: &mut Conn, savepoint: bool) -> bool {
        let result = if savepoint {
            in_savepoint(connection, &mut self.write)
        } else {
            (self.write)(connection)
        };
        let succeeded = result.is_ok();
        self.result = Some(result);
        succeeded
    }

    fn finish(self: Box<Self>, commit_failure: Option<&str>) {
        let result = match (commit_failure, self.result) {
            (None, Some(result)) => result,
            (Some(message), _) => Err(E::from(Error::CommitFailed(message.to_owned()))),
            (None, None) => Err(E::from(Error::CommitFailed(
                "the write was never run".to_owned(),
            ))),
        };
        // The caller may have stopped waiting; the write's fate is settled either way.
        drop(self.reply.send(result));
    }

    fn fail(self: Box<Self>, message: &str) {
        let error = E::from(Error::CommitFailed(message.to_owned()));
        // As above: a caller that stopped waiting needs no answer.
        drop(self.reply.send(Err(error)));
    }

    fn session(&self) -> Option<SessionId> {
        self.session
    }

    fn deferred(&self) -> Option<SessionId> {
        self.deferred.as_ref().map(|(session, _)| *session)
    }

    fn take_sync_waiter(&mut self) -> Option<SyncWaiter> {
        self.deferred.as_mut().and_then(|(_, waiter)| waiter.take())
    }
}

/// Runs `write` in a savepoint of the batch transaction: an `Err` undoes this write only.
///
/// diesel's nested transactions would do the same, but send `SAVEPOINT` and `RELEASE` as
/// plain SQL that is parsed again for every write; these statements are fixed queries
/// (see [`super::fixed`]), prepared once per connection. A savepoint that cannot be rolled back leaves the
/// transaction in an unknown state, so it panics, which the batch handles like any
/// panicking write: everything in the transaction is rolled back and failed.
fn in_savepoint<T, E>(
    connection: &mut Conn,
    write: impl FnOnce(&mut Conn) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    Savepoint.execute(connection)?;
    let result = write(connection);
    if result.is_ok() {
        match Release.execute(connection) {
            Ok(_) => return result,
            Err(e) => {
                undo_savepoint(connection);
                return Err(E::from(e));
            }
        }
    }
    undo_savepoint(connection);
    result
}

/// Rolls back to the write's savepoint and releases it.
fn undo_savepoint(connection: &mut Conn) {
    let undone = RollbackTo
        .execute(connection)
        .and_then(|_| Release.execute(connection));
    if let Err(e) = undone {
        panic!("a write's savepoint could not be rolled back: {e}");
    }
}

fixed_query! {
    struct Savepoint;
    sql "SAVEPOINT keel_write"
}

fixed_query! {
    struct Release;
    sql "RELEASE SAVEPOINT keel_write"
}

fixed_query! {
    struct RollbackTo;
    sql "ROLLBACK TO SAVEPOINT keel_write"
}

/// How many writes may wait for the writer before callers wait to submit.
const QUEUE: usize = 4096;

/// Submits writes to the writer thread.
pub(super) struct Handle {
    jobs: mpsc::Sender<Job>,
    /// Whether deferred writes are deferred (a SQLite file at `FULL`).
    defers: bool,
}

impl Handle {
    // These box the write's job at once (see `Store::write` for why), and build their
    // futures with combinators: an `async` block that awaits a future it captured
    // holds it twice.

    /// Submits a write, of `session` when it is for one.
    pub fn submit<T, E, F>(
        &self,
        session: Option<SessionId>,
        write: F,
    ) -> impl Future<Output = Result<T, E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        self.send(write, session, None)
    }

    /// Submits a write of `session` whose caller hears of it once committed, and learns
    /// from the [`Durable`] when it is on disk.
    pub fn submit_deferred<T, E, F>(
        &self,
        session: SessionId,
        write: F,
    ) -> impl Future<Output = Result<(T, Durable), E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        let (deferred, synced) = if self.defers {
            let (waiter, synced) = oneshot::channel();
            (Some((session, Some(waiter))), Some(synced))
        } else {
            (None, None)
        };
        self.send(write, Some(session), deferred)
            .map(move |committed| {
                let durable = synced.map_or_else(Durable::now, Durable::later);
                committed.map(|value| (value, durable))
            })
    }

    fn send<T, E, F>(
        &self,
        write: F,
        session: Option<SessionId>,
        deferred: Option<(SessionId, Option<SyncWaiter>)>,
    ) -> impl Future<Output = Result<T, E>> + Send + '_
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnMut(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        let (reply, outcome) = oneshot::channel::<Result<T, E>>();
        let job: Job = Box::new(Pending {
            write,
            result: None,
            reply,
            session,
            deferred,
        });
        async move {
            self.jobs
                .send(job)
                .await
                .map_err(|_| E::from(Error::WriterGone))?;
            outcome.await.unwrap_or(Err(E::from(Error::WriterGone)))
        }
    }
}

/// Where the writer's deferred commits go, and how long it waits before syncing them.
pub(super) struct Deferral {
    /// The write-ahead log to sync: `None` when this store does not defer.
    pub wal: Option<std::path::PathBuf>,
    pub horizon: Arc<Horizon>,
    /// How long the writer waits, with deferred commits not on disk, for a synced commit
    /// to take them along before it syncs them itself.
    pub flush_delay: std::time::Duration,
}

/// Starts writer `index` of its store on `connection`.
pub(super) fn spawn(
    index: usize,
    connection: Conn,
    settings: Settings,
    max_batch: usize,
    stats: Arc<Stats>,
    failpoint: Option<Failpoint>,
    deferral: Deferral,
) -> Result<Handle, Error> {
    let (jobs, receiver) = mpsc::channel(QUEUE);
    let defers = deferral.wal.is_some();
    std::thread::Builder::new()
        .name("keel-store-writer".into())
        .spawn(move || {
            run(
                connection,
                settings,
                receiver,
                (index, max_batch.max(1)),
                &stats,
                failpoint.as_ref(),
                deferral,
            )
        })
        .map_err(|e| Error::Connect {
            url: "writer".into(),
            message: format!("starting the writer thread: {e}"),
        })?;
    Ok(Handle { jobs, defers })
}

/// The writer loop of writer `index`, which commits up to `max_batch` writes at once.
fn run(
    mut connection: Conn,
    settings: Settings,
    mut receiver: mpsc::Receiver<Job>,
    (index, max_batch): (usize, usize),
    stats: &Stats,
    failpoint: Option<&Failpoint>,
    deferral: Deferral,
) {
    let conflicts = Conflicts::default();
    conflicts.watch(&mut connection);
    // Waiting for a write with a deadline (the flush delay) needs a clock: a runtime of
    // this thread's own, used for nothing else.
    let clock = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .inspect_err(|e| tracing::warn!(error = %e, "no timer for the store writer; every commit waits for the disk"))
        .ok();
    let wal = deferral.wal.filter(|_| clock.is_some());
    let mut unsynced = Unsynced::new(wal, deferral.horizon);
    // Whether the connection commits without waiting for the disk (`synchronous = NORMAL`).
    let mut relaxed = false;
    let mut carried: Vec<Job> = Vec::new();
    loop {
        let mut batch = std::mem::take(&mut carried);
        if batch.is_empty() {
            let next = match &clock {
                Some(clock) if unsynced.pending() => {
                    // The timer is made inside the runtime, whose clock it needs.
                    let wait =
                        async { tokio::time::timeout(deferral.flush_delay, receiver.recv()).await };
                    match clock.block_on(wait) {
                        Ok(next) => next,
                        // Quiet for the flush delay: the deferred commits are synced now.
                        Err(_) => {
                            unsynced.sync(stats);
                            continue;
                        }
                    }
                }
                _ => receiver.blocking_recv(),
            };
            match next {
                Some(job) => batch.push(job),
                None => break,
            }
        }
        while batch.len() < max_batch {
            match receiver.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        crate::metrics::store_queue(index, receiver.len());
        let ordinal = stats.batches.fetch_add(1, Ordering::Relaxed);
        let fail = failpoint.is_some_and(|f| (f.0)(ordinal));
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        let deferred = unsynced.defers() && hold_back(&mut connection, &batch, &unsynced);
        if deferred != relaxed {
            let set = if deferred {
                SynchronousNormal.execute(&mut connection)
            } else {
                SynchronousFull.execute(&mut connection)
            };
            match set {
                Ok(_) => relaxed = deferred,
                Err(e) if deferred => {
                    tracing::warn!(error = %e, "could not defer a commit's sync; it waits for the disk");
                }
                Err(e) => {
                    // A connection that cannot be told to wait for the disk is replaced by
                    // a new one, which waits by default.
                    tracing::warn!(error = %e, "could not restore synchronous commits; reconnecting");
                    connection = reconnect(&settings, &conflicts);
                    relaxed = false;
                }
            }
        }
        let mut context = Batch {
            unsynced: &mut unsynced,
            deferred: deferred && relaxed,
            stats,
        };
        carried = match run_batch(&mut connection, batch, fail, &conflicts, &mut context) {
            Ran::Carry(jobs) => jobs,
            // Nothing ran: a connection the database dropped (a restart, a failover) is
            // replaced and the same writes are tried once more on the new one.
            Ran::NotBegun(jobs, message) => {
                tracing::warn!(%message, writes = jobs.len(), "could not begin a write batch; reconnecting");
                connection = reconnect(&settings, &conflicts);
                relaxed = false;
                context.deferred = false;
                match run_batch(&mut connection, jobs, fail, &conflicts, &mut context) {
                    Ran::Carry(jobs) => jobs,
                    Ran::NotBegun(jobs, message) => {
                        tracing::error!(%message, writes = jobs.len(), "write batch failed");
                        for job in jobs {
                            job.fail(&message);
                        }
                        Vec::new()
                    }
                }
            }
        };

        if <Conn as Connection>::TransactionManager::is_broken_transaction_manager(&mut connection)
        {
            connection = reconnect(&settings, &conflicts);
            relaxed = false;
        }
    }
    if unsynced.pending() {
        unsynced.sync(stats);
    }
    tracing::debug!(url = %settings.url, "store writer stopped");
}

/// Whether `batch` may commit without waiting for the disk: every write in it is
/// deferred. Its sessions' events are then held back from readers from their last seq on
/// disk (unless an earlier hold stands); a session that cannot be looked up makes the
/// batch wait for the disk instead.
fn hold_back(connection: &mut Conn, batch: &[Job], unsynced: &Unsynced) -> bool {
    use diesel::{OptionalExtension, QueryDsl, RunQueryDsl};

    use super::schema::session;

    let Some(sessions) = batch
        .iter()
        .map(|job| job.deferred())
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    for id in sessions {
        if unsynced.horizon().limit(id).is_some() {
            continue;
        }
        // Everything committed before this batch is on disk, or held back already.
        let last = session::table
            .find(id.to_string())
            .select(session::last_seq)
            .get_result::<i64>(connection)
            .optional();
        match last {
            Ok(last) => unsynced
                .horizon()
                .hold(id, last.map_or(0, |seq| u64::try_from(seq).unwrap_or(0))),
            Err(e) => {
                tracing::warn!(error = %e, "could not read a session's last seq; the commit waits for the disk");
                return false;
            }
        }
    }
    true
}

/// What a batch's commit changes beyond its writes.
struct Batch<'a> {
    unsynced: &'a mut Unsynced,
    /// The batch commits without waiting for the disk.
    deferred: bool,
    stats: &'a Stats,
}

impl Batch<'_> {
    /// Whether a synced commit should be checked for writing anything: only a commit
    /// that writes syncs the log, and deferred commits wait for one that does.
    fn counts_changes(&self) -> bool {
        !self.deferred && self.unsynced.pending()
    }

    /// The batch committed; `wrote` says whether a synced commit wrote anything (`None`:
    /// not checked).
    fn committed(&mut self, batch: &mut [Job], wrote: Option<bool>) {
        if self.deferred {
            for job in batch {
                if let Some(waiter) = job.take_sync_waiter() {
                    self.unsynced.wait_for_sync(waiter);
                }
            }
            return;
        }
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        if wrote != Some(false) {
            self.unsynced.synced();
        }
        // A deferred write that rode with synced ones is on disk with them (or wrote
        // nothing that could be lost).
        for job in batch {
            if let Some(waiter) = job.take_sync_waiter() {
                drop(waiter.send(Ok(())));
            }
        }
    }
}

/// The connection's count of rows changed since it opened (SQLite; `None` elsewhere or
/// when it cannot be read).
fn total_changes(connection: &mut Conn) -> Option<i64> {
    use diesel::RunQueryDsl;
    match connection {
        Conn::Sqlite(c) => TotalChanges.get_result(c).ok(),
        Conn::Pg(_) => None,
    }
}

fixed_query! {
    struct TotalChanges;
    returns diesel::sql_types::BigInt;
    sql "SELECT total_changes()"
}

/// How many times a batch runs before a conflict with another transaction fails it.
pub(super) const CONFLICT_ATTEMPTS: u32 = 8;

/// What running a batch left to do.
enum Ran {
    /// The writes it did not get to (after a panic), to run next.
    Carry(Vec<Job>),
    /// The transaction could not begin, so no write ran: all of them, and why.
    NotBegun(Vec<Job>, String),
}

/// How one attempt at a batch ended. Every variant but `WriteFailed`, `Conflict` and
/// `NotBegun` has ended the transaction for good.
enum Attempt {
    Committed,
    /// The commit failed: no write happened.
    CommitFailed(String),
    /// A write failed outside a savepoint and the transaction was rolled back: the end of
    /// a batch of one write (its caller hears its own error), else the batch runs again
    /// with savepoints.
    WriteFailed,
    /// The gathered event rows (or kept counters) were refused and the transaction was
    /// rolled back: the batch runs again inserting each row with its write.
    FlushFailed(String),
    /// A write went on past a statement that failed outside any savepoint, which ended
    /// the transaction on PostgreSQL, and it was rolled back: the batch runs again with
    /// savepoints.
    Aborted,
    /// Event rows, counters or message edits the batch had gathered or kept may have been
    /// undone or lost unseen, or started from a stale copy ([`doubt_gathered`]), and the
    /// transaction was rolled back: the batch runs again gathering and keeping none.
    Undone,
    /// A failpoint rolled the transaction back.
    Failpoint,
    /// The write at this index panicked; everything was rolled back.
    Panicked(usize),
    /// The database aborted the transaction to resolve a conflict with another one; it
    /// was rolled back and may run again.
    Conflict(String),
    /// A session's counter, remembered from an earlier batch, was not the table's, or a
    /// write or the batch's end failed after events were numbered from one
    /// ([`counters::numbered_from_memory`]); it was rolled back, and runs again reading
    /// its sessions' counters.
    Stale,
    NotBegun(String),
}

/// Runs one batch, again from the start after a conflict.
fn run_batch(
    connection: &mut Conn,
    mut batch: Vec<Job>,
    fail: bool,
    conflicts: &Conflicts,
    context: &mut Batch<'_>,
) -> Ran {
    let started = std::time::Instant::now();
    let changes_before = context
        .counts_changes()
        .then(|| total_changes(connection))
        .flatten();
    let mut attempt = 1;
    let mut mode = Mode::PLAIN;
    let ended = loop {
        match attempt_batch(connection, &mut batch, fail, conflicts, mode) {
            Attempt::WriteFailed if batch.len() > 1 => mode = Mode::CAREFUL,
            Attempt::FlushFailed(message) => {
                tracing::warn!(%message, writes = batch.len(), "a batch's event rows or counters were refused; running it again row by row");
                mode = Mode {
                    savepoints: batch.len() > 1,
                    gathered: false,
                    kept: false,
                };
            }
            Attempt::Aborted => {
                tracing::warn!(
                    writes = batch.len(),
                    "a write went on past a failed statement, which ended the transaction; running the batch again with savepoints"
                );
                mode = Mode::CAREFUL;
            }
            Attempt::Undone => {
                tracing::debug!(
                    writes = batch.len(),
                    "what the batch gathered may have been undone or lost; running it again gathering nothing"
                );
                mode = Mode {
                    gathered: false,
                    kept: false,
                    ..mode
                };
            }
            Attempt::Conflict(message) if attempt < CONFLICT_ATTEMPTS => {
                tracing::warn!(%message, attempt, writes = batch.len(), "write batch conflicted with another transaction; running it again");
                std::thread::sleep(conflict_pause(attempt));
                attempt += 1;
            }
            Attempt::Stale if attempt < CONFLICT_ATTEMPTS => {
                context.stats.stale.fetch_add(1, Ordering::Relaxed);
                crate::metrics::store_stale_rerun();
                tracing::debug!(
                    attempt,
                    writes = batch.len(),
                    "a batch numbered events from a counter the table no longer has; running it again"
                );
                attempt += 1;
            }
            Attempt::NotBegun(message) => return Ran::NotBegun(batch, message),
            ended => break ended,
        }
    };
    if matches!(ended, Attempt::Committed) {
        crate::metrics::store_committed(batch.len(), started.elapsed());
        // Unknown (the count unreadable) counts as written: SQLite's own count does not
        // fail on a connection that just committed.
        let wrote = changes_before
            .zip(total_changes(connection))
            .map(|(before, after)| after > before);
        // Before any caller hears of its write: a deferred commit is on disk once a synced
        // one after it is.
        context.committed(&mut batch, wrote);
    }
    let failure = match ended {
        Attempt::Committed | Attempt::WriteFailed => None,
        Attempt::CommitFailed(message) => Some(message),
        Attempt::Failpoint => Some("a failpoint made this commit fail".to_owned()),
        Attempt::Stale => {
            let message = format!(
                "the sessions' counters kept moving outside the batch (gave up after {attempt} attempts)"
            );
            tracing::error!(%message, writes = batch.len(), "write batch failed");
            Some(message)
        }
        Attempt::Conflict(message) => {
            let message = format!("{message} (gave up after {attempt} attempts)");
            tracing::error!(%message, writes = batch.len(), "write batch failed");
            Some(message)
        }
        Attempt::Panicked(index) => {
            // The panicking write's caller hears `WriterGone` (its reply is dropped). The
            // writes before it shared its transaction, so they were rolled back and are
            // failed; the writes after it have not run and go into the next batch.
            let rest = batch.split_off(index + 1);
            drop(batch.pop());
            for job in batch {
                job.finish(Some("another write in the same transaction panicked"));
            }
            return Ran::Carry(rest);
        }
        Attempt::NotBegun(_) | Attempt::FlushFailed(_) | Attempt::Undone | Attempt::Aborted => {
            unreachable!("handled above")
        }
    };
    // Without a failure, the last attempt ran every write, so each reports its own result.
    for job in batch {
        job.finish(failure.as_deref());
    }
    Ran::Carry(Vec::new())
}

/// How an attempt runs a batch's writes.
#[derive(Debug, Clone, Copy)]
struct Mode {
    /// Each write in its own savepoint.
    savepoints: bool,
    /// The event rows the writes append gathered and inserted together before the
    /// commit ([`crate::event::rows`]).
    gathered: bool,
    /// With `gathered`, the counters of the sessions the writes are for kept in memory
    /// and written back together before the commit ([`counters`]).
    kept: bool,
}

impl Mode {
    /// How a batch first runs.
    const PLAIN: Self = Self {
        savepoints: false,
        gathered: true,
        kept: true,
    };
    /// After a write failed: each undoes only itself.
    const CAREFUL: Self = Self {
        savepoints: true,
        gathered: false,
        kept: false,
    };
}

thread_local! {
    /// Whether something gathered for the batch running on this thread may have been
    /// undone or lost unseen ([`doubt_gathered`]).
    static DOUBTED: Cell<bool> = const { Cell::new(false) };
}

/// Says that what this thread gathered for its batch (event rows, kept counters,
/// unwritten message edits) may have been undone or lost without the batch seeing it:
/// written inside a write's own savepoint, which may be rolled back, or refused to a
/// write that may go on; or that edits started from a kept message another node had
/// changed. The batch then cannot commit, nor a write's failure be told to it; it runs
/// again gathering nothing.
pub(crate) fn doubt_gathered() {
    DOUBTED.with(|doubted| doubted.set(true));
}

/// Ends an attempt's gathering of event rows and keeping of counters, however the
/// attempt ends.
struct Gathering;

impl Gathering {
    /// Gathers as `mode` says: the event rows, and the counters of the sessions
    /// `batch`'s writes are for ([`counters`]); otherwise rows go in at once and counters
    /// move in the table, as after every attempt.
    fn start(connection: &Conn, batch: &[Job], mode: Mode) -> Self {
        if mode.gathered {
            rows::gather();
            if mode.kept {
                let sessions: Vec<SessionId> =
                    batch.iter().filter_map(|job| job.session()).collect();
                counters::keep(connection, &sessions);
            }
        }
        Self
    }

    /// Writes what was gathered and kept before the commit: the event rows and the
    /// counters (on PostgreSQL by one statement), then the messages the batch's edits left
    /// unwritten. The counters go first: a write-back that finds a remembered counter
    /// moved ends the batch before its edits are written, and otherwise locks the
    /// sessions' rows before their messages', as an append that locks its counter does.
    fn flush(connection: &mut Conn) -> diesel::QueryResult<()> {
        rows::flush_with(connection, counters::flush_with_rows)?;
        crate::event::projector::write_unwritten(connection, None)
    }
}

impl Drop for Gathering {
    fn drop(&mut self) {
        crate::event::projector::forget_unwritten();
        rows::stop();
        counters::end();
        DOUBTED.with(|doubted| doubted.set(false));
    }
}

/// Runs every write of `batch` in one transaction as `mode` says, and commits it.
fn attempt_batch(
    connection: &mut Conn,
    batch: &mut [Job],
    fail: bool,
    conflicts: &Conflicts,
    mode: Mode,
) -> Attempt {
    if let Err(e) = begin(connection) {
        return Attempt::NotBegun(format!("could not begin a transaction: {e}"));
    }
    conflicts.take();
    conflicts.take_failed();
    // The writer's own savepoints are raw statements diesel does not count
    // (`store::is_in_savepoint` would not see them), so a mode that uses them gathers
    // nothing.
    debug_assert!(!(mode.savepoints && mode.gathered));
    let _gathering = Gathering::start(connection, batch, mode);
    let savepoints = mode.savepoints;

    for (index, job) in batch.iter_mut().enumerate() {
        let Ok(succeeded) = catch_unwind(AssertUnwindSafe(|| job.run(connection, savepoints)))
        else {
            rollback_all(connection);
            return Attempt::Panicked(index);
        };
        if conflicts.take() {
            // The transaction is doomed, and holds locks the other one waits for.
            rollback_all(connection);
            return Attempt::Conflict(
                "the database aborted the transaction to resolve a conflict with another one"
                    .to_owned(),
            );
        }
        if counters::stale() || (!succeeded && !savepoints && counters::numbered_from_memory()) {
            // A counter remembered from an earlier batch was not the table's, or the write
            // failed after numbering events from one: nothing is believed yet.
            rollback_all(connection);
            return Attempt::Stale;
        }
        if !succeeded && !savepoints {
            // Undoing the transaction undoes what the failed write did.
            rollback_all(connection);
            if DOUBTED.with(Cell::get) {
                // It may have failed on what the batch gathered or kept (a message another
                // node edited before the batch's first edit of it): the batch runs again
                // from the rows alone, which tells.
                return Attempt::Undone;
            }
            return Attempt::WriteFailed;
        }
    }
    if !savepoints && conflicts.take_failed() && !can_commit(connection) {
        // A write went on past a failed statement: which one cannot be told, so each
        // runs again in a savepoint of its own, whose release fails where it did.
        rollback_all(connection);
        return Attempt::Aborted;
    }
    if DOUBTED.with(Cell::get) {
        rollback_all(connection);
        return Attempt::Undone;
    }
    if mode.gathered
        && let Err(e) = Gathering::flush(connection)
    {
        if counters::stale() {
            rollback_all(connection);
            return Attempt::Stale;
        }
        let conflict = conflicts.take() || is_conflict(&e);
        let message = format!("writing the batch's event rows and counters failed: {e}");
        rollback_all(connection);
        return if conflict {
            Attempt::Conflict(message)
        } else {
            Attempt::FlushFailed(message)
        };
    }
    if DOUBTED.with(Cell::get) {
        // A message another node edited before the batch's first edit of it.
        rollback_all(connection);
        return Attempt::Undone;
    }

    if fail {
        rollback_all(connection);
        return Attempt::Failpoint;
    }
    match commit(connection) {
        Ok(()) => {
            counters::committed();
            Attempt::Committed
        }
        Err(e) => {
            let conflict = conflicts.take() || is_conflict(&e);
            let message = format!("commit failed: {e}");
            rollback_all(connection);
            if conflict {
                Attempt::Conflict(message)
            } else {
                tracing::error!(%message, writes = batch.len(), "write batch failed");
                Attempt::CommitFailed(message)
            }
        }
    }
}

/// Begins a batch's transaction: `BEGIN IMMEDIATE` on SQLite, so it never fails to
/// upgrade a read lock.
///
/// diesel sends `BEGIN` and `COMMIT` as plain SQL, which SQLite parses again at every
/// batch; on SQLite they are fixed statements here (see [`super::fixed`]), prepared once
/// per connection, and diesel's transaction manager is told of the change of depth, so
/// its rollback and its broken-connection check work as they do for its own. On
/// PostgreSQL either way is one round trip, and diesel's is used.
fn begin(connection: &mut Conn) -> diesel::QueryResult<()> {
    match connection {
        Conn::Sqlite(_) => {
            if transaction_depth(connection)?.is_some() {
                return Err(diesel::result::Error::AlreadyInTransaction);
            }
            BeginImmediate.execute(connection)?;
            change_depth(connection, TransactionDepthChange::IncreaseDepth)
        }
        Conn::Pg(c) => AnsiTransactionManager::begin_transaction(c),
    }
}

/// Commits the batch's transaction ([`begin`] says why SQLite's is a fixed statement).
/// On failure the transaction may still be open: the caller rolls it back.
fn commit(connection: &mut Conn) -> diesel::QueryResult<()> {
    match connection {
        Conn::Sqlite(_) => {
            if transaction_depth(connection)?.map(std::num::NonZeroU32::get) != Some(1) {
                return Err(diesel::result::Error::NotInTransaction);
            }
            Commit.execute(connection)?;
            change_depth(connection, TransactionDepthChange::DecreaseDepth)
        }
        Conn::Pg(_) => <Conn as Connection>::TransactionManager::commit_transaction(connection),
    }
}

fn change_depth(connection: &mut Conn, change: TransactionDepthChange) -> diesel::QueryResult<()> {
    match <Conn as Connection>::TransactionManager::transaction_manager_status_mut(connection) {
        TransactionManagerStatus::Valid(status) => status.change_transaction_depth(change),
        TransactionManagerStatus::InError => Err(diesel::result::Error::BrokenTransactionManager),
    }
}

fixed_query! {
    struct BeginImmediate;
    sql "BEGIN IMMEDIATE"
}

fixed_query! {
    struct Commit;
    sql "COMMIT"
}

fixed_query! {
    struct SynchronousNormal;
    sql "PRAGMA synchronous = NORMAL"
}

fixed_query! {
    struct SynchronousFull;
    sql "PRAGMA synchronous = FULL"
}

/// The pause before running a conflicted batch again: random, so two nodes that
/// conflicted do not meet again in step, and growing with the attempts (at most ~0.3 s).
fn conflict_pause(attempt: u32) -> std::time::Duration {
    let ceiling_ms = 5u64 << attempt.min(6);
    std::time::Duration::from_millis(fastrand::u64(1..=ceiling_ms))
}

/// Whether `error` is the database resolving a conflict between transactions by
/// aborting one of them: a serialization failure (SQLSTATE 40001) or a deadlock
/// (40P01). diesel does not expose the SQLSTATE of a deadlock, so it is recognised by
/// PostgreSQL's message; a server whose `lc_messages` is not English has it
/// translated, and its deadlocks then fail the batch as before.
pub(super) fn is_conflict(error: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error};
    match error {
        Error::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        Error::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            info.message() == "deadlock detected"
        }
        _ => false,
    }
}

/// Remembers, for the writer, that a statement on its connection failed with a conflict
/// ([`is_conflict`]), or failed at all: a write may turn the database's error into its
/// own, or go on past it, so the writer learns of it from the connection, not from the
/// write's result.
#[derive(Clone, Default)]
struct Conflicts {
    conflicted: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
}

impl Conflicts {
    /// Watches `connection`'s statements (PostgreSQL only: SQLite's single writer never
    /// conflicts, and a failed statement does not end its transaction).
    fn watch(&self, connection: &mut Conn) {
        if let Conn::Pg(c) = connection {
            c.set_instrumentation(ConflictWatch {
                conflicted: self.conflicted.clone(),
                failed: self.failed.clone(),
            });
        }
    }

    /// Whether a conflict happened since the last call.
    fn take(&self) -> bool {
        self.conflicted.swap(false, Ordering::Relaxed)
    }

    /// Whether a statement failed since the last call.
    fn take_failed(&self) -> bool {
        self.failed.swap(false, Ordering::Relaxed)
    }
}

struct ConflictWatch {
    conflicted: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
}

impl Instrumentation for ConflictWatch {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let InstrumentationEvent::FinishQuery {
            error: Some(error), ..
        } = event
        {
            self.failed.store(true, Ordering::Relaxed);
            if is_conflict(error) {
                self.conflicted.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Whether the batch's transaction on PostgreSQL can still commit. A failed statement
/// there ends it (every later statement is refused, and `COMMIT` answers by rolling
/// back, without an error diesel would see); a write that went on past a failed
/// statement outside a savepoint of its own would otherwise have every write of its batch
/// told it committed. Asked only when a statement failed: it costs a round trip.
fn can_commit(connection: &mut Conn) -> bool {
    match connection {
        Conn::Sqlite(_) => true,
        Conn::Pg(_) => Probe.execute(connection).is_ok(),
    }
}

fixed_query! {
    /// A statement that fails only in a transaction that has already failed.
    struct Probe;
    sql "SELECT 1"
}

fn rollback_all(connection: &mut Conn) {
    // What the batch's edits wrote is undone: the messages kept as written are not the
    // rows' any more.
    crate::event::projector::forget_kept();
    while matches!(transaction_depth(connection), Ok(Some(_))) {
        if let Err(e) = <Conn as Connection>::TransactionManager::rollback_transaction(connection) {
            tracing::error!(error = %e, "rollback failed; the connection will be replaced");
            break;
        }
    }
}

/// Replaces a broken writer connection, retrying until the database answers.
fn reconnect(settings: &Settings, conflicts: &Conflicts) -> Conn {
    let mut delay = std::time::Duration::from_millis(100);
    loop {
        match settings.establish() {
            Ok(mut connection) => {
                conflicts.watch(&mut connection);
                tracing::info!(url = %settings.url, "store writer reconnected");
                return connection;
            }
            Err(e) => {
                tracing::error!(error = %e, "store writer cannot reconnect; retrying");
                std::thread::sleep(delay);
                delay = (delay * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use diesel::connection::SimpleConnection;
    use diesel::{RunQueryDsl, SqliteConnection};

    use super::*;

    fn connection() -> Conn {
        let mut connection = SqliteConnection::establish(":memory:").unwrap();
        connection
            .batch_execute("CREATE TABLE t (x INTEGER NOT NULL)")
            .unwrap();
        Conn::Sqlite(connection)
    }

    fn rows(connection: &mut Conn) -> Vec<i32> {
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            x: i32,
        }
        diesel::sql_query("SELECT x FROM t ORDER BY x")
            .load::<Row>(connection)
            .unwrap()
            .into_iter()
            .map(|row| row.x)
            .collect()
    }

    type Outcome = oneshot::Receiver<Result<(), Error>>;

    /// `write` as the writer's job, with where its caller hears the outcome.
    fn pending(
        write: impl FnMut(&mut Conn) -> Result<(), Error> + Send + 'static,
    ) -> (Job, Outcome) {
        let (reply, outcome) = oneshot::channel();
        let job: Job = Box::new(Pending {
            write,
            result: None,
            reply,
            session: None,
            deferred: None,
        });
        (job, outcome)
    }

    /// A write inserting `x` whose first `conflicting` runs end as a statement the
    /// database aborted for a conflict would; counts its runs.
    fn job(x: i32, conflicting: u32, conflicts: &Conflicts) -> (Job, Arc<AtomicU32>, Outcome) {
        let runs = Arc::new(AtomicU32::new(0));
        let (counted, conflicts) = (runs.clone(), conflicts.clone());
        let (job, outcome) = pending(move |c| {
            diesel::sql_query(format!("INSERT INTO t (x) VALUES ({x})")).execute(c)?;
            if counted.fetch_add(1, Ordering::SeqCst) < conflicting {
                conflicts.conflicted.store(true, Ordering::SeqCst);
            }
            Ok(())
        });
        (job, runs, outcome)
    }

    /// Runs `batch` as the writer runs a synced one, on a store that does not defer.
    fn run_synced(connection: &mut Conn, batch: Vec<Job>, conflicts: &Conflicts) -> Ran {
        let mut unsynced = Unsynced::new(None, Arc::default());
        let stats = Stats::default();
        let mut context = Batch {
            unsynced: &mut unsynced,
            deferred: false,
            stats: &stats,
        };
        run_batch(connection, batch, false, conflicts, &mut context)
    }

    /// A write inserting `x` that then fails; counts its runs.
    fn failing_job(x: i32) -> (Job, Arc<AtomicU32>, Outcome) {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let (job, outcome) = pending(move |c| {
            counted.fetch_add(1, Ordering::SeqCst);
            diesel::sql_query(format!("INSERT INTO t (x) VALUES ({x})")).execute(c)?;
            diesel::sql_query("SELECT nothing FROM missing").execute(c)?;
            Ok(())
        });
        (job, runs, outcome)
    }

    #[test]
    fn a_failing_write_is_undone_alone_and_the_batch_runs_again_with_savepoints() {
        let mut connection = connection();
        let conflicts = Conflicts::default();
        let (first, first_runs, first_outcome) = job(1, 0, &conflicts);
        let (failing, failing_runs, failing_outcome) = failing_job(2);
        let (third, third_runs, third_outcome) = job(3, 0, &conflicts);
        let ran = run_synced(&mut connection, vec![first, failing, third], &conflicts);
        assert!(matches!(ran, Ran::Carry(carried) if carried.is_empty()));
        // The plain run stopped at the failure; the run with savepoints ran them all.
        assert_eq!(first_runs.load(Ordering::SeqCst), 2);
        assert_eq!(failing_runs.load(Ordering::SeqCst), 2);
        assert_eq!(third_runs.load(Ordering::SeqCst), 1);
        assert!(matches!(first_outcome.blocking_recv(), Ok(Ok(()))));
        assert!(matches!(failing_outcome.blocking_recv(), Ok(Err(_))));
        assert!(matches!(third_outcome.blocking_recv(), Ok(Ok(()))));
        assert_eq!(
            rows(&mut connection),
            [1, 3],
            "the failed write left nothing"
        );
    }

    #[test]
    fn a_failing_write_alone_is_rolled_back_and_runs_once() {
        let mut connection = connection();
        let conflicts = Conflicts::default();
        let (failing, runs, outcome) = failing_job(2);
        let ran = run_synced(&mut connection, vec![failing], &conflicts);
        assert!(matches!(ran, Ran::Carry(carried) if carried.is_empty()));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(matches!(outcome.blocking_recv(), Ok(Err(_))));
        assert!(rows(&mut connection).is_empty());
    }

    /// A write inserting one event row with id `id`, gathered while its batch gathers.
    fn event_row(id: &'static str, seq: i64) -> (Job, Outcome) {
        pending(move |c| {
            let row = rows::Row {
                session_id: "ses".into(),
                seq,
                id: id.into(),
                type_name: "session.next.renamed",
                version: 1,
                data: "{}".into(),
                time: 0,
            };
            rows::insert(c, row)?;
            Ok(())
        })
    }

    fn event_ids(connection: &mut Conn) -> Vec<String> {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = diesel::sql_types::Text)]
            id: String,
        }
        diesel::sql_query("SELECT id FROM event ORDER BY seq")
            .load::<Id>(connection)
            .unwrap()
            .into_iter()
            .map(|row| row.id)
            .collect()
    }

    #[test]
    fn gathered_rows_go_in_before_the_commit_and_a_refused_one_fails_its_write_alone() {
        let mut connection = connection();
        connection
            .batch_execute(
                "CREATE TABLE event (session_id TEXT NOT NULL, seq BIGINT NOT NULL, \
                 id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, version INTEGER NOT NULL, \
                 data TEXT NOT NULL, time BIGINT NOT NULL, PRIMARY KEY (session_id, seq))",
            )
            .unwrap();
        let conflicts = Conflicts::default();
        let (first, first_outcome) = event_row("evt_a", 1);
        let (second, second_outcome) = event_row("evt_b", 2);
        let ran = run_synced(&mut connection, vec![first, second], &conflicts);
        assert!(matches!(ran, Ran::Carry(carried) if carried.is_empty()));
        assert!(matches!(first_outcome.blocking_recv(), Ok(Ok(()))));
        assert!(matches!(second_outcome.blocking_recv(), Ok(Ok(()))));
        assert_eq!(event_ids(&mut connection), ["evt_a", "evt_b"]);

        // The middle write's row repeats an id: the gathered insert is refused, and the
        // batch runs again row by row, where only that write fails.
        let (first, first_outcome) = event_row("evt_c", 3);
        let (repeated, repeated_outcome) = event_row("evt_a", 4);
        let (third, third_outcome) = event_row("evt_d", 5);
        let ran = run_synced(&mut connection, vec![first, repeated, third], &conflicts);
        assert!(matches!(ran, Ran::Carry(carried) if carried.is_empty()));
        assert!(matches!(first_outcome.blocking_recv(), Ok(Ok(()))));
        assert!(matches!(repeated_outcome.blocking_recv(), Ok(Err(_))));
        assert!(matches!(third_outcome.blocking_recv(), Ok(Ok(()))));
        assert_eq!(
            event_ids(&mut connection),
            ["evt_a", "evt_b", "evt_c", "evt_d"]
        );

        // Alone, the write with the refused row hears its own error and leaves nothing.
        let (repeated, repeated_outcome) = event_row("evt_b", 6);
        run_synced(&mut connection, vec![repeated], &conflicts);
        assert!(matches!(repeated_outcome.blocking_recv(), Ok(Err(_))));
        assert_eq!(event_ids(&mut connection).len(), 4);

        // A later write of the same batch that reads the log flushes first, and so sees
        // the rows gathered before it.
        let (appending, _) = event_row("evt_e", 7);
        let (reply, seen) = oneshot::channel();
        let reading: Job = Box::new(Pending {
            write: |c: &mut Conn| -> Result<(usize, usize), Error> {
                let before = event_ids(c).len();
                rows::flush(c)?;
                Ok((before, event_ids(c).len()))
            },
            result: None,
            reply,
            session: None,
            deferred: None,
        });
        run_synced(&mut connection, vec![appending, reading], &conflicts);
        assert!(
            matches!(seen.blocking_recv(), Ok(Ok((4, 5)))),
            "gathered, then flushed for the read"
        );
    }

    #[test]
    fn a_conflicted_batch_runs_again_whole_and_each_write_commits_once() {
        let mut connection = connection();
        let conflicts = Conflicts::default();
        let (first, first_runs, first_outcome) = job(1, 0, &conflicts);
        let (second, second_runs, second_outcome) = job(2, 2, &conflicts);
        let ran = run_synced(&mut connection, vec![first, second], &conflicts);
        assert!(matches!(ran, Ran::Carry(carried) if carried.is_empty()));
        // The write before the conflicted one ran again too: its first run was undone.
        assert_eq!(first_runs.load(Ordering::SeqCst), 3);
        assert_eq!(second_runs.load(Ordering::SeqCst), 3);
        assert!(matches!(first_outcome.blocking_recv(), Ok(Ok(()))));
        assert!(matches!(second_outcome.blocking_recv(), Ok(Ok(()))));
        assert_eq!(rows(&mut connection), [1, 2]);
    }

    #[test]
    fn a_batch_that_keeps_conflicting_fails_every_write_and_leaves_nothing() {
        let mut connection = connection();
        let conflicts = Conflicts::default();
        let (first, _, first_outcome) = job(1, 0, &conflicts);
        let (second, second_runs, second_outcome) = job(2, u32::MAX, &conflicts);
        run_synced(&mut connection, vec![first, second], &conflicts);
        assert_eq!(second_runs.load(Ordering::SeqCst), CONFLICT_ATTEMPTS);
        for outcome in [first_outcome, second_outcome] {
            match outcome.blocking_recv() {
                Ok(Err(Error::CommitFailed(message))) => {
                    let gave_up = format!("gave up after {CONFLICT_ATTEMPTS} attempts");
                    assert!(message.contains(&gave_up), "{message}");
                }
                other => panic!("expected a failed commit, got {other:?}"),
            }
        }
        assert!(rows(&mut connection).is_empty());
    }

    #[test]
    fn serialization_failures_and_deadlocks_are_conflicts_and_nothing_else_is() {
        use diesel::result::{DatabaseErrorKind, Error as DbError};
        let database =
            |kind, message: &str| DbError::DatabaseError(kind, Box::new(message.to_owned()));
        assert!(is_conflict(&database(
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access due to concurrent update"
        )));
        assert!(is_conflict(&database(
            DatabaseErrorKind::Unknown,
            "deadlock detected"
        )));
        assert!(!is_conflict(&database(
            DatabaseErrorKind::UniqueViolation,
            "deadlock detected"
        )));
        assert!(!is_conflict(&database(
            DatabaseErrorKind::Unknown,
            "canceling statement due to statement timeout"
        )));
        assert!(!is_conflict(&DbError::NotFound));
    }
}
