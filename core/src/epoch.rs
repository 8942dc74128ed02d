//! Context epochs: the system prompt a session's requests start with, fixed per epoch.
//!
//! Every request of an epoch starts with the same system prompt, so a provider's prompt
//! cache keeps hitting, and what the model was told is in the log, not in whatever
//! configuration the process that sends the next request happens to run with:
//!
//! - The session's first step starts epoch 1 (`context.epoch_started`) with its agent's
//!   system prompt, in the step's fenced transaction ([`establish`]).
//! - When the agent's system prompt changes during an epoch (a new `keel.toml` after a
//!   restart, a node with another configuration, a switch to another agent), the next
//!   step appends `context.system_updated`: the new prompt becomes a message of the
//!   transcript, and the epoch's system prompt stays as it was. History is never
//!   rewritten.
//! - A completed compaction starts the next epoch ([`advance`]) from the effective prompt
//!   (the last update, else the epoch's own), in the transaction of its
//!   `compaction.ended`: the summary stands for the history before the new baseline,
//!   updates included. A compaction that fails or is interrupted advances nothing, and
//!   the updates stay in the transcript.
//!
//! Each of these writes rides a fenced transaction: it rolls back with everything else
//! (a promotion, the claim's renewal) when ownership was lost, and the projection refuses
//! an epoch that does not follow the session's last one, which rolls that transaction
//! back too.

use diesel::prelude::*;
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{MessageId, SessionId};

use crate::event::view::{SessionInfo, SessionInfoRow};
use crate::event::{counters, log};
use crate::store::column::from_db_int;
use crate::store::on_backend;
use crate::store::schema::{context_epoch, session};
use crate::store::{self, Conn, load_at_most};

/// A session's current context epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    pub epoch: u32,
    /// The first seq whose messages are sent as they are (0: the whole log).
    pub baseline_seq: u64,
    /// The system prompt every request of the epoch starts with.
    pub system: String,
    /// The prompt in effect: the last `context.system_updated` of the epoch, else
    /// `system`.
    pub effective_system: String,
}

#[derive(Queryable, Selectable)]
#[diesel(table_name = context_epoch)]
struct Row {
    epoch: i64,
    baseline_seq: i64,
    system: String,
    effective_system: String,
}

impl Row {
    fn into_epoch(self) -> Result<Epoch, store::Error> {
        Ok(Epoch {
            epoch: u32::try_from(self.epoch).map_err(|_| {
                store::Error::Corrupt(format!("context_epoch.epoch is {}", self.epoch))
            })?,
            baseline_seq: from_db_int(self.baseline_seq)?,
            system: self.system,
            effective_system: self.effective_system,
        })
    }
}

/// The session's current epoch, or `None` before its first step.
pub fn current(connection: &mut Conn, session: SessionId) -> Result<Option<Epoch>, store::Error> {
    let query = context_epoch::table
        .find(session.to_string())
        .select(Row::as_select());
    let row: Option<Row> = load_at_most(connection, query, 1)?.pop();
    row.map(Row::into_epoch).transpose()
}

/// What [`crate::event::view::session_info`] reads and the session's current epoch, in one statement:
/// a step's boundary needs both. `None` for an unknown session.
pub fn with_session(
    connection: &mut Conn,
    session: SessionId,
) -> Result<Option<(SessionInfo, Option<Epoch>)>, store::Error> {
    let id = session.to_string();
    // Of what it reads, only the agent and model may be kept in memory (`event::counters`).
    counters::flush_agent_and_model(connection, &id)?;
    let row: Option<(SessionInfoRow, Option<Row>)> = on_backend!(connection, |c| {
        session::table
            .left_join(context_epoch::table.on(context_epoch::session_id.eq(session::id)))
            .filter(session::id.eq(&id))
            .select((SessionInfoRow::as_select(), Option::<Row>::as_select()))
            .get_result(c)
    })
    .optional()?;
    row.map(|(info, epoch)| Ok((info.into(), epoch.map(Row::into_epoch).transpose()?)))
        .transpose()
}

/// Before a step, inside its fenced transaction: brings the session's context, `current`
/// as read in that transaction ([`with_session`]), in line with the agent's `system`
/// prompt. A session without an epoch starts epoch 1 with it;
/// one whose effective prompt differs gets `context.system_updated`. Returns the epoch's
/// system prompt (the one the step's request starts with) and what was written.
pub fn establish(
    connection: &mut Conn,
    now: i64,
    session: SessionId,
    current: Option<Epoch>,
    system: &str,
) -> Result<(String, Vec<Envelope>), store::Error> {
    let event = match current {
        None => DurableEvent::ContextEpochStarted(payload::ContextEpochStarted {
            epoch: 1,
            system: system.to_owned(),
            baseline_seq: 0,
        }),
        Some(epoch) if epoch.effective_system == system => {
            return Ok((epoch.system, Vec::new()));
        }
        Some(epoch) => {
            let written = log::append(
                connection,
                now,
                session,
                vec![DurableEvent::ContextSystemUpdated(
                    payload::ContextSystemUpdated {
                        message_id: MessageId::new(),
                        system: system.to_owned(),
                    },
                )],
            )?;
            return Ok((epoch.system, written));
        }
    };
    let written = log::append(connection, now, session, vec![event])?;
    Ok((system.to_owned(), written))
}

/// The event that starts the epoch after a completed compaction whose summary stands for
/// the history before `baseline_seq`, to append with its `compaction.ended`. The new
/// epoch starts from the effective prompt; `system` (the agent's) only when the session
/// has no epoch yet. Returns the event and the new epoch's system prompt.
pub fn advance(
    connection: &mut Conn,
    session: SessionId,
    baseline_seq: u64,
    system: &str,
) -> Result<(DurableEvent, String), store::Error> {
    let (epoch, system) = match current(connection, session)? {
        Some(current) => (current.epoch + 1, current.effective_system),
        None => (1, system.to_owned()),
    };
    let event = DurableEvent::ContextEpochStarted(payload::ContextEpochStarted {
        epoch,
        system: system.clone(),
        baseline_seq,
    });
    Ok((event, system))
}
