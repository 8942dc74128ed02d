//! Projections: `session`, `session_message`, `session_tool` and `session_input` are pure
//! functions of the log. [`project`] applies one event inside the appending transaction;
//! an error rolls the event (and everything appended with it) back. Reading them is
//! [`super::view`]'s job.
//!
//! Rules kept here:
//! - A tool call is resolved exactly once: by its own `tool.success`/`tool.failed`, or by
//!   the `step.interrupted`/`step.recovered` of its step, which fails every call of that
//!   step still unresolved, in the same transaction.
//! - Usage and cost totals of a session accumulate from `step.ended` and `step.failed`.
//! - Nothing here reads the clock or generates ids: replaying the log reproduces every row.
//!
//! This file dispatches each event and keeps the session and input rows;
//! `projector/assistant.rs` edits assistant messages and their tool rows;
//! `projector/statements.rs` holds the statements, each prepared once per connection.

mod assistant;
mod statements;

pub(crate) use assistant::{forget_kept, forget_unwritten, write_unwritten};

use diesel::prelude::*;
use keel_schema::api::{AssistantPart, InputStatus, Message, StepEnd};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{InputId, MessageId, SessionId};
use keel_schema::types::{ErrorInfo, InputKind, Part, ToolContent, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use self::statements::{
    AddUsage, AnswerRequest, CancelInput, CountCreated, CountDeleted, InsertMessage, InsertRequest,
    PromoteInput, RequestExecution, SetAgent, SetDeleted, SetModel, SetTitle,
};
use super::counters;
use super::view::InputRow;
use crate::request::{Kind, Reply};
use crate::store::column::{db_int, text_of};
use crate::store::fixed::Execute;
use crate::store::schema::{context_epoch, session, session_input};
use crate::store::{Conn, Error, load_at_most};

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
        assistant::refusing(self.session());
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

    /// Changes the session's own row: kept with its counter by the writer's batch when it
    /// keeps one ([`counters::change`]), by `statement` otherwise.
    fn change_session(
        &mut self,
        change: counters::Change<'_>,
        statement: impl Execute,
    ) -> Result<(), Error> {
        if counters::change(self.connection, self.session_id, change)? {
            return Ok(());
        }
        self.run(statement)
    }

    fn apply(&mut self) -> Result<(), Error> {
        let envelope = self.envelope;
        match &envelope.event {
            DurableEvent::Created(e) => self.created(e),
            DurableEvent::Renamed(e) => self.change_session(
                counters::Change::Title(&e.title),
                SetTitle {
                    id: self.session_id,
                    title: &e.title,
                },
            ),
            DurableEvent::AgentSwitched(e) => self.change_session(
                counters::Change::Agent(&e.agent),
                SetAgent {
                    id: self.session_id,
                    agent: &e.agent,
                },
            ),
            DurableEvent::ModelSwitched(e) => self.change_session(
                counters::Change::Model {
                    provider: &e.model.provider,
                    id: &e.model.id,
                },
                SetModel {
                    id: self.session_id,
                    provider: &e.model.provider,
                    model: &e.model.id,
                },
            ),
            DurableEvent::Deleted(_) => {
                self.run(SetDeleted {
                    id: self.session_id,
                    at: envelope.time,
                })?;
                // The writer's batch counts this session's events no more in memory: the
                // table says it takes none.
                counters::forget(self.connection, self.session_id)?;
                // A deleted session takes no more events, so this runs once per session.
                self.run(CountDeleted)
            }
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
            DurableEvent::PermissionRequested(e) => self.asked(
                e.request_id,
                e.call_id,
                Kind::Permission,
                &e.tool,
                (&e.pattern, e.rule.as_deref()),
            ),
            DurableEvent::QuestionAsked(e) => self.asked(
                e.request_id,
                e.call_id,
                Kind::Question,
                "question",
                ("", None),
            ),
            DurableEvent::PermissionReplied(e) => {
                self.answered(e.request_id, &Reply::Permission(e.decision))
            }
            DurableEvent::QuestionAnswered(e) => {
                self.answered(e.request_id, &Reply::Answer(e.answer.clone()))
            }
            DurableEvent::QuestionDismissed(e) => self.answered(e.request_id, &Reply::Dismiss),
            DurableEvent::RetryScheduled(_) => Ok(()),
            DurableEvent::StepAwaiting(e) => self.step_awaiting(e),
            DurableEvent::StepEnded(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Ended { finish: e.finish },
                Some(e.usage),
                e.cost,
                None,
                &[],
            ),
            DurableEvent::StepFailed(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Failed {
                    error: e.error.clone(),
                },
                e.usage,
                0.0,
                None,
                &[],
            ),
            DurableEvent::StepInterrupted(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Interrupted { reason: e.reason },
                None,
                0.0,
                Some(interrupted_tool_error(e.reason)),
                &[],
            ),
            DurableEvent::StepRecovered(e) => self.end_step(
                e.assistant_message_id,
                StepEnd::Recovered {
                    execution_id: e.execution_id,
                },
                None,
                0.0,
                Some(crashed_tool_error()),
                &e.rerun,
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
            DurableEvent::ContextEpochStarted(e) => self.epoch_started(e),
            DurableEvent::ContextSystemUpdated(e) => {
                self.insert_message(
                    e.message_id,
                    &Message::System {
                        id: e.message_id,
                        seq: envelope.seq,
                        system: e.system.clone(),
                    },
                )?;
                let updated = diesel::update(context_epoch::table.find(self.session_id))
                    .set(context_epoch::effective_system.eq(&e.system))
                    .execute(self.connection)?;
                if updated == 1 {
                    Ok(())
                } else {
                    Err(self.refuse("the session has no context epoch to update"))
                }
            }
        }
    }

    // --- context epochs -------------------------------------------------------------------

    /// A new epoch must follow the last one (epoch 1 when there is none): an advance
    /// computed from a stale view is refused, and with it the transaction that carries it.
    fn epoch_started(&mut self, e: &payload::ContextEpochStarted) -> Result<(), Error> {
        let query = context_epoch::table
            .find(self.session_id)
            .select(context_epoch::epoch);
        let current: Option<i64> = load_at_most(self.connection, query, 1)?.pop();
        let expected = current.map_or(1, |epoch| epoch + 1);
        if i64::from(e.epoch) != expected {
            return Err(self.refuse(format!(
                "epoch {} does not follow the session's epoch {}",
                e.epoch,
                current.unwrap_or(0)
            )));
        }
        let values = (
            context_epoch::epoch.eq(expected),
            context_epoch::baseline_seq.eq(db_int(e.baseline_seq)?),
            context_epoch::system.eq(&e.system),
            context_epoch::effective_system.eq(&e.system),
        );
        if current.is_some() {
            diesel::update(context_epoch::table.find(self.session_id))
                .set(values)
                .execute(self.connection)?;
        } else {
            diesel::insert_into(context_epoch::table)
                .values((context_epoch::session_id.eq(self.session_id), values))
                .execute(self.connection)?;
        }
        Ok(())
    }

    // --- requests for a person ------------------------------------------------------------

    fn asked(
        &mut self,
        request: keel_schema::id::RequestId,
        call: keel_schema::id::CallId,
        kind: Kind,
        tool: &str,
        (pattern, rule): (&str, Option<&str>),
    ) -> Result<(), Error> {
        let asked_seq = self.seq()?;
        self.run(InsertRequest {
            id: &request.to_string(),
            session_id: self.session_id,
            call_id: &call.to_string(),
            kind: kind.as_str(),
            tool,
            asked_seq,
            pattern,
            rule,
        })
    }

    /// A reply: the request must be pending, of the reply's kind, in this session.
    fn answered(
        &mut self,
        request: keel_schema::id::RequestId,
        reply: &Reply,
    ) -> Result<(), Error> {
        let written = serde_json::to_string(reply)
            .map_err(|err| self.refuse(format!("the reply does not serialize: {err}")))?;
        let updated = AnswerRequest {
            id: &request.to_string(),
            session_id: self.session_id,
            kind: reply.kind().as_str(),
            reply: &written,
            always: *reply == Reply::Permission(keel_schema::types::Decision::Always),
        }
        .execute_on(self.connection)?;
        if updated == 1 {
            Ok(())
        } else {
            Err(self.refuse(format!(
                "no pending {} request {request} in this session",
                reply.kind().as_str()
            )))
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
        self.run(CountCreated)
    }

    fn add_usage(&mut self, usage: Usage, cost: f64) -> Result<(), Error> {
        let tokens = [
            db_int(usage.input)?,
            db_int(usage.output)?,
            db_int(usage.reasoning)?,
            db_int(usage.cache_read)?,
            db_int(usage.cache_write)?,
        ];
        let [input, output, reasoning, cache_read, cache_write] = tokens;
        self.change_session(
            counters::Change::Usage { tokens, cost },
            AddUsage {
                id: self.session_id,
                input,
                output,
                reasoning,
                cache_read,
                cache_write,
                cost,
            },
        )
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
            Message::System { .. } => "system",
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
        if let Message::Assistant { end: None, .. } = message {
            let version = self.version_to_keep()?;
            assistant::Written::keep(id, data, message.clone(), version);
        }
        Ok(())
    }
}
