//! One step: a provider request, its streamed response, and the local tools it called.
//!
//! The publisher turns provider events into durable and ephemeral events under these
//! rules: at most one open text and one open reasoning fragment; ordinals count per kind;
//! deltas are ephemeral and batched (whatever the stream has ready goes out together);
//! a duplicate start, call, result or finish is a protocol error that fails the step.
//! Local tools start only after their `tool.called` commits, run concurrently, and are
//! all joined before the step settles. A hosted call left unresolved at the end of the
//! stream fails. Each step ends in exactly one of `step.ended`, `step.failed` or
//! `step.interrupted`.

use std::collections::HashMap;
use std::path::PathBuf;

use futures::{FutureExt, StreamExt};
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{CallId, MessageId, RequestId};
use keel_schema::types::{
    Decision, Effect, ErrorInfo, Finish, InterruptReason, Phase, ToolContent, Usage,
};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Engine, Error, Held, Policy, Reply, context};
use crate::event::projector;
use crate::execution;
use crate::provider::{self, Event, ToolChoice, ToolSpec};
use crate::tool;

/// How a step ended, as far as the drain needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSummary {
    pub finish: Option<Finish>,
    /// Whether any local tool call was made (a continuation follows tool results).
    pub called_tools: bool,
    /// A rejected permission or dismissed question interrupted the continuation.
    pub stopped: bool,
}

impl StepSummary {
    /// Whether a tool-driven continuation follows.
    pub fn continues(&self) -> bool {
        !self.stopped && self.called_tools && self.finish == Some(Finish::ToolCalls)
    }
}

/// What the built-in `question` tool takes.
const QUESTION: &str = "question";

fn question_spec() -> ToolSpec {
    ToolSpec {
        name: QUESTION.into(),
        description: "Ask the user a question and wait for the answer.".into(),
        input_schema: json!({
            "type": "object",
            "properties": {
                "question": {"type": "string"},
                "options": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["question"],
            "additionalProperties": false,
        }),
    }
}

/// A local call ready to act on once its `tool.called` committed.
#[derive(Debug, Clone, PartialEq)]
struct Launch {
    call_id: CallId,
    name: String,
    input: Value,
}

#[derive(Debug)]
struct Call {
    call_id: CallId,
    name: String,
    hosted: bool,
    resolved: bool,
}

/// Turns provider events into Keel events for one assistant message.
struct Publisher {
    assistant: MessageId,
    /// Tools the model may call, with their effects.
    known: HashMap<String, Effect>,
    /// Tool calls are not run on the last allowed step.
    last_step: bool,
    text: Option<(u32, String)>,
    reasoning: Option<(u32, String)>,
    texts: u32,
    reasonings: u32,
    /// Streaming tool inputs by provider id: (call id, raw text so far).
    inputs: HashMap<String, (CallId, String)>,
    calls: HashMap<String, Call>,
    finish: Option<(Finish, Usage)>,
}

/// What one provider event asks of the step.
#[derive(Debug, Default)]
struct Actions {
    durable: Vec<DurableEvent>,
    ephemeral: Vec<EphemeralEvent>,
    launch: Vec<Launch>,
}

fn protocol(message: impl Into<String>) -> provider::Error {
    provider::Error::Protocol(message.into())
}

impl Publisher {
    fn new(assistant: MessageId, known: HashMap<String, Effect>, last_step: bool) -> Self {
        Self {
            assistant,
            known,
            last_step,
            text: None,
            reasoning: None,
            texts: 0,
            reasonings: 0,
            inputs: HashMap::new(),
            calls: HashMap::new(),
            finish: None,
        }
    }

    fn accept(&mut self, event: Event) -> Result<Actions, provider::Error> {
        let mut out = Actions::default();
        let assistant_message_id = self.assistant;
        if self.finish.is_some() {
            return Err(protocol("an event arrived after the finish"));
        }
        match event {
            Event::TextStart => {
                if self.text.is_some() {
                    return Err(protocol("a text fragment started while one was open"));
                }
                let ordinal = self.texts;
                self.texts += 1;
                self.text = Some((ordinal, String::new()));
                out.durable
                    .push(DurableEvent::TextStarted(payload::TextStarted {
                        assistant_message_id,
                        ordinal,
                    }));
            }
            Event::TextDelta(delta) => {
                let Some((ordinal, text)) = &mut self.text else {
                    return Err(protocol("text arrived with no open text fragment"));
                };
                text.push_str(&delta);
                out.ephemeral
                    .push(EphemeralEvent::TextDelta(payload::TextDelta {
                        assistant_message_id,
                        ordinal: *ordinal,
                        delta,
                    }));
            }
            Event::TextEnd => {
                let Some((ordinal, text)) = self.text.take() else {
                    return Err(protocol("a text fragment ended that was not open"));
                };
                out.durable
                    .push(DurableEvent::TextEnded(payload::TextEnded {
                        assistant_message_id,
                        ordinal,
                        text,
                    }));
            }
            Event::ReasoningStart => {
                if self.reasoning.is_some() {
                    return Err(protocol("a reasoning fragment started while one was open"));
                }
                let ordinal = self.reasonings;
                self.reasonings += 1;
                self.reasoning = Some((ordinal, String::new()));
                out.durable
                    .push(DurableEvent::ReasoningStarted(payload::ReasoningStarted {
                        assistant_message_id,
                        ordinal,
                        provider_metadata: None,
                    }));
            }
            Event::ReasoningDelta(delta) => {
                let Some((ordinal, text)) = &mut self.reasoning else {
                    return Err(protocol(
                        "reasoning arrived with no open reasoning fragment",
                    ));
                };
                text.push_str(&delta);
                out.ephemeral
                    .push(EphemeralEvent::ReasoningDelta(payload::ReasoningDelta {
                        assistant_message_id,
                        ordinal: *ordinal,
                        delta,
                    }));
            }
            Event::ReasoningEnd { metadata } => {
                let Some((ordinal, text)) = self.reasoning.take() else {
                    return Err(protocol("a reasoning fragment ended that was not open"));
                };
                out.durable
                    .push(DurableEvent::ReasoningEnded(payload::ReasoningEnded {
                        assistant_message_id,
                        ordinal,
                        text,
                        provider_metadata: metadata,
                    }));
            }
            Event::ToolInputStart { id, name } => {
                if self.inputs.contains_key(&id) || self.calls.contains_key(&id) {
                    return Err(protocol(format!("tool call `{id}` started twice")));
                }
                let call_id = CallId::new();
                self.inputs.insert(id, (call_id, String::new()));
                out.durable
                    .push(DurableEvent::ToolInputStarted(payload::ToolInputStarted {
                        assistant_message_id,
                        call_id,
                        name,
                    }));
            }
            Event::ToolInputDelta { id, delta } => {
                let Some((call_id, raw)) = self.inputs.get_mut(&id) else {
                    return Err(protocol(format!(
                        "input for tool call `{id}` that never started"
                    )));
                };
                raw.push_str(&delta);
                out.ephemeral
                    .push(EphemeralEvent::ToolInputDelta(payload::ToolInputDelta {
                        call_id: *call_id,
                        delta,
                    }));
            }
            Event::ToolInputEnd { id } => {
                let Some((call_id, raw)) = self.inputs.get(&id) else {
                    return Err(protocol(format!("tool call `{id}` ended without starting")));
                };
                out.durable
                    .push(DurableEvent::ToolInputEnded(payload::ToolInputEnded {
                        assistant_message_id,
                        call_id: *call_id,
                        text: raw.clone(),
                    }));
            }
            Event::ToolCall {
                id,
                name,
                input,
                provider_executed,
            } => {
                if self.calls.contains_key(&id) {
                    return Err(protocol(format!("tool call `{id}` was called twice")));
                }
                let call_id = self
                    .inputs
                    .remove(&id)
                    .map_or_else(CallId::new, |(call_id, _)| call_id);
                let parsed = serde_json::from_str::<Value>(&input).map_err(|e| e.to_string());
                let effect = self.known.get(&name).copied().unwrap_or(Effect::Read);
                out.durable
                    .push(DurableEvent::ToolCalled(payload::ToolCalled {
                        assistant_message_id,
                        call_id,
                        name: name.clone(),
                        input: parsed.clone().unwrap_or(Value::String(input)),
                        provider_executed,
                        effect,
                        provider_call_id: Some(id.clone()),
                    }));
                let failure = match &parsed {
                    _ if provider_executed => None,
                    Err(e) => Some(ErrorInfo::new(
                        "tool.input-json",
                        format!("the input is not valid JSON ({e}); the tool was not run"),
                    )),
                    Ok(_) if !self.known.contains_key(&name) => Some(ErrorInfo::new(
                        "tool.unknown",
                        format!("there is no tool named `{name}`"),
                    )),
                    Ok(_) if self.last_step => Some(ErrorInfo::new(
                        "tool.max-steps",
                        "this was the last step allowed; tools are not run any more",
                    )),
                    Ok(_) => None,
                };
                let resolved = failure.is_some();
                if let Some(error) = failure {
                    out.durable
                        .push(DurableEvent::ToolFailed(payload::ToolFailed {
                            call_id,
                            error,
                        }));
                } else if !provider_executed {
                    out.launch.push(Launch {
                        call_id,
                        name: name.clone(),
                        input: parsed.unwrap_or(Value::Null),
                    });
                }
                self.calls.insert(
                    id,
                    Call {
                        call_id,
                        name,
                        hosted: provider_executed,
                        resolved,
                    },
                );
            }
            Event::ToolResult {
                id,
                result,
                content,
                error,
            } => {
                let Some(call) = self.calls.get_mut(&id) else {
                    return Err(protocol(format!("a result for unknown tool call `{id}`")));
                };
                if !call.hosted {
                    return Err(protocol(format!("a result for local tool call `{id}`")));
                }
                if call.resolved {
                    return Err(protocol(format!("tool call `{id}` has two results")));
                }
                call.resolved = true;
                let call_id = call.call_id;
                out.durable.push(match error {
                    Some(error) => DurableEvent::ToolFailed(payload::ToolFailed { call_id, error }),
                    None => DurableEvent::ToolSuccess(payload::ToolSuccess {
                        call_id,
                        structured: result.clone(),
                        content,
                        result: Some(result),
                    }),
                });
            }
            Event::Finish { finish, usage } => {
                self.finish = Some((finish, usage));
            }
        }
        Ok(out)
    }

    /// Closes what the stream left open, in the order text, reasoning, tool input, and
    /// fails hosted calls the provider never settled.
    fn close(&mut self) -> Vec<DurableEvent> {
        let assistant_message_id = self.assistant;
        let mut out = Vec::new();
        if let Some((ordinal, text)) = self.text.take() {
            out.push(DurableEvent::TextEnded(payload::TextEnded {
                assistant_message_id,
                ordinal,
                text,
            }));
        }
        if let Some((ordinal, text)) = self.reasoning.take() {
            out.push(DurableEvent::ReasoningEnded(payload::ReasoningEnded {
                assistant_message_id,
                ordinal,
                text,
                provider_metadata: None,
            }));
        }
        let mut unfinished: Vec<(CallId, String)> = self.inputs.drain().map(|(_, v)| v).collect();
        unfinished.sort_by_key(|(call_id, _)| *call_id);
        for (call_id, text) in unfinished {
            out.push(DurableEvent::ToolInputEnded(payload::ToolInputEnded {
                assistant_message_id,
                call_id,
                text,
            }));
            out.push(DurableEvent::ToolFailed(payload::ToolFailed {
                call_id,
                error: ErrorInfo::new(
                    "provider.incomplete",
                    "the model did not finish this call; it was not run",
                ),
            }));
        }
        let mut hosted: Vec<&mut Call> = self
            .calls
            .values_mut()
            .filter(|c| c.hosted && !c.resolved)
            .collect();
        hosted.sort_by_key(|c| c.call_id);
        for call in hosted {
            call.resolved = true;
            out.push(DurableEvent::ToolFailed(payload::ToolFailed {
                call_id: call.call_id,
                error: ErrorInfo::new(
                    "provider.unsettled",
                    format!(
                        "Provider Step ended without settlement of hosted tool `{}`",
                        call.name
                    ),
                ),
            }));
        }
        out
    }
}

/// How a local call ended (or what it waits for next).
enum Done {
    Ran(Result<tool::Output, tool::Error>),
    Decided(Decision, Launch),
    Answered(RequestId, String),
    Dismissed(RequestId),
    /// The wait for a reply was interrupted.
    Abandoned,
}

impl Engine {
    /// Runs one step of `held`'s session. `messages` is the transcript to send.
    pub(super) async fn step(
        &self,
        held: &Held,
        step_number: u32,
        messages: Vec<Message>,
        cancel: &CancellationToken,
    ) -> Result<StepSummary, Error> {
        let session = held.claim.session_id;
        let info = self
            .store
            .read(move |c| projector::session_info(c, session).map_err(Error::from))
            .await?
            .ok_or_else(|| Error::Config(format!("no session {session}")))?;
        let agent = self.agent(&info.agent)?;
        let provider = self
            .settings
            .providers
            .get(&info.model.provider)
            .cloned()
            .ok_or_else(|| {
                Error::Config(format!(
                    "no provider `{}` is configured (model {})",
                    info.model.provider, info.model
                ))
            })?;
        let last_step = step_number >= agent.max_steps;
        let mut specs: Vec<ToolSpec> = self
            .settings
            .tools
            .iter()
            .map(|t| ToolSpec {
                name: t.name().into(),
                description: t.description().into(),
                input_schema: t.input_schema(),
            })
            .collect();
        specs.push(question_spec());
        let mut known: HashMap<String, Effect> = self
            .settings
            .tools
            .iter()
            .map(|t| (t.name().to_owned(), t.effect()))
            .collect();
        known.insert(QUESTION.into(), Effect::Read);
        let request = provider::Request {
            model: info.model.clone(),
            system: agent.system.clone(),
            turns: context::turns(&messages),
            tools: specs,
            tool_choice: if last_step {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            },
            max_output_tokens: None,
        };

        // The fenced `step.started` is the ownership check before the provider request.
        let assistant = MessageId::new();
        let claim = held.claim;
        let (agent_name, model) = (info.agent.clone(), info.model.clone());
        let started = self
            .fenced(held, move |c, now| {
                let envelopes = crate::event::log::append(
                    c,
                    now,
                    session,
                    vec![DurableEvent::StepStarted(payload::StepStarted {
                        assistant_message_id: assistant,
                        step: step_number,
                        agent: agent_name,
                        model,
                    })],
                )?;
                let seq = envelopes.first().map_or(0, |e| e.seq);
                execution::set_phase(c, &claim, Phase::Running, Some((assistant, seq)))?;
                Ok(envelopes)
            })
            .await?;
        self.broadcast(&started);
        if cancel.is_cancelled() {
            return Err(Error::Interrupted);
        }
        if !self.owns(held) {
            return Err(Error::OwnershipLost(session));
        }

        let tool_cancel = cancel.child_token();
        let result: Result<StepSummary, Error> = async {
            let directory = std::fs::canonicalize(&info.directory).map_err(|e| {
                format!("the session directory {} is not usable: {e}", info.directory)
            });
            let mut publisher = Publisher::new(assistant, known, last_step);
            let mut tasks: JoinSet<(CallId, Done)> = JoinSet::new();
            let mut stream = provider.stream(request);
            let mut stream_open = true;
            let mut interrupted = false;
            let mut failure: Option<provider::Error> = None;
            let mut stop: Option<InterruptReason> = None;
            let mut called_tools = false;
            let mut pending_deltas: Vec<EphemeralEvent> = Vec::new();

            loop {
                if !stream_open && tasks.is_empty() {
                    break;
                }
                tokio::select! {
                    biased;
                    () = cancel.cancelled(), if !interrupted => {
                        interrupted = true;
                        stream_open = false;
                        tool_cancel.cancel();
                    }
                    Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                        let (call_id, done) = joined.map_err(|e| Error::Store(format!("a tool task failed: {e}")))?;
                        if let Some(reason) = self
                            .settle_call(held, directory.as_ref().ok(), call_id, done, &tool_cancel, &mut tasks, interrupted)
                            .await?
                        {
                            stop.get_or_insert(reason);
                        }
                    }
                    item = stream.next(), if stream_open => {
                        let mut item = item;
                        // Take everything the stream has ready, so deltas go out batched.
                        loop {
                            match item {
                                None => {
                                    stream_open = false;
                                    break;
                                }
                                Some(Err(e)) => {
                                    failure = Some(e);
                                    stream_open = false;
                                    break;
                                }
                                Some(Ok(event)) => match publisher.accept(event) {
                                    Err(e) => {
                                        failure = Some(e);
                                        stream_open = false;
                                        break;
                                    }
                                    Ok(actions) => {
                                        if !actions.durable.is_empty() {
                                            self.flush(held, &mut pending_deltas);
                                            self.publish(held, actions.durable).await?;
                                        }
                                        pending_deltas.extend(actions.ephemeral);
                                        for launch in actions.launch {
                                            called_tools = true;
                                            self.launch(held, &agent, directory.as_ref(), launch, &tool_cancel, &mut tasks).await?;
                                        }
                                    }
                                },
                            }
                            match stream.next().now_or_never() {
                                Some(next) => item = next,
                                None => break,
                            }
                        }
                        self.flush(held, &mut pending_deltas);
                    }
                }
            }
            self.flush(held, &mut pending_deltas);

            if interrupted {
                self.publish(held, vec![DurableEvent::StepInterrupted(payload::StepInterrupted {
                    assistant_message_id: assistant,
                    reason: InterruptReason::User,
                })])
                .await?;
                return Err(Error::Interrupted);
            }
            let mut closing = publisher.close();
            if failure.is_none() && publisher.finish.is_none() {
                failure = Some(provider::Error::Incomplete(
                    "the stream ended without a finish".into(),
                ));
            }
            let (summary, end) = match (failure, stop) {
                (_, Some(reason)) => (
                    StepSummary {
                        finish: publisher.finish.map(|(f, _)| f),
                        called_tools,
                        stopped: true,
                    },
                    DurableEvent::StepInterrupted(payload::StepInterrupted {
                        assistant_message_id: assistant,
                        reason,
                    }),
                ),
                (Some(error), None) => {
                    let info = error.info();
                    closing.push(DurableEvent::StepFailed(payload::StepFailed {
                        assistant_message_id: assistant,
                        error: info.clone(),
                        usage: publisher.finish.map(|(_, u)| u),
                    }));
                    self.publish(held, closing).await?;
                    return Err(Error::StepFailed(info));
                }
                (None, None) => {
                    let (finish, usage) = publisher.finish.unwrap_or((Finish::Other, Usage::default()));
                    (
                        StepSummary {
                            finish: Some(finish),
                            called_tools,
                            stopped: false,
                        },
                        DurableEvent::StepEnded(payload::StepEnded {
                            assistant_message_id: assistant,
                            finish,
                            usage,
                            cost: 0.0,
                        }),
                    )
                }
            };
            closing.push(end);
            self.publish(held, closing).await?;
            Ok(summary)
        }
        .await;
        match result {
            Err(error @ (Error::Store(_) | Error::Config(_))) => {
                // Any write of the step may have failed; settle it so it ends with exactly
                // one terminal event and no call left running.
                tool_cancel.cancel();
                self.fail_step(held, assistant, &error).await;
                Err(error)
            }
            other => other,
        }
    }

    /// Fails a step that broke off: every unresolved call, then `step.failed`, in one
    /// fenced transaction, retried a few times.
    async fn fail_step(&self, held: &Held, assistant: MessageId, cause: &Error) {
        let session = held.claim.session_id;
        let error = ErrorInfo::new("execution.failed", cause.to_string());
        for attempt in 0..4 {
            let error = error.clone();
            let written = self
                .fenced(held, move |c, now| {
                    let open = projector::unresolved_tools(c, session, assistant)?;
                    let mut events: Vec<DurableEvent> = open
                        .into_iter()
                        .map(|call_id| {
                            DurableEvent::ToolFailed(payload::ToolFailed {
                                call_id,
                                error: ErrorInfo::new(
                                    "tool.step-failed",
                                    "the step failed before this call's result was recorded",
                                ),
                            })
                        })
                        .collect();
                    events.push(DurableEvent::StepFailed(payload::StepFailed {
                        assistant_message_id: assistant,
                        error,
                        usage: None,
                    }));
                    crate::event::log::append(c, now, session, events).map_err(Error::from)
                })
                .await;
            match written {
                Ok(envelopes) => {
                    self.broadcast(&envelopes);
                    return;
                }
                Err(Error::OwnershipLost(_)) => return,
                Err(e) => {
                    tracing::warn!(%session, error = %e, attempt, "failing the broken step failed");
                }
            }
        }
    }

    fn flush(&self, held: &Held, pending: &mut Vec<EphemeralEvent>) {
        for event in coalesce(std::mem::take(pending)) {
            self.publish_ephemeral(held, event);
        }
    }

    /// Acts on a local call whose `tool.called` has committed: asks, denies, or starts it.
    async fn launch(
        &self,
        held: &Held,
        agent: &super::Agent,
        directory: Result<&PathBuf, &String>,
        launch: Launch,
        cancel: &CancellationToken,
        tasks: &mut JoinSet<(CallId, Done)>,
    ) -> Result<(), Error> {
        if !self.owns(held) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let call_id = launch.call_id;
        if launch.name == QUESTION {
            let question = launch.input["question"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let options: Vec<String> = launch.input["options"]
                .as_array()
                .map(|o| {
                    o.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            let request = RequestId::new();
            let reply = self.wait_for(request);
            self.publish(
                held,
                vec![DurableEvent::QuestionAsked(payload::QuestionAsked {
                    request_id: request,
                    call_id,
                    question,
                    options,
                })],
            )
            .await?;
            let cancel = cancel.clone();
            tasks.spawn(async move {
                let done = tokio::select! {
                    () = cancel.cancelled() => Done::Abandoned,
                    reply = reply => match reply {
                        Ok(Reply::Answer(text)) => Done::Answered(request, text),
                        Ok(Reply::Dismiss) => Done::Dismissed(request),
                        Ok(Reply::Permission(_)) | Err(_) => Done::Abandoned,
                    },
                };
                (call_id, done)
            });
            return Ok(());
        }
        let policy = agent
            .permissions
            .get(&launch.name)
            .copied()
            .unwrap_or_default();
        let policy = if policy == Policy::Ask && self.always_allowed(held, &launch.name).await? {
            Policy::Allow
        } else {
            policy
        };
        match policy {
            Policy::Deny => {
                self.publish(
                    held,
                    vec![DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.permission-denied",
                            format!("the `{}` tool is not allowed for this agent", launch.name),
                        ),
                    })],
                )
                .await?;
            }
            Policy::Ask => {
                let pattern = self
                    .settings
                    .tools
                    .get(&launch.name)
                    .map(|t| t.permission_pattern(&launch.input))
                    .unwrap_or_default();
                let request = RequestId::new();
                let reply = self.wait_for(request);
                self.publish(
                    held,
                    vec![DurableEvent::PermissionRequested(
                        payload::PermissionRequested {
                            request_id: request,
                            call_id,
                            tool: launch.name.clone(),
                            pattern,
                        },
                    )],
                )
                .await?;
                let cancel = cancel.clone();
                tasks.spawn(async move {
                    let done = tokio::select! {
                        () = cancel.cancelled() => Done::Abandoned,
                        reply = reply => match reply {
                            Ok(Reply::Permission(decision)) => Done::Decided(decision, Launch { ..launch }),
                            Ok(Reply::Answer(_) | Reply::Dismiss) | Err(_) => Done::Abandoned,
                        },
                    };
                    (call_id, done)
                });
            }
            Policy::Allow => self.start_tool(held, directory, launch, cancel, tasks)?,
        }
        Ok(())
    }

    /// Starts a tool run, after checking ownership one last time.
    fn start_tool(
        &self,
        held: &Held,
        directory: Result<&PathBuf, &String>,
        launch: Launch,
        cancel: &CancellationToken,
        tasks: &mut JoinSet<(CallId, Done)>,
    ) -> Result<(), Error> {
        if !self.owns(held) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let call_id = launch.call_id;
        let Some(tool) = self.settings.tools.get(&launch.name).cloned() else {
            tasks.spawn(async move {
                (
                    call_id,
                    Done::Ran(Err(tool::Error::InvalidInput(format!(
                        "no tool `{}`",
                        launch.name
                    )))),
                )
            });
            return Ok(());
        };
        let directory = match directory {
            Ok(directory) => directory.clone(),
            Err(message) => {
                let message = message.clone();
                tasks.spawn(async move { (call_id, Done::Ran(Err(tool::Error::Io(message)))) });
                return Ok(());
            }
        };
        let (progress_tx, mut progress_rx) = tokio::sync::mpsc::channel::<Value>(64);
        let context = tool::Context {
            directory,
            cancel: cancel.clone(),
            limits: self.settings.limits,
            progress: Some(progress_tx),
        };
        let live = self.live.clone();
        let session = held.claim.session_id;
        let ownership = held.ownership.clone();
        let clock = self.store.clock().clone();
        tokio::spawn(async move {
            while let Some(metadata) = progress_rx.recv().await {
                let owns = !ownership.lost.load(std::sync::atomic::Ordering::SeqCst)
                    && clock.now_ms()
                        < ownership.deadline.load(std::sync::atomic::Ordering::SeqCst);
                if owns {
                    drop(live.send(super::Live::Ephemeral(
                        keel_schema::event::EphemeralEnvelope {
                            session_id: session,
                            time: clock.now_ms(),
                            event: EphemeralEvent::ToolProgress(payload::ToolProgress {
                                call_id,
                                metadata,
                            }),
                        },
                    )));
                }
            }
        });
        tasks.spawn(async move {
            let result = tool.run(launch.input, &context).await;
            (call_id, Done::Ran(result))
        });
        Ok(())
    }

    /// Records how a local call ended, or starts it once permitted. Returns a reason when
    /// the reply interrupts the continuation.
    #[allow(clippy::too_many_arguments)]
    async fn settle_call(
        &self,
        held: &Held,
        directory: Option<&PathBuf>,
        call_id: CallId,
        done: Done,
        cancel: &CancellationToken,
        tasks: &mut JoinSet<(CallId, Done)>,
        interrupted: bool,
    ) -> Result<Option<InterruptReason>, Error> {
        match done {
            // Left unresolved: the step's `step.interrupted` fails it durably.
            Done::Abandoned | Done::Ran(Err(tool::Error::Interrupted)) if interrupted => Ok(None),
            Done::Abandoned => Ok(None),
            Done::Ran(Ok(output)) => {
                self.publish(
                    held,
                    vec![DurableEvent::ToolSuccess(payload::ToolSuccess {
                        call_id,
                        structured: output.structured,
                        content: output.content,
                        result: None,
                    })],
                )
                .await?;
                Ok(None)
            }
            Done::Ran(Err(error)) => {
                self.publish(
                    held,
                    vec![DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: error.info(),
                    })],
                )
                .await?;
                Ok(None)
            }
            Done::Decided(decision, launch) => {
                let request = self.request_of(held, call_id).await?;
                let mut events = vec![DurableEvent::PermissionReplied(
                    payload::PermissionReplied {
                        request_id: request,
                        decision,
                    },
                )];
                if decision == Decision::Reject {
                    events.push(DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.permission-rejected",
                            format!("the user rejected this `{}` call", launch.name),
                        ),
                    }));
                    self.publish(held, events).await?;
                    return Ok(Some(InterruptReason::PermissionRejected));
                }
                self.publish(held, events).await?;
                let unusable = "the session directory is not usable".to_owned();
                self.start_tool(held, directory.ok_or(&unusable), launch, cancel, tasks)?;
                Ok(None)
            }
            Done::Answered(request, answer) => {
                self.publish(
                    held,
                    vec![
                        DurableEvent::QuestionAnswered(payload::QuestionAnswered {
                            request_id: request,
                            answer: answer.clone(),
                        }),
                        DurableEvent::ToolSuccess(payload::ToolSuccess {
                            call_id,
                            structured: json!({"answer": answer}),
                            content: vec![ToolContent::Text { text: answer }],
                            result: None,
                        }),
                    ],
                )
                .await?;
                Ok(None)
            }
            Done::Dismissed(request) => {
                self.publish(
                    held,
                    vec![
                        DurableEvent::QuestionDismissed(payload::QuestionDismissed {
                            request_id: request,
                        }),
                        DurableEvent::ToolFailed(payload::ToolFailed {
                            call_id,
                            error: ErrorInfo::new(
                                "tool.question-dismissed",
                                "the user dismissed the question",
                            ),
                        }),
                    ],
                )
                .await?;
                Ok(Some(InterruptReason::QuestionDismissed))
            }
        }
    }

    /// The permission request made for `call_id` in this session.
    async fn request_of(&self, held: &Held, call_id: CallId) -> Result<RequestId, Error> {
        let session = held.claim.session_id;
        let log = self.store.read_log(session, 0, u32::MAX).await?;
        log.iter()
            .rev()
            .find_map(|e| match &e.event {
                DurableEvent::PermissionRequested(p) if p.call_id == call_id => Some(p.request_id),
                _ => None,
            })
            .ok_or_else(|| Error::Store(format!("no permission request for {call_id}")))
    }

    /// Whether an earlier `always` reply allows `tool` for the rest of the session.
    async fn always_allowed(&self, held: &Held, tool: &str) -> Result<bool, Error> {
        let session = held.claim.session_id;
        let log = self.store.read_log(session, 0, u32::MAX).await?;
        let mut tools: HashMap<RequestId, String> = HashMap::new();
        for event in &log {
            match &event.event {
                DurableEvent::PermissionRequested(p) => {
                    tools.insert(p.request_id, p.tool.clone());
                }
                DurableEvent::PermissionReplied(r)
                    if r.decision == Decision::Always
                        && tools.get(&r.request_id).is_some_and(|t| t == tool) =>
                {
                    return Ok(true);
                }
                _ => {}
            }
        }
        Ok(false)
    }
}

/// Merges consecutive deltas of the same fragment into one event.
fn coalesce(events: Vec<EphemeralEvent>) -> Vec<EphemeralEvent> {
    let mut out: Vec<EphemeralEvent> = Vec::with_capacity(events.len());
    for event in events {
        match (out.last_mut(), event) {
            (Some(EphemeralEvent::TextDelta(last)), EphemeralEvent::TextDelta(next))
                if last.ordinal == next.ordinal =>
            {
                last.delta.push_str(&next.delta);
            }
            (Some(EphemeralEvent::ReasoningDelta(last)), EphemeralEvent::ReasoningDelta(next))
                if last.ordinal == next.ordinal =>
            {
                last.delta.push_str(&next.delta);
            }
            (Some(EphemeralEvent::ToolInputDelta(last)), EphemeralEvent::ToolInputDelta(next))
                if last.call_id == next.call_id =>
            {
                last.delta.push_str(&next.delta);
            }
            (_, event) => out.push(event),
        }
    }
    out
}
