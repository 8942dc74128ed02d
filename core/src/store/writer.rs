//! The writer thread: group commit.
//!
//! Writes arrive on a bounded channel. The thread takes the first, then every write
//! already waiting (up to the batch limit), begins one transaction (`BEGIN IMMEDIATE` on
//! SQLite, so it never fails to upgrade a read lock), runs each write in its own savepoint
//! (prepared statements, see [`in_savepoint`]), commits, and only then tells each caller
//! its result. A write whose closure fails rolls back to its savepoint and leaves the
//! others intact; a failed commit fails them all.
//!
//! A batch of one write needs no savepoint: if it fails, the whole transaction is rolled
//! back instead, which undoes exactly that write. Writes arriving one at a time (a single
//! session's runner, say) are the common case, and the two statements saved are a good
//! share of such a write's cost.
//!
//! When the transaction cannot even begin (the database dropped the connection: a
//! restart, a failover), no write has run, so the writer reconnects, waiting for the
//! database as long as it takes, and tries the same writes once more.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use diesel::Connection;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use tokio::sync::{mpsc, oneshot};

use super::conn::Settings;
use super::fixed::fixed_query;
use super::{Conn, Error, Failpoint, Stats};

/// Tells a caller how its write ended, once the batch's commit is known.
/// `Some(message)` means the commit failed and the write did not happen.
type Finish = Box<dyn FnOnce(Option<&str>) + Send>;

/// One write waiting for the writer.
trait Write: Send {
    /// Runs inside the batch transaction, in its own savepoint when `savepoint`; returns
    /// whether it succeeded and how to report the result after commit. Without a
    /// savepoint, a failed write leaves the transaction for the caller to roll back.
    fn run(self: Box<Self>, connection: &mut Conn, savepoint: bool) -> (bool, Finish);
    /// Reports that the write never ran.
    fn fail(self: Box<Self>, message: &str);
}

type Job = Box<dyn Write>;

struct Pending<F, T, E> {
    write: F,
    reply: oneshot::Sender<Result<T, E>>,
}

impl<F, T, E> Write for Pending<F, T, E>
where
    T: Send + 'static,
    E: From<Error> + From<diesel::result::Error> + Send + 'static,
    F: FnOnce(&mut Conn) -> Result<T, E> + Send + 'static,
{
    fn run(self: Box<Self>, connection: &mut Conn, savepoint: bool) -> (bool, Finish) {
        let Pending { write, reply } = *self;
        let result = if savepoint {
            in_savepoint(connection, write)
        } else {
            write(connection)
        };
        let succeeded = result.is_ok();
        let finish = Box::new(move |commit_failure: Option<&str>| {
            let result = match commit_failure {
                None => result,
                Some(message) => Err(E::from(Error::CommitFailed(message.to_owned()))),
            };
            // The caller may have stopped waiting; the write's fate is settled either way.
            drop(reply.send(result));
        });
        (succeeded, finish)
    }

    fn fail(self: Box<Self>, message: &str) {
        let error = E::from(Error::CommitFailed(message.to_owned()));
        // As above: a caller that stopped waiting needs no answer.
        drop(self.reply.send(Err(error)));
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
}

impl Handle {
    pub async fn submit<T, E, F>(&self, write: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<Error> + From<diesel::result::Error> + Send + 'static,
        F: FnOnce(&mut Conn) -> Result<T, E> + Send + 'static,
    {
        let (reply, outcome) = oneshot::channel::<Result<T, E>>();
        let job: Job = Box::new(Pending { write, reply });
        self.jobs
            .send(job)
            .await
            .map_err(|_| E::from(Error::WriterGone))?;
        outcome.await.unwrap_or(Err(E::from(Error::WriterGone)))
    }
}

/// Starts the writer thread on `connection`.
pub(super) fn spawn(
    connection: Conn,
    settings: Settings,
    max_batch: usize,
    stats: Arc<Stats>,
    failpoint: Option<Failpoint>,
) -> Result<Handle, Error> {
    let (jobs, receiver) = mpsc::channel(QUEUE);
    std::thread::Builder::new()
        .name("keel-store-writer".into())
        .spawn(move || {
            run(
                connection,
                settings,
                receiver,
                max_batch.max(1),
                &stats,
                failpoint.as_ref(),
            )
        })
        .map_err(|e| Error::Connect {
            url: "writer".into(),
            message: format!("starting the writer thread: {e}"),
        })?;
    Ok(Handle { jobs })
}

fn run(
    mut connection: Conn,
    settings: Settings,
    mut receiver: mpsc::Receiver<Job>,
    max_batch: usize,
    stats: &Stats,
    failpoint: Option<&Failpoint>,
) {
    let mut carried: Vec<Job> = Vec::new();
    loop {
        let mut batch = std::mem::take(&mut carried);
        if batch.is_empty() {
            match receiver.blocking_recv() {
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
        let ordinal = stats.batches.fetch_add(1, Ordering::Relaxed);
        let fail = failpoint.is_some_and(|f| (f.0)(ordinal));
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        carried = match run_batch(&mut connection, batch, fail) {
            Ran::Carry(jobs) => jobs,
            // Nothing ran: a connection the database dropped (a restart, a failover) is
            // replaced and the same writes are tried once more on the new one.
            Ran::NotBegun(jobs, message) => {
                tracing::warn!(%message, writes = jobs.len(), "could not begin a write batch; reconnecting");
                connection = reconnect(&settings);
                match run_batch(&mut connection, jobs, fail) {
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
            connection = reconnect(&settings);
        }
    }
    tracing::debug!(url = %settings.url, "store writer stopped");
}

/// What running a batch left to do.
enum Ran {
    /// The writes it did not get to (after a panic), to run next.
    Carry(Vec<Job>),
    /// The transaction could not begin, so no write ran: all of them, and why.
    NotBegun(Vec<Job>, String),
}

/// Runs one batch.
fn run_batch(connection: &mut Conn, batch: Vec<Job>, fail: bool) -> Ran {
    let began = match connection {
        Conn::Sqlite(c) => AnsiTransactionManager::begin_transaction_sql(c, "BEGIN IMMEDIATE"),
        Conn::Pg(c) => AnsiTransactionManager::begin_transaction(c),
    };
    if let Err(e) = began {
        return Ran::NotBegun(batch, format!("could not begin a transaction: {e}"));
    }

    let mut finishes: Vec<Finish> = Vec::with_capacity(batch.len());
    let savepoints = batch.len() > 1;
    let mut alone_failed = false;
    let mut jobs = batch.into_iter();
    let mut panicked = false;
    for job in jobs.by_ref() {
        match catch_unwind(AssertUnwindSafe(|| job.run(connection, savepoints))) {
            Ok((succeeded, finish)) => {
                alone_failed = !savepoints && !succeeded;
                finishes.push(finish);
            }
            Err(_) => {
                panicked = true;
                break;
            }
        }
    }

    if panicked {
        // The panicking write's caller hears `WriterGone` (its reply was dropped). The
        // writes before it shared its transaction, so they are rolled back and failed;
        // the writes after it have not run and go into the next batch.
        rollback_all(connection);
        for finish in finishes {
            finish(Some("another write in the same transaction panicked"));
        }
        return Ran::Carry(jobs.collect());
    }

    if alone_failed {
        // The only write failed without a savepoint: undoing the transaction undoes it,
        // and its caller hears its own error.
        rollback_all(connection);
        for finish in finishes {
            finish(None);
        }
        return Ran::Carry(Vec::new());
    }

    if fail {
        rollback_all(connection);
        for finish in finishes {
            finish(Some("a failpoint made this commit fail"));
        }
        return Ran::Carry(Vec::new());
    }
    match <Conn as Connection>::TransactionManager::commit_transaction(connection) {
        Ok(()) => {
            for finish in finishes {
                finish(None);
            }
        }
        Err(e) => {
            let message = format!("commit failed: {e}");
            tracing::error!(%message, writes = finishes.len(), "write batch failed");
            rollback_all(connection);
            for finish in finishes {
                finish(Some(&message));
            }
        }
    }
    Ran::Carry(Vec::new())
}

fn rollback_all(connection: &mut Conn) {
    while matches!(
        <Conn as Connection>::TransactionManager::transaction_manager_status_mut(connection)
            .transaction_depth(),
        Ok(Some(_))
    ) {
        if let Err(e) = <Conn as Connection>::TransactionManager::rollback_transaction(connection) {
            tracing::error!(error = %e, "rollback failed; the connection will be replaced");
            break;
        }
    }
}

/// Replaces a broken writer connection, retrying until the database answers.
fn reconnect(settings: &Settings) -> Conn {
    let mut delay = std::time::Duration::from_millis(100);
    loop {
        match settings.establish() {
            Ok(connection) => {
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
