//! The log's counters, kept by the store's writer for a batch on PostgreSQL.
//!
//! An append moves its session's counter (`session.last_seq`) before numbering its
//! events ([`crate::event::log`]): on PostgreSQL a round trip per append, and the counter
//! is what serializes a session's appends across nodes, by its row lock. While the writer
//! runs a batch of writes for several sessions plainly, it keeps the counters of the
//! sessions they were submitted for ([`Store::write_for`]) here, on its thread, instead
//! ([`keep`]): the first append to one of them outside a savepoint locks them all with
//! one statement (`SELECT … FOR NO KEY UPDATE`, the lock an `UPDATE` takes, in the order
//! of their ids), each append to one of them then moves its counter in memory, whichever
//! write makes it ([`advance`]), and one statement writes the moved counters back before
//! the batch commits ([`flush`]). A batch of n sessions' appends makes two round trips
//! for its counters instead of n or more. Any other session (not named, created after
//! the lock, or forgotten, below) is counted in the table as before.
//!
//! The table's counters are stale until then, so whatever reads `session`'s counter or
//! update time on a connection that may be the writer's flushes first (the log's
//! [`last_seq`](crate::event::log::last_seq) and its lock, the session views), and
//! whatever else changes them forgets the kept counter ([`forget`]): the import's own
//! numbering, and a deletion, after which the session takes no more events. A batch that
//! fails in any way is rolled back and what it kept dropped with it ([`stop`]); it runs
//! again keeping them afresh after a conflict, or keeping nothing (after a failed write,
//! refused rows or counters, or [`doubt_gathered`]).
//!
//! A write's own savepoint (a nested transaction) may be rolled back while the batch goes
//! on, which would release locks taken in it and undo a write-back made in it, but not
//! what is kept here. So nothing is locked or moved in memory inside one: an append there
//! moves its counter in the table, after forgetting the kept one (writing it back if the
//! batch had moved it); and should a write-back happen inside one (that one, or a read's),
//! or fail there, the batch cannot commit what it kept ([`doubt_gathered`]): the writer
//! rolls it back and runs it again keeping nothing. An admission appends in a savepoint,
//! so a batch where a session's runner appended before its admission runs twice.
//!
//! SQLite keeps nothing here: its statements cost no round trip, and a batch's counter
//! update and lookup cost it about what keeping them would.
//!
//! [`Store::write_for`]: crate::store::Store::write_for

use std::cell::RefCell;
use std::collections::HashMap;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Text};
use diesel::{QueryResult, RunQueryDsl};
use keel_schema::id::SessionId;

use crate::store::{Conn, doubt_gathered, is_in_savepoint};

/// A kept session's counter.
#[derive(Debug)]
struct Counter {
    last_seq: i64,
    /// When it was last moved, while the table does not have it yet.
    moved_at: Option<i64>,
}

/// What this thread keeps for its batch.
#[derive(Debug)]
enum Kept {
    /// The sessions the batch's writes are for (sorted), not locked until one of them is
    /// appended to.
    Named(Vec<String>),
    /// Their counters, the sessions locked; a session deleted before the lock is not
    /// among them, nor one forgotten since ([`forget`]).
    Locked(HashMap<String, Counter>),
}

thread_local! {
    /// What this thread keeps, while it runs a batch that keeps counters.
    static KEPT: RefCell<Option<Kept>> = const { RefCell::new(None) };
}

/// Keeps the counters of `sessions` on this thread until [`stop`], locking them when the
/// first is appended to. Keeps nothing on SQLite, nor for a single session: a batch of
/// one session's writes moves its counter in the table, a round trip per append, where
/// keeping it would cost two (the lock, the write back).
pub(crate) fn keep(connection: &Conn, sessions: &[SessionId]) {
    let mut ids: Vec<String> = match connection {
        Conn::Pg(_) => sessions.iter().map(ToString::to_string).collect(),
        Conn::Sqlite(_) => return,
    };
    ids.sort_unstable();
    ids.dedup();
    if ids.len() > 1 {
        KEPT.with(|kept| *kept.borrow_mut() = Some(Kept::Named(ids)));
    }
}

/// Drops what this thread keeps, written back or not.
pub(crate) fn stop() {
    KEPT.with(|kept| *kept.borrow_mut() = None);
}

/// Moves the kept counter of session `id` on by `by` at time `now` and returns its new
/// value, or `Ok(None)` when this thread keeps no counter for it. The first append
/// outside a savepoint to a session the batch's writes named locks all of them, with one
/// statement, in the order of their ids, so two nodes' batches never wait for each other
/// in a cycle there.
///
/// Inside a savepoint (a write's own nested transaction) nothing is locked or moved in
/// memory, since rolling the savepoint back would release the locks and leave the moves:
/// the session's counter moves in the table, written back first if it had moved.
pub(crate) fn advance(
    connection: &mut Conn,
    id: &str,
    by: i64,
    now: i64,
) -> QueryResult<Option<i64>> {
    let state = KEPT.with(|kept| match kept.borrow().as_ref() {
        None => State::None,
        Some(Kept::Named(ids)) if ids.binary_search_by(|named| named.as_str().cmp(id)).is_ok() => {
            State::Named
        }
        Some(Kept::Named(_)) => State::None,
        Some(Kept::Locked(counters)) if counters.contains_key(id) => State::Locked,
        Some(Kept::Locked(_)) => State::None,
    });
    if state == State::None {
        return Ok(None);
    }
    if is_in_savepoint(connection)? {
        if state == State::Locked {
            forget(connection, id)?;
        }
        return Ok(None);
    }
    if state == State::Named {
        lock(connection)?;
    }
    Ok(KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        let Some(Kept::Locked(counters)) = kept.as_mut() else {
            return None;
        };
        let counter = counters.get_mut(id)?;
        counter.last_seq += by;
        counter.moved_at = Some(now);
        Some(counter.last_seq)
    }))
}

/// Where a session stands in what this thread keeps.
#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Not kept: its counter moves in the table.
    None,
    /// Named by the batch's writes, none of them locked yet.
    Named,
    /// Locked, its counter kept.
    Locked,
}

/// Locks the named sessions and keeps their counters.
fn lock(connection: &mut Conn) -> QueryResult<()> {
    let Conn::Pg(pg) = connection else {
        unreachable!("counters are kept only on PostgreSQL")
    };
    let ids = KEPT.with(|kept| match kept.borrow_mut().as_mut() {
        Some(Kept::Named(ids)) => std::mem::take(ids),
        _ => Vec::new(),
    });
    let locked = match (LockSessions { ids: &ids }).load::<(String, i64)>(pg) {
        Ok(locked) => locked,
        Err(e) => {
            // The transaction is doomed; nothing more is kept for it.
            stop();
            return Err(e);
        }
    };
    let counters = locked
        .into_iter()
        .map(|(id, last_seq)| {
            let counter = Counter {
                last_seq,
                moved_at: None,
            };
            (id, counter)
        })
        .collect();
    KEPT.with(|kept| *kept.borrow_mut() = Some(Kept::Locked(counters)));
    Ok(())
}

/// Writes the counters moved since the last flush to the table; they stay kept.
pub(crate) fn flush(connection: &mut Conn) -> QueryResult<()> {
    write_back(connection, None)
}

/// Writes the kept counters that moved since they were last written (only session
/// `only`'s, when given) to the table.
fn write_back(connection: &mut Conn, only: Option<&str>) -> QueryResult<()> {
    let Conn::Pg(_) = connection else {
        return Ok(());
    };
    let moved = KEPT.with(|kept| {
        let mut moved = Moved::default();
        if let Some(Kept::Locked(counters)) = kept.borrow_mut().as_mut() {
            for (id, counter) in counters {
                if only.is_some_and(|only| only != id) {
                    continue;
                }
                if let Some(time) = counter.moved_at.take() {
                    moved.ids.push(id.clone());
                    moved.last_seqs.push(counter.last_seq);
                    moved.times.push(time);
                }
            }
        }
        moved
    });
    if moved.ids.is_empty() {
        return Ok(());
    }
    if is_in_savepoint(connection)? {
        // Rolling the savepoint back would undo this write-back, and nothing here would
        // know: the batch cannot commit what it kept.
        doubt_gathered();
    }
    let Conn::Pg(pg) = connection else {
        unreachable!("matched above")
    };
    let written = moved.execute(pg);
    if written.is_err() {
        // Not in the table, and nothing more is kept for it. At the top the transaction
        // is doomed; inside a savepoint it is not, and a write that swallowed the error
        // would let the batch commit without the counters: it cannot.
        stop();
        doubt_gathered();
    }
    written.map(drop)
}

/// Writes session `id`'s kept counter to the table if it moved, and keeps it no more:
/// for a change of the counter or of the session's liveness made in the table itself,
/// and for an append inside a savepoint. The other sessions' counters stay as they are,
/// so that a savepoint appending to a session the batch has not moved costs nothing more.
pub(crate) fn forget(connection: &mut Conn, id: &str) -> QueryResult<()> {
    let locked = KEPT.with(|kept| {
        matches!(kept.borrow().as_ref(), Some(Kept::Locked(counters)) if counters.contains_key(id))
    });
    if !locked {
        // Not locked yet, the lock will read what the table says by then.
        return Ok(());
    }
    write_back(connection, Some(id))?;
    KEPT.with(|kept| {
        if let Some(Kept::Locked(counters)) = kept.borrow_mut().as_mut() {
            counters.remove(id);
        }
    });
    Ok(())
}

/// Locks the live sessions among `ids` (sorted) and returns their counters.
struct LockSessions<'a> {
    ids: &'a [String],
}

impl QueryId for LockSessions<'_> {
    type QueryId = LockSessions<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for LockSessions<'_> {
    type SqlType = (Text, BigInt);
}

impl QueryFragment<Pg> for LockSessions<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(r#"SELECT "id", "last_seq" FROM "session" WHERE "id" = ANY("#);
        out.push_bind_param::<Array<Text>, _>(self.ids)?;
        out.push_sql(r#") AND "deleted_at" IS NULL ORDER BY "id" FOR NO KEY UPDATE"#);
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for LockSessions<'_> {}

/// The counters moved in a batch, written back by one statement.
#[derive(Debug, Default)]
struct Moved {
    ids: Vec<String>,
    last_seqs: Vec<i64>,
    times: Vec<i64>,
}

impl QueryId for Moved {
    type QueryId = Moved;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for Moved {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            r#"UPDATE "session" SET "last_seq" = "moved"."last_seq", "time_updated" = "moved"."time" FROM UNNEST("#,
        );
        out.push_bind_param::<Array<Text>, _>(&self.ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.last_seqs)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.times)?;
        out.push_sql(
            r#") AS "moved" ("id", "last_seq", "time") WHERE "session"."id" = "moved"."id""#,
        );
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for Moved {}
