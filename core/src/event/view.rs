//! Reading the projections: the session and input rows, the transcript (whole, or held
//! and brought up to date), a step's unresolved calls, the pending inputs. The writing
//! side is [`super::projector`]; everything here is a plain read over a [`Conn`].
//!
//! Rows are found by primary key with `get_result`, never `first`: `first` adds a bound
//! `LIMIT`, and SQLite recompiles a statement whose `LIMIT` parameter was bound again, so
//! every such lookup would be parsed and planned anew.

use std::collections::HashMap;

use diesel::prelude::*;
use keel_schema::api::{Input, InputStatus, Message, Session};
use keel_schema::id::{CallId, InputId, MessageId, SessionId};
use keel_schema::types::{Delivery, InputKind, InputSource, ModelRef, Usage};

use super::counters;
use crate::event::projector::write_unwritten;
use crate::store::Direct as _;
use crate::store::column::{from_db_int, parse_text};
use crate::store::on_backend;
use crate::store::schema::{session, session_input, session_message, session_tool};
use crate::store::{Conn, Error};

/// A row of `session_input`.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable)]
#[diesel(table_name = session_input)]
pub struct InputRow {
    pub id: String,
    pub session_id: String,
    pub kind: String,
    pub delivery: String,
    pub parts: String,
    pub source: String,
    pub request_execution: bool,
    pub admitted_seq: i64,
    pub execution_requested: bool,
    pub promoted_seq: Option<i64>,
    pub message_id: Option<String>,
    pub cancelled_seq: Option<i64>,
}

impl InputRow {
    pub fn find(connection: &mut Conn, id: InputId) -> Result<Option<Self>, Error> {
        Ok(on_backend!(connection, |c| session_input::table
            .find(id.to_string())
            .select(Self::as_select())
            .get_result(c))
        .optional()?)
    }

    pub fn status(&self) -> InputStatus {
        match (self.promoted_seq, self.cancelled_seq) {
            (Some(_), _) => InputStatus::Promoted,
            (None, Some(_)) => InputStatus::Cancelled,
            (None, None) => InputStatus::Pending,
        }
    }

    pub fn kind(&self) -> Result<InputKind, Error> {
        parse_text("session_input.kind", &self.kind)
    }

    pub fn delivery(&self) -> Result<Delivery, Error> {
        parse_text("session_input.delivery", &self.delivery)
    }

    pub fn source(&self) -> Result<InputSource, Error> {
        parse_text("session_input.source", &self.source)
    }

    /// The API view of the input.
    pub fn to_api(&self) -> Result<Input, Error> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            Error::Corrupt(format!("input {} {what}: {e}", self.id))
        };
        Ok(Input {
            id: self.id.parse().map_err(|e| corrupt("id", &e))?,
            session_id: self
                .session_id
                .parse()
                .map_err(|e| corrupt("session", &e))?,
            kind: self.kind()?,
            delivery: self.delivery()?,
            parts: serde_json::from_str(&self.parts).map_err(|e| corrupt("parts", &e))?,
            source: self.source()?,
            request_execution: self.request_execution,
            status: self.status(),
            admitted_seq: from_db_int(self.admitted_seq)?,
            promoted_seq: self.promoted_seq.map(from_db_int).transpose()?,
        })
    }
}

/// A row of `session_message`, as the transcript reads it.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_message)]
struct MessageRow {
    id: String,
    seq: i64,
    updated_seq: i64,
    data: String,
}

impl MessageRow {
    fn message(&self) -> Result<Message, Error> {
        serde_json::from_str(&self.data)
            .map_err(|e| Error::Corrupt(format!("message {}: {e}", self.id)))
    }
}

/// The projected transcript of a session, in seq order.
pub fn messages(connection: &mut Conn, session_id: SessionId) -> Result<Vec<Message>, Error> {
    // Edits the writer's batch has not written yet go first (`projector::write_unwritten`).
    write_unwritten(connection, Some(session_id))?;
    on_backend!(connection, |c| session_message::table
        .filter(session_message::session_id.eq(session_id.to_string()))
        .order(session_message::seq.asc())
        .select(MessageRow::as_select())
        .load(c))?
    .iter()
    .map(MessageRow::message)
    .collect()
}

/// A session's transcript held in memory and brought up to date by reading only the
/// messages written since the last read (`session_message.updated_seq`), so a long run
/// does not decode its whole history before every step.
#[derive(Debug, Default)]
pub struct Transcript {
    messages: Vec<Message>,
    /// Each message's seq and the seq of the last event that wrote it (`updated_seq`),
    /// in the order of `messages`: what changed since a caller last looked.
    versions: Vec<(u64, i64)>,
    /// Each message's position in `messages`, by id.
    index: HashMap<String, usize>,
    /// The seq of the last message held.
    last_seq: i64,
    /// The highest `updated_seq` read so far.
    through: i64,
}

impl Transcript {
    /// The messages, in seq order, as of the last [`Transcript::refresh`].
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Each message's seq and `updated_seq`, in the order of [`Transcript::messages`].
    pub fn versions(&self) -> &[(u64, i64)] {
        &self.versions
    }

    /// Reads the messages of `session_id` written since the last refresh. A session's
    /// writes commit in seq order, so every message not read yet has a higher
    /// `updated_seq` than any read, and a new message a higher seq than any held. Returns
    /// how many messages were read.
    pub fn refresh(
        &mut self,
        connection: &mut Conn,
        session_id: SessionId,
    ) -> Result<usize, Error> {
        write_unwritten(connection, Some(session_id))?;
        let rows: Vec<MessageRow> = on_backend!(connection, |c| session_message::table
            .filter(session_message::session_id.eq(session_id.to_string()))
            .filter(session_message::updated_seq.gt(self.through))
            .order(session_message::seq.asc())
            .select(MessageRow::as_select())
            .load(c))?;
        let read = rows.len();
        for row in rows {
            let message = row.message()?;
            self.through = self.through.max(row.updated_seq);
            let version = (u64::try_from(row.seq).unwrap_or_default(), row.updated_seq);
            match self.index.get(&row.id) {
                Some(&position) => {
                    self.messages[position] = message;
                    self.versions[position] = version;
                }
                None if row.seq > self.last_seq => {
                    self.index.insert(row.id, self.messages.len());
                    self.messages.push(message);
                    self.versions.push(version);
                    self.last_seq = row.seq;
                }
                // Not expected (see above); reading everything again keeps the order right.
                None => {
                    *self = Transcript::default();
                    return self.refresh(connection, session_id);
                }
            }
        }
        Ok(read)
    }
}

/// What the runner needs of a session row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub directory: String,
    pub agent: String,
    pub model: ModelRef,
    pub deleted: bool,
}

/// The columns of `session` that [`SessionInfo`] comes from.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session)]
pub(crate) struct SessionInfoRow {
    directory: String,
    agent: String,
    model_provider: String,
    model_id: String,
    deleted_at: Option<i64>,
}

/// The session's directory, agent and model, or `None` for an unknown session.
pub fn session_info(
    connection: &mut Conn,
    session_id: SessionId,
) -> Result<Option<SessionInfo>, Error> {
    let id = session_id.to_string();
    // Of what it reads, only the agent and model may be kept in memory (`event::counters`).
    counters::flush_agent_and_model(connection, &id)?;
    Ok(on_backend!(connection, |c| session::table
        .find(&id)
        .select(SessionInfoRow::as_select())
        .get_result(c))
    .optional()?
    .map(SessionInfo::from))
}

impl From<SessionInfoRow> for SessionInfo {
    fn from(row: SessionInfoRow) -> Self {
        SessionInfo {
            directory: row.directory,
            agent: row.agent,
            model: ModelRef {
                provider: row.model_provider,
                id: row.model_id,
            },
            deleted: row.deleted_at.is_some(),
        }
    }
}

/// The calls of an assistant message that are neither completed nor failed.
pub fn unresolved_tools(
    connection: &mut Conn,
    session_id: SessionId,
    message_id: MessageId,
) -> Result<Vec<CallId>, Error> {
    let ids: Vec<String> = session_tool::table
        .filter(session_tool::session_id.eq(session_id.to_string()))
        .filter(session_tool::message_id.eq(message_id.to_string()))
        .filter(session_tool::status.eq_any(["pending", "running"]))
        .order(session_tool::call_id.asc())
        .select(session_tool::call_id)
        .load_direct(connection)?;
    ids.into_iter()
        .map(|id| {
            id.parse()
                .map_err(|e| Error::Corrupt(format!("tool call id {id}: {e}")))
        })
        .collect()
}

/// A row of `session` as the API shows it (without `deleted_at`).
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session)]
struct SessionRow {
    id: String,
    title: Option<String>,
    directory: String,
    agent: String,
    model_provider: String,
    model_id: String,
    time_created: i64,
    time_updated: i64,
    last_seq: i64,
    usage_input: i64,
    usage_output: i64,
    usage_reasoning: i64,
    usage_cache_read: i64,
    usage_cache_write: i64,
    cost: f64,
}

impl SessionRow {
    fn into_api(self) -> Result<Session, Error> {
        Ok(Session {
            id: self
                .id
                .parse()
                .map_err(|e| Error::Corrupt(format!("session id {}: {e}", self.id)))?,
            title: self.title,
            directory: self.directory,
            agent: self.agent,
            model: ModelRef {
                provider: self.model_provider,
                id: self.model_id,
            },
            time_created: self.time_created,
            time_updated: self.time_updated,
            usage: Usage {
                input: from_db_int(self.usage_input)?,
                output: from_db_int(self.usage_output)?,
                reasoning: from_db_int(self.usage_reasoning)?,
                cache_read: from_db_int(self.usage_cache_read)?,
                cache_write: from_db_int(self.usage_cache_write)?,
            },
            cost: self.cost,
            last_seq: from_db_int(self.last_seq)?,
        })
    }
}

/// A session as the API shows it; `None` when unknown or deleted.
pub fn session(connection: &mut Conn, session_id: SessionId) -> Result<Option<Session>, Error> {
    counters::flush(connection)?;
    on_backend!(connection, |c| session::table
        .find(session_id.to_string())
        .filter(session::deleted_at.is_null())
        .select(SessionRow::as_select())
        .get_result(c))
    .optional()?
    .map(SessionRow::into_api)
    .transpose()
}

/// A page of sessions, newest first, after the session `cursor` (exclusive).
pub fn sessions(
    connection: &mut Conn,
    cursor: Option<SessionId>,
    limit: u32,
) -> Result<Vec<Session>, Error> {
    counters::flush(connection)?;
    let mut query = session::table
        .filter(session::deleted_at.is_null())
        .order((session::time_created.desc(), session::id.desc()))
        .limit(i64::from(limit))
        .select(SessionRow::as_select())
        .into_boxed();
    if let Some(cursor) = cursor {
        let created: Option<i64> = session::table
            .find(cursor.to_string())
            .select(session::time_created)
            .get_direct(connection)
            .optional()?;
        let Some(created) = created else {
            return Ok(Vec::new());
        };
        query = query.filter(
            session::time_created.lt(created).or(session::time_created
                .eq(created)
                .and(session::id.lt(cursor.to_string()))),
        );
    }
    query
        .load::<SessionRow>(connection)?
        .into_iter()
        .map(SessionRow::into_api)
        .collect()
}

/// How many inputs of the session wait for promotion.
pub fn pending_inputs(connection: &mut Conn, session_id: SessionId) -> Result<u32, Error> {
    let count: i64 = session_input::table
        .filter(session_input::session_id.eq(session_id.to_string()))
        .filter(session_input::promoted_seq.is_null())
        .filter(session_input::cancelled_seq.is_null())
        .count()
        .get_direct(connection)?;
    u32::try_from(count).map_err(|_| Error::Corrupt(format!("{count} pending inputs")))
}
