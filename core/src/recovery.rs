//! Recovery: taking over executions whose owner died, exactly once.
//!
//! A pass runs at start and then every half lease, or at once again while the previous
//! pass found a full batch ([`run`]). It
//! 1. selects expired claims that are not quarantined, a bounded batch
//!    ([`BATCH_SIZE`]) in the order of `session_execution_recovery_scan_idx`;
//! 2. validates each row; a row that cannot be trusted (unknown phase, an assistant that
//!    is not this session's, an assistant superseded by a newer one) is quarantined:
//!    `recovery_error` set, logged, shown by the status route, never retried
//!    automatically, and never in the way of valid rows (it leaves the scan);
//! 3. recovers each valid row in one transaction, conditioned on the exact claim (id,
//!    owner, `expires_at`), so a claim settled or renewed since it was selected is left
//!    alone and a live lease is never taken: `step.recovered` for the step that was
//!    running (its projection fails the unresolved tool calls with
//!    `tool.interrupted-by-crash`, so no write tool is run twice), `execution.settled
//!    {outcome: recovered}`, deletion of the claim, and, when a step was cut off, the
//!    admission of one continuation input whose id derives from the dead execution's id,
//!    so a second pass can never recover the same execution again;
//! 4. wakes the recovered sessions, and redrives ordinary intent whose wake was lost:
//!    sessions not deleted and with no claim that have inputs admitted with execution
//!    requested, still pending (unless a step there waits for a person), or a reply to a
//!    step that waits, one batch per pass from a cursor that wraps around ([`Recovery`]);
//!    each is checked again at the moment of its wake, so work settled, cancelled or
//!    claimed since the selection is not woken.
//!
//! A session recovered [`MAX_ATTEMPTS`] times in a row (no execution settling otherwise
//! in between) is not continued again: its execution settles `failed` with
//! `recovery.attempts-exhausted`, so a crash loop ends with a clear error.

use std::ops::Bound;
use std::time::Duration;

use diesel::prelude::*;
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{CallId, ExecutionId, InputId, MessageId, SessionId};
use keel_schema::types::{Delivery, ErrorInfo, InputKind, InputSource, Outcome, Part, Phase};
use tokio_util::sync::CancellationToken;

use crate::coordinator::Scope;
use crate::event::log;
use crate::inbox::{self, Admission};
use crate::runner::Runner;
use crate::store::Direct as _;
use crate::store::column::parse_text;
use crate::store::schema::{
    event, session, session_execution, session_input, session_message, session_request,
};
use crate::store::{self, Conn, Store};

/// The claim exactly as it was selected, still expired at `now`: what recovery may touch.
/// The phase is part of it: an interrupt recorded on an expired claim after the selection
/// (`execution::request_cancel`) must not be recovered as the running work it was.
macro_rules! selected {
    ($candidate:expr, $now:expr) => {
        session_execution::table
            .filter(session_execution::id.eq(&$candidate.id))
            .filter(session_execution::owner_id.eq(&$candidate.owner_id))
            .filter(session_execution::phase.eq(&$candidate.phase))
            .filter(session_execution::expires_at.eq($candidate.expires_at))
            .filter(session_execution::expires_at.le($now))
            .filter(session_execution::recovery_error.is_null())
    };
}

/// The recovery scan: one batch of expired, unquarantined claims in the order of
/// `session_execution_recovery_scan_idx` (`recovery_error`, `expires_at`, `time_created`,
/// `id`), so the database reads the batch off that index.
macro_rules! scan {
    ($now:expr) => {
        session_execution::table
            .filter(session_execution::recovery_error.is_null())
            .filter(session_execution::expires_at.le($now))
            .order((
                session_execution::expires_at.asc(),
                session_execution::time_created.asc(),
                session_execution::id.asc(),
            ))
            .limit(BATCH_SIZE)
            .select(Candidate::as_select())
    };
}

/// Claims examined per pass; the rest wait for the next pass.
pub const BATCH_SIZE: i64 = 256;

/// Recoveries of one session in a row after which its execution fails instead.
pub const MAX_ATTEMPTS: usize = 10;

/// The continuation the model sees after a recovery.
pub const CONTINUATION: &str = "Keel restarted while you were working. Tool calls that were \
    running did not finish and were not run again; their results say so. Check their effect \
    before repeating any, then continue.";

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Sessions whose abandoned execution was settled; each is woken to go on.
    pub recovered: Vec<SessionId>,
    /// Sessions whose abandoned execution failed: too many recoveries in a row.
    pub exhausted: Vec<SessionId>,
    /// Claims set aside.
    pub quarantined: Vec<Quarantined>,
    /// Sessions with pending, requested work and no claim, woken again.
    pub redriven: Vec<SessionId>,
    /// The pass found a full batch of expired claims: more may be waiting, so the next
    /// pass should start at once.
    pub backlog: bool,
}

/// A claim recovery set aside, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    /// The claim's id as stored (it may not even parse).
    pub claim: String,
    pub reason: String,
}

impl Report {
    pub fn is_empty(&self) -> bool {
        self == &Report::default()
    }
}

/// A claim row as selected, before validation: plain text, so a corrupt row can still
/// be named and quarantined.
#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = session_execution)]
struct Candidate {
    id: String,
    session_id: String,
    owner_id: String,
    assistant_message_id: Option<String>,
    phase: String,
    expires_at: i64,
}

/// What recovering one candidate came to.
enum Recovered {
    Continued(SessionId, Vec<Envelope>),
    Exhausted(SessionId, Vec<Envelope>),
    /// Settled, renewed or taken since it was selected: left alone.
    Moved,
    Quarantine(String),
}

/// Runs a pass now and then every half lease until `shutdown`; while a pass finds a full
/// batch (a backlog, after a crash that left many sessions), the next starts at once.
pub async fn run(runner: Runner, lease_ms: i64, shutdown: CancellationToken) {
    let period = Duration::from_millis(u64::try_from(lease_ms / 2).unwrap_or(1).max(1));
    let mut recovery = Recovery::default();
    loop {
        let mut backlog = false;
        match recovery.pass(&runner).await {
            Ok(report) if !report.is_empty() => {
                backlog = report.backlog;
                tracing::info!(
                    recovered = report.recovered.len(),
                    exhausted = report.exhausted.len(),
                    quarantined = report.quarantined.len(),
                    redriven = report.redriven.len(),
                    "recovery pass"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "a recovery pass failed; retrying next period"),
        }
        let pause = if backlog { Duration::ZERO } else { period };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// Recovery's state between passes: where the next redrive scan starts.
#[derive(Debug, Default)]
pub struct Recovery {
    /// The last session the previous pass redrove. The next scan starts after it and
    /// wraps around, so sessions whose wake keeps failing cannot starve the ones behind a
    /// full batch. (Expired claims need no cursor: each one examined leaves the scan,
    /// settled or quarantined.)
    redrive_after: Option<String>,
}

impl Recovery {
    /// One pass: settle the abandoned executions of one batch and wake their sessions,
    /// then redrive one batch of lost wakes.
    pub async fn pass(&mut self, runner: &Runner) -> Result<Report, store::Error> {
        let store = runner.store().clone();
        let mut report = settle_abandoned(&store, |envelopes| runner.publish(envelopes)).await?;
        for &session in &report.recovered {
            runner.wake(session, Scope::Input);
        }
        let after = self.redrive_after.clone();
        let lost = store.read(move |c| lost_wakes(c, after.as_deref())).await?;
        self.redrive_after = lost.last().map(ToString::to_string);
        report.redriven = redrive(
            &store,
            lost,
            |session| runner.is_busy(session),
            |session| runner.wake(session, Scope::Input),
        )
        .await?;
        crate::metrics::recovery_pass(report.recovered.len(), report.quarantined.len());
        Ok(report)
    }
}

/// Wakes the selected lost wakes that are still lost at the moment of their wake (the
/// compare-and-set): a session this process is busy with, or whose work was settled,
/// cancelled or claimed since the selection, is not woken, so no execution starts (and no
/// `execution.started` is written) for work that is gone. What is left between that
/// re-check and the wake is harmless: a wake only asks for a drain, which claims the
/// session atomically. Returns the sessions woken.
async fn redrive(
    store: &Store,
    lost: Vec<SessionId>,
    busy: impl Fn(SessionId) -> bool,
    wake: impl Fn(SessionId),
) -> Result<Vec<SessionId>, store::Error> {
    let mut woken = Vec::new();
    for session in lost {
        if busy(session) {
            continue;
        }
        let id = session.to_string();
        let still_lost = store
            .read(move |c| {
                lost_wakes_between(c, Bound::Included(&id), Bound::Included(&id), 1)
                    .map(|ids| !ids.is_empty())
            })
            .await?;
        if still_lost {
            wake(session);
            woken.push(session);
        }
    }
    Ok(woken)
}

/// The database half of a pass: validates one batch of expired claims, quarantines the
/// invalid ones and settles the rest, handing what it wrote to `publish`. Wakes nothing.
pub async fn settle_abandoned(
    store: &Store,
    publish: impl Fn(&[Envelope]),
) -> Result<Report, store::Error> {
    let mut report = Report::default();
    let now = store.clock().now_ms();
    let candidates = store.read(move |c| expired(c, now)).await?;
    report.backlog = candidates.len() >= BATCH_SIZE as usize;
    // Every settlement is submitted at once, so the writer commits the batch together (one
    // fsync, not one per claim); one that fails undoes only itself, leaving the others
    // settled. Each goes to its session's writer, in order with the session's writes.
    let settlements = candidates.iter().map(|candidate| {
        let clock = store.clock().clone();
        let attempt = candidate.clone();
        let session = attempt.session_id.parse::<SessionId>().ok();
        let settle = move |c: &mut Conn| recover(c, clock.now_ms(), &attempt);
        async move {
            match session {
                Some(session) => store.write_for(session, settle).await,
                // A malformed id is judged by the write, which sets the claim aside.
                None => store.write(settle).await,
            }
        }
    });
    let outcomes = futures::future::join_all(settlements).await;
    for (candidate, recovered) in candidates.into_iter().zip(outcomes) {
        let id = candidate.id.clone();
        match recovered {
            Ok(Recovered::Continued(session, envelopes)) => {
                publish(&envelopes);
                tracing::warn!(%session, claim = %id, "recovered an abandoned execution");
                report.recovered.push(session);
            }
            Ok(Recovered::Exhausted(session, envelopes)) => {
                publish(&envelopes);
                tracing::error!(%session, claim = %id, "recovery attempts exhausted; the execution failed");
                report.exhausted.push(session);
            }
            Ok(Recovered::Moved) => {}
            Ok(Recovered::Quarantine(reason)) => {
                tracing::error!(claim = %id, session = %candidate.session_id, %reason, "claim quarantined");
                report.quarantined.push(Quarantined { claim: id, reason });
            }
            Err(e) => {
                // A row the database refuses to settle (a broken reference, say) must not
                // hold the rest back; it is set aside with the reason.
                let reason = format!("recovering failed: {e}");
                if quarantine(store, &candidate, &reason).await? {
                    report.quarantined.push(Quarantined { claim: id, reason });
                }
            }
        }
    }
    Ok(report)
}

/// One batch of expired, unquarantined claims, in scan-index order.
fn expired(connection: &mut Conn, now: i64) -> Result<Vec<Candidate>, store::Error> {
    Ok(scan!(now).load(connection)?)
}

/// One batch of sessions with an input admitted with execution requested, still pending,
/// and no claim: their wake was lost (the process died between admission and wake, say).
/// In session id order, starting after `after` and wrapping around.
fn lost_wakes(connection: &mut Conn, after: Option<&str>) -> Result<Vec<SessionId>, store::Error> {
    let from = after.map_or(Bound::Unbounded, Bound::Excluded);
    let mut ids = lost_wakes_between(connection, from, Bound::Unbounded, BATCH_SIZE)?;
    let missing = BATCH_SIZE - i64::try_from(ids.len()).unwrap_or(BATCH_SIZE);
    if let Some(after) = after
        && missing > 0
    {
        ids.extend(lost_wakes_between(
            connection,
            Bound::Unbounded,
            Bound::Included(after),
            missing,
        )?);
    }
    ids.into_iter()
        .map(|id| {
            id.parse()
                .map_err(|e| store::Error::Corrupt(format!("input session {id}: {e}")))
        })
        .collect()
}

/// Lost wakes with a session id between `from` and `to`, at most `limit`, in order:
/// sessions with no claim and either an input that asked for execution (unless a step
/// there waits for a person: its inputs wait for its end) or a reply to a waiting step.
fn lost_wakes_between(
    connection: &mut Conn,
    from: Bound<&str>,
    to: Bound<&str>,
    limit: i64,
) -> Result<Vec<String>, store::Error> {
    let claimed = || session_execution::table.select(session_execution::session_id);
    // A deleted session takes no more events: waking it could only fail.
    let deleted = || {
        session::table
            .filter(session::deleted_at.is_not_null())
            .select(session::id)
    };
    let waiting = session_request::table
        .filter(session_request::state.ne("settled"))
        .select(session_request::session_id);
    let mut inputs = session_input::table
        .filter(session_input::execution_requested.eq(true))
        .filter(session_input::promoted_seq.is_null())
        .filter(session_input::cancelled_seq.is_null())
        .filter(session_input::session_id.ne_all(claimed()))
        .filter(session_input::session_id.ne_all(deleted()))
        .filter(session_input::session_id.ne_all(waiting))
        .select(session_input::session_id)
        .distinct()
        .order(session_input::session_id.asc())
        .limit(limit)
        .into_boxed();
    let mut replies = session_request::table
        .filter(session_request::state.eq("answered"))
        .filter(session_request::session_id.ne_all(claimed()))
        .filter(session_request::session_id.ne_all(deleted()))
        .select(session_request::session_id)
        .distinct()
        .order(session_request::session_id.asc())
        .limit(limit)
        .into_boxed();
    match from {
        Bound::Included(id) => {
            inputs = inputs.filter(session_input::session_id.ge(id.to_owned()));
            replies = replies.filter(session_request::session_id.ge(id.to_owned()));
        }
        Bound::Excluded(id) => {
            inputs = inputs.filter(session_input::session_id.gt(id.to_owned()));
            replies = replies.filter(session_request::session_id.gt(id.to_owned()));
        }
        Bound::Unbounded => {}
    }
    match to {
        Bound::Included(id) => {
            inputs = inputs.filter(session_input::session_id.le(id.to_owned()));
            replies = replies.filter(session_request::session_id.le(id.to_owned()));
        }
        Bound::Excluded(id) => {
            inputs = inputs.filter(session_input::session_id.lt(id.to_owned()));
            replies = replies.filter(session_request::session_id.lt(id.to_owned()));
        }
        Bound::Unbounded => {}
    }
    let mut ids: Vec<String> = inputs.load(connection)?;
    ids.extend(replies.load::<String>(connection)?);
    ids.sort_unstable();
    ids.dedup();
    ids.truncate(usize::try_from(limit).unwrap_or(0));
    Ok(ids)
}

/// Sets the selected claim aside after its recovery failed; false when the claim changed
/// meanwhile (then it is not this pass's to judge).
async fn quarantine(
    store: &Store,
    candidate: &Candidate,
    reason: &str,
) -> Result<bool, store::Error> {
    tracing::error!(claim = %candidate.id, session = %candidate.session_id, %reason, "claim quarantined");
    let (candidate, reason) = (candidate.clone(), reason.to_owned());
    let clock = store.clock().clone();
    store
        .write(move |c| {
            diesel::update(selected!(candidate, clock.now_ms()))
                .set(session_execution::recovery_error.eq(&reason))
                .execute(c)
                .map(|updated| updated == 1)
                .map_err(store::Error::from)
        })
        .await
}

/// Validates and recovers one claim, in the caller's transaction. Everything it does is
/// conditioned on the claim being exactly the one selected (the compare-and-set): a claim
/// renewed, settled or replaced since is left alone, never quarantined or recovered.
fn recover(
    connection: &mut Conn,
    now: i64,
    candidate: &Candidate,
) -> Result<Recovered, store::Error> {
    let unchanged = selected!(candidate, now)
        .count()
        .get_result::<i64>(connection)?
        == 1;
    if !unchanged {
        return Ok(Recovered::Moved);
    }
    let verdict = validate(connection, candidate)?;
    let (session, execution, phase, open_step) = match verdict {
        Ok(valid) => valid,
        Err(reason) => {
            diesel::update(selected!(candidate, now))
                .set(session_execution::recovery_error.eq(&reason))
                .execute(connection)?;
            return Ok(Recovered::Quarantine(reason));
        }
    };
    let deleted = diesel::delete(selected!(candidate, now)).execute(connection)?;
    if deleted != 1 {
        return Ok(Recovered::Moved);
    }

    let exhausted = recoveries_in_a_row(connection, session)? + 1 >= MAX_ATTEMPTS;
    let mut events = Vec::new();
    // Calls an earlier recovery let run again, cut off again: they fail now (once only).
    for call_id in rerun_pending(connection, session)? {
        events.push(DurableEvent::ToolFailed(payload::ToolFailed {
            call_id,
            error: crate::event::projector::crashed_tool_error(),
        }));
    }
    if let Some(assistant_message_id) = open_step {
        events.push(DurableEvent::StepRecovered(payload::StepRecovered {
            assistant_message_id,
            execution_id: execution,
            rerun: rerunnable(connection, session, assistant_message_id)?,
        }));
    }
    events.push(DurableEvent::ExecutionSettled(payload::ExecutionSettled {
        execution_id: execution,
        outcome: if exhausted {
            Outcome::Failed
        } else {
            Outcome::Recovered
        },
        error: exhausted.then(|| {
            ErrorInfo::new(
                "recovery.attempts-exhausted",
                format!(
                    "the session's execution was abandoned {MAX_ATTEMPTS} times in a row; \
                     Keel stopped continuing it. Send a prompt to go on."
                ),
            )
        }),
    }));
    let mut envelopes = log::append(connection, now, session, events)?;
    if exhausted {
        return Ok(Recovered::Exhausted(session, envelopes));
    }
    if !needs_continuation(phase, open_step) {
        return Ok(Recovered::Continued(session, envelopes));
    }
    let before = log::last_seq(connection, session)?.unwrap_or(0);
    let continuation = Admission {
        id: Some(InputId::from_ulid(execution.ulid())),
        kind: InputKind::Prompt,
        parts: vec![Part::Text {
            text: CONTINUATION.into(),
        }],
        delivery: Delivery::Steer,
        source: InputSource::Recovery,
        request_execution: true,
    };
    inbox::admit(connection, now, session, continuation).map_err(|e| match e {
        inbox::Error::Store(e) => e,
        // The continuation's id derives from an execution settled in this transaction,
        // so any other refusal means the session's rows are not what Keel writes.
        other => store::Error::Corrupt(format!("admitting the continuation: {other}")),
    })?;
    envelopes.extend(log::read(connection, session, before, u32::MAX)?);
    Ok(Recovered::Continued(session, envelopes))
}

/// The calls of `step` a crash cut off that may run again: those whose `tool.called`
/// said so, that had started (a call still waiting for a person never ran, and never
/// runs without the reply). The rest fail with the step's `step.recovered`.
fn rerunnable(
    connection: &mut Conn,
    session: SessionId,
    step: MessageId,
) -> Result<Vec<CallId>, store::Error> {
    use crate::store::schema::{session_request, session_tool};
    let session = session.to_string();
    let waiting = session_request::table
        .filter(session_request::session_id.eq(&session))
        .filter(session_request::state.eq("pending"))
        .select(session_request::call_id);
    let calls: Vec<String> = session_tool::table
        .filter(session_tool::session_id.eq(&session))
        .filter(session_tool::message_id.eq(step.to_string()))
        .filter(session_tool::status.eq("running"))
        .filter(session_tool::rerun.eq(true))
        .filter(session_tool::provider_executed.eq(false))
        .filter(session_tool::call_id.ne_all(waiting))
        .order(session_tool::call_id.asc())
        .select(session_tool::call_id)
        .load_direct(connection)?;
    parse_calls(calls)
}

/// The calls of `session` a recovery let run again that have no result yet.
pub(crate) fn rerun_pending(
    connection: &mut Conn,
    session: SessionId,
) -> Result<Vec<CallId>, store::Error> {
    use crate::store::schema::session_tool;
    let calls: Vec<String> = session_tool::table
        .filter(session_tool::session_id.eq(session.to_string()))
        .filter(session_tool::status.eq("pending"))
        .filter(session_tool::rerun.eq(true))
        .order(session_tool::call_id.asc())
        .select(session_tool::call_id)
        .load_direct(connection)?;
    parse_calls(calls)
}

fn parse_calls(calls: Vec<String>) -> Result<Vec<CallId>, store::Error> {
    calls
        .into_iter()
        .map(|c| {
            c.parse()
                .map_err(|e| store::Error::Corrupt(format!("tool call id {c}: {e}")))
        })
        .collect()
}

/// Whether the session needs a continuation input to go on after its execution was
/// recovered: only a step that was cut off mid-way does. A claim that died before it ran
/// a step (its promoted input, or input committed at the boundary, is still the last word
/// and the ordinary wake answers it), between steps (a finished tool loop continues by
/// itself), or while carrying out an interrupt (the user asked it to stop) gets none, so
/// the model never sees a restart it was not part of.
fn needs_continuation(phase: Phase, open_step: Option<MessageId>) -> bool {
    open_step.is_some() && matches!(phase, Phase::Running | Phase::Compacting)
}

/// A valid claim's session, execution, phase and open step, or why the row cannot be
/// trusted.
type Verdict = Result<(SessionId, ExecutionId, Phase, Option<MessageId>), String>;

fn validate(connection: &mut Conn, candidate: &Candidate) -> Result<Verdict, store::Error> {
    let Ok(session) = candidate.session_id.parse::<SessionId>() else {
        return Ok(Err(format!(
            "session id `{}` is not valid",
            candidate.session_id
        )));
    };
    let Ok(execution) = candidate.id.parse::<ExecutionId>() else {
        return Ok(Err(format!("execution id `{}` is not valid", candidate.id)));
    };
    let phase = match parse_text::<Phase>("session_execution.phase", &candidate.phase) {
        Ok(phase) => phase,
        Err(e) => return Ok(Err(format!("unknown phase: {e}"))),
    };
    let open_step = match &candidate.assistant_message_id {
        None => None,
        Some(assistant) => match validate_assistant(connection, session, assistant)? {
            Ok(step) => step,
            Err(reason) => return Ok(Err(reason)),
        },
    };
    Ok(Ok((session, execution, phase, open_step)))
}

/// Checks the claim's assistant message: it must be this session's and its latest. Returns
/// it when its step is still open (it needs `step.recovered`), or the reason to quarantine.
fn validate_assistant(
    connection: &mut Conn,
    session: SessionId,
    assistant: &str,
) -> Result<Result<Option<MessageId>, String>, store::Error> {
    let Ok(id) = assistant.parse::<MessageId>() else {
        return Ok(Err(format!("assistant id `{assistant}` is not valid")));
    };
    // By primary key, without `first()`: a bound `LIMIT` makes SQLite recompile the
    // statement at every use (see `event::projector`).
    let owner: Option<String> = session_message::table
        .find(assistant)
        .select(session_message::session_id)
        .get_direct(connection)
        .optional()?;
    match owner {
        None => return Ok(Err(format!("assistant {assistant} does not exist"))),
        Some(owner) if owner != session.to_string() => {
            return Ok(Err(format!(
                "assistant {assistant} belongs to session {owner}, not {session}"
            )));
        }
        Some(_) => {}
    }
    let messages = crate::event::view::messages(connection, session)?;
    let latest = messages.iter().rev().find_map(|m| match m {
        keel_schema::api::Message::Assistant { id, end, .. } => Some((*id, end.is_none())),
        _ => None,
    });
    match latest {
        Some((latest, open)) if latest == id => Ok(Ok(open.then_some(id))),
        Some((latest, _)) => Ok(Err(format!(
            "assistant {assistant} is superseded by a newer assistant {latest}"
        ))),
        None => Ok(Err(format!(
            "assistant {assistant} is not in the transcript"
        ))),
    }
}

/// How many of the session's latest executions in a row settled `recovered`.
fn recoveries_in_a_row(connection: &mut Conn, session: SessionId) -> Result<usize, store::Error> {
    crate::event::rows::flush(connection)?;
    // Newest first, at most MAX_ATTEMPTS.
    let query = event::table
        .filter(event::session_id.eq(session.to_string()))
        .filter(event::type_name.eq("session.next.execution.settled"))
        .order(event::seq.desc())
        .select(event::data);
    let settled: Vec<String> = store::load_at_most(connection, query, MAX_ATTEMPTS)?;
    let in_a_row = settled
        .iter()
        .take_while(|data| {
            serde_json::from_str::<payload::ExecutionSettled>(data)
                .is_ok_and(|s| s.outcome == Outcome::Recovered)
        })
        .count();
    Ok(in_a_row)
}

#[cfg(test)]
mod tests;
