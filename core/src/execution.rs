//! Execution claims: who runs a session's execution, until when, fenced.
//!
//! A claim is the `session_execution` row. [`acquire`] inserts it, and `session_id` is
//! UNIQUE, so exactly one owner wins; it never replaces an existing claim, even an expired
//! one (reconciling expired claims belongs to recovery alone). The lease is
//! `expires_at = now + lease`, renewed by the owner for the claims it is running
//! ([`renew`]). A claim in phase `cancelling` stays there: a step start or a compaction's
//! end after an interrupt updates its assistant message but not its phase, so a crash
//! after an interrupt never lets recovery continue work the user stopped.
//!
//! **The fence.** Every durable write made on behalf of an execution runs through
//! [`fenced`]: in the write's transaction it first updates the claim
//! `WHERE id = ? AND session_id = ? AND owner_id = ? AND expires_at > now` (renewing it)
//! and requires exactly one affected row; otherwise the whole transaction rolls back with
//! [`Error::OwnershipLost`]. A process that lost its claim (paused past its lease, or
//! recovered by another node) can therefore never write into the session again.
//!
//! The fence compares the writer's clock with a lease written by (possibly) another
//! node's clock: Keel assumes clock skew between nodes plus scheduling delay stays well
//! below the lease (default 30 s). See `docs/execution.md`.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{ExecutionId, MessageId, OwnerId, SessionId};
use keel_schema::types::{ErrorInfo, Outcome, Phase};

use crate::event::log;
use crate::store::Direct as _;
use crate::store::column::{db_int, from_db_int, parse_text, text_of};
use crate::store::fixed::fixed_query;
use crate::store::on_backend;
use crate::store::schema::session_execution;
use crate::store::{self, Conn};

/// What can go wrong with a claim.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The claim is gone, belongs to another owner, or its lease expired: this process
    /// no longer runs the execution and must stop without writing.
    #[error("ownership of execution {execution_id} of session {session_id} was lost")]
    OwnershipLost {
        execution_id: ExecutionId,
        session_id: SessionId,
    },
    #[error(transparent)]
    Store(#[from] store::Error),
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Self::Store(e.into())
    }
}

/// The identity of a claim: what the fence matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claim {
    pub id: ExecutionId,
    pub session_id: SessionId,
    pub owner_id: OwnerId,
}

/// A claim row as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRow {
    pub claim: Claim,
    pub phase: Phase,
    pub assistant_message_id: Option<MessageId>,
    pub assistant_seq: Option<u64>,
    pub time_created: i64,
    pub expires_at: i64,
    pub recovery_error: Option<String>,
}

/// A row of `session_execution`, as stored.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_execution)]
struct Row {
    id: String,
    session_id: String,
    owner_id: String,
    assistant_message_id: Option<String>,
    assistant_seq: Option<i64>,
    phase: String,
    time_created: i64,
    expires_at: i64,
    recovery_error: Option<String>,
}

impl Row {
    fn into_claim(self) -> Result<ClaimRow, store::Error> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            store::Error::Corrupt(format!("claim {} {what}: {e}", self.id))
        };
        Ok(ClaimRow {
            claim: Claim {
                id: self.id.parse().map_err(|e| corrupt("id", &e))?,
                session_id: self
                    .session_id
                    .parse()
                    .map_err(|e| corrupt("session", &e))?,
                owner_id: self.owner_id.parse().map_err(|e| corrupt("owner", &e))?,
            },
            phase: parse_text("session_execution.phase", &self.phase)?,
            assistant_message_id: self
                .assistant_message_id
                .as_deref()
                .map(|a| a.parse().map_err(|e| corrupt("assistant", &e)))
                .transpose()?,
            assistant_seq: self.assistant_seq.map(from_db_int).transpose()?,
            time_created: self.time_created,
            expires_at: self.expires_at,
            recovery_error: self.recovery_error,
        })
    }
}

/// The session's claim, if any.
pub fn get(connection: &mut Conn, session_id: SessionId) -> Result<Option<ClaimRow>, store::Error> {
    on_backend!(connection, |c| session_execution::table
        .filter(session_execution::session_id.eq(session_id.to_string()))
        .select(Row::as_select())
        .get_result(c))
    .optional()?
    .map(Row::into_claim)
    .transpose()
}

/// Claims the session's execution for `owner_id`, appending `execution.started` in the
/// same transaction. Returns `None` when a claim exists already (live or expired).
pub fn acquire(
    connection: &mut Conn,
    now: i64,
    lease_ms: i64,
    session_id: SessionId,
    owner_id: OwnerId,
) -> Result<Option<(Claim, Envelope)>, store::Error> {
    if get(connection, session_id)?.is_some() {
        return Ok(None);
    }
    let claim = Claim {
        id: ExecutionId::new(),
        session_id,
        owner_id,
    };
    // A savepoint: losing the race for the UNIQUE session_id (another node inserted
    // between our read and our insert) must leave the caller's transaction usable.
    let inserted = connection.transaction(|c| {
        diesel::insert_into(session_execution::table)
            .values((
                session_execution::id.eq(claim.id.to_string()),
                session_execution::session_id.eq(session_id.to_string()),
                session_execution::owner_id.eq(owner_id.to_string()),
                session_execution::phase.eq(text_of(&Phase::Claimed)),
                session_execution::time_created.eq(now),
                session_execution::expires_at.eq(now + lease_ms),
            ))
            .execute(c)
    });
    match inserted {
        Ok(_) => {}
        Err(diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::UniqueViolation,
            _,
        )) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let started = log::append(
        connection,
        now,
        session_id,
        vec![DurableEvent::ExecutionStarted(payload::ExecutionStarted {
            execution_id: claim.id,
            owner_id,
        })],
    )?;
    let envelope = started
        .into_iter()
        .next()
        .ok_or_else(|| store::Error::Corrupt("appending execution.started wrote nothing".into()))?;
    Ok(Some((claim, envelope)))
}

/// The fence alone: renews the claim if and only if `claim` still owns an unexpired lease.
pub fn check(connection: &mut Conn, now: i64, lease_ms: i64, claim: &Claim) -> Result<(), Error> {
    let (id, session_id, owner_id) = (
        claim.id.to_string(),
        claim.session_id.to_string(),
        claim.owner_id.to_string(),
    );
    let updated = Renew {
        id: &id,
        session_id: &session_id,
        owner_id: &owner_id,
        now,
        expires_at: now + lease_ms,
    }
    .execute(connection)?;
    if updated == 1 {
        Ok(())
    } else {
        Err(Error::OwnershipLost {
            execution_id: claim.id,
            session_id: claim.session_id,
        })
    }
}

fixed_query! {
    /// The fence's statement: renews the exact claim while its lease runs. Every durable
    /// write of a step runs it.
    struct Renew<'a> {
        id: &'a str,
        session_id: &'a str,
        owner_id: &'a str,
        now: i64,
        expires_at: i64,
    }
    sql r#"UPDATE "session_execution" SET "expires_at" = "# {expires_at: BigInt}
        r#" WHERE "id" = "# {id: Text} r#" AND "session_id" = "# {session_id: Text}
        r#" AND "owner_id" = "# {owner_id: Text} r#" AND "expires_at" > "# {now: BigInt}
}

fixed_query! {
    /// Sets the phase (unless the claim is cancelling) and the assistant message of the
    /// exact claim.
    struct SetPhase<'a> {
        id: &'a str,
        owner_id: &'a str,
        phase: &'a str,
        message: Option<&'a str>,
        seq: Option<i64>,
    }
    sql r#"UPDATE "session_execution" SET "phase" = CASE WHEN "phase" = 'cancelling' THEN "phase" ELSE "# {phase: Text}
        r#" END, "assistant_message_id" = "# {message: Nullable<Text>}
        r#", "assistant_seq" = "# {seq: Nullable<BigInt>}
        r#" WHERE "id" = "# {id: Text} r#" AND "owner_id" = "# {owner_id: Text}
}

fixed_query! {
    /// Sets the phase of the exact claim (unless it is cancelling), keeping its assistant
    /// message.
    struct SetPhaseOnly<'a> { id: &'a str, owner_id: &'a str, phase: &'a str }
    sql r#"UPDATE "session_execution" SET "phase" = CASE WHEN "phase" = 'cancelling' THEN "phase" ELSE "# {phase: Text}
        r#" END WHERE "id" = "# {id: Text} r#" AND "owner_id" = "# {owner_id: Text}
}

/// Runs `write` behind the fence, in the caller's transaction: the fence first, then the
/// write. Any error rolls both back.
pub fn fenced<T, E>(
    connection: &mut Conn,
    now: i64,
    lease_ms: i64,
    claim: &Claim,
    write: impl FnOnce(&mut Conn) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<Error>,
{
    check(connection, now, lease_ms, claim)?;
    write(connection)
}

/// Renews the live leases of `claims` (held by `owner_id`); returns how many. Only the
/// claims the owner is running are named: one whose release failed is left to expire,
/// so recovery takes it instead of the session staying busy. Expired leases are not
/// renewed: they belong to recovery.
pub fn renew(
    connection: &mut Conn,
    now: i64,
    lease_ms: i64,
    owner_id: OwnerId,
    claims: &[ExecutionId],
) -> Result<usize, store::Error> {
    let mut renewed = 0;
    for chunk in claims.chunks(RENEW_CHUNK) {
        let ids: Vec<String> = chunk.iter().map(ToString::to_string).collect();
        renewed += diesel::update(
            session_execution::table
                .filter(session_execution::id.eq_any(ids))
                .filter(session_execution::owner_id.eq(owner_id.to_string()))
                .filter(session_execution::expires_at.gt(now)),
        )
        .set(session_execution::expires_at.eq(now + lease_ms))
        .execute(connection)?;
    }
    Ok(renewed)
}

/// Claims renewed per statement (SQLite binds each id of an `IN` list).
const RENEW_CHUNK: usize = 500;

/// The sessions whose claims `owner_id` holds with a lease still running at `now`, with
/// each claim's phase (a `cancelling` the owner did not set itself is an interrupt
/// another node recorded: [`request_cancel`]).
pub fn live_sessions(
    connection: &mut Conn,
    now: i64,
    owner_id: OwnerId,
) -> Result<Vec<(SessionId, Phase)>, store::Error> {
    let rows: Vec<(String, String)> = session_execution::table
        .filter(session_execution::owner_id.eq(owner_id.to_string()))
        .filter(session_execution::expires_at.gt(now))
        .select((session_execution::session_id, session_execution::phase))
        .load_direct(connection)?;
    rows.into_iter()
        .map(|(id, phase)| {
            let session = id
                .parse()
                .map_err(|e| store::Error::Corrupt(format!("claim session {id}: {e}")))?;
            Ok((session, parse_text("session_execution.phase", &phase)?))
        })
        .collect()
}

/// Records an interrupt of `session`'s execution, whichever process runs it: the claim's
/// phase becomes `cancelling`. Returns the claim, or `None` when there is no claim to
/// stop (or it is quarantined). Once committed, the interrupt cannot be lost:
/// the owner stops the execution when the interrupt reaches it or, at the latest, at its
/// next lease renewal, and recovery settles a cancelling claim (`step.recovered`), never
/// continuing it. Not fenced: it is not a write of the execution's own.
pub fn request_cancel(
    connection: &mut Conn,
    session: SessionId,
) -> Result<Option<Claim>, store::Error> {
    let claim: Option<(String, String)> = diesel::update(
        session_execution::table
            .filter(session_execution::session_id.eq(session.to_string()))
            .filter(session_execution::recovery_error.is_null()),
    )
    .set(session_execution::phase.eq(text_of(&Phase::Cancelling)))
    .returning((session_execution::id, session_execution::owner_id))
    .get_direct(connection)
    .optional()?;
    let corrupt = |what: &str, e: &dyn std::fmt::Display| {
        store::Error::Corrupt(format!("claim of session {session}: {what}: {e}"))
    };
    claim
        .map(|(id, owner)| {
            Ok(Claim {
                id: id.parse().map_err(|e| corrupt("id", &e))?,
                session_id: session,
                owner_id: owner.parse().map_err(|e| corrupt("owner", &e))?,
            })
        })
        .transpose()
}

/// Expires every lease of `owner_id` now, handing its executions to recovery at once (a
/// graceful shutdown).
pub fn expire_all(
    connection: &mut Conn,
    now: i64,
    owner_id: OwnerId,
) -> Result<usize, store::Error> {
    Ok(diesel::update(
        session_execution::table.filter(session_execution::owner_id.eq(owner_id.to_string())),
    )
    .set(session_execution::expires_at.eq(now))
    .execute(connection)?)
}

/// Sets the claim's phase and, when given, its assistant message (fenced by the caller).
pub fn set_phase(
    connection: &mut Conn,
    claim: &Claim,
    phase: Phase,
    assistant: Option<(MessageId, u64)>,
) -> Result<(), Error> {
    let (id, owner_id, phase) = (
        &claim.id.to_string(),
        &claim.owner_id.to_string(),
        &text_of(&phase),
    );
    let updated = match assistant {
        Some((message, seq)) => SetPhase {
            id,
            owner_id,
            phase,
            message: Some(&message.to_string()),
            seq: Some(db_int(seq)?),
        }
        .execute(connection)?,
        None => SetPhaseOnly {
            id,
            owner_id,
            phase,
        }
        .execute(connection)?,
    };
    if updated == 1 {
        Ok(())
    } else {
        Err(Error::OwnershipLost {
            execution_id: claim.id,
            session_id: claim.session_id,
        })
    }
}

/// Settles the execution: `execution.settled` and the deletion of the exact claim row in
/// one fenced transaction (the caller's).
pub fn release(
    connection: &mut Conn,
    now: i64,
    lease_ms: i64,
    claim: &Claim,
    outcome: Outcome,
    error: Option<ErrorInfo>,
) -> Result<Envelope, Error> {
    fenced(connection, now, lease_ms, claim, |c| {
        let settled = log::append(
            c,
            now,
            claim.session_id,
            vec![DurableEvent::ExecutionSettled(payload::ExecutionSettled {
                execution_id: claim.id,
                outcome,
                error,
            })],
        )?;
        diesel::delete(
            session_execution::table
                .filter(session_execution::id.eq(claim.id.to_string()))
                .filter(session_execution::owner_id.eq(claim.owner_id.to_string())),
        )
        .execute(c)?;
        settled.into_iter().next().ok_or_else(|| {
            store::Error::Corrupt("appending execution.settled wrote nothing".into()).into()
        })
    })
}
