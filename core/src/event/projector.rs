//! Projections: `session`, `session_message`, `session_tool` and `session_input` are pure
//! functions of the log. [`project`] applies one event inside the appending transaction;
//! an error rolls the event (and everything appended with it) back.
//!
//! Rules kept here:
//! - A tool call is resolved exactly once: by its own `tool.success`/`tool.failed`, or by
//!   the `step.interrupted`/`step.recovered` of its step, which fails every call of that
//!   step still unresolved, in the same transaction.
//! - Usage and cost totals of a session accumulate from `step.ended` and `step.failed`.
//! - Nothing here reads the clock or generates ids: replaying the log reproduces every row.
//!
//! Rows are found by primary key with `get_result`, never `first`: `first` adds a bound
//! `LIMIT`, and SQLite recompiles a statement whose `LIMIT` parameter was bound again, so
//! every such lookup would be parsed and planned anew.

use std::collections::HashMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Double, Nullable, Text};
use keel_schema::api::{AssistantPart, InputStatus, Message, StepEnd, ToolStatus};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{CallId, InputId, MessageId, SessionId};
use keel_schema::types::{Delivery, ErrorInfo, InputKind, InputSource, Part, ToolContent, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::log::{db_int, from_db_int};
use crate::store::fixed::{Execute, fixed_query};
use crate::store::schema::{session, session_input, session_message, session_tool};
use crate::store::{Conn, Error};

/// Applies one event to the projections. `session_id` is the envelope's session as
/// stored (formatted once by the caller for all of an append's statements).
pub fn project(connection: &mut Conn, envelope: &Envelope, session_id: &str) -> Result<(), Error> {
    let mut projection = Projection {
        connection,
        envelope,
        session_id,
    };
    projection.apply()
}

/// The error the model sees for a call its step's interruption left unresolved.
pub fn interrupted_tool_error(reason: keel_schema::types::InterruptReason) -> ErrorInfo {
    let reason = serde_json::to_value(reason)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    ErrorInfo::new(
        "tool.interrupted",
        format!("the step was interrupted ({reason}) before this tool call finished"),
    )
}

/// The error the model sees for a call whose owner died while it ran.
pub fn crashed_tool_error() -> ErrorInfo {
    ErrorInfo::new(
        "tool.interrupted-by-crash",
        "Keel stopped while this tool call was running, and did not run it again. It may or \
         may not have taken effect: check before repeating it.",
    )
}

/// What `session_tool.output` holds for a completed or failed call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolOutput {
    Success {
        structured: Value,
        content: Vec<ToolContent>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    },
    Failure {
        error: ErrorInfo,
    },
}

struct Projection<'a> {
    connection: &'a mut Conn,
    envelope: &'a Envelope,
    /// The envelope's session as stored.
    session_id: &'a str,
}

impl Projection<'_> {
    fn session(&self) -> SessionId {
        self.envelope.session_id
    }

    fn refuse(&self, reason: impl Into<String>) -> Error {
        let event = &self.envelope.event;
        Error::Projection {
            session: self.session(),
            key: format!("{}.{}", event.type_name(), event.version()),
            reason: reason.into(),
        }
    }

    fn seq(&self) -> Result<i64, Error> {
        db_int(self.envelope.seq)
    }

    /// Runs a fixed statement.
    fn run(&mut self, statement: impl Execute) -> Result<(), Error> {
        statement.execute_on(self.connection)?;
        Ok(())
    }

    fn apply(&mut self) -> Result<(), Error> {
        let envelope = self.envelope;
        match &envelope.event {
            DurableEvent::Created(e) => self.created(e),
            DurableEvent::Renamed(e) => self.run(SetTitle {
                id: self.session_id,
                title: &e.title,
            }),
            DurableEvent::AgentSwitched(e) => self.run(SetAgent {
                id: self.session_id,
                agent: &e.agent,
            }),
            DurableEvent::ModelSwitched(e) => self.run(SetModel {
                id: self.session_id,
                provider: &e.model.provider,
                model: &e.model.id,
            }),
            DurableEvent::Deleted(_) => self.run(SetDeleted {
                id: self.session_id,
                at: envelope.time,
            }),
            DurableEvent::PromptAdmitted(e) => self.admitted(e),
            DurableEvent::PromptExecutionRequested(e) => self.execution_requested(e.input_id),
            DurableEvent::PromptCancelled(e) => self.cancelled(e.input_id),
            DurableEvent::Prompted(e) => self.prompted(e),
            DurableEvent::Synthetic(e) => self.insert_message(
                e.message_id,
                &Message::Synthetic {
                    id: e.message_id,
                    seq: envelope.seq,
                    text: e.text.clone(),
                    reason: e.reason,
                },
            ),
            // Claims live in `session_execution`, written by the execution module in the
            // same transaction; the busy period itself leaves no projected row.
            DurableEvent::ExecutionStarted(_) | DurableEvent::ExecutionSettled(_) => Ok(()),
            DurableEvent::StepStarted(e) => self.insert_message(
                e.assistant_message_id,
                &Message::Assistant {
                    id: e.assistant_message_id,
                    seq: envelope.seq,
                    step: e.step,
                    agent: e.agent.clone(),
                    model: e.model.clone(),
                    parts: Vec::new(),
                    end: None,
                    usage: Usage::default(),
                    cost: 0.0,
                },
            ),
            DurableEvent::TextStarted(e) => self.open_part(
                e.assistant_message_id,
                AssistantPart::Text {
                    ordinal: e.ordinal,
                    text: String::new(),
                },
            ),
            DurableEvent::TextEnded(e) => {
                self.close_text(e.assistant_message_id, e.ordinal, &e.text)
            }
            DurableEvent::ReasoningStarted(e) => self.open_part(
                e.assistant_message_id,
                AssistantPart::Reasoning {
                    ordinal: e.ordinal,
                    text: String::new(),
                    provider_metadata: e.provider_metadata.clone(),
                },
            ),
            DurableEvent::ReasoningEnded(e) => self.close_reasoning(e),
            DurableEvent::ToolInputStarted(e) => self.tool_input_started(e),
            // The raw input text is kept in the log; the parsed input arrives with tool.called.
            DurableEvent::ToolInputEnded(_) => Ok(()),
            DurableEvent::ToolCalled(e) => self.tool_called(e),
            DurableEvent::ToolSuccess(e) => self.resolve_tool(
                e.call_id,
                ToolOutput::Success {
                    structured: e.structured.clone(),
                    content: e.content.clone(),
                    result: e.result.clone(),
                },
            ),
            DurableEvent::ToolFailed(e) => self.resolve_tool(
                e.call_id,
                ToolOutput::Failure {
                    error: e.error.clone(),
                },
            ),
            // Permission requests and questions are read from the log by the runner that
            // waits on them; they project into no table of this schema.
            DurableEvent::PermissionRequested(_)
            | DurableEvent::PermissionReplied(_)
            | DurableEvent::QuestionAsked(_)
            | DurableEvent::QuestionAnswered(_)
            | DurableEvent::QuestionDismissed(_)
            | DurableEvent::RetryScheduled(_) => Ok(()),
            DurableEvent::StepEnded(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Ended { finish: e.finish },
                Some(e.usage),
                e.cost,
                None,
            ),
            DurableEvent::StepFailed(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Failed {
                    error: e.error.clone(),
                },
                e.usage,
                0.0,
                None,
            ),
            DurableEvent::StepInterrupted(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Interrupted { reason: e.reason },
                None,
                0.0,
                Some(interrupted_tool_error(e.reason)),
            ),
            DurableEvent::StepRecovered(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Recovered {
                    execution_id: e.execution_id,
                },
                None,
                0.0,
                Some(crashed_tool_error()),
            ),
            DurableEvent::CompactionStarted(e) => match e.input_id {
                Some(input_id) => self.promote_control(input_id),
                None => Ok(()),
            },
            DurableEvent::CompactionEnded(e) => {
                // The summary's id derives from its event's id, so replay reproduces it.
                let id = MessageId::from_ulid(envelope.id.ulid());
                self.insert_message(
                    id,
                    &Message::Summary {
                        seq: envelope.seq,
                        boundary_seq: e.boundary_seq,
                        summary: e.summary.clone(),
                    },
                )?;
                self.add_usage(e.usage, 0.0)
            }
            DurableEvent::CompactionFailed(_) => Ok(()),
        }
    }

    fn created(&mut self, e: &payload::Created) -> Result<(), Error> {
        let time = self.envelope.time;
        diesel::insert_into(session::table)
            .values((
                session::id.eq(self.session_id),
                session::title.eq(&e.title),
                session::directory.eq(&e.directory),
                session::agent.eq(&e.agent),
                session::model_provider.eq(&e.model.provider),
                session::model_id.eq(&e.model.id),
                session::time_created.eq(time),
                session::time_updated.eq(time),
                session::last_seq.eq(0i64),
                session::usage_input.eq(0i64),
                session::usage_output.eq(0i64),
                session::usage_reasoning.eq(0i64),
                session::usage_cache_read.eq(0i64),
                session::usage_cache_write.eq(0i64),
                session::cost.eq(0.0),
            ))
            .execute(self.connection)?;
        Ok(())
    }

    fn add_usage(&mut self, usage: Usage, cost: f64) -> Result<(), Error> {
        AddUsage {
            id: self.session_id,
            input: db_int(usage.input)?,
            output: db_int(usage.output)?,
            reasoning: db_int(usage.reasoning)?,
            cache_read: db_int(usage.cache_read)?,
            cache_write: db_int(usage.cache_write)?,
            cost,
        }
        .execute(self.connection)?;
        Ok(())
    }

    // --- inputs -------------------------------------------------------------------------

    fn admitted(&mut self, e: &payload::PromptAdmitted) -> Result<(), Error> {
        let parts = serde_json::to_string(&e.parts)
            .map_err(|err| self.refuse(format!("parts do not serialize: {err}")))?;
        diesel::insert_into(session_input::table)
            .values((
                session_input::id.eq(e.input_id.to_string()),
                session_input::session_id.eq(self.session_id),
                session_input::kind.eq(text_of(&e.kind)),
                session_input::delivery.eq(text_of(&e.delivery)),
                session_input::parts.eq(parts),
                session_input::source.eq(text_of(&e.source)),
                session_input::request_execution.eq(e.request_execution),
                session_input::admitted_seq.eq(self.seq()?),
                session_input::execution_requested.eq(false),
            ))
            .execute(self.connection)
            .map_err(|err| match err {
                diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::UniqueViolation,
                    _,
                ) => self.refuse(format!("input {} was already admitted", e.input_id)),
                other => other.into(),
            })?;
        Ok(())
    }

    /// The input, which must belong to this session and still be pending.
    fn pending_input(&mut self, input_id: InputId) -> Result<InputRow, Error> {
        let row = InputRow::find(self.connection, input_id)?
            .filter(|row| row.session_id == self.session_id)
            .ok_or_else(|| self.refuse(format!("no input {input_id} in this session")))?;
        match row.status() {
            InputStatus::Pending => Ok(row),
            status => Err(self.refuse(format!("input {input_id} is {status:?}, not pending"))),
        }
    }

    fn execution_requested(&mut self, input_id: InputId) -> Result<(), Error> {
        let row = InputRow::find(self.connection, input_id)?
            .filter(|row| row.session_id == self.session_id)
            .ok_or_else(|| self.refuse(format!("no input {input_id} in this session")))?;
        RequestExecution { id: &row.id }.execute(self.connection)?;
        Ok(())
    }

    fn cancelled(&mut self, input_id: InputId) -> Result<(), Error> {
        let row = self.pending_input(input_id)?;
        CancelInput {
            id: &row.id,
            seq: self.seq()?,
        }
        .execute(self.connection)?;
        Ok(())
    }

    fn prompted(&mut self, e: &payload::Prompted) -> Result<(), Error> {
        let row = self.pending_input(e.input_id)?;
        if row.kind()? != InputKind::Prompt {
            return Err(self.refuse(format!(
                "input {} is a control input; it is promoted by what it controls",
                e.input_id
            )));
        }
        let parts: Vec<Part> = serde_json::from_str(&row.parts)
            .map_err(|err| Error::Corrupt(format!("input {} parts: {err}", e.input_id)))?;
        PromoteInput {
            id: &row.id,
            seq: self.seq()?,
            message_id: Some(&e.message_id.to_string()),
        }
        .execute(self.connection)?;
        self.insert_message(
            e.message_id,
            &Message::User {
                id: e.message_id,
                seq: self.envelope.seq,
                input_id: e.input_id,
                parts,
            },
        )
    }

    fn promote_control(&mut self, input_id: InputId) -> Result<(), Error> {
        let row = self.pending_input(input_id)?;
        if !row.kind()?.is_control() {
            return Err(self.refuse(format!("input {input_id} is a prompt, not a control input")));
        }
        PromoteInput {
            id: &row.id,
            seq: self.seq()?,
            message_id: None,
        }
        .execute(self.connection)?;
        Ok(())
    }

    // --- messages -----------------------------------------------------------------------

    fn insert_message(&mut self, id: MessageId, message: &Message) -> Result<(), Error> {
        let role = match message {
            Message::User { .. } => "user",
            Message::Assistant { .. } => "assistant",
            Message::Synthetic { .. } => "synthetic",
            Message::Summary { .. } => "summary",
        };
        let data = serde_json::to_string(message)
            .map_err(|err| self.refuse(format!("message does not serialize: {err}")))?;
        InsertMessage {
            id: &id.to_string(),
            session_id: self.session_id,
            seq: self.seq()?,
            role,
            data: &data,
        }
        .execute(self.connection)
        .map_err(|err| match err {
            diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::UniqueViolation,
                _,
            ) => self.refuse(format!("message {id} already exists")),
            other => other.into(),
        })?;
        Ok(())
    }

    /// Loads this session's assistant message `id`, lets `change` edit it, and stores it.
    fn edit_assistant<T>(
        &mut self,
        id: MessageId,
        change: impl FnOnce(&mut AssistantView<'_>) -> Result<T, String>,
    ) -> Result<T, Error> {
        let row: Option<(String, String)> = session_message::table
            .find(id.to_string())
            .select((session_message::session_id, session_message::data))
            .get_result(self.connection)
            .optional()?;
        let Some((owner, data)) = row else {
            return Err(self.refuse(format!("no message {id}")));
        };
        if owner != self.session_id {
            return Err(self.refuse(format!("message {id} belongs to another session")));
        }
        let mut message: Message = serde_json::from_str(&data)
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

    fn open_part(&mut self, id: MessageId, part: AssistantPart) -> Result<(), Error> {
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

    fn close_text(&mut self, id: MessageId, ordinal: u32, text: &str) -> Result<(), Error> {
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

    fn close_reasoning(&mut self, e: &payload::ReasoningEnded) -> Result<(), Error> {
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

    fn tool_input_started(&mut self, e: &payload::ToolInputStarted) -> Result<(), Error> {
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

    fn tool_called(&mut self, e: &payload::ToolCalled) -> Result<(), Error> {
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
        Ok(())
    }

    fn tool_row(&mut self, call_id: CallId) -> Result<Option<ToolRow>, Error> {
        Ok(session_tool::table
            .find((self.session_id, call_id.to_string()))
            .select((session_tool::message_id, session_tool::status))
            .get_result::<(String, String)>(self.connection)
            .optional()?
            .map(|(message_id, status)| ToolRow { message_id, status }))
    }

    fn resolve_tool(&mut self, call_id: CallId, output: ToolOutput) -> Result<(), Error> {
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
        ResolveTool {
            session_id: self.session_id,
            call_id: &call_id.to_string(),
            status,
            output: &written,
        }
        .execute(self.connection)?;
        Ok(())
    }

    // --- steps --------------------------------------------------------------------------

    /// Settles a step. `unresolved` is the error for every call of the step still
    /// unresolved; `None` requires there to be none.
    fn end_step(
        &mut self,
        id: MessageId,
        end: StepEnd,
        usage: Option<Usage>,
        cost: f64,
        unresolved: Option<ErrorInfo>,
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
        if let Some(reason) = unresolved {
            let output = serde_json::to_string(&ToolOutput::Failure { error: reason })
                .map_err(|err| self.refuse(format!("tool output does not serialize: {err}")))?;
            let session_id = self.session_id;
            for call_id in failed {
                ResolveTool {
                    session_id,
                    call_id: &call_id.to_string(),
                    status: "error",
                    output: &output,
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

// The projections' statements, each prepared once per connection (see
// `crate::store::fixed`). Every event projects through one or two of them.

fixed_query! {
    /// How every event of a step stores its assistant message: the hottest statement of
    /// the projector.
    struct SetMessageData<'a> { id: &'a str, data: &'a str, seq: i64 }
    sql r#"UPDATE "session_message" SET "data" = "# {data: Text}
        r#", "updated_seq" = "# {seq: BigInt} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct InsertMessage<'a> { id: &'a str, session_id: &'a str, seq: i64, role: &'a str, data: &'a str }
    sql r#"INSERT INTO "session_message" ("id", "session_id", "seq", "role", "data", "updated_seq") VALUES ("#
        {id: Text} ", " {session_id: Text} ", " {seq: BigInt} ", " {role: Text} ", "
        {data: Text} ", " {seq: BigInt} ")"
}

fixed_query! {
    struct SetTitle<'a> { id: &'a str, title: &'a str }
    sql r#"UPDATE "session" SET "title" = "# {title: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct SetAgent<'a> { id: &'a str, agent: &'a str }
    sql r#"UPDATE "session" SET "agent" = "# {agent: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct SetModel<'a> { id: &'a str, provider: &'a str, model: &'a str }
    sql r#"UPDATE "session" SET "model_provider" = "# {provider: Text}
        r#", "model_id" = "# {model: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct SetDeleted<'a> { id: &'a str, at: i64 }
    sql r#"UPDATE "session" SET "deleted_at" = "# {at: BigInt} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// Adds a step's usage and cost to the session's totals.
    struct AddUsage<'a> {
        id: &'a str,
        input: i64,
        output: i64,
        reasoning: i64,
        cache_read: i64,
        cache_write: i64,
        cost: f64,
    }
    sql r#"UPDATE "session" SET "usage_input" = "usage_input" + "# {input: BigInt}
        r#", "usage_output" = "usage_output" + "# {output: BigInt}
        r#", "usage_reasoning" = "usage_reasoning" + "# {reasoning: BigInt}
        r#", "usage_cache_read" = "usage_cache_read" + "# {cache_read: BigInt}
        r#", "usage_cache_write" = "usage_cache_write" + "# {cache_write: BigInt}
        r#", "cost" = "cost" + "# {cost: Double} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct RequestExecution<'a> { id: &'a str }
    sql r#"UPDATE "session_input" SET "execution_requested" = TRUE WHERE "id" = "# {id: Text}
}

fixed_query! {
    struct CancelInput<'a> { id: &'a str, seq: i64 }
    sql r#"UPDATE "session_input" SET "cancelled_seq" = "# {seq: BigInt}
        r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// Promotes an input: a prompt with the message it became, a control input without.
    struct PromoteInput<'a> { id: &'a str, seq: i64, message_id: Option<&'a str> }
    sql r#"UPDATE "session_input" SET "promoted_seq" = "# {seq: BigInt}
        r#", "message_id" = "# {message_id: Nullable<Text>} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// A tool call's row, when its input starts streaming (pending) or it is called.
    struct InsertTool<'a> {
        session_id: &'a str,
        call_id: &'a str,
        message_id: &'a str,
        name: &'a str,
        effect: Option<&'a str>,
        status: &'a str,
        provider_executed: bool,
        input: Option<&'a str>,
    }
    sql r#"INSERT INTO "session_tool" ("session_id", "call_id", "message_id", "name", "effect", "status", "provider_executed", "input") VALUES ("#
        {session_id: Text} ", " {call_id: Text} ", " {message_id: Text} ", " {name: Text} ", "
        {effect: Nullable<Text>} ", " {status: Text} ", " {provider_executed: Bool} ", "
        {input: Nullable<Text>} ")"
}

fixed_query! {
    /// A streamed call, called: its row gets the parsed input.
    struct CallTool<'a> {
        session_id: &'a str,
        call_id: &'a str,
        name: &'a str,
        effect: &'a str,
        provider_executed: bool,
        input: &'a str,
    }
    sql r#"UPDATE "session_tool" SET "name" = "# {name: Text} r#", "effect" = "# {effect: Text}
        r#", "status" = 'running', "provider_executed" = "# {provider_executed: Bool}
        r#", "input" = "# {input: Text}
        r#" WHERE "session_id" = "# {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
}

fixed_query! {
    struct ResolveTool<'a> { session_id: &'a str, call_id: &'a str, status: &'a str, output: &'a str }
    sql r#"UPDATE "session_tool" SET "status" = "# {status: Text} r#", "output" = "# {output: Text}
        r#" WHERE "session_id" = "# {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
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

struct ToolRow {
    message_id: String,
    status: String,
}

/// The text form of a unit enum (`"steer"`, `"prompt"` …), as stored in CHECKed columns.
pub(crate) fn text_of<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(Value::String(text)) => text,
        // Every type passed here is a unit enum with snake_case names.
        other => panic!("text_of takes unit enums, got {other:?}"),
    }
}

/// Parses a unit enum from its stored text form.
pub(crate) fn parse_text<T: for<'de> Deserialize<'de>>(
    column: &str,
    text: &str,
) -> Result<T, Error> {
    serde_json::from_value(Value::String(text.to_owned()))
        .map_err(|e| Error::Corrupt(format!("{column} `{text}`: {e}")))
}

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
        Ok(session_input::table
            .find(id.to_string())
            .select(Self::as_select())
            .get_result(connection)
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
    pub fn to_api(&self) -> Result<keel_schema::api::Input, Error> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| {
            Error::Corrupt(format!("input {} {what}: {e}", self.id))
        };
        Ok(keel_schema::api::Input {
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

/// The projected transcript of a session, in seq order.
pub fn messages(connection: &mut Conn, session_id: SessionId) -> Result<Vec<Message>, Error> {
    let rows: Vec<(String, String)> = session_message::table
        .filter(session_message::session_id.eq(session_id.to_string()))
        .order(session_message::seq.asc())
        .select((session_message::id, session_message::data))
        .load(connection)?;
    rows.into_iter()
        .map(|(id, data)| {
            serde_json::from_str(&data).map_err(|e| Error::Corrupt(format!("message {id}: {e}")))
        })
        .collect()
}

/// A session's transcript held in memory and brought up to date by reading only the
/// messages written since the last read (`session_message.updated_seq`), so a long run
/// does not decode its whole history before every step.
#[derive(Debug, Default)]
pub struct Transcript {
    messages: Vec<Message>,
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

    /// Reads the messages of `session_id` written since the last refresh. A session's
    /// writes commit in seq order, so every message not read yet has a higher
    /// `updated_seq` than any read, and a new message a higher seq than any held. Returns
    /// how many messages were read.
    pub fn refresh(
        &mut self,
        connection: &mut Conn,
        session_id: SessionId,
    ) -> Result<usize, Error> {
        let rows: Vec<(String, i64, i64, String)> = session_message::table
            .filter(session_message::session_id.eq(session_id.to_string()))
            .filter(session_message::updated_seq.gt(self.through))
            .order(session_message::seq.asc())
            .select((
                session_message::id,
                session_message::seq,
                session_message::updated_seq,
                session_message::data,
            ))
            .load(connection)?;
        let read = rows.len();
        for (id, seq, updated_seq, data) in rows {
            let message: Message = serde_json::from_str(&data)
                .map_err(|e| Error::Corrupt(format!("message {id}: {e}")))?;
            self.through = self.through.max(updated_seq);
            match self.index.get(&id) {
                Some(&position) => self.messages[position] = message,
                None if seq > self.last_seq => {
                    self.index.insert(id, self.messages.len());
                    self.messages.push(message);
                    self.last_seq = seq;
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
    pub model: keel_schema::types::ModelRef,
    pub deleted: bool,
}

/// The session's directory, agent and model, or `None` for an unknown session.
pub fn session_info(
    connection: &mut Conn,
    session_id: SessionId,
) -> Result<Option<SessionInfo>, Error> {
    Ok(session::table
        .find(session_id.to_string())
        .select((
            session::directory,
            session::agent,
            session::model_provider,
            session::model_id,
            session::deleted_at,
        ))
        .get_result::<(String, String, String, String, Option<i64>)>(connection)
        .optional()?
        .map(|(directory, agent, provider, id, deleted)| SessionInfo {
            directory,
            agent,
            model: keel_schema::types::ModelRef { provider, id },
            deleted: deleted.is_some(),
        }))
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
        .load(connection)?;
    ids.into_iter()
        .map(|id| {
            id.parse()
                .map_err(|e| Error::Corrupt(format!("tool call id {id}: {e}")))
        })
        .collect()
}

type SessionRow = (
    String,
    Option<String>,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    (i64, i64, i64, i64, i64),
    f64,
);

fn api_session(row: SessionRow) -> Result<keel_schema::api::Session, Error> {
    let (id, title, directory, agent, provider, model, created, updated, last_seq, usage, cost) =
        row;
    Ok(keel_schema::api::Session {
        id: id
            .parse()
            .map_err(|e| Error::Corrupt(format!("session id {id}: {e}")))?,
        title,
        directory,
        agent,
        model: keel_schema::types::ModelRef {
            provider,
            id: model,
        },
        time_created: created,
        time_updated: updated,
        usage: Usage {
            input: from_db_int(usage.0)?,
            output: from_db_int(usage.1)?,
            reasoning: from_db_int(usage.2)?,
            cache_read: from_db_int(usage.3)?,
            cache_write: from_db_int(usage.4)?,
        },
        cost,
        last_seq: from_db_int(last_seq)?,
    })
}

macro_rules! session_columns {
    () => {
        (
            session::id,
            session::title,
            session::directory,
            session::agent,
            session::model_provider,
            session::model_id,
            session::time_created,
            session::time_updated,
            session::last_seq,
            (
                session::usage_input,
                session::usage_output,
                session::usage_reasoning,
                session::usage_cache_read,
                session::usage_cache_write,
            ),
            session::cost,
        )
    };
}

/// A session as the API shows it; `None` when unknown or deleted.
pub fn session(
    connection: &mut Conn,
    session_id: SessionId,
) -> Result<Option<keel_schema::api::Session>, Error> {
    session::table
        .find(session_id.to_string())
        .filter(session::deleted_at.is_null())
        .select(session_columns!())
        .get_result::<SessionRow>(connection)
        .optional()?
        .map(api_session)
        .transpose()
}

/// A page of sessions, newest first, after the session `cursor` (exclusive).
pub fn sessions(
    connection: &mut Conn,
    cursor: Option<SessionId>,
    limit: u32,
) -> Result<Vec<keel_schema::api::Session>, Error> {
    let mut query = session::table
        .filter(session::deleted_at.is_null())
        .order((session::time_created.desc(), session::id.desc()))
        .limit(i64::from(limit))
        .select(session_columns!())
        .into_boxed();
    if let Some(cursor) = cursor {
        let created: Option<i64> = session::table
            .find(cursor.to_string())
            .select(session::time_created)
            .get_result(connection)
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
        .map(api_session)
        .collect()
}

/// How many inputs of the session wait for promotion.
pub fn pending_inputs(connection: &mut Conn, session_id: SessionId) -> Result<u32, Error> {
    let count: i64 = session_input::table
        .filter(session_input::session_id.eq(session_id.to_string()))
        .filter(session_input::promoted_seq.is_null())
        .filter(session_input::cancelled_seq.is_null())
        .count()
        .get_result(connection)?;
    u32::try_from(count).map_err(|_| Error::Corrupt(format!("{count} pending inputs")))
}
