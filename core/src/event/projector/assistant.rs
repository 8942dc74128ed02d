//! Edits of assistant messages and their tool rows: fragments opened and closed, calls
//! streamed, called and resolved, the step's end (which resolves what its calls left).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

use diesel::prelude::*;
use keel_schema::api::{AssistantPart, Message, StepEnd, ToolStatus};
use keel_schema::event::payload;
use keel_schema::id::{CallId, MessageId, SessionId};
use keel_schema::types::{ErrorInfo, Usage};
use serde_json::Value;

use super::statements::{
    CallTool, InsertTool, ResolveAndSettle, ResolveTool, SetMessageData, SetMessageDataIf,
    SettleRequests,
};
use super::{Projection, ToolOutput};
use crate::event::rows;
use crate::store::Direct as _;
use crate::store::column::text_of;
use crate::store::on_backend;
use crate::store::schema::{session_message, session_tool};
use crate::store::{Conn, Error, is_in_savepoint};

impl Projection<'_> {
    /// Loads this session's assistant message `id`, lets `change` edit it, and stores it.
    ///
    /// When this thread kept the message as it last wrote it, at a version (the
    /// `updated_seq`) of a transaction still open or committed ([`Written`]), the edit
    /// starts from that copy without reading the row, and stores it only if the row is
    /// still at that version; otherwise (the row moved on, or `change` refused what may be
    /// a stale copy) it reads the row and runs `change` again on what it holds.
    fn edit_assistant<T>(
        &mut self,
        id: MessageId,
        mut change: impl FnMut(&mut AssistantView<'_>) -> Result<T, String>,
    ) -> Result<T, Error> {
        if let Some((message, kept_at)) = Written::take_current(id, self.session())
            && let Some(value) = self.store_edit(id, message, Some(kept_at), &mut change)?
        {
            return Ok(value);
        }
        let row: Option<StoredMessage> = on_backend!(self.connection, |c| session_message::table
            .find(id.to_string())
            .select(StoredMessage::as_select())
            .get_result(c))
        .optional()?;
        let Some(row) = row else {
            return Err(self.refuse(format!("no message {id}")));
        };
        if row.session_id != self.session_id {
            return Err(self.refuse(format!("message {id} belongs to another session")));
        }
        let message = match Written::take(id, &row.data) {
            Some(message) => message,
            None => serde_json::from_str(&row.data)
                .map_err(|err| Error::Corrupt(format!("message {id}: {err}")))?,
        };
        let stored = self.store_edit(id, message, None, &mut change)?;
        Ok(stored.expect("an edit of the row as read is stored or refused"))
    }

    /// Applies `change` to `message` and stores it. A message `kept_at` a version is not
    /// known to be the row's: it is stored only if the row is still at that version, and
    /// `None` comes back when it is not, or when `change` refuses it, for the caller to
    /// read the row.
    fn store_edit<T>(
        &mut self,
        id: MessageId,
        mut message: Message,
        kept_at: Option<i64>,
        change: &mut impl FnMut(&mut AssistantView<'_>) -> Result<T, String>,
    ) -> Result<Option<T>, Error> {
        let Message::Assistant {
            parts,
            end,
            usage,
            cost,
            ..
        } = &mut message
        else {
            return Err(self.refuse(format!("message {id} is not an assistant message")));
        };
        let mut view = AssistantView {
            parts,
            end,
            usage,
            cost,
        };
        let value = match change(&mut view) {
            Ok(value) => value,
            Err(_) if kept_at.is_some() => return Ok(None),
            Err(reason) => return Err(self.refuse(reason)),
        };
        let ended = view.end.is_some();
        let data = serde_json::to_string(&message)
            .map_err(|err| self.refuse(format!("message does not serialize: {err}")))?;
        let (id_text, seq) = (id.to_string(), self.seq()?);
        match kept_at {
            Some(kept_at) => {
                let stored = SetMessageDataIf {
                    id: &id_text,
                    data: &data,
                    seq,
                    kept_at,
                }
                .execute(self.connection)?;
                if stored == 0 {
                    return Ok(None);
                }
            }
            None => {
                SetMessageData {
                    id: &id_text,
                    data: &data,
                    seq,
                }
                .execute(self.connection)?;
            }
        }
        // An ended step's message is not edited again.
        if !ended {
            let version = self.version_to_keep()?;
            Written::keep(id, data, message, version);
        }
        Ok(Some(value))
    }

    /// The version a message written now is kept at ([`Written`]): its `updated_seq`,
    /// when the writer runs a plain batch (one that keeps nothing of a write it rolls back
    /// alone, see `store::writer`) and this is not inside a write's own savepoint, so
    /// that only a rollback of the whole batch can undo the write; `None` otherwise.
    pub(super) fn version_to_keep(&mut self) -> Result<Option<Version>, Error> {
        if !rows::gathering() || is_in_savepoint(self.connection)? {
            return Ok(None);
        }
        Ok(Some(Version {
            session: self.session(),
            updated_seq: self.seq()?,
        }))
    }

    pub(super) fn open_part(&mut self, id: MessageId, part: AssistantPart) -> Result<(), Error> {
        self.edit_assistant(id, |view| {
            view.require_open()?;
            let duplicate = view.parts.iter().any(|p| same_part(p, &part));
            if duplicate {
                return Err("the fragment is already open".into());
            }
            view.parts.push(part.clone());
            Ok(())
        })
    }

    pub(super) fn close_text(
        &mut self,
        id: MessageId,
        ordinal: u32,
        text: &str,
    ) -> Result<(), Error> {
        self.edit_assistant(id, |view| {
            view.require_open()?;
            match view
                .parts
                .iter_mut()
                .find(|p| matches!(p, AssistantPart::Text { ordinal: o, .. } if *o == ordinal))
            {
                Some(AssistantPart::Text { text: t, .. }) => {
                    *t = text.to_owned();
                    Ok(())
                }
                _ => Err(format!("no open text fragment {ordinal}")),
            }
        })
    }

    pub(super) fn close_reasoning(&mut self, e: &payload::ReasoningEnded) -> Result<(), Error> {
        self.edit_assistant(e.assistant_message_id, |view| {
            view.require_open()?;
            match view.parts.iter_mut().find(
                |p| matches!(p, AssistantPart::Reasoning { ordinal: o, .. } if *o == e.ordinal),
            ) {
                Some(AssistantPart::Reasoning {
                    text,
                    provider_metadata,
                    ..
                }) => {
                    *text = e.text.clone();
                    if e.provider_metadata.is_some() {
                        *provider_metadata = e.provider_metadata.clone();
                    }
                    Ok(())
                }
                _ => Err(format!("no open reasoning fragment {}", e.ordinal)),
            }
        })
    }

    // --- tools --------------------------------------------------------------------------

    pub(super) fn tool_input_started(
        &mut self,
        e: &payload::ToolInputStarted,
    ) -> Result<(), Error> {
        self.open_part(
            e.assistant_message_id,
            AssistantPart::Tool {
                call_id: e.call_id,
                name: e.name.clone(),
                input: Value::Null,
                effect: keel_schema::types::Effect::Read,
                provider_executed: false,
                status: ToolStatus::Pending,
                content: Vec::new(),
                error: None,
                provider_result: None,
            },
        )?;
        let inserted = InsertTool {
            session_id: self.session_id,
            call_id: &e.call_id.to_string(),
            message_id: &e.assistant_message_id.to_string(),
            name: &e.name,
            effect: None,
            status: "pending",
            provider_executed: false,
            input: None,
            rerun: false,
        }
        .execute(self.connection)?;
        if inserted == 0 {
            return Err(self.refuse(format!("tool call {} already exists", e.call_id)));
        }
        Ok(())
    }

    /// A call, streamed or not. Its message says which: a call whose input streamed is in
    /// it (pending). The row is written only as that allows (a streamed call's pending
    /// under this message, none for another), and the row is read only when it did not,
    /// to say why the event is refused: one statement per call instead of two.
    pub(super) fn tool_called(&mut self, e: &payload::ToolCalled) -> Result<(), Error> {
        let call_id = e.call_id;
        let input = e.input.clone();
        let (name, effect, provider_executed) = (e.name.clone(), e.effect, e.provider_executed);
        let streamed = self.edit_assistant(e.assistant_message_id, |view| {
            view.require_open()?;
            let called = AssistantPart::Tool {
                call_id,
                name: name.clone(),
                input: input.clone(),
                effect,
                provider_executed,
                status: ToolStatus::Running,
                content: Vec::new(),
                error: None,
                provider_result: None,
            };
            Ok(match view.tool_part(call_id) {
                Some(part) => {
                    *part = called;
                    true
                }
                None => {
                    view.parts.push(called);
                    false
                }
            })
        })?;
        let input = e.input.to_string();
        let effect = text_of(&e.effect);
        let message_id = e.assistant_message_id.to_string();
        let (session_id, call) = (self.session_id, &call_id.to_string());
        let written = if streamed {
            CallTool {
                session_id,
                call_id: call,
                message_id: &message_id,
                name: &e.name,
                effect: &effect,
                provider_executed: e.provider_executed,
                input: &input,
                rerun: e.rerun,
            }
            .execute(self.connection)?
        } else {
            InsertTool {
                session_id,
                call_id: call,
                message_id: &message_id,
                name: &e.name,
                effect: Some(&effect),
                status: "running",
                provider_executed: e.provider_executed,
                input: Some(&input),
                rerun: e.rerun,
            }
            .execute(self.connection)?
        };
        if written == 1 {
            return Ok(());
        }
        let reason = match self.tool_row(call_id)? {
            Some(row) if row.status != "pending" => {
                format!("tool call {call_id} was already called")
            }
            Some(row) if row.message_id != message_id => {
                format!("tool call {call_id} was started by another message")
            }
            Some(_) => format!("tool call {call_id} is not in the message"),
            None => format!("tool call {call_id} is already in the message"),
        };
        Err(self.refuse(reason))
    }

    fn tool_row(&mut self, call_id: CallId) -> Result<Option<ToolRow>, Error> {
        Ok(on_backend!(self.connection, |c| session_tool::table
            .find((self.session_id, call_id.to_string()))
            .select(ToolRow::as_select())
            .get_result(c))
        .optional()?)
    }

    pub(super) fn resolve_tool(
        &mut self,
        call_id: CallId,
        output: ToolOutput,
    ) -> Result<(), Error> {
        let status = match output {
            ToolOutput::Success { .. } => "completed",
            ToolOutput::Failure { .. } => "error",
        };
        let written = serde_json::to_string(&output)
            .map_err(|err| self.refuse(format!("tool output does not serialize: {err}")))?;
        let call = call_id.to_string();
        // The row, resolved only while it is not, names the message to edit. PostgreSQL
        // resolves it and answers in one round trip; SQLite reads it (a lookup costs it
        // less than a `RETURNING` clause) and resolves it after the edit.
        let message_id = match self.connection {
            Conn::Pg(_) => ResolveAndSettle {
                session_id: self.session_id,
                call_id: &call,
                status,
                output: &written,
            }
            .load_direct(self.connection)?
            .pop(),
            Conn::Sqlite(_) => self
                .tool_row(call_id)?
                .filter(|row| !matches!(row.status.as_str(), "completed" | "error"))
                .map(|row| row.message_id),
        };
        let Some(message_id) = message_id else {
            let reason = match self.tool_row(call_id)? {
                Some(_) => format!("tool call {call_id} is already resolved"),
                None => format!("no tool call {call_id}"),
            };
            return Err(self.refuse(reason));
        };
        let message_id: MessageId = message_id
            .parse()
            .map_err(|err| Error::Corrupt(format!("tool call {call_id} message: {err}")))?;
        self.edit_assistant(message_id, |view| {
            let part = view
                .tool_part(call_id)
                .ok_or_else(|| format!("tool call {call_id} is not in its message"))?;
            if let AssistantPart::Tool {
                status,
                content,
                error,
                provider_result,
                ..
            } = part
            {
                match &output {
                    ToolOutput::Success {
                        content: c, result, ..
                    } => {
                        *status = ToolStatus::Completed;
                        content.clone_from(c);
                        provider_result.clone_from(result);
                    }
                    ToolOutput::Failure { error: e } => {
                        *status = ToolStatus::Error;
                        *error = Some(e.clone());
                    }
                }
            }
            Ok(())
        })?;
        if let Conn::Sqlite(_) = self.connection {
            self.resolve_row(&call, status, &written)?;
        }
        Ok(())
    }

    /// Resolves call `call_id`'s row with `status` and `output` if it is unresolved, and
    /// settles its requests.
    fn resolve_row(&mut self, call_id: &str, status: &str, output: &str) -> Result<(), Error> {
        let session_id = self.session_id;
        match self.connection {
            Conn::Pg(_) => {
                let _resolved: Vec<String> = ResolveAndSettle {
                    session_id,
                    call_id,
                    status,
                    output,
                }
                .load_direct(self.connection)?;
            }
            Conn::Sqlite(_) => {
                ResolveTool {
                    session_id,
                    call_id,
                    status,
                    output,
                }
                .execute(self.connection)?;
                SettleRequests {
                    session_id,
                    call_id,
                }
                .execute(self.connection)?;
            }
        }
        Ok(())
    }

    /// The step's response is over with calls waiting for a person: the message stays
    /// open and shows the usage so far; `step.ended` repeats it.
    pub(super) fn step_awaiting(&mut self, e: &payload::StepAwaiting) -> Result<(), Error> {
        self.edit_assistant(e.assistant_message_id, |view| {
            view.require_open()?;
            *view.usage = e.usage;
            Ok(())
        })
    }

    // --- steps --------------------------------------------------------------------------

    /// Settles a step. `unresolved` is the error for every call of the step still
    /// unresolved but those in `spared` (which run again after recovery); `None`
    /// requires there to be none.
    pub(super) fn end_step(
        &mut self,
        id: MessageId,
        end: StepEnd,
        usage: Option<Usage>,
        cost: f64,
        unresolved: Option<ErrorInfo>,
        spared: &[CallId],
    ) -> Result<(), Error> {
        let failed: Vec<CallId> = self.edit_assistant(id, |view| {
            view.require_open()?;
            let mut failed = Vec::new();
            for part in view.parts.iter_mut() {
                if let AssistantPart::Tool {
                    call_id,
                    status,
                    error,
                    ..
                } = part
                    && matches!(status, ToolStatus::Pending | ToolStatus::Running)
                    && !spared.contains(call_id)
                {
                    let Some(reason) = &unresolved else {
                        return Err(format!(
                            "tool call {call_id} is unresolved; a step ends only after its tools"
                        ));
                    };
                    *status = ToolStatus::Error;
                    *error = Some(reason.clone());
                    failed.push(*call_id);
                }
            }
            *view.end = Some(end.clone());
            if let Some(usage) = usage {
                *view.usage = usage;
            }
            *view.cost = cost;
            Ok(failed)
        })?;
        // Spared calls run again after recovery: `pending` (with `rerun`) marks them until
        // their result, or a second crash's failure, commits.
        for call_id in spared {
            diesel::update(session_tool::table.find((self.session_id, call_id.to_string())))
                .set(session_tool::status.eq("pending"))
                .execute(self.connection)?;
        }
        if let Some(reason) = unresolved {
            let output = serde_json::to_string(&ToolOutput::Failure { error: reason })
                .map_err(|err| self.refuse(format!("tool output does not serialize: {err}")))?;
            for call_id in failed {
                self.resolve_row(&call_id.to_string(), "error", &output)?;
            }
        }
        match usage {
            Some(usage) => self.add_usage(usage, cost),
            None if cost != 0.0 => self.add_usage(Usage::default(), cost),
            None => Ok(()),
        }
    }
}

/// Assistant messages of open steps as this thread last wrote them: each one's stored
/// text and the message that text encodes.
///
/// Every fragment's start and end, every call and result of a step is an edit of its
/// whole assistant message, and decoding the stored text again for each was about a
/// seventh of the store writer's work while steps stream text. An edit whose row still
/// holds exactly the text written last starts from the message kept with it instead: a
/// row changed any other way (a transaction rolled back after the edit, another writer,
/// another node) holds other text, and is decoded.
///
/// Reading the row back to compare was a statement per edit, a round trip on
/// PostgreSQL. So a message is also kept with the version of the row it wrote (the seq
/// of its event, which every edit stores in `updated_seq`), and the next edit starts
/// from it without reading: its `UPDATE … WHERE updated_seq = <version>` finds the row
/// only as it was written, and finding none, the edit reads the row after all. Another
/// writer's edit moves the version on; but an edit undone by a rollback leaves the seq
/// free for another event, which another node could append, editing the message to a
/// different text at the same version. So a message is kept at a version only when its
/// write can be undone by nothing but a rollback of the writer's whole transaction (a
/// plain batch, outside a write's own savepoint), and every such rollback forgets what is
/// kept ([`forget_kept`]).
#[derive(Default)]
pub(super) struct Written {
    messages: HashMap<MessageId, Kept>,
    /// Ids by when they were kept, oldest first; an entry whose stamp is no longer its
    /// message's is stale and skipped.
    order: VecDeque<(MessageId, u64)>,
    stamp: u64,
    /// The estimated heap of everything kept.
    bytes: usize,
}

struct Kept {
    stamp: u64,
    data: String,
    message: Message,
    /// The row's version the message was written at, when only a rollback of the whole
    /// transaction can undo that write (which forgets it, [`forget_kept`]).
    version: Option<Version>,
}

/// The version of a message's row a kept message was written at: its session, and the
/// seq of the event whose edit wrote it (`updated_seq`, which every edit moves on).
#[derive(Debug, Clone, Copy)]
pub(super) struct Version {
    session: SessionId,
    updated_seq: i64,
}

/// The most a thread keeps, estimated as in [`Written::cost`]: enough for the open
/// steps of thousands of streaming sessions.
const WRITTEN_BYTES: usize = 8 << 20;

thread_local! {
    static WRITTEN: RefCell<Written> = RefCell::new(Written::default());
}

/// Forgets every message this thread kept: the writer's transaction was rolled back, and
/// what its edits wrote is not the rows' any more (see [`Written`]).
pub(crate) fn forget_kept() {
    WRITTEN.with(|written| *written.borrow_mut() = Written::default());
}

impl Written {
    /// The message kept for `id` when `stored` is the text it was written as; either way
    /// `id` is no longer kept (its edit keeps it again).
    fn take(id: MessageId, stored: &str) -> Option<Message> {
        WRITTEN.with(|written| written.borrow_mut().take_kept(id, stored))
    }

    /// The message kept for `id` with the version it was written at, when it was kept
    /// with one in `session`; `id` is then no longer kept.
    fn take_current(id: MessageId, session: SessionId) -> Option<(Message, i64)> {
        WRITTEN.with(|written| written.borrow_mut().take_versioned(id, session))
    }

    /// Keeps `message`, just written as `data`, at `version` when known.
    pub(super) fn keep(id: MessageId, data: String, message: Message, version: Option<Version>) {
        WRITTEN.with(|written| written.borrow_mut().insert(id, data, message, version));
    }

    fn take_kept(&mut self, id: MessageId, stored: &str) -> Option<Message> {
        self.remove(id)
            .filter(|kept| kept.data == stored)
            .map(|kept| kept.message)
    }

    fn take_versioned(&mut self, id: MessageId, session: SessionId) -> Option<(Message, i64)> {
        let version = self.messages.get(&id)?.version?;
        if version.session != session {
            return None;
        }
        let kept = self.remove(id)?;
        Some((kept.message, version.updated_seq))
    }

    fn insert(&mut self, id: MessageId, data: String, message: Message, version: Option<Version>) {
        self.remove(id);
        let cost = Self::cost(&data);
        // A message this large is rare, and would push out many others.
        if cost > WRITTEN_BYTES / 16 {
            return;
        }
        while self.bytes + cost > WRITTEN_BYTES {
            let Some((oldest, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.messages.get(&oldest).is_some_and(|k| k.stamp == stamp) {
                self.remove(oldest);
            }
        }
        self.stamp += 1;
        let stamp = self.stamp;
        self.order.push_back((id, stamp));
        self.bytes += cost;
        let kept = Kept {
            stamp,
            data,
            message,
            version,
        };
        self.messages.insert(id, kept);
        // Stale ids pile up as messages are taken and kept again.
        if self.order.len() > 2 * self.messages.len() + 64 {
            let messages = &self.messages;
            self.order
                .retain(|(id, stamp)| messages.get(id).is_some_and(|k| k.stamp == *stamp));
        }
    }

    fn remove(&mut self, id: MessageId) -> Option<Kept> {
        let kept = self.messages.remove(&id)?;
        self.bytes -= Self::cost(&kept.data);
        Some(kept)
    }

    /// A kept message's heap, estimated: its text, the decoded message's strings about
    /// as large again, and 1 KiB for the message's structure and the entry (a short
    /// message kept this way was measured at about 1.7 KiB of resident memory).
    fn cost(data: &str) -> usize {
        2 * data.len() + 1024
    }
}

/// A message row, as an edit of it needs it.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_message)]
struct StoredMessage {
    session_id: String,
    data: String,
}

/// The editable parts of an assistant message.
struct AssistantView<'a> {
    parts: &'a mut Vec<AssistantPart>,
    end: &'a mut Option<StepEnd>,
    usage: &'a mut Usage,
    cost: &'a mut f64,
}

impl AssistantView<'_> {
    fn require_open(&self) -> Result<(), String> {
        match self.end {
            None => Ok(()),
            Some(_) => Err("the step has already ended".into()),
        }
    }

    fn tool_part(&mut self, call_id: CallId) -> Option<&mut AssistantPart> {
        self.parts
            .iter_mut()
            .find(|p| matches!(p, AssistantPart::Tool { call_id: c, .. } if *c == call_id))
    }
}

/// Whether two parts are the same fragment (same kind and ordinal, or the same call).
fn same_part(a: &AssistantPart, b: &AssistantPart) -> bool {
    match (a, b) {
        (AssistantPart::Text { ordinal: x, .. }, AssistantPart::Text { ordinal: y, .. })
        | (
            AssistantPart::Reasoning { ordinal: x, .. },
            AssistantPart::Reasoning { ordinal: y, .. },
        ) => x == y,
        (AssistantPart::Tool { call_id: x, .. }, AssistantPart::Tool { call_id: y, .. }) => x == y,
        _ => false,
    }
}

/// What resolving a call needs of its row.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_tool)]
struct ToolRow {
    message_id: String,
    status: String,
}

#[cfg(test)]
mod tests {
    use keel_schema::types::{Effect, Finish, ModelRef, ToolContent};
    use serde_json::json;

    use super::*;

    /// An assistant message with a part of every kind, as edits leave them.
    fn message(text: &str) -> Message {
        Message::Assistant {
            id: MessageId::new(),
            seq: 7,
            step: 2,
            agent: "build".into(),
            model: ModelRef {
                provider: "p".into(),
                id: "m".into(),
            },
            parts: vec![
                AssistantPart::Text {
                    ordinal: 0,
                    text: text.into(),
                },
                AssistantPart::Reasoning {
                    ordinal: 1,
                    text: "why".into(),
                    provider_metadata: Some(json!({"signature": "s", "n": 1.5})),
                },
                AssistantPart::Tool {
                    call_id: CallId::new(),
                    name: "write".into(),
                    input: json!({"path": "a.txt", "content": "x\ny", "big": 18446744073709551615u64}),
                    effect: Effect::Write,
                    provider_executed: false,
                    status: ToolStatus::Error,
                    content: vec![ToolContent::Text { text: "ok".into() }],
                    error: Some(ErrorInfo::new("tool.failed", "no")),
                    provider_result: Some(json!([1, "two"])),
                },
            ],
            end: Some(StepEnd::Ended {
                finish: Finish::ToolCalls,
            }),
            usage: Usage {
                input: 10,
                output: 3,
                reasoning: 1,
                cache_read: 2,
                cache_write: 0,
            },
            cost: 0.1 + 0.2,
        }
    }

    #[test]
    fn a_kept_message_is_what_decoding_its_text_gives() {
        // The cache stands in for decoding: every field an edit sets must come back
        // from its text unchanged.
        let message = message("hello");
        let data = serde_json::to_string(&message).unwrap();
        assert_eq!(serde_json::from_str::<Message>(&data).unwrap(), message);
    }

    #[test]
    fn a_message_is_given_back_only_for_the_text_it_was_kept_with() {
        let mut written = Written::default();
        let id = MessageId::new();
        let kept = message("one");
        let data = serde_json::to_string(&kept).unwrap();
        written.insert(id, data.clone(), kept.clone(), None);
        assert!(
            written.take_kept(id, "{}").is_none(),
            "other text: decode it"
        );
        assert!(
            written.take_kept(id, &data).is_none(),
            "taking it forgot it, whatever the text"
        );
        written.insert(id, data.clone(), kept.clone(), None);
        assert_eq!(written.take_kept(id, &data), Some(kept));
        assert_eq!(written.bytes, 0);
    }

    #[test]
    fn the_oldest_messages_go_first_once_the_budget_is_spent() {
        let mut written = Written::default();
        let text = "x".repeat(64 * 1024);
        let data = serde_json::to_string(&message(&text)).unwrap();
        let fits = WRITTEN_BYTES / Written::cost(&data);
        let ids: Vec<MessageId> = (0..fits + 10).map(|_| MessageId::new()).collect();
        for id in &ids {
            written.insert(*id, data.clone(), message(&text), None);
            // Taken and kept again, as every edit does: the order stays bounded.
            let again = written.take_kept(*id, &data).unwrap();
            written.insert(*id, data.clone(), again, None);
        }
        assert!(written.bytes <= WRITTEN_BYTES);
        assert_eq!(written.messages.len(), fits);
        assert!(written.order.len() <= 2 * written.messages.len() + 64);
        assert!(
            written.take_kept(ids[0], &data).is_none(),
            "the oldest went"
        );
        assert!(
            written.take_kept(ids[fits + 9], &data).is_some(),
            "the newest stayed"
        );

        let huge = "y".repeat(WRITTEN_BYTES / 16);
        let id = ids[fits + 8];
        written.insert(id, huge.clone(), message("huge"), None);
        assert!(written.take_kept(id, &huge).is_none(), "too large to keep");
    }
}
