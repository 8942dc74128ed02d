//! Requests for a person: the permission requests and questions a step waits on.
//!
//! A step that needs a person commits `permission.requested` or `question.asked`; the
//! projection keeps one `session_request` row per request, `pending`, then `answered` once
//! a reply commits, then `settled` once its call is resolved. Nothing waits in memory: a
//! step whose remaining calls all wait for a person ends its response with
//! `step.awaiting` and its execution is handed back (see `runner::drain`).
//!
//! A reply is made durable by whoever receives it ([`answer`]): it is checked against the
//! row (an unknown request or another session's is [`Error::Unknown`], one of the other
//! kind [`Error::WrongKind`], one already answered [`Error::Answered`]) and appended, and
//! only then acknowledged; the session is then woken, and whichever process claims it
//! resumes the step from the log. A wake lost on the way is redriven by recovery (a
//! session with an answered request and no claim).

use diesel::prelude::*;
use diesel::sql_types::{Nullable, Text};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{CallId, MessageId, RequestId, SessionId};
use keel_schema::types::Decision;
use serde::{Deserialize, Serialize};

use crate::event::log;
use crate::permission;
use crate::store::Direct as _;
use crate::store::fixed::fixed_query;
use crate::store::schema::{session_request, session_tool};
use crate::store::{self, Conn};

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// May the tool run? Answered by a [`Decision`].
    Permission,
    /// The built-in `question` tool: answered with text, or dismissed.
    Question,
}

impl Kind {
    /// The kind as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Permission => "permission",
            Self::Question => "question",
        }
    }

    fn parse(text: &str) -> Result<Self, store::Error> {
        match text {
            "permission" => Ok(Self::Permission),
            "question" => Ok(Self::Question),
            other => Err(store::Error::Corrupt(format!(
                "session_request.kind is `{other}`"
            ))),
        }
    }
}

/// A reply to a permission request or a question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Permission(Decision),
    Answer(String),
    Dismiss,
}

impl Reply {
    /// The kind of request this reply answers.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Permission(_) => Kind::Permission,
            Self::Answer(_) | Self::Dismiss => Kind::Question,
        }
    }

    /// The durable event that records this reply to `request`.
    pub fn event(&self, request_id: RequestId) -> DurableEvent {
        match self {
            Self::Permission(decision) => {
                DurableEvent::PermissionReplied(payload::PermissionReplied {
                    request_id,
                    decision: *decision,
                })
            }
            Self::Answer(answer) => DurableEvent::QuestionAnswered(payload::QuestionAnswered {
                request_id,
                answer: answer.clone(),
            }),
            Self::Dismiss => {
                DurableEvent::QuestionDismissed(payload::QuestionDismissed { request_id })
            }
        }
    }
}

/// Why a reply was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no permission request or question {0} in this session")]
    Unknown(RequestId),
    #[error(
        "{request} is a {asked}, not a {replied}: answer it at …/{asked}/{request}",
        asked = asked.as_str(),
        replied = replied.as_str()
    )]
    WrongKind {
        request: RequestId,
        asked: Kind,
        replied: Kind,
    },
    #[error("{0} was already answered")]
    Answered(RequestId),
    #[error(transparent)]
    Store(#[from] store::Error),
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Self::Store(e.into())
    }
}

/// A request whose call is not resolved yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub id: RequestId,
    pub call_id: CallId,
    pub kind: Kind,
    /// The tool asked about (`question` for a question).
    pub tool: String,
    /// What the call would touch (a permission's command or path; empty for a question).
    pub pattern: String,
    /// The reply, once one committed.
    pub reply: Option<Reply>,
}

#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_request)]
struct Row {
    id: String,
    session_id: String,
    call_id: String,
    kind: String,
    tool: String,
    state: String,
    reply: Option<String>,
    pattern: String,
}

impl Row {
    fn into_open(self) -> Result<Open, store::Error> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            store::Error::Corrupt(format!("request {} {what}: {e}", self.id))
        };
        Ok(Open {
            id: self.id.parse().map_err(|e| corrupt("id", &e))?,
            call_id: self.call_id.parse().map_err(|e| corrupt("call", &e))?,
            kind: Kind::parse(&self.kind)?,
            reply: self
                .reply
                .as_deref()
                .map(|r| serde_json::from_str(r).map_err(|e| corrupt("reply", &e)))
                .transpose()?,
            tool: self.tool,
            pattern: self.pattern,
        })
    }
}

/// Commits `reply` to `request` of `session`, or refuses it (writing nothing). Returns
/// what was appended.
pub fn answer(
    connection: &mut Conn,
    now: i64,
    session: SessionId,
    request: RequestId,
    reply: &Reply,
) -> Result<Vec<Envelope>, Error> {
    let row: Option<Row> = session_request::table
        .find(request.to_string())
        .select(Row::as_select())
        .get_result(connection)
        .optional()?;
    let row = match row {
        Some(row) if row.session_id == session.to_string() => row,
        _ => return Err(Error::Unknown(request)),
    };
    let asked = Kind::parse(&row.kind)?;
    if asked != reply.kind() {
        return Err(Error::WrongKind {
            request,
            asked,
            replied: reply.kind(),
        });
    }
    if row.state != "pending" {
        return Err(Error::Answered(request));
    }
    // The projection checks the state again under the append's lock on the session, so
    // of two replies racing, the second is refused by the database.
    Ok(log::append(
        connection,
        now,
        session,
        vec![reply.event(request)],
    )?)
}

/// The requests of `session` whose calls are not resolved yet, oldest first.
pub fn open(connection: &mut Conn, session: SessionId) -> Result<Vec<Open>, store::Error> {
    let session = session.to_string();
    let rows: Vec<Row> = OpenRequests {
        session_id: &session,
    }
    .load_direct(connection)?;
    rows.into_iter().map(Row::into_open).collect()
}

fixed_query! {
    /// The open requests of a session, oldest first. `'settled'` is in the SQL text, not
    /// bound: SQLite matches a bound value against the predicate of the partial index
    /// `session_request_open_idx`, and prepares the statement again whenever it is bound
    /// anew. Read at every step boundary that may find a wait.
    struct OpenRequests<'a> { session_id: &'a str }
    returns (Text, Text, Text, Text, Text, Text, Nullable<Text>, Text);
    sql r#"SELECT "id", "session_id", "call_id", "kind", "tool", "state", "reply", "pattern" "#
        r#"FROM "session_request" WHERE "session_id" = "# {session_id: Text}
        r#" AND "state" <> 'settled' ORDER BY "asked_seq""#
}

/// The step of `session` that waits for a person, if one does: the assistant message of
/// the oldest call with an open request.
pub fn waiting_step(
    connection: &mut Conn,
    session: SessionId,
) -> Result<Option<MessageId>, store::Error> {
    let message: Option<String> = session_request::table
        .inner_join(
            session_tool::table.on(session_tool::session_id
                .eq(session_request::session_id)
                .and(session_tool::call_id.eq(session_request::call_id))),
        )
        .filter(session_request::session_id.eq(session.to_string()))
        .filter(session_request::state.ne("settled"))
        .order(session_request::asked_seq.asc())
        .select(session_tool::message_id)
        .first(connection)
        .optional()?;
    message
        .map(|m| {
            m.parse()
                .map_err(|e| store::Error::Corrupt(format!("tool call message {m}: {e}")))
        })
        .transpose()
}

/// Whether an earlier `always` reply allows a call of `tool` that would touch `pattern`:
/// one to a request whose rule matches it, or (asked without a rule) with the same
/// pattern.
pub fn always_allowed(
    connection: &mut Conn,
    session: SessionId,
    tool: &str,
    pattern: &str,
) -> Result<bool, store::Error> {
    let remembered: Vec<(String, Option<String>)> = session_request::table
        .filter(session_request::session_id.eq(session.to_string()))
        .filter(session_request::tool.eq(tool))
        .filter(session_request::always.eq(true))
        .select((session_request::pattern, session_request::rule))
        .load_direct(connection)?;
    Ok(remembered.iter().any(|(asked, rule)| match rule {
        Some(rule) => permission::matches(rule, pattern),
        None => asked == pattern,
    }))
}

/// How many requests of `session` wait for a reply.
pub fn awaiting_replies(connection: &mut Conn, session: SessionId) -> Result<u32, store::Error> {
    let count: i64 = session_request::table
        .filter(session_request::session_id.eq(session.to_string()))
        .filter(session_request::state.eq("pending"))
        .count()
        .get_direct(connection)?;
    Ok(u32::try_from(count).unwrap_or(u32::MAX))
}
