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
//! locks the row, and the counter is kept from there ([`adopt`]). Any other session (not
//! named, or created after the lock) is counted in the table as before; so is a forgotten
//! one (below) until its next append outside a savepoint, which adopts its counter again.
//!
//! A session's writes all go to one writer of a node, so the writer also remembers the
//! counters its committed batches left in the table ([`committed`]) and starts its next
//! batch for those sessions from them, reading and locking nothing first. That is a
//! guess, since another node (or a connection other than the writer's) may have appended
//! since, so it is checked where it is written: the write-back moves only a counter the
//! table still holds at the remembered value, and says how many it moved. One that moved
//! elsewhere meanwhile (an append or a deletion, which appends too), or any failure of a
//! write or of the write-back after events were numbered from an unchecked counter (the
//! other node's rows may have taken their seqs first: the event's key, a message's), makes
//! the batch roll back and run again reading its counters, which it then remembers no
//! more ([`numbered_from_memory`], [`stop`]); nothing is committed from a counter no
//! statement checked. In steady state a batch's counters cost it no round trip of their
//! own: the lock is gone and the write-back rides with the rows.
//!
//! The table's counters are stale until then, so whatever reads `session`'s counter or
//! update time on a connection that may be the writer's flushes first (the log's
//! [`last_seq`](crate::event::log::last_seq) and its lock, the session views), and
//! whatever else changes them forgets the kept counter ([`forget`]): the import's own
//! numbering, and a deletion, after which the session takes no more events. A batch that
//! fails in any way is rolled back and what it kept dropped with it ([`stop`]); it runs
//! again keeping them afresh after a conflict or a stale remembered counter, or keeping
//! nothing (after a failed write, refused rows or counters, or [`doubt_gathered`]).
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

use std::cell::{Cell, RefCell};
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
    /// What the table holds, as far as this thread knows: what the batch's lock read or
    /// its append moved it to ([`adopt`]), then wrote back; or, until a write-back checks
    /// it, what an earlier batch of this thread committed ([`REMEMBERED`]). The write-back
    /// moves only a counter the table still has at this value.
    table_seq: i64,
    /// Whether `table_seq` came from the table in this batch (by its lock, its append or a
    /// write-back), not from memory.
    checked: bool,
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
#[derive(Debug, Default)]
struct Kept {
    /// The sessions the batch's writes are for whose counters are not kept yet.
    unkept: Unkept,
    /// The counters kept: remembered from an earlier batch ([`REMEMBERED`]), or read by
    /// the batch's lock or adopted after its append; not a session deleted before the
    /// lock, nor one forgotten since ([`forget`]).
    counters: HashMap<String, Counter>,
}

/// The sessions a batch's writes are for whose counters it neither remembers nor has
/// read yet.
#[derive(Debug, Default)]
enum Unkept {
    #[default]
    None,
    /// Several (sorted), locked together when one of them is first appended to.
    Named(Vec<String>),
    /// One, whose first append moves its counter in the table (which locks the row) and
    /// then adopts it ([`adopt`]).
    Single(String),
}

/// The most counters a thread remembers between batches: about 80 bytes each.
const REMEMBERED_MAX: usize = 16_384;

thread_local! {
    /// What this thread keeps, while it runs a batch that keeps counters.
    static KEPT: RefCell<Option<Kept>> = const { RefCell::new(None) };
    /// The counters this thread's committed batches left in the table, by session, for
    /// its next batches to start from without reading them ([`keep`]).
    static REMEMBERED: RefCell<HashMap<String, i64>> = RefCell::new(HashMap::new());
    /// Whether a write-back found a remembered counter the table no longer has.
    static STALE: Cell<bool> = const { Cell::new(false) };
}

/// Keeps the counters of `sessions` on this thread until [`stop`]: those the thread
/// remembers ([`committed`]) from memory, checked by their write-back; the others locked
/// when the first of them is appended to. Keeps nothing on SQLite. A single session's
/// counter not remembered is not locked by a statement of its own: its first append
/// moves it in the table as without keeping, which locks its row, and the counter is
/// kept from there ([`adopt`]).
pub(crate) fn keep(connection: &Conn, sessions: &[SessionId]) {
    let mut ids: Vec<String> = match connection {
        Conn::Pg(_) => sessions.iter().map(ToString::to_string).collect(),
        Conn::Sqlite(_) => return,
    };
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return;
    }
    let mut counters = HashMap::new();
    REMEMBERED.with(|remembered| {
        let remembered = remembered.borrow();
        ids.retain(|id| {
            let Some(&seq) = remembered.get(id) else {
                return true;
            };
            counters.insert(id.clone(), Counter::at(seq, false));
            false
        });
    });
    let unkept = match <[String; 1]>::try_from(ids) {
        Ok([one]) => Unkept::Single(one),
        Err(ids) if ids.is_empty() => Unkept::None,
        Err(ids) => Unkept::Named(ids),
    };
    KEPT.with(|slot| *slot.borrow_mut() = Some(Kept { unkept, counters }));
}

impl Counter {
    /// A counter the table holds at `seq`, not moved since.
    fn at(seq: i64, checked: bool) -> Self {
        Self {
            last_seq: seq,
            table_seq: seq,
            checked,
            moved_at: None,
            table_time: None,
            changes: Changes::default(),
        }
    }
}

/// Keeps session `id`'s counter, just moved in the table to `last_seq` at time `now` by
/// an append of this thread outside a savepoint (the update locked its row), when it is
/// the batch's one session not kept yet ([`Unkept::Single`]): its next appends move it in
/// memory.
pub(crate) fn adopt(connection: &mut Conn, id: &str, last_seq: i64, now: i64) -> QueryResult<()> {
    // Moved in the table: whatever this thread remembered of it is past.
    unremember(id);
    let single = KEPT.with(|kept| {
        matches!(kept.borrow().as_ref(), Some(Kept { unkept: Unkept::Single(one), .. }) if one == id)
    });
    if !single || is_in_savepoint(connection)? {
        return Ok(());
    }
    KEPT.with(|kept| {
        if let Some(kept) = kept.borrow_mut().as_mut() {
            kept.unkept = Unkept::None;
            let counter = Counter {
                table_time: Some(now),
                ..Counter::at(last_seq, true)
            };
            kept.counters.insert(id.to_owned(), counter);
        }
    });
    Ok(())
}

/// After the batch committed: remembers the counters the table was seen to hold (read,
/// moved or written back by the batch), for the thread's next batches, and keeps nothing
/// more.
pub(crate) fn committed() {
    let Some(kept) = KEPT.with(|kept| kept.borrow_mut().take()) else {
        return;
    };
    REMEMBERED.with(|remembered| {
        let mut remembered = remembered.borrow_mut();
        for (id, counter) in kept.counters {
            if !counter.checked {
                continue;
            }
            if remembered.len() >= REMEMBERED_MAX && !remembered.contains_key(&id) {
                // Forgetting all costs each session one lock statement, once.
                remembered.clear();
            }
            remembered.insert(id, counter.last_seq);
        }
    });
}

/// Drops what this thread keeps, written back or not: the batch did not commit, and its
/// sessions' counters are remembered no more, so that a batch run again locks them (in
/// the order of their ids) and reads them from the table.
pub(crate) fn stop() {
    let Some(kept) = KEPT.with(|kept| kept.borrow_mut().take()) else {
        return;
    };
    REMEMBERED.with(|remembered| {
        let mut remembered = remembered.borrow_mut();
        for id in kept.counters.keys() {
            remembered.remove(id);
        }
    });
}

/// Whether the batch kept a counter remembered from an earlier one (not read from the
/// table) and numbered events from it before any statement checked it, or a write-back
/// found one the table no longer has: a batch that failed then may have failed for it,
/// and runs again reading its counters ([`stop`]) before anything is said to have
/// failed.
pub(crate) fn numbered_from_memory() -> bool {
    STALE.with(Cell::get)
        || KEPT.with(|kept| {
            kept.borrow().as_ref().is_some_and(|kept| {
                kept.counters
                    .values()
                    .any(|counter| !counter.checked && counter.moved_at.is_some())
            })
        })
}

/// Whether a write-back found a remembered counter the table no longer has (another node
/// appended to its session, or deleted it), or failed writing one back: the batch cannot
/// commit, and runs again reading its counters.
pub(crate) fn stale() -> bool {
    STALE.with(Cell::get)
}

/// Ends a batch's attempt, however it ended: [`stop`], and no write-back is stale any
/// more.
pub(crate) fn end() {
    stop();
    STALE.with(|stale| stale.set(false));
}

/// Remembers session `id`'s counter no more: the table's is moving on this thread
/// outside what is kept.
fn unremember(id: &str) {
    REMEMBERED.with(|remembered| remembered.borrow_mut().remove(id));
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
        Some(kept) if kept.counters.contains_key(id) => State::Kept,
        Some(Kept {
            unkept: Unkept::Named(ids),
            ..
        }) if ids.binary_search_by(|named| named.as_str().cmp(id)).is_ok() => State::Named,
        Some(_) => State::None,
    });
    if state == State::None {
        return Ok(None);
    }
    if is_in_savepoint(connection)? {
        if state == State::Kept {
            forget(connection, id)?;
        }
        return Ok(None);
    }
    if state == State::Named {
        lock(connection)?;
    }
    Ok(KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        let counter = kept.as_mut()?.counters.get_mut(id)?;
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
    /// Its counter kept: remembered, or locked and read.
    Kept,
}

/// Locks the named sessions and keeps their counters.
fn lock(connection: &mut Conn) -> QueryResult<()> {
    let Conn::Pg(pg) = connection else {
        unreachable!("counters are kept only on PostgreSQL")
    };
    let ids = KEPT.with(|kept| match kept.borrow_mut().as_mut() {
        Some(kept) => match std::mem::take(&mut kept.unkept) {
            Unkept::Named(ids) => ids,
            other => {
                kept.unkept = other;
                Vec::new()
            }
        },
        None => Vec::new(),
    });
    let locked = match (LockSessions { ids: &ids }).load::<(String, i64)>(pg) {
        Ok(locked) => locked,
        Err(e) => {
            // The transaction is doomed; nothing more is kept for it.
            stop();
            return Err(e);
        }
    };
    KEPT.with(|kept| {
        if let Some(kept) = kept.borrow_mut().as_mut() {
            kept.counters.extend(
                locked
                    .into_iter()
                    .map(|(id, last_seq)| (id, Counter::at(last_seq, true))),
            );
        }
    });
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
        Some(kept) => kept.counters.get(id).and_then(|counter| {
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
        let Some(counter) = kept.as_mut().and_then(|kept| kept.counters.get_mut(id)) else {
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
    let changed = KEPT.with(|kept| {
        kept.borrow()
            .as_ref()
            .and_then(|kept| kept.counters.get(id))
            .is_some_and(|counter| {
                counter.changes.agent.is_some() || counter.changes.model.is_some()
            })
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
    let (moved, from_memory) = KEPT.with(|kept| {
        let mut moved = Moved::default();
        let mut from_memory = false;
        if let Some(kept) = kept.borrow_mut().as_mut() {
            // In the order of their ids, as the lock takes them: the update locks the
            // rows in the order it reaches them, which for a few ids is theirs.
            let mut counters: Vec<_> = kept.counters.iter_mut().collect();
            counters.sort_unstable_by_key(|(id, _)| *id);
            for (id, counter) in counters {
                if only.is_some_and(|only| only != id) {
                    continue;
                }
                counter.table_time = None;
                if let Some(time) = counter.moved_at.take() {
                    from_memory |= !counter.checked;
                    moved.push(id, counter, time);
                }
            }
        }
        (moved, from_memory)
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
    let count = moved.ids.len();
    let written = match rows {
        [] => moved.load::<String>(pg),
        rows => WithRows {
            rows: RowArrays::of(rows),
            moved: &moved,
        }
        .load::<String>(pg),
    };
    let written = written.and_then(|written| {
        if written.len() == count {
            return Ok(written);
        }
        // A remembered counter the table no longer has, or a session deleted since:
        // nothing more is written, and the batch runs again reading its counters.
        STALE.with(|stale| stale.set(true));
        Err(diesel::result::Error::QueryBuilderError(
            "a session's counter moved outside this batch since it was remembered".into(),
        ))
    });
    let written = match written {
        Ok(written) => written,
        Err(e) => {
            // Not in the table, and nothing more is kept for it. At the top the transaction
            // is doomed; inside a savepoint it is not, and a write that swallowed the error
            // would let the batch commit without the counters: it cannot. A row numbered
            // from a remembered counter may have been refused for it: the batch runs
            // again reading its counters before the refusal is believed.
            if from_memory {
                STALE.with(|stale| stale.set(true));
            }
            stop();
            doubt_gathered();
            return Err(e);
        }
    };
    KEPT.with(|kept| {
        if let Some(kept) = kept.borrow_mut().as_mut() {
            for id in &written {
                if let Some(counter) = kept.counters.get_mut(id) {
                    counter.table_seq = counter.last_seq;
                    counter.checked = true;
                }
            }
        }
    });
    Ok(())
}

/// Writes session `id`'s kept counter to the table if it moved, and keeps it no more:
/// for a change of the counter or of the session's liveness made in the table itself,
/// and for an append inside a savepoint. The other sessions' counters stay as they are,
/// so that a savepoint appending to a session the batch has not moved costs nothing more.
pub(crate) fn forget(connection: &mut Conn, id: &str) -> QueryResult<()> {
    unremember(id);
    let kept = KEPT.with(|kept| {
        kept.borrow()
            .as_ref()
            .is_some_and(|kept| kept.counters.contains_key(id))
    });
    if !kept {
        // Not locked yet, the lock will read what the table says by then.
        return Ok(());
    }
    write_back(connection, Some(id), &[])?;
    KEPT.with(|kept| {
        if let Some(kept) = kept.borrow_mut().as_mut() {
            kept.counters.remove(id);
            if matches!(kept.unkept, Unkept::None) {
                // Its next append outside a savepoint moves the counter in the table,
                // which locks the row again, and keeps it from there.
                kept.unkept = Unkept::Single(id.to_owned());
            }
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
    /// What the table must still hold for each ([`Counter::table_seq`]).
    table_seqs: Vec<i64>,
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
    fn push(&mut self, id: &str, counter: &mut Counter, time: i64) {
        let changes = std::mem::take(&mut counter.changes);
        self.ids.push(id.to_owned());
        self.table_seqs.push(counter.table_seq);
        self.last_seqs.push(counter.last_seq);
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
        out.push_bind_param::<Array<BigInt>, _>(&self.table_seqs)?;
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
            r#") AS "moved" ("id", "table_seq", "last_seq", "time", "title", "agent", "provider", "model", "input", "output", "reasoning", "cache_read", "cache_write", "cost") WHERE "session"."id" = "moved"."id" AND "session"."last_seq" = "moved"."table_seq" RETURNING "session"."id""#,
        );
        Ok(())
    }
}

impl Query for Moved {
    type SqlType = Text;
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

impl Query for WithRows<'_> {
    type SqlType = Text;
}

impl<C> RunQueryDsl<C> for WithRows<'_> {}
