//! Edits of assistant messages and their tool rows: fragments opened and closed, calls
//! streamed, called and resolved, the step's end (which resolves what its calls left).

use diesel::prelude::*;
use keel_schema::api::{AssistantPart, Message, StepEnd, ToolStatus};
use keel_schema::event::payload;
use keel_schema::id::{CallId, MessageId};
use keel_schema::types::{ErrorInfo, Usage};
use serde_json::Value;

use super::statements::{CallTool, InsertTool, ResolveTool, SetMessageData, SettleRequests};
use super::{Projection, ToolOutput};
use crate::store::Error;
use crate::store::column::text_of;
use crate::store::schema::{session_message, session_tool};

impl Projection<'_> {
    /// Loads this session's assistant message `id`, lets `change` edit it, and stores it.
    fn edit_assistant<T>(
        &mut self,
        id: MessageId,
        change: impl FnOnce(&mut AssistantView<'_>) -> Result<T, String>,
    ) -> Result<T, Error> {
        let row: Option<StoredMessage> = session_message::table
            .find(id.to_string())
            .select(StoredMessage::as_select())
            .get_result(self.connection)
            .optional()?;
        let Some(row) = row else {
            return Err(self.refuse(format!("no message {id}")));
        };
        if row.session_id != self.session_id {
            return Err(self.refuse(format!("message {id} belongs to another session")));
        }
        let mut message: Message = serde_json::from_str(&row.data)
            .map_err(|err| Error::Corrupt(format!("message {id}: {err}")))?;
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
        let value = change(&mut view).map_err(|reason| self.refuse(reason))?;
        let data = serde_json::to_string(&message)
            .map_err(|err| self.refuse(format!("message does not serialize: {err}")))?;
        SetMessageData {
            id: &id.to_string(),
            data: &data,
            seq: self.seq()?,
        }
        .execute(self.connection)?;
        Ok(value)
    }

    pub(super) fn open_part(&mut self, id: MessageId, part: AssistantPart) -> Result<(), Error> {
        self.edit_assistant(id, |view| {
            view.require_open()?;
            let duplicate = view.parts.iter().any(|p| same_part(p, &part));
            if duplicate {
                return Err("the fragment is already open".into());
            }
            view.parts.push(part);
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
        InsertTool {
            session_id: self.session_id,
            call_id: &e.call_id.to_string(),
            message_id: &e.assistant_message_id.to_string(),
            name: &e.name,
            effect: None,
            status: "pending",
            provider_executed: false,
            input: None,
        }
        .execute(self.connection)?;
        Ok(())
    }

    pub(super) fn tool_called(&mut self, e: &payload::ToolCalled) -> Result<(), Error> {
        let call_id = e.call_id;
        let existing = self.tool_row(call_id)?;
        let streamed = match &existing {
            None => false,
            Some(row) if row.status == "pending" => {
                if row.message_id != e.assistant_message_id.to_string() {
                    return Err(self.refuse(format!(
                        "tool call {call_id} was started by another message"
                    )));
                }
                true
            }
            Some(_) => return Err(self.refuse(format!("tool call {call_id} was already called"))),
        };
        let input = e.input.clone();
        let (name, effect, provider_executed) = (e.name.clone(), e.effect, e.provider_executed);
        self.edit_assistant(e.assistant_message_id, |view| {
            view.require_open()?;
            let called = AssistantPart::Tool {
                call_id,
                name,
                input,
                effect,
                provider_executed,
                status: ToolStatus::Running,
                content: Vec::new(),
                error: None,
                provider_result: None,
            };
            match view.tool_part(call_id) {
                Some(part) if streamed => *part = called,
                Some(_) => return Err(format!("tool call {call_id} is already in the message")),
                None if streamed => {
                    return Err(format!("tool call {call_id} is not in the message"));
                }
                None => view.parts.push(called),
            }
            Ok(())
        })?;
        let input = e.input.to_string();
        let effect = text_of(&e.effect);
        let (session_id, call_id) = (self.session_id, &call_id.to_string());
        if streamed {
            CallTool {
                session_id,
                call_id,
                name: &e.name,
                effect: &effect,
                provider_executed: e.provider_executed,
                input: &input,
            }
            .execute(self.connection)?;
        } else {
            InsertTool {
                session_id,
                call_id,
                message_id: &e.assistant_message_id.to_string(),
                name: &e.name,
                effect: Some(&effect),
                status: "running",
                provider_executed: e.provider_executed,
                input: Some(&input),
            }
            .execute(self.connection)?;
        }
        if e.rerun {
            diesel::update(session_tool::table.find((session_id, call_id)))
                .set(session_tool::rerun.eq(true))
                .execute(self.connection)?;
        }
        Ok(())
    }

    fn tool_row(&mut self, call_id: CallId) -> Result<Option<ToolRow>, Error> {
        Ok(session_tool::table
            .find((self.session_id, call_id.to_string()))
            .select(ToolRow::as_select())
            .get_result(self.connection)
            .optional()?)
    }

    pub(super) fn resolve_tool(
        &mut self,
        call_id: CallId,
        output: ToolOutput,
    ) -> Result<(), Error> {
        let Some(row) = self.tool_row(call_id)? else {
            return Err(self.refuse(format!("no tool call {call_id}")));
        };
        if matches!(row.status.as_str(), "completed" | "error") {
            return Err(self.refuse(format!("tool call {call_id} is already resolved")));
        }
        let message_id: MessageId = row
            .message_id
            .parse()
            .map_err(|err| Error::Corrupt(format!("tool call {call_id} message: {err}")))?;
        let status = match output {
            ToolOutput::Success { .. } => "completed",
            ToolOutput::Failure { .. } => "error",
        };
        let written = serde_json::to_string(&output)
            .map_err(|err| self.refuse(format!("tool output does not serialize: {err}")))?;
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
                match output {
                    ToolOutput::Success {
                        content: c, result, ..
                    } => {
                        *status = ToolStatus::Completed;
                        *content = c;
                        *provider_result = result;
                    }
                    ToolOutput::Failure { error: e } => {
                        *status = ToolStatus::Error;
                        *error = Some(e);
                    }
                }
            }
            Ok(())
        })?;
        let call_id = call_id.to_string();
        ResolveTool {
            session_id: self.session_id,
            call_id: &call_id,
            status,
            output: &written,
        }
        .execute(self.connection)?;
        SettleRequests {
            session_id: self.session_id,
            call_id: &call_id,
        }
        .execute(self.connection)?;
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
            *view.end = Some(end);
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
            let session_id = self.session_id;
            for call_id in failed {
                let call_id = call_id.to_string();
                ResolveTool {
                    session_id,
                    call_id: &call_id,
                    status: "error",
                    output: &output,
                }
                .execute(self.connection)?;
                SettleRequests {
                    session_id,
                    call_id: &call_id,
                }
                .execute(self.connection)?;
            }
        }
        match usage {
            Some(usage) => self.add_usage(usage, cost),
            None if cost != 0.0 => self.add_usage(Usage::default(), cost),
            None => Ok(()),
        }
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
