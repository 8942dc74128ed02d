//! The event log: one ordered, gapless sequence of durable events per session.
//!
//! [`append`] assigns each event the next `seq` of its session, an id and a time, runs the
//! projector for it and inserts it, all inside the caller's transaction: events appended
//! together commit together, and a projector error rolls them all back. The session row's
//! `last_seq` is the counter; it is advanced (locking the row on PostgreSQL) before any
//! event is numbered, or, on PostgreSQL from a counter the store's writer remembers,
//! moved only if the table still holds the remembered value
//! ([`crate::event::counters`]), so concurrent appends to one session serialize.
//!
//! Appending is the hottest write Keel has, so its statements are few and prepared once
//! (fixed statements, see [`crate::store::fixed`]): the counter is advanced and read back
//! ([`advance`]), then each event costs its projection and its insert. Lookups by key use
//! `get_result`, not `first`, whose bound `LIMIT` makes SQLite recompile the statement at
//! every use. On PostgreSQL the writer's batch moves the counters of the sessions it
//! locked in memory and writes them back at its end ([`super::counters`]).

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use keel_schema::event::{DurableEvent, Envelope, RawEvent};
use keel_schema::id::{EventId, SessionId};

use super::{counters, projector, rows};
use crate::store::Direct as _;
use crate::store::column::{db_int, from_db_int};
use crate::store::fixed::fixed_query;
use crate::store::schema::{event, session};
use crate::store::{Conn, Error, Store, load_at_most};

/// Appends `events` to `session`'s log at time `now` and projects them.
///
/// A session's log begins with `session.next.created`, which creates it; any other first
/// event needs the session to exist, and a deleted session takes no more events.
pub fn append(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
    events: Vec<DurableEvent>,
) -> Result<Vec<Envelope>, Error> {
    let Some(first) = events.first() else {
        return Ok(Vec::new());
    };
    let id = session_id.to_string();
    if matches!(first, DurableEvent::Created(_)) {
        if lock_session(connection, session_id)?.is_some() {
            return Err(Error::SessionExists(session_id));
        }
        let appended = number(connection, now, (session_id, &id), 0, events)?;
        let last = appended.last().map_or(0, |e| e.seq);
        set_last_seq(connection, session_id, last, now)?;
        return Ok(appended);
    }
    // The counter moves first, which also takes the row lock and checks the session is
    // live (from a counter the writer remembers, its write-back does both, and the batch
    // runs again if it finds the counter moved); an error below rolls it back with the
    // events.
    let count = db_int(events.len() as u64)?;
    let Some(last) = advance(connection, &id, count, now)? else {
        // Nothing was changed: say why.
        return Err(match lock_session(connection, session_id)? {
            Some(_) => Error::SessionDeleted(session_id),
            None => Error::SessionNotFound(session_id),
        });
    };
    let base = from_db_int(last - count)?;
    number(connection, now, (session_id, &id), base, events)
}

/// Reserves `by` seqs of a live session and returns the last of them, or `None` for a
/// deleted or unknown session.
fn advance(connection: &mut Conn, id: &str, by: i64, now: i64) -> Result<Option<i64>, Error> {
    match connection {
        // SQLite runs a RETURNING clause through a temporary table: the update and a
        // lookup of the row it wrote cost about a quarter less.
        Conn::Sqlite(_) => {
            let advance = Advance {
                session_id: id,
                by,
                now,
            };
            if advance.execute(connection)? == 0 {
                return Ok(None);
            }
            Ok(Some(LastSeq { session_id: id }.get_direct(connection)?))
        }
        // The writer's batch may keep the counter in memory (see `counters`); otherwise
        // PostgreSQL answers in the same round trip, and a batch of one session's writes
        // keeps it from there.
        Conn::Pg(_) => match counters::advance(connection, id, by, now)? {
            Some(last) => Ok(Some(last)),
            None => {
                let last = AdvanceReturning {
                    session_id: id,
                    by,
                    now,
                }
                .get_direct(connection)
                .optional()?;
                if let Some(last) = last {
                    counters::adopt(connection, id, last, now)?;
                }
                Ok(last)
            }
        },
    }
}

/// Numbers `events` after `base`, projects and inserts each. The session is given as
/// its id and that id as stored.
fn number(
    connection: &mut Conn,
    now: i64,
    (session_id, id): (SessionId, &str),
    base: u64,
    events: Vec<DurableEvent>,
) -> Result<Vec<Envelope>, Error> {
    let mut appended = Vec::with_capacity(events.len());
    for (offset, event) in (1u64..).zip(events) {
        let envelope = Envelope {
            id: EventId::new(),
            session_id,
            seq: base + offset,
            time: now,
            event,
        };
        apply(connection, &envelope, id)?;
        appended.push(envelope);
    }
    Ok(appended)
}

fixed_query! {
    /// Moves a live session's counter on by `by` (no row changes for a deleted or
    /// unknown session).
    struct Advance<'a> { session_id: &'a str, by: i64, now: i64 }
    sql r#"UPDATE "session" SET "last_seq" = "last_seq" + "# {by: BigInt}
        r#", "time_updated" = "# {now: BigInt}
        r#" WHERE "id" = "# {session_id: Text} r#" AND "deleted_at" IS NULL"#
}

fixed_query! {
    /// [`Advance`], returning the counter (no row for a deleted or unknown session).
    struct AdvanceReturning<'a> { session_id: &'a str, by: i64, now: i64 }
    returns BigInt;
    sql r#"UPDATE "session" SET "last_seq" = "last_seq" + "# {by: BigInt}
        r#", "time_updated" = "# {now: BigInt}
        r#" WHERE "id" = "# {session_id: Text}
        r#" AND "deleted_at" IS NULL RETURNING "last_seq""#
}

fixed_query! {
    struct LastSeq<'a> { session_id: &'a str }
    returns BigInt;
    sql r#"SELECT "last_seq" FROM "session" WHERE "id" = "# {session_id: Text}
}

/// Adds events that already have their id, seq and time (a replay or an import) to the
/// log, projecting each. They must continue the session's log without a gap.
pub fn import(connection: &mut Conn, envelopes: &[Envelope]) -> Result<(), Error> {
    for envelope in envelopes {
        let creates = matches!(envelope.event, DurableEvent::Created(_));
        let expected = match lock_session(connection, envelope.session_id)? {
            Some(_) if creates => return Err(Error::SessionExists(envelope.session_id)),
            Some(LogHead {
                deleted_at: Some(_),
                ..
            }) => return Err(Error::SessionDeleted(envelope.session_id)),
            Some(LogHead { last_seq, .. }) => from_db_int(last_seq)? + 1,
            None if creates => 1,
            None => return Err(Error::SessionNotFound(envelope.session_id)),
        };
        if envelope.seq != expected {
            return Err(Error::Projection {
                session: envelope.session_id,
                key: key(&envelope.event),
                reason: format!(
                    "seq {} does not continue the log at {expected}",
                    envelope.seq
                ),
            });
        }
        // Checked first: after a failed insert PostgreSQL refuses further statements.
        if id_exists(connection, envelope.id)? {
            return Err(Error::DuplicateEventId(envelope.id));
        }
        apply(connection, envelope, &envelope.session_id.to_string())?;
        set_last_seq(connection, envelope.session_id, envelope.seq, envelope.time)?;
    }
    Ok(())
}

fn key(event: &DurableEvent) -> String {
    format!("{}.{}", event.type_name(), event.version())
}

/// Where a session's log stands: its last seq, and whether it was deleted.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session)]
struct LogHead {
    last_seq: i64,
    deleted_at: Option<i64>,
}

/// Locks the session row (a no-op update takes the row lock on PostgreSQL; SQLite's write
/// transaction is already exclusive) and returns where its log stands.
fn lock_session(connection: &mut Conn, session_id: SessionId) -> Result<Option<LogHead>, Error> {
    let id = session_id.to_string();
    counters::flush(connection)?;
    let locked = diesel::update(session::table.find(&id))
        .set(session::last_seq.eq(session::last_seq))
        .execute(connection)?;
    if locked == 0 {
        return Ok(None);
    }
    Ok(Some(
        session::table
            .find(&id)
            .select(LogHead::as_select())
            .get_result(connection)?,
    ))
}

fn set_last_seq(
    connection: &mut Conn,
    session_id: SessionId,
    last_seq: u64,
    time: i64,
) -> Result<(), Error> {
    let id = session_id.to_string();
    counters::forget(connection, &id)?;
    diesel::update(session::table.find(id))
        .set((
            session::last_seq.eq(db_int(last_seq)?),
            session::time_updated.eq(time),
        ))
        .execute(connection)?;
    Ok(())
}

/// Projects one event and inserts it. `session_id` is the envelope's, as stored.
fn apply(connection: &mut Conn, envelope: &Envelope, session_id: &str) -> Result<(), Error> {
    projector::project(connection, envelope, session_id)?;
    let data = envelope.event.data_json().map_err(|e| Error::Projection {
        session: envelope.session_id,
        key: key(&envelope.event),
        reason: format!("the payload does not serialize: {e}"),
    })?;
    let version = envelope.event.version();
    let row = rows::Row {
        session_id: session_id.to_owned(),
        seq: db_int(envelope.seq)?,
        id: envelope.id.to_string(),
        type_name: envelope.event.type_name(),
        version: i32::try_from(version)
            .map_err(|_| Error::Corrupt(format!("event version {version} is too large")))?,
        data,
        time: envelope.time,
    };
    rows::insert(connection, row)?;
    Ok(())
}

fn id_exists(connection: &mut Conn, id: EventId) -> Result<bool, Error> {
    rows::flush(connection)?;
    let count: i64 = event::table
        .filter(event::id.eq(id.to_string()))
        .count()
        .get_direct(connection)?;
    Ok(count > 0)
}

/// A row of `event`, as stored.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = event)]
struct EventRow {
    session_id: String,
    seq: i64,
    id: String,
    type_name: String,
    version: i32,
    data: String,
    time: i64,
}

impl EventRow {
    fn into_raw(self) -> Result<RawEvent, Error> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            Error::Corrupt(format!(
                "event {}#{}: {what}: {e}",
                self.session_id, self.seq
            ))
        };
        Ok(RawEvent {
            id: self.id.parse().map_err(|e| corrupt("id", &e))?,
            session_id: self
                .session_id
                .parse()
                .map_err(|e| corrupt("session id", &e))?,
            seq: from_db_int(self.seq)?,
            version: u32::try_from(self.version).map_err(|e| corrupt("version", &e))?,
            data: serde_json::from_str(&self.data).map_err(|e| corrupt("data is not JSON", &e))?,
            type_name: self.type_name,
            time: self.time,
        })
    }
}

/// The session's events with seq greater than `after`, at most `limit`, as stored.
pub fn read_raw(
    connection: &mut Conn,
    session_id: SessionId,
    after: u64,
    limit: u32,
) -> Result<Vec<RawEvent>, Error> {
    rows::flush(connection)?;
    let query = event::table
        .filter(event::session_id.eq(session_id.to_string()))
        .filter(event::seq.gt(db_int(after)?))
        .order(event::seq.asc())
        .select(EventRow::as_select());
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let rows: Vec<EventRow> = load_at_most(connection, query, limit)?;
    rows.into_iter().map(EventRow::into_raw).collect()
}

/// The session's latest event of type `type_name` with seq greater than `after`, decoded:
/// a read of one step's record that does not decode the whole step.
pub fn latest_of_type(
    connection: &mut Conn,
    session_id: SessionId,
    after: u64,
    type_name: &str,
) -> Result<Option<Envelope>, Error> {
    rows::flush(connection)?;
    let row: Option<EventRow> = event::table
        .filter(event::session_id.eq(session_id.to_string()))
        .filter(event::seq.gt(db_int(after)?))
        .filter(event::type_name.eq(type_name))
        .order(event::seq.desc())
        .select(EventRow::as_select())
        .first(connection)
        .optional()?;
    row.map(|row| decode(session_id, row.into_raw()?))
        .transpose()
}

/// The session's events with seq greater than `after`, at most `limit`, decoded into the
/// latest shapes.
pub fn read(
    connection: &mut Conn,
    session_id: SessionId,
    after: u64,
    limit: u32,
) -> Result<Vec<Envelope>, Error> {
    read_raw(connection, session_id, after, limit)?
        .into_iter()
        .map(|raw| decode(session_id, raw))
        .collect()
}

/// Decodes a stored event into the latest shape.
fn decode(session_id: SessionId, raw: RawEvent) -> Result<Envelope, Error> {
    let seq = raw.seq;
    raw.decode().map_err(|source| Error::Decode {
        session: session_id,
        seq,
        source,
    })
}

/// The seq of the session's latest event, or `None` if there is no such session.
pub fn last_seq(connection: &mut Conn, session_id: SessionId) -> Result<Option<u64>, Error> {
    counters::flush(connection)?;
    session::table
        .find(session_id.to_string())
        .select(session::last_seq)
        .get_result::<i64>(connection)
        .optional()?
        .map(from_db_int)
        .transpose()
}

impl Store {
    /// Appends events to a session's log (see [`append`]), stamped with the store's clock.
    pub async fn append(
        &self,
        session_id: SessionId,
        events: Vec<DurableEvent>,
    ) -> Result<Vec<Envelope>, Error> {
        let clock = self.clock().clone();
        self.write_for(session_id, move |c| {
            append(c, clock.now_ms(), session_id, events.clone())
        })
        .await
    }

    /// Reads a session's events after `after` (see [`read`]), up to the last one on disk:
    /// events of a deferred commit not yet synced are not shown
    /// ([`Store::write_deferred`]).
    pub async fn read_log(
        &self,
        session_id: SessionId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<Envelope>, Error> {
        let mut events = self
            .read(move |c| read(c, session_id, after, limit))
            .await?;
        // Looked at after the read: a hold is taken before its commit makes rows visible
        // and released only once they are on disk, so whatever the read saw past a hold
        // still standing now is not on disk yet.
        if let Some(limit) = self.durable_limit(session_id) {
            events.retain(|event| event.seq <= limit);
        }
        Ok(events)
    }

    /// The seq of a session's latest event, `None` for an unknown session.
    pub async fn last_seq(&self, session_id: SessionId) -> Result<Option<u64>, Error> {
        self.read(move |c| last_seq(c, session_id)).await
    }
}
