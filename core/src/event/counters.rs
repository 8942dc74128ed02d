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
//! the batch commits, inserting the batch's gathered event rows too
//! ([`flush_with_rows`]). A batch of n sessions' appends makes two round trips
//! for its counters instead of n or more. A batch of one session's writes locks nothing
//! by a statement of its own: its first append moves the counter in the table, which
//! locks the row, and the counter is kept from there ([`adopt`]); a batch of one append
//! costs what it did, one of several appends (a step's boundary: the last step's end with
//! its usage, then the next step's start) one statement more than its first append. Any
//! other session (not named, created after the lock, or forgotten, below) is counted in
//! the table as before.
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
//! rolls it back and runs it again keeping nothing. An admission, which appends in a
//! savepoint, forgets its session's counter before it opens one, so that a batch where the
//! session's runner appended before its admission still runs once.
//!
//! The projections' changes to a kept session's own row ride with its counter ([`change`]):
//! its title, agent and model, and the usage and cost its steps add, are kept beside the
//! counter and written back by the same statement, so an event that projects only onto
//! its session's row (a rename, a switch of agent or model) costs the batch no round
//! trip of its own. Whatever reads those columns on a connection that may be the writer's
//! flushes first, as for the counter, or, reading only the agent and model of them,
//! writes back that session's changes alone when they change those
//! ([`flush_agent_and_model`], for [`crate::event::view::session_info`]).
//!
//! SQLite keeps nothing here: its statements cost no round trip, and a batch's counter
//! update and lookup cost it about what keeping them would.
//!
//! [`Store::write_for`]: crate::store::Store::write_for

use std::cell::RefCell;
use std::collections::HashMap;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Double, Nullable, Text};
use diesel::{QueryResult, RunQueryDsl};
use keel_schema::id::SessionId;

use crate::event::rows::{self, Row, RowArrays};
use crate::store::{Conn, doubt_gathered, is_in_savepoint};

/// A kept session's counter.
#[derive(Debug)]
struct Counter {
    last_seq: i64,
    /// When it was last moved, while the table does not have it yet.
    moved_at: Option<i64>,
    /// The update time the table holds with the counter, when this thread knows it: a
    /// counter adopted after its append moved it in the table ([`adopt`]), until its
    /// first write-back. A change kept beside it writes it back at that time.
    table_time: Option<i64>,
    /// The session row's changes the table does not have yet; only while `moved_at` is
    /// set ([`change`] keeps none otherwise), so that a write-back writes them.
    changes: Changes,
}

/// A projection's change to its session's row ([`change`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change<'a> {
    Title(&'a str),
    Agent(&'a str),
    Model {
        provider: &'a str,
        id: &'a str,
    },
    /// A step's usage (input, output, reasoning, cache read, cache write tokens) and
    /// cost, added to the session's totals.
    Usage {
        tokens: [i64; 5],
        cost: f64,
    },
}

/// The changes kept for a session's row until its write-back.
#[derive(Debug, Default, PartialEq)]
struct Changes {
    title: Option<String>,
    agent: Option<String>,
    model: Option<(String, String)>,
    /// One step's usage at most: two costs added together here and then to the table
    /// could round differently from each added to the table in turn, and the projections
    /// must equal a replay of the log exactly.
    usage: Option<([i64; 5], f64)>,
}

/// What this thread keeps for its batch.
#[derive(Debug)]
enum Kept {
    /// The sessions the batch's writes are for (sorted), not locked until one of them is
    /// appended to.
    Named(Vec<String>),
    /// The one session the batch's writes are for, whose first append moves its counter
    /// in the table (which locks the row) and then adopts it ([`adopt`]).
    Single(String),
    /// Their counters, the sessions locked; a session deleted before the lock is not
    /// among them, nor one forgotten since ([`forget`]).
    Locked(HashMap<String, Counter>),
}

thread_local! {
    /// What this thread keeps, while it runs a batch that keeps counters.
    static KEPT: RefCell<Option<Kept>> = const { RefCell::new(None) };
}

/// Keeps the counters of `sessions` on this thread until [`stop`], locking them when the
/// first is appended to. Keeps nothing on SQLite. A single session's counter is not
/// locked by a statement of its own: its first append moves it in the table as without
/// keeping, which locks its row, and the counter is kept from there ([`adopt`]), so that
/// a batch of one append costs what it did, and one of more appends, or of an append and
/// its step's usage, one statement more than its first append in all.
pub(crate) fn keep(connection: &Conn, sessions: &[SessionId]) {
    let mut ids: Vec<String> = match connection {
        Conn::Pg(_) => sessions.iter().map(ToString::to_string).collect(),
        Conn::Sqlite(_) => return,
    };
    ids.sort_unstable();
    ids.dedup();
    let kept = match <[String; 1]>::try_from(ids) {
        Ok([one]) => Kept::Single(one),
        Err(ids) if ids.is_empty() => return,
        Err(ids) => Kept::Named(ids),
    };
    KEPT.with(|slot| *slot.borrow_mut() = Some(kept));
}

/// Keeps session `id`'s counter, just moved in the table to `last_seq` at time `now` by
/// an append of this thread outside a savepoint (the update locked its row), when it is
/// the batch's one session ([`Kept::Single`]): its next appends move it in memory.
pub(crate) fn adopt(connection: &mut Conn, id: &str, last_seq: i64, now: i64) -> QueryResult<()> {
    let single =
        KEPT.with(|kept| matches!(kept.borrow().as_ref(), Some(Kept::Single(one)) if one == id));
    if !single || is_in_savepoint(connection)? {
        return Ok(());
    }
    let counter = Counter {
        last_seq,
        moved_at: None,
        table_time: Some(now),
        changes: Changes::default(),
    };
    let counters = HashMap::from([(id.to_owned(), counter)]);
    KEPT.with(|kept| *kept.borrow_mut() = Some(Kept::Locked(counters)));
    Ok(())
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
        Some(Kept::Named(_) | Kept::Single(_)) => State::None,
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
                table_time: None,
                changes: Changes::default(),
            };
            (id, counter)
        })
        .collect();
    KEPT.with(|kept| *kept.borrow_mut() = Some(Kept::Locked(counters)));
    Ok(())
}

/// Keeps `what`, made by the projection of an event appended to session `id`, with the
/// session's kept counter, to be written back with it. Returns `false`, for the caller
/// to make the change in the table itself, when this thread keeps no counter for the
/// session, runs inside a savepoint (where nothing is kept), or has neither moved the
/// counter since its last write-back nor adopted it since (knowing the update time the
/// table has): an import numbers its events in the table after writing the kept counters
/// back, and its forgetting of the counter writes back only a moved one, which a kept
/// change marks.
pub(crate) fn change(connection: &mut Conn, id: &str, what: Change<'_>) -> QueryResult<bool> {
    let state = KEPT.with(|kept| match kept.borrow().as_ref() {
        Some(Kept::Locked(counters)) => counters.get(id).and_then(|counter| {
            let usage_pending =
                matches!(what, Change::Usage { .. }) && counter.changes.usage.is_some();
            Some((counter.moved_at.or(counter.table_time)?, usage_pending))
        }),
        _ => None,
    });
    let Some((moved_at, usage_pending)) = state else {
        return Ok(false);
    };
    if is_in_savepoint(connection)? {
        return Ok(false);
    }
    if usage_pending {
        // A second step's usage in one batch (rare): the first goes to the table now.
        write_back(connection, Some(id), &[])?;
    }
    Ok(KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        let Some(Kept::Locked(counters)) = kept.as_mut() else {
            return false;
        };
        let Some(counter) = counters.get_mut(id) else {
            return false;
        };
        // Still to be written back, with this change.
        counter.moved_at = Some(moved_at);
        let changes = &mut counter.changes;
        match what {
            Change::Title(title) => changes.title = Some(title.to_owned()),
            Change::Agent(agent) => changes.agent = Some(agent.to_owned()),
            Change::Model {
                provider,
                id: model,
            } => {
                changes.model = Some((provider.to_owned(), model.to_owned()));
            }
            Change::Usage { tokens, cost } => changes.usage = Some((tokens, cost)),
        }
        true
    }))
}

/// Writes session `id`'s kept changes to its row, with its counter, if they change its
/// agent or model: for a read of those and of the columns no projection keeps here,
/// which neither the counter's write-back nor a kept title or usage need precede (a
/// step's boundary reads them after the last step's usage).
pub(crate) fn flush_agent_and_model(connection: &mut Conn, id: &str) -> QueryResult<()> {
    let changed = KEPT.with(|kept| match kept.borrow().as_ref() {
        Some(Kept::Locked(counters)) => counters.get(id).is_some_and(|counter| {
            counter.changes.agent.is_some() || counter.changes.model.is_some()
        }),
        _ => false,
    });
    if changed {
        write_back(connection, Some(id), &[])?;
    }
    Ok(())
}

/// Writes the counters moved since the last flush to the table; they stay kept.
pub(crate) fn flush(connection: &mut Conn) -> QueryResult<()> {
    write_back(connection, None, &[])
}

/// [`flush`], inserting `rows` (a batch's gathered event rows, [`rows::flush_with`]) in
/// the same statement on PostgreSQL: the last round trip of a batch before its commit.
pub(crate) fn flush_with_rows(connection: &mut Conn, rows: &[Row]) -> QueryResult<()> {
    write_back(connection, None, rows)
}

/// Writes the kept counters that moved since they were last written (only session
/// `only`'s, when given) to the table, and inserts `rows` with them.
fn write_back(connection: &mut Conn, only: Option<&str>, rows: &[Row]) -> QueryResult<()> {
    let Conn::Pg(_) = connection else {
        return rows::insert_all(connection, rows);
    };
    let moved = KEPT.with(|kept| {
        let mut moved = Moved::default();
        if let Some(Kept::Locked(counters)) = kept.borrow_mut().as_mut() {
            for (id, counter) in counters {
                if only.is_some_and(|only| only != id) {
                    continue;
                }
                counter.table_time = None;
                if let Some(time) = counter.moved_at.take() {
                    moved.push(
                        id,
                        counter.last_seq,
                        time,
                        std::mem::take(&mut counter.changes),
                    );
                }
            }
        }
        moved
    });
    if moved.ids.is_empty() {
        return rows::insert_all(connection, rows);
    }
    if is_in_savepoint(connection)? {
        // Rolling the savepoint back would undo this write-back, and nothing here would
        // know: the batch cannot commit what it kept.
        doubt_gathered();
    }
    let Conn::Pg(pg) = connection else {
        unreachable!("matched above")
    };
    let written = match rows {
        [] => moved.execute(pg),
        rows => WithRows {
            rows: RowArrays::of(rows),
            moved: &moved,
        }
        .execute(pg),
    };
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
    write_back(connection, Some(id), &[])?;
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

/// The counters moved in a batch, and their sessions' changes, written back by one
/// statement: a column of values for each, a `NULL` or a zero where a session's row keeps
/// what it has.
#[derive(Debug, Default)]
struct Moved {
    ids: Vec<String>,
    last_seqs: Vec<i64>,
    times: Vec<i64>,
    titles: Vec<Option<String>>,
    agents: Vec<Option<String>>,
    providers: Vec<Option<String>>,
    models: Vec<Option<String>>,
    /// Tokens added, by kind, in [`Change::Usage`]'s order.
    tokens: [Vec<i64>; 5],
    costs: Vec<f64>,
}

impl Moved {
    fn push(&mut self, id: &str, last_seq: i64, time: i64, changes: Changes) {
        self.ids.push(id.to_owned());
        self.last_seqs.push(last_seq);
        self.times.push(time);
        self.titles.push(changes.title);
        self.agents.push(changes.agent);
        let (provider, model) = changes.model.unzip();
        self.providers.push(provider);
        self.models.push(model);
        let (tokens, cost) = changes.usage.unwrap_or_default();
        for (column, added) in self.tokens.iter_mut().zip(tokens) {
            column.push(added);
        }
        self.costs.push(cost);
    }
}

impl QueryId for Moved {
    type QueryId = Moved;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for Moved {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            r#"UPDATE "session" SET "last_seq" = "moved"."last_seq", "time_updated" = "moved"."time", "title" = COALESCE("moved"."title", "session"."title"), "agent" = COALESCE("moved"."agent", "session"."agent"), "model_provider" = COALESCE("moved"."provider", "session"."model_provider"), "model_id" = COALESCE("moved"."model", "session"."model_id"), "usage_input" = "session"."usage_input" + "moved"."input", "usage_output" = "session"."usage_output" + "moved"."output", "usage_reasoning" = "session"."usage_reasoning" + "moved"."reasoning", "usage_cache_read" = "session"."usage_cache_read" + "moved"."cache_read", "usage_cache_write" = "session"."usage_cache_write" + "moved"."cache_write", "cost" = "session"."cost" + "moved"."cost" FROM UNNEST("#,
        );
        out.push_bind_param::<Array<Text>, _>(&self.ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.last_seqs)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.times)?;
        for column in [&self.titles, &self.agents, &self.providers, &self.models] {
            out.push_sql(", ");
            out.push_bind_param::<Array<Nullable<Text>>, _>(column)?;
        }
        for column in &self.tokens {
            out.push_sql(", ");
            out.push_bind_param::<Array<BigInt>, _>(column)?;
        }
        out.push_sql(", ");
        out.push_bind_param::<Array<Double>, _>(&self.costs)?;
        out.push_sql(
            r#") AS "moved" ("id", "last_seq", "time", "title", "agent", "provider", "model", "input", "output", "reasoning", "cache_read", "cache_write", "cost") WHERE "session"."id" = "moved"."id""#,
        );
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for Moved {}

/// Event rows inserted and counters written back by one statement, the rows' insert as
/// the update's `WITH`: the rows' foreign keys see the sessions' rows, which the batch
/// holds locked, whatever the update does to them.
struct WithRows<'a> {
    rows: RowArrays<'a>,
    moved: &'a Moved,
}

impl QueryId for WithRows<'_> {
    type QueryId = WithRows<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for WithRows<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(r#"WITH "inserted" AS ("#);
        self.rows.walk_ast(out.reborrow())?;
        out.push_sql(") ");
        self.moved.walk_ast(out)
    }
}

impl<C> RunQueryDsl<C> for WithRows<'_> {}
