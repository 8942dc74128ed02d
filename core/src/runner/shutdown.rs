//! A planned shutdown (SIGTERM, Ctrl-C): running work gets a grace period, and what is
//! still running after it is stopped as `shutdown`, never left for recovery to report as
//! a crash.
//!
//! [`super::Runner::shut_down`] sets the engine's `stopping` flag: no new execution is
//! claimed, and a drain stops at its next boundary, committing the step that ended there
//! (so a step that finishes within the grace finishes normally). When the grace runs out,
//! the executions still running are interrupted the ordinary way, except that the reason
//! is [`InterruptReason::Shutdown`]: the step ends with `step.interrupted { shutdown }`,
//! whose projection fails its unfinished calls with that reason.
//!
//! Either way the execution is released with `execution.settled { interrupted }` and the
//! error `execution.shutdown`, and, when the session's work goes on (a step was cut off,
//! or a tool-driven continuation was due, or the model had not answered the last
//! message), a continuation input is admitted with execution requested in the same
//! transaction: the durable intent that makes a restarted Keel (or another node) continue
//! the session, through the ordinary redrive of lost wakes. Its id derives from the
//! execution's id, like a recovery continuation's, so the intent is recorded once.

use keel_schema::api::{Message, StepEnd};
use keel_schema::event::Envelope;
use keel_schema::id::InputId;
use keel_schema::types::{
    Delivery, ErrorInfo, Finish, InputKind, InputSource, InterruptReason, Part, Phase,
};

use super::Error;
use crate::event::{log, view};
use crate::execution::{self, Claim};
use crate::inbox::{self, Admission};
use crate::store::Conn;

/// What the model reads when it continues after a shutdown cut its work short.
pub const CONTINUATION: &str = "Keel was shut down while you were working and has started \
    again. Tool calls that were running were stopped and not run again; their results say \
    so. Check their effect before repeating any, then continue.";

/// The error an execution stopped by a shutdown is settled with.
pub(super) fn shutdown_error() -> ErrorInfo {
    ErrorInfo::new(
        "execution.shutdown",
        "Keel shut down; the session continues when Keel starts again",
    )
}

/// Admits the continuation of `claim`'s session when its work goes on (see the module
/// documentation), in the caller's transaction. Returns what was written. Work a user
/// interrupted (the claim is `cancelling`, which a shutdown never sets) does not go on.
pub(super) fn continue_after_restart(
    connection: &mut Conn,
    now: i64,
    claim: &Claim,
) -> Result<Vec<Envelope>, Error> {
    let session = claim.session_id;
    let cancelling = execution::get(connection, session)?
        .is_some_and(|row| row.claim.id == claim.id && row.phase == Phase::Cancelling);
    if cancelling {
        return Ok(Vec::new());
    }
    let messages = view::messages(connection, session)?;
    if !goes_on(&messages) {
        return Ok(Vec::new());
    }
    let before = log::last_seq(connection, session)?.unwrap_or(0);
    let continuation = Admission {
        id: Some(InputId::from_ulid(claim.id.ulid())),
        kind: InputKind::Prompt,
        parts: vec![Part::Text {
            text: CONTINUATION.into(),
        }],
        delivery: Delivery::Steer,
        source: InputSource::Recovery,
        request_execution: true,
    };
    inbox::admit(connection, now, session, continuation)?;
    Ok(log::read(connection, session, before, u32::MAX)?)
}

/// Whether the transcript waits for more of the model: its last message is the user's,
/// or a step that asked for tools, or one a shutdown cut off. A step that waits for a
/// person (still open) goes on when the reply comes, not here.
fn goes_on(messages: &[Message]) -> bool {
    // A changed system prompt is context for the turn that follows, not a turn.
    match messages
        .iter()
        .rev()
        .find(|m| !matches!(m, Message::System { .. }))
    {
        Some(Message::User { .. } | Message::Synthetic { .. }) => true,
        Some(Message::Assistant { end, .. }) => matches!(
            end,
            Some(
                StepEnd::Ended {
                    finish: Finish::ToolCalls
                } | StepEnd::Interrupted {
                    reason: InterruptReason::Shutdown
                }
            )
        ),
        Some(Message::Summary { .. } | Message::System { .. }) | None => false,
    }
}
