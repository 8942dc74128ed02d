//! The inbox: admission of inputs and their promotion into the transcript.
//!
//! Admission writes the input row (through `prompt.admitted`) and, when execution is
//! requested, `prompt.execution_requested`, in one transaction; only then may the caller
//! send an advisory wake. A client-chosen id makes admission idempotent: the same id with
//! the same session and content returns the original input (`replayed: true`) and writes
//! nothing; with another session or other content it is a [`Error::Conflict`], which never
//! asks for a wake.
//!
//! Promotion order ([`select`]):
//! - at a step boundary of a running execution, every pending steering prompt admitted
//!   before the first pending control input is promoted, in admission order, together
//!   (they coalesce into one continuation turn); queued prompts wait;
//! - at an idle boundary (the session would otherwise go idle, or an execution starts),
//!   the same steers if there are any; otherwise the oldest pending input alone: a queued
//!   prompt, or a control input, which the caller carries out (a compaction records its
//!   promotion in `compaction.started`).

use diesel::prelude::*;
use keel_schema::api::{Input, InputStatus};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{InputId, MessageId, SessionId};
use keel_schema::types::{Delivery, InputKind, InputSource, Part};

use crate::event::view::InputRow;
use crate::event::{counters, log};
use crate::store::Direct as _;
use crate::store::on_backend;
use crate::store::schema::session_input;
use crate::store::{self, Conn};

/// What can go wrong in the inbox.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The input id is taken by another session, or by other content.
    #[error("input {input_id} conflicts with an earlier admission: {reason}")]
    Conflict { input_id: InputId, reason: String },
    /// The input is not what the request needs (empty parts, parts on a control input).
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("no input {input_id} in session {session_id}")]
    NotFound {
        session_id: SessionId,
        input_id: InputId,
    },
    #[error("input {input_id} is {status:?}, not pending")]
    NotPending {
        input_id: InputId,
        status: InputStatus,
    },
    #[error(transparent)]
    Store(#[from] store::Error),
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Self::Store(e.into())
    }
}

/// An input to admit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// A client-chosen id for idempotent retries; a fresh one when `None`.
    pub id: Option<InputId>,
    pub kind: InputKind,
    pub parts: Vec<Part>,
    pub delivery: Delivery,
    pub source: InputSource,
    pub request_execution: bool,
}

impl Admission {
    /// A user prompt with the API's defaults (queued, execution requested).
    pub fn prompt(parts: Vec<Part>) -> Self {
        Self {
            id: None,
            kind: InputKind::Prompt,
            parts,
            delivery: Delivery::Queue,
            source: InputSource::User,
            request_execution: true,
        }
    }
}

/// The outcome of an admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub input: Input,
    /// A retry of an earlier admission: nothing was written.
    pub replayed: bool,
    /// Whether the caller should wake the session's execution: execution was requested and
    /// the input is still pending.
    pub wake: bool,
}

/// Admits an input into `session_id`'s inbox at time `now`.
pub fn admit(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
    admission: Admission,
) -> Result<Admitted, Error> {
    validate(&admission)?;
    if let Some(id) = admission.id
        && let Some(row) = InputRow::find(connection, id)?
    {
        return replay(&row, session_id, &admission);
    }
    let input_id = admission.id.unwrap_or_else(InputId::new);
    let mut events = vec![DurableEvent::PromptAdmitted(payload::PromptAdmitted {
        input_id,
        kind: admission.kind,
        delivery: admission.delivery,
        parts: admission.parts.clone(),
        source: admission.source,
        request_execution: admission.request_execution,
    })];
    if admission.request_execution {
        events.push(DurableEvent::PromptExecutionRequested(
            payload::PromptExecutionRequested { input_id },
        ));
    }
    // A savepoint of its own, so that losing a race for the same client id (another node
    // admitted it first) can fall back to the replay rules below. The session's counter,
    // should the writer's batch keep it moved by an earlier write (a step's, on PostgreSQL:
    // `event::counters`), is written back first: inside the savepoint that would make the
    // batch run again.
    counters::forget(connection, &session_id.to_string()).map_err(store::Error::from)?;
    if let Err(e) = connection.transaction(|c| log::append(c, now, session_id, events)) {
        return match admission.id {
            Some(id) => match InputRow::find(connection, id)? {
                Some(row) => replay(&row, session_id, &admission),
                None => Err(e.into()),
            },
            None => Err(e.into()),
        };
    }
    let row = InputRow::find(connection, input_id)?.ok_or_else(|| {
        store::Error::Corrupt(format!("input {input_id} was admitted but has no row"))
    })?;
    Ok(Admitted {
        input: row.to_api()?,
        replayed: false,
        wake: admission.request_execution,
    })
}

fn validate(admission: &Admission) -> Result<(), Error> {
    match admission.kind {
        InputKind::Prompt if admission.parts.is_empty() => {
            Err(Error::Invalid("a prompt needs at least one part".into()))
        }
        InputKind::Compact if !admission.parts.is_empty() => {
            Err(Error::Invalid("a compaction request has no parts".into()))
        }
        InputKind::Prompt | InputKind::Compact => Ok(()),
    }
}

/// The answer to a retry of an admission whose id already exists.
fn replay(row: &InputRow, session_id: SessionId, admission: &Admission) -> Result<Admitted, Error> {
    let input = row.to_api()?;
    let conflict = |reason: &str| Error::Conflict {
        input_id: input.id,
        reason: reason.to_owned(),
    };
    if input.session_id != session_id {
        return Err(conflict("the id belongs to an input of another session"));
    }
    let same_content = input.kind == admission.kind
        && input.parts == admission.parts
        && input.delivery == admission.delivery
        && input.request_execution == admission.request_execution;
    if !same_content {
        return Err(conflict(
            "the id was admitted with other content (parts, delivery or request_execution)",
        ));
    }
    let wake = input.request_execution && input.status == InputStatus::Pending;
    Ok(Admitted {
        input,
        replayed: true,
        wake,
    })
}

/// Where in an execution promotion happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// Between steps of a running execution.
    Step,
    /// Where the session would otherwise go idle, or where an execution starts.
    Idle,
}

/// A pending input, as promotion sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub id: InputId,
    pub kind: InputKind,
    pub delivery: Delivery,
    pub source: InputSource,
}

/// What a boundary promotes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    Nothing,
    /// Prompts, in admission order, promoted together into one turn.
    Prompts(Vec<InputId>),
    /// One control input, for the caller to carry out.
    Control(InputId),
}

/// Chooses what `boundary` promotes from `pending` (in admission order).
///
/// A recovery continuation goes first and alone, at any boundary: the step it continues
/// was cut short by a crash, and the inputs that waited behind it come after, by the
/// ordinary rules.
pub fn select(pending: &[Pending], boundary: Boundary) -> Selection {
    if let Some(continuation) = pending.iter().find(|p| p.source == InputSource::Recovery) {
        return Selection::Prompts(vec![continuation.id]);
    }
    let steers: Vec<InputId> = pending
        .iter()
        .take_while(|p| !p.kind.is_control())
        .filter(|p| p.delivery == Delivery::Steer)
        .map(|p| p.id)
        .collect();
    if !steers.is_empty() {
        return Selection::Prompts(steers);
    }
    match (boundary, pending.first()) {
        (Boundary::Step, _) | (Boundary::Idle, None) => Selection::Nothing,
        (Boundary::Idle, Some(first)) if first.kind.is_control() => Selection::Control(first.id),
        (Boundary::Idle, Some(first)) => Selection::Prompts(vec![first.id]),
    }
}

/// The longest idempotency key a client may send, in characters.
pub const MAX_KEY_CHARS: usize = 128;

/// The input id a client's idempotency key maps to in `session_id`. An `inp_` id is
/// its own key (the input gets that id, and reusing it in another session is a
/// conflict); any other key (1 to [`MAX_KEY_CHARS`] characters, no control character)
/// maps to an id derived from the session and the key, so the same key names the same
/// input on every node and after every restart, with nothing stored beside the log.
pub fn keyed_id(session_id: SessionId, key: &str) -> Result<InputId, Error> {
    if let Ok(id) = key.parse::<InputId>() {
        return Ok(id);
    }
    let chars = key.chars().count();
    if chars == 0 || chars > MAX_KEY_CHARS {
        return Err(Error::Invalid(format!(
            "an idempotency key has 1 to {MAX_KEY_CHARS} characters (this one has {chars})"
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(Error::Invalid(
            "an idempotency key has no control characters".into(),
        ));
    }
    use sha1::Digest;
    let mut hash = sha1::Sha1::new();
    hash.update(b"keel idempotency key\0");
    hash.update(session_id.to_string().as_bytes());
    hash.update(b"\0");
    hash.update(key.as_bytes());
    let digest = hash.finalize();
    let mut bits = [0u8; 16];
    bits.copy_from_slice(&digest[..16]);
    Ok(InputId::from_ulid(ulid::Ulid(u128::from_be_bytes(bits))))
}

/// Records an explicit resume durably: every pending input of the session admitted
/// without execution intent gets `prompt.execution_requested`, so a resume whose run is
/// lost with its process is redriven like any admitted intent. Returns what was written.
pub fn request_execution(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
) -> Result<Vec<keel_schema::event::Envelope>, Error> {
    let ids: Vec<String> = session_input::table
        .filter(session_input::session_id.eq(session_id.to_string()))
        .filter(session_input::promoted_seq.is_null())
        .filter(session_input::cancelled_seq.is_null())
        .filter(session_input::execution_requested.eq(false))
        .order(session_input::admitted_seq.asc())
        .select(session_input::id)
        .load_direct(connection)?;
    let events = ids
        .iter()
        .map(|id| {
            let input_id = id
                .parse()
                .map_err(|e| store::Error::Corrupt(format!("input id {id}: {e}")))?;
            Ok(DurableEvent::PromptExecutionRequested(
                payload::PromptExecutionRequested { input_id },
            ))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(log::append(connection, now, session_id, events)?)
}

/// The session's pending inputs, in admission order.
pub fn pending(connection: &mut Conn, session_id: SessionId) -> Result<Vec<Input>, Error> {
    let rows: Vec<InputRow> = on_backend!(connection, |c| session_input::table
        .filter(session_input::session_id.eq(session_id.to_string()))
        .filter(session_input::promoted_seq.is_null())
        .filter(session_input::cancelled_seq.is_null())
        .order(session_input::admitted_seq.asc())
        .select(InputRow::as_select())
        .load(c))?;
    rows.iter()
        .map(|row| row.to_api().map_err(Error::from))
        .collect()
}

/// What a promotion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Promotion {
    Nothing,
    /// These inputs are now user messages (`session.next.prompted` was appended).
    Prompts(Vec<(InputId, MessageId)>),
    /// This control input is next; the caller carries it out and records its promotion.
    Control(Input),
}

/// Promotes what `boundary` calls for (see [`select`]), appending `session.next.prompted`
/// for each promoted prompt.
pub fn promote(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
    boundary: Boundary,
) -> Result<Promotion, Error> {
    promote_into(connection, now, session_id, boundary, &mut Vec::new())
}

/// [`promote`], adding the events it appended to `written`.
pub fn promote_into(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
    boundary: Boundary,
    written: &mut Vec<Envelope>,
) -> Result<Promotion, Error> {
    let pending = pending(connection, session_id)?;
    let view: Vec<Pending> = pending
        .iter()
        .map(|input| Pending {
            id: input.id,
            kind: input.kind,
            delivery: input.delivery,
            source: input.source,
        })
        .collect();
    match select(&view, boundary) {
        Selection::Nothing => Ok(Promotion::Nothing),
        Selection::Control(id) => {
            let input = pending
                .into_iter()
                .find(|input| input.id == id)
                .ok_or_else(|| store::Error::Corrupt(format!("selected {id} is not pending")))?;
            Ok(Promotion::Control(input))
        }
        Selection::Prompts(ids) => {
            let promoted: Vec<(InputId, MessageId)> =
                ids.into_iter().map(|id| (id, MessageId::new())).collect();
            let events = promoted
                .iter()
                .map(|&(input_id, message_id)| {
                    DurableEvent::Prompted(payload::Prompted {
                        input_id,
                        message_id,
                    })
                })
                .collect();
            written.extend(log::append(connection, now, session_id, events)?);
            Ok(Promotion::Prompts(promoted))
        }
    }
}

/// Cancels a pending input.
pub fn cancel(
    connection: &mut Conn,
    now: i64,
    session_id: SessionId,
    input_id: InputId,
) -> Result<Input, Error> {
    let row = InputRow::find(connection, input_id)?
        .filter(|row| row.session_id == session_id.to_string())
        .ok_or(Error::NotFound {
            session_id,
            input_id,
        })?;
    let status = row.status();
    if status != InputStatus::Pending {
        return Err(Error::NotPending { input_id, status });
    }
    log::append(
        connection,
        now,
        session_id,
        vec![DurableEvent::PromptCancelled(payload::PromptCancelled {
            input_id,
        })],
    )?;
    InputRow::find(connection, input_id)?
        .ok_or_else(|| store::Error::Corrupt(format!("input {input_id} vanished")))?
        .to_api()
        .map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(id: u128, kind: InputKind, delivery: Delivery) -> Pending {
        Pending {
            id: InputId::from_ulid(ulid::Ulid::from_parts(1, id)),
            kind,
            delivery,
            source: InputSource::User,
        }
    }

    #[test]
    fn an_idempotency_key_names_one_input_per_session() {
        let a = SessionId::new();
        let b = SessionId::new();
        let key = "order 42, attempt";
        let id = keyed_id(a, key).expect("a valid key");
        assert_eq!(keyed_id(a, key).expect("a valid key"), id, "stable");
        assert_ne!(keyed_id(b, key).expect("a valid key"), id, "per session");
        assert_ne!(keyed_id(a, "order 43").expect("a valid key"), id);
        let own = InputId::new();
        assert_eq!(keyed_id(a, &own.to_string()).expect("an input id"), own);
        assert!(keyed_id(a, &"k".repeat(MAX_KEY_CHARS)).is_ok());
        for bad in [String::new(), "k".repeat(MAX_KEY_CHARS + 1), "a\nb".into()] {
            assert!(
                matches!(keyed_id(a, &bad), Err(Error::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_recovery_continuation_goes_first_and_alone() {
        let c1 = pending(1, InputKind::Compact, Delivery::Queue);
        let s1 = pending(2, InputKind::Prompt, Delivery::Steer);
        let r1 = Pending {
            source: InputSource::Recovery,
            ..pending(3, InputKind::Prompt, Delivery::Steer)
        };
        let s2 = pending(4, InputKind::Prompt, Delivery::Steer);
        for boundary in [Boundary::Step, Boundary::Idle] {
            assert_eq!(
                select(&[c1, s1, r1, s2], boundary),
                Selection::Prompts(vec![r1.id])
            );
        }
        assert_eq!(
            select(&[s1, s2], Boundary::Step),
            Selection::Prompts(vec![s1.id, s2.id])
        );
    }

    #[test]
    fn steers_before_the_first_control_input_coalesce_and_skip_queued_prompts() {
        let q1 = pending(1, InputKind::Prompt, Delivery::Queue);
        let s1 = pending(2, InputKind::Prompt, Delivery::Steer);
        let s2 = pending(3, InputKind::Prompt, Delivery::Steer);
        let c1 = pending(4, InputKind::Compact, Delivery::Queue);
        let s3 = pending(5, InputKind::Prompt, Delivery::Steer);
        let all = [q1, s1, s2, c1, s3];
        for boundary in [Boundary::Step, Boundary::Idle] {
            assert_eq!(
                select(&all, boundary),
                Selection::Prompts(vec![s1.id, s2.id])
            );
        }
    }

    #[test]
    fn an_idle_boundary_promotes_one_queued_prompt_or_the_first_control_input() {
        let q1 = pending(1, InputKind::Prompt, Delivery::Queue);
        let q2 = pending(2, InputKind::Prompt, Delivery::Queue);
        let c1 = pending(3, InputKind::Compact, Delivery::Queue);
        assert_eq!(
            select(&[q1, q2], Boundary::Idle),
            Selection::Prompts(vec![q1.id])
        );
        assert_eq!(select(&[q1, q2], Boundary::Step), Selection::Nothing);
        assert_eq!(select(&[c1, q1], Boundary::Idle), Selection::Control(c1.id));
        assert_eq!(select(&[], Boundary::Idle), Selection::Nothing);
    }

    #[test]
    fn a_control_input_blocks_the_steers_behind_it() {
        let c1 = pending(1, InputKind::Compact, Delivery::Queue);
        let s1 = pending(2, InputKind::Prompt, Delivery::Steer);
        assert_eq!(select(&[c1, s1], Boundary::Step), Selection::Nothing);
        assert_eq!(select(&[c1, s1], Boundary::Idle), Selection::Control(c1.id));
    }
}
