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
use crate::store::{Conn, Error, doubt_gathered, is_in_savepoint};

impl Projection<'_> {
    /// Loads this session's assistant message `id`, lets `change` edit it, and stores it.
    ///
    /// When this thread kept the message ([`Written`]) at a version of its row, the edit
    /// starts from that copy without reading the row; otherwise (nothing kept, `change`
    /// refused a copy kept from an earlier transaction, or the row had moved on when the
    /// edit was written at once) it reads the row and runs `change` on what it holds. In
    /// a plain batch outside a write's own savepoint the edit is kept unwritten, for the
    /// batch's end or the next read of the session's messages to write
    /// ([`write_unwritten`]); elsewhere, and for the edit that ends the step, it is
    /// written at once.
    fn edit_assistant<T>(
        &mut self,
        id: MessageId,
        mut change: impl FnMut(&mut AssistantView<'_>) -> Result<T, String>,
    ) -> Result<T, Error> {
        if let Some((message, base)) = Written::take_current(id, self.session())
            && let Some(value) = self.store_edit(id, message, base, &mut change)?
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
        let base = Base::Read {
            at: row.updated_seq,
            size: row.data.len(),
        };
        let stored = self.store_edit(id, message, base, &mut change)?;
        Ok(stored.expect("an edit of the row as read is stored or refused"))
    }

    /// Applies `change` to `message`, which came from `base`, and stores it. `None` comes
    /// back, for the caller to read the row, when `message` was kept from an earlier
    /// transaction and may be stale: `change` refused it, or the row was not at its
    /// version any more. A change that refuses leaves the message as it was (checked in
    /// debug builds): a copy with unwritten edits is kept again as it was.
    fn store_edit<T>(
        &mut self,
        id: MessageId,
        mut message: Message,
        base: Base,
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
        #[cfg(debug_assertions)]
        let before = view.parts.clone();
        let value = match change(&mut view) {
            Ok(value) => value,
            Err(reason) => {
                #[cfg(debug_assertions)]
                debug_assert!(
                    *view.parts == before,
                    "a refused change leaves the message as it was"
                );
                match base {
                    Base::Kept { .. } => return Ok(None),
                    Base::Read { .. } => {}
                    // It holds the batch's earlier edits, which no row has yet, and the
                    // write may go on past the refusal (a savepoint's rollback).
                    Base::Unwritten {
                        at,
                        size,
                        version,
                        checked,
                    } => {
                        Written::keep_unwritten(id, message, version, at, size, checked);
                    }
                }
                return Err(self.refuse(reason));
            }
        };
        let ended = view.end.is_some();
        let version = self.version_to_keep()?;
        if let (Some(version), false) = (version, ended) {
            // The row waits for the batch's end, or for a read of the session's messages.
            Written::keep_unwritten(id, message, version, base.at(), base.size(), base.checked());
            return Ok(Some(value));
        }
        if let (Base::Unwritten { .. }, None) = (base, version) {
            // The batch's earlier edits go into the row with this one, inside a write's own
            // savepoint whose rollback would undo them unseen: the batch cannot commit.
            doubt_gathered();
        }
        let data = serde_json::to_string(&message)
            .map_err(|err| self.refuse(format!("message does not serialize: {err}")))?;
        let (id_text, seq) = (id.to_string(), self.seq()?);
        match base {
            Base::Read { .. } => {
                SetMessageData {
                    id: &id_text,
                    data: &data,
                    seq,
                }
                .execute(self.connection)?;
            }
            Base::Kept { at, .. } | Base::Unwritten { at, .. } => {
                let stored = SetMessageDataIf {
                    id: &id_text,
                    data: &data,
                    seq,
                    kept_at: at,
                }
                .execute(self.connection)?;
                if stored == 0 {
                    if let Base::Unwritten { .. } = base {
                        // Another node edited the row before this batch's first edit:
                        // every edit of the batch started from a stale copy.
                        doubt_gathered();
                        return Err(self.refuse(format!("message {id} changed under the batch")));
                    }
                    return Ok(None);
                }
            }
        }
        // An ended step's message is not edited again.
        if !ended {
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

/// Assistant messages of open steps as this thread last wrote or edited them.
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
/// from it without reading. Another writer's edit moves the version on; but an edit
/// undone by a rollback leaves the seq free for another event, which another node could
/// append, editing the message to a different text at the same version. So a message is
/// kept at a version only when its write can be undone by nothing but a rollback of the
/// writer's whole transaction (a plain batch, outside a write's own savepoint), and every
/// such rollback forgets what is kept ([`forget_kept`]).
///
/// In such a batch an edit is not written either: the message is kept unwritten
/// ([`Stored::Unwritten`]) for the batch's next edit, and written once, before the batch
/// commits or anything reads the session's messages ([`write_unwritten`]), with
/// `UPDATE … WHERE updated_seq = <version the batch's first edit started from>`: should
/// another node have edited the message since, the write finds no row. The batch holds
/// the session from its first append (PostgreSQL: the counter's row lock; SQLite: its
/// write transaction), or, on PostgreSQL with a counter its writer remembers, from the
/// counter's write-back, which fails should another node have appended (and so edited)
/// meanwhile. An edit refused on such a copy may stem from another node's edit too
/// ([`refusing`]): either way the batch runs again from the rows. Outside a plain batch
/// an edit is written at once, `WHERE updated_seq = <version>` when it started from a
/// kept copy, and finding no row it reads the row after all.
#[derive(Default)]
pub(super) struct Written {
    messages: HashMap<MessageId, Kept>,
    /// Ids by when they were kept, oldest first; an entry whose stamp is no longer its
    /// message's is stale and skipped.
    order: VecDeque<(MessageId, u64)>,
    stamp: u64,
    /// The estimated heap of everything kept.
    bytes: usize,
    /// The messages kept with edits their rows do not have yet (ids may repeat, or no
    /// longer be unwritten).
    unwritten: Vec<MessageId>,
}

struct Kept {
    stamp: u64,
    message: Message,
    /// The length of the text the message was last read or written as: its cost.
    size: usize,
    row: Stored,
}

/// What the row of a kept message holds.
enum Stored {
    /// The text this thread wrote, at the row's version when only a rollback of the
    /// whole transaction can undo that write (which forgets it, [`forget_kept`]).
    Written {
        data: String,
        version: Option<Version>,
    },
    /// Not yet the edits the running batch made, up to `version`: the row is still at
    /// version `at`, and the message is written before the batch commits or anything
    /// reads the session's transcript ([`write_unwritten`]).
    Unwritten {
        version: Version,
        at: i64,
        checked: bool,
    },
}

/// Where an edit's message came from: the version of its row it started from, and the
/// length of the text that was, for [`Written::cost`].
#[derive(Debug, Clone, Copy)]
enum Base {
    /// The row, read in this transaction.
    Read { at: i64, size: usize },
    /// A copy this thread wrote at version `at`, maybe in an earlier transaction: the
    /// row may have moved on since (another node's edit).
    Kept { at: i64, size: usize },
    /// A copy holding edits of the running batch that the row, at version `at`, does
    /// not have yet; `checked` when the row is known to be at `at` ([`Base::checked`]).
    Unwritten {
        at: i64,
        size: usize,
        version: Version,
        checked: bool,
    },
}

impl Base {
    fn at(self) -> i64 {
        match self {
            Base::Read { at, .. } | Base::Kept { at, .. } | Base::Unwritten { at, .. } => at,
        }
    }

    /// Whether the row is known to be at version `at`: read in this transaction, or
    /// written from a copy read in it. A copy kept from an earlier transaction is not,
    /// until its write.
    fn checked(self) -> bool {
        match self {
            Base::Read { .. } => true,
            Base::Kept { .. } => false,
            Base::Unwritten { checked, .. } => checked,
        }
    }

    fn size(self) -> usize {
        match self {
            Base::Read { size, .. } | Base::Kept { size, .. } | Base::Unwritten { size, .. } => {
                size
            }
        }
    }
}

/// The version of a message's row a kept message was written at: its session, and the
/// seq of the event whose edit wrote it (`updated_seq`, which every edit moves on).
#[derive(Debug, Clone, Copy)]
pub(super) struct Version {
    session: SessionId,
    updated_seq: i64,
}

/// The most a thread keeps, estimated as in [`Written::cost`]: enough for the open
/// steps of thousands of streaming sessions. Unwritten messages are kept whatever the
/// budget, until the end of their batch.
const WRITTEN_BYTES: usize = 8 << 20;

thread_local! {
    static WRITTEN: RefCell<Written> = RefCell::new(Written::default());
}

/// Forgets every message this thread kept: the writer's transaction was rolled back, and
/// what its edits wrote is not the rows' any more (see [`Written`]).
pub(crate) fn forget_kept() {
    WRITTEN.with(|written| *written.borrow_mut() = Written::default());
}

/// Forgets every message this thread kept if any is still unwritten: for the end of a
/// batch, which writes them all before it commits and forgets them all when it rolls
/// back, so that none outlives it whatever the way it ended.
pub(crate) fn forget_unwritten() {
    WRITTEN.with(|written| {
        let mut written = written.borrow_mut();
        if written.any_unwritten(|_, _| true) {
            *written = Written::default();
        }
    });
}

/// Says that a projection of an event of `session` refuses it. Should the session have a
/// message whose edits the batch keeps unwritten, started from a copy kept from an earlier
/// transaction and not yet checked against its row, the refusal may come from that copy
/// being stale (another node edited the message before the batch's first edit): the batch
/// then runs again from the rows ([`doubt_gathered`]), which tell.
pub(super) fn refusing(session: SessionId) {
    let unchecked = WRITTEN.with(|written| {
        written
            .borrow()
            .any_unwritten(|version, checked| !checked && version.session == session)
    });
    if unchecked {
        doubt_gathered();
    }
}

/// Writes the messages this thread keeps unwritten ([`Stored::Unwritten`]) to their rows,
/// only session `only`'s when given: before the writer's batch commits, and before a read
/// of a session's messages on a connection that may be the writer's. A row that is not
/// at the version the batch's first edit started from was edited by another node first;
/// then, or should this fail or run inside a write's own savepoint (whose rollback would
/// undo it unseen), the batch cannot commit ([`doubt_gathered`]) and runs again from the
/// rows.
pub(crate) fn write_unwritten(connection: &mut Conn, only: Option<SessionId>) -> QueryResult<()> {
    let ids = WRITTEN.with(|written| written.borrow_mut().take_unwritten_ids(only));
    if ids.is_empty() {
        return Ok(());
    }
    let written = write_messages(connection, ids);
    if written.is_err() {
        doubt_gathered();
    }
    written
}

fn write_messages(connection: &mut Conn, ids: Vec<MessageId>) -> QueryResult<()> {
    let keep_versions = !is_in_savepoint(connection)?;
    if !keep_versions {
        doubt_gathered();
    }
    for id in ids {
        let Some((message, version, at)) =
            WRITTEN.with(|written| written.borrow_mut().take_unwritten(id))
        else {
            continue;
        };
        let data = serde_json::to_string(&message)
            .map_err(|err| diesel::result::Error::SerializationError(Box::new(err)))?;
        let stored = SetMessageDataIf {
            id: &id.to_string(),
            data: &data,
            seq: version.updated_seq,
            kept_at: at,
        }
        .execute(connection)?;
        if stored == 0 {
            doubt_gathered();
            continue;
        }
        Written::keep(id, data, message, keep_versions.then_some(version));
    }
    Ok(())
}

impl Written {
    /// The message kept for `id` when `stored` is the text it was written as; either way
    /// `id` is no longer kept (its edit keeps it again).
    fn take(id: MessageId, stored: &str) -> Option<Message> {
        WRITTEN.with(|written| written.borrow_mut().take_kept(id, stored))
    }

    /// The message kept for `id` at a version of its row in `session`, and where it
    /// stands against its row; `id` is then no longer kept.
    fn take_current(id: MessageId, session: SessionId) -> Option<(Message, Base)> {
        WRITTEN.with(|written| written.borrow_mut().take_versioned(id, session))
    }

    /// Keeps `message`, just written as `data`, at `version` when known.
    pub(super) fn keep(id: MessageId, data: String, message: Message, version: Option<Version>) {
        let size = data.len();
        WRITTEN.with(|written| {
            written
                .borrow_mut()
                .insert(id, message, size, Stored::Written { data, version });
        });
    }

    /// Keeps `message`, edited up to `version` and not written, whose row is at version
    /// `at`; `size` is the length of the text it was last read or written as.
    fn keep_unwritten(
        id: MessageId,
        message: Message,
        version: Version,
        at: i64,
        size: usize,
        checked: bool,
    ) {
        let row = Stored::Unwritten {
            version,
            at,
            checked,
        };
        WRITTEN.with(|written| {
            let mut written = written.borrow_mut();
            written.insert(id, message, size, row);
            written.unwritten.push(id);
        });
    }

    fn take_kept(&mut self, id: MessageId, stored: &str) -> Option<Message> {
        self.remove(id)
            .filter(|kept| matches!(&kept.row, Stored::Written { data, .. } if data == stored))
            .map(|kept| kept.message)
    }

    fn take_versioned(&mut self, id: MessageId, session: SessionId) -> Option<(Message, Base)> {
        let kept = self.messages.get(&id)?;
        let size = kept.size;
        let base = match kept.row {
            Stored::Written {
                version: Some(version),
                ..
            } if version.session == session => Base::Kept {
                at: version.updated_seq,
                size,
            },
            Stored::Unwritten {
                version,
                at,
                checked,
            } if version.session == session => Base::Unwritten {
                at,
                size,
                version,
                checked,
            },
            _ => return None,
        };
        let kept = self.remove(id)?;
        Some((kept.message, base))
    }

    /// The ids of the unwritten messages, of session `only` when given; they are no
    /// longer listed.
    fn take_unwritten_ids(&mut self, only: Option<SessionId>) -> Vec<MessageId> {
        if self.unwritten.is_empty() {
            return Vec::new();
        }
        let Some(only) = only else {
            return std::mem::take(&mut self.unwritten);
        };
        let (taken, left) = self.unwritten.iter().partition(|id| {
            self.unwritten_at(id)
                .is_some_and(|(version, _)| version.session == only)
        });
        self.unwritten = left;
        taken
    }

    /// The version an unwritten message was edited up to, and whether its row is known
    /// to be where its edits started ([`Base::checked`]).
    fn unwritten_at(&self, id: &MessageId) -> Option<(Version, bool)> {
        match self.messages.get(id)?.row {
            Stored::Unwritten {
                version, checked, ..
            } => Some((version, checked)),
            Stored::Written { .. } => None,
        }
    }

    /// Whether an unwritten message's version and check match `matching`.
    fn any_unwritten(&self, matching: impl Fn(Version, bool) -> bool) -> bool {
        self.unwritten.iter().any(|id| {
            self.unwritten_at(id)
                .is_some_and(|(version, checked)| matching(version, checked))
        })
    }

    /// An unwritten message, its version and the version its row is at; it is then no
    /// longer kept.
    fn take_unwritten(&mut self, id: MessageId) -> Option<(Message, Version, i64)> {
        let Stored::Unwritten { version, at, .. } = self.messages.get(&id)?.row else {
            return None;
        };
        let kept = self.remove(id)?;
        Some((kept.message, version, at))
    }

    fn insert(&mut self, id: MessageId, message: Message, size: usize, row: Stored) {
        self.remove(id);
        let cost = Self::cost(size);
        let unwritten = matches!(row, Stored::Unwritten { .. });
        // A message this large is rare, and would push out many others.
        if cost > WRITTEN_BYTES / 16 && !unwritten {
            return;
        }
        let mut spared = Vec::new();
        while self.bytes + cost > WRITTEN_BYTES {
            let Some((oldest, stamp)) = self.order.pop_front() else {
                break;
            };
            match self.messages.get(&oldest) {
                Some(kept) if kept.stamp == stamp => {
                    if let Stored::Unwritten { .. } = kept.row {
                        spared.push((oldest, stamp));
                    } else {
                        self.remove(oldest);
                    }
                }
                _ => {}
            }
        }
        // Still the oldest, and kept.
        for entry in spared.into_iter().rev() {
            self.order.push_front(entry);
        }
        self.stamp += 1;
        let stamp = self.stamp;
        self.order.push_back((id, stamp));
        self.bytes += cost;
        let kept = Kept {
            stamp,
            message,
            size,
            row,
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
        self.bytes -= Self::cost(kept.size);
        Some(kept)
    }

    /// A kept message's heap, estimated from the length of its text: the text, the
    /// decoded message's strings about as large again, and 1 KiB for the message's
    /// structure and the entry (a short message kept this way was measured at about
    /// 1.7 KiB of resident memory).
    fn cost(size: usize) -> usize {
        2 * size + 1024
    }
}

/// A message row, as an edit of it needs it.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = session_message)]
struct StoredMessage {
    session_id: String,
    data: String,
    updated_seq: i64,
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

    /// A row holding `data`, written outside a plain batch.
    fn stored(data: &str) -> Stored {
        Stored::Written {
            data: data.to_owned(),
            version: None,
        }
    }

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
        written.insert(id, kept.clone(), data.len(), stored(&data));
        assert!(
            written.take_kept(id, "{}").is_none(),
            "other text: decode it"
        );
        assert!(
            written.take_kept(id, &data).is_none(),
            "taking it forgot it, whatever the text"
        );
        written.insert(id, kept.clone(), data.len(), stored(&data));
        assert_eq!(written.take_kept(id, &data), Some(kept));
        assert_eq!(written.bytes, 0);
    }

    #[test]
    fn the_oldest_messages_go_first_once_the_budget_is_spent() {
        let mut written = Written::default();
        let text = "x".repeat(64 * 1024);
        let data = serde_json::to_string(&message(&text)).unwrap();
        let fits = WRITTEN_BYTES / Written::cost(data.len());
        let ids: Vec<MessageId> = (0..fits + 10).map(|_| MessageId::new()).collect();
        for id in &ids {
            written.insert(*id, message(&text), data.len(), stored(&data));
            // Taken and kept again, as every edit does: the order stays bounded.
            let again = written.take_kept(*id, &data).unwrap();
            written.insert(*id, again, data.len(), stored(&data));
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
        written.insert(id, message("huge"), huge.len(), stored(&huge));
        assert!(written.take_kept(id, &huge).is_none(), "too large to keep");
    }
}
