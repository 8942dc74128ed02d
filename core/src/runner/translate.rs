//! The translator: turns one assistant message's provider events into Keel events.
//!
//! Rules: at most one open text and one open reasoning fragment; ordinals count per kind;
//! deltas are ephemeral (and [`coalesce`]d into batches by the step); a duplicate start,
//! call, result or finish is a protocol error that fails the step. A local call is
//! launched only after its `tool.called` commits; a call the model may not make (unknown
//! tool, malformed input, past the last step) is failed right there and never run.

use std::collections::HashMap;

use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{CallId, MessageId};
use keel_schema::types::{Effect, ErrorInfo, Finish, Usage};
use serde_json::Value;

use crate::provider::{self, Event};

/// What the step knows of a tool the model may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    pub effect: Effect,
    /// A call cut off by a crash may run again ([`crate::tool::Tool::rerun_safe`]).
    pub rerun: bool,
}

/// A local call ready to act on once its `tool.called` committed.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Launch {
    pub call_id: CallId,
    pub name: String,
    pub input: Value,
}

#[derive(Debug)]
struct Call {
    call_id: CallId,
    name: String,
    hosted: bool,
    resolved: bool,
}

/// Turns provider events into Keel events for one assistant message.
pub(super) struct Translator {
    assistant: MessageId,
    /// Tools the model may call, with their effects.
    known: HashMap<String, Known>,
    /// Tool calls are not run on the last allowed step.
    last_step: bool,
    text: Option<(u32, String)>,
    reasoning: Option<(u32, String)>,
    texts: u32,
    reasonings: u32,
    /// Streaming tool inputs by provider id: (call id, raw text so far).
    inputs: HashMap<String, (CallId, String)>,
    calls: HashMap<String, Call>,
    pub finish: Option<(Finish, Usage)>,
}

/// What one provider event asks of the step.
#[derive(Debug, Default)]
pub(super) struct Actions {
    pub durable: Vec<DurableEvent>,
    pub ephemeral: Vec<EphemeralEvent>,
    pub launch: Vec<Launch>,
}

fn protocol(message: impl Into<String>) -> provider::Error {
    provider::Error::Protocol(message.into())
}

impl Translator {
    pub fn new(assistant: MessageId, known: HashMap<String, Known>, last_step: bool) -> Self {
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

    pub fn accept(&mut self, event: Event) -> Result<Actions, provider::Error> {
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
                let known = self.known.get(&name).copied();
                let effect = known.map_or(Effect::Read, |k| k.effect);
                out.durable
                    .push(DurableEvent::ToolCalled(payload::ToolCalled {
                        assistant_message_id,
                        call_id,
                        name: name.clone(),
                        input: parsed.clone().unwrap_or(Value::String(input)),
                        provider_executed,
                        effect,
                        provider_call_id: Some(id.clone()),
                        rerun: !provider_executed && known.is_some_and(|k| k.rerun),
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
    pub fn close(&mut self) -> Vec<DurableEvent> {
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

/// Merges consecutive deltas of the same fragment into one event, which keeps the first's
/// tag (a delta's arrival time).
pub(super) fn coalesce<T>(events: Vec<(EphemeralEvent, T)>) -> Vec<(EphemeralEvent, T)> {
    let mut out: Vec<(EphemeralEvent, T)> = Vec::with_capacity(events.len());
    for (event, tag) in events {
        match (out.last_mut().map(|(last, _)| last), event) {
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
            (_, event) => out.push((event, tag)),
        }
    }
    out
}

#[cfg(test)]
mod tests;
