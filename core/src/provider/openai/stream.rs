//! The response stream: Chat Completions chunks as Keel's events.
//!
//! Text and reasoning deltas open their fragment on first sight; tool calls are keyed by
//! `index`, the first delta naming the call, the rest carrying pieces of its arguments;
//! `finish_reason` closes what is open and the usage chunk or the end of the body
//! finishes the response. An `error` object in place of a chunk fails it with the error
//! it names (a context overflow, a rate limit, a refusal).

use std::collections::BTreeMap;

use keel_schema::types::{Finish, Usage};
use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use super::is_overflow;
use crate::provider::http::{Decoder, SseEvent};
use crate::provider::{Error, Event};

/// A streamed chunk, as far as Keel reads it.
#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<WireUsage>,
    error: Option<WireError>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Delta,
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Delta {
    content: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Vec<CallDelta>,
}

#[derive(Debug, Deserialize)]
struct CallDelta {
    index: u32,
    id: Option<String>,
    function: Option<FunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct FunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Debug, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: u64,
}

#[derive(Debug, Deserialize)]
struct CompletionDetails {
    #[serde(default)]
    reasoning_tokens: u64,
}

#[derive(Debug, Deserialize)]
struct WireError {
    message: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    code: Option<Value>,
}

/// A tool call being streamed.
#[derive(Debug)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// The decoder's state across chunks.
#[derive(Debug, Default)]
pub(super) struct Chunks {
    text_open: bool,
    reasoning_open: bool,
    /// By `index`, so calls end in the order the model began them.
    calls: BTreeMap<u32, Call>,
    finish: Option<Finish>,
    usage: Usage,
    done: bool,
}

impl Chunks {
    fn chunk(&mut self, chunk: Chunk, out: &mut Vec<Event>) -> Result<(), Error> {
        if let Some(error) = chunk.error {
            return Err(stream_error(error));
        }
        if let Some(usage) = chunk.usage {
            let cached = usage.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
            self.usage = Usage {
                input: usage.prompt_tokens.saturating_sub(cached),
                output: usage.completion_tokens,
                reasoning: usage
                    .completion_tokens_details
                    .map_or(0, |d| d.reasoning_tokens),
                cache_read: cached,
                cache_write: 0,
            };
        }
        // Keel asks for one choice; any other index is ignored.
        let Some(choice) = chunk.choices.into_iter().next() else {
            return Ok(());
        };
        let delta = choice.delta;
        if let Some(reasoning) = delta
            .reasoning_content
            .or(delta.reasoning)
            .filter(|r| !r.is_empty())
        {
            self.close_text(out);
            if !self.reasoning_open {
                self.reasoning_open = true;
                out.push(Event::ReasoningStart);
            }
            out.push(Event::ReasoningDelta(reasoning));
        }
        if let Some(content) = delta.content.filter(|c| !c.is_empty()) {
            self.close_reasoning(out);
            if !self.text_open {
                self.text_open = true;
                out.push(Event::TextStart);
            }
            out.push(Event::TextDelta(content));
        }
        for call in delta.tool_calls {
            self.call_delta(call, out)?;
        }
        if let Some(reason) = choice.finish_reason {
            self.finish(&reason, out);
        }
        Ok(())
    }

    fn call_delta(&mut self, delta: CallDelta, out: &mut Vec<Event>) -> Result<(), Error> {
        let function = delta.function;
        let (name, arguments) = match function {
            Some(f) => (f.name, f.arguments.unwrap_or_default()),
            None => (None, String::new()),
        };
        let call = match self.calls.get_mut(&delta.index) {
            Some(call) => call,
            None => {
                let (Some(id), Some(name)) = (delta.id, name) else {
                    return Err(Error::Protocol(format!(
                        "tool call {} began without an id and a name",
                        delta.index
                    )));
                };
                self.close_text(out);
                self.close_reasoning(out);
                out.push(Event::ToolInputStart {
                    id: id.clone(),
                    name: name.clone(),
                });
                self.calls.entry(delta.index).or_insert(Call {
                    id,
                    name,
                    arguments: String::new(),
                })
            }
        };
        if !arguments.is_empty() {
            call.arguments.push_str(&arguments);
            out.push(Event::ToolInputDelta {
                id: call.id.clone(),
                delta: arguments,
            });
        }
        Ok(())
    }

    fn finish(&mut self, reason: &str, out: &mut Vec<Event>) {
        self.close_text(out);
        self.close_reasoning(out);
        let called = !self.calls.is_empty();
        for call in std::mem::take(&mut self.calls).into_values() {
            out.push(Event::ToolInputEnd {
                id: call.id.clone(),
            });
            out.push(Event::ToolCall {
                id: call.id,
                name: call.name,
                input: if call.arguments.trim().is_empty() {
                    "{}".into()
                } else {
                    call.arguments
                },
                provider_executed: false,
            });
        }
        self.finish = Some(match reason {
            "length" => Finish::Length,
            "content_filter" => Finish::ContentFilter,
            _ if called => Finish::ToolCalls,
            "stop" => Finish::Stop,
            "tool_calls" | "function_call" => Finish::ToolCalls,
            _ => Finish::Other,
        });
    }

    fn close_text(&mut self, out: &mut Vec<Event>) {
        if std::mem::take(&mut self.text_open) {
            out.push(Event::TextEnd);
        }
    }

    fn close_reasoning(&mut self, out: &mut Vec<Event>) {
        if std::mem::take(&mut self.reasoning_open) {
            out.push(Event::ReasoningEnd { metadata: None });
        }
    }

    /// The one `Finish`, once the response is complete.
    fn finished(&mut self) -> Result<Vec<Event>, Error> {
        if self.done {
            return Ok(Vec::new());
        }
        self.done = true;
        match self.finish {
            Some(finish) => Ok(vec![Event::Finish {
                finish,
                usage: self.usage,
            }]),
            None => Err(Error::Incomplete(
                "the stream ended before the model finished".into(),
            )),
        }
    }
}

impl Decoder for Chunks {
    fn event(&mut self, event: SseEvent) -> Result<Vec<Event>, Error> {
        let data = event.data.trim();
        if data == "[DONE]" {
            return self.finished();
        }
        if self.done {
            return Ok(Vec::new());
        }
        let chunk: Chunk = serde_json::from_str(data)
            .map_err(|e| Error::Protocol(format!("an undecodable chunk ({e}): {data}")))?;
        let mut out = Vec::new();
        self.chunk(chunk, &mut out)?;
        Ok(out)
    }

    fn end(&mut self) -> Result<Vec<Event>, Error> {
        self.finished()
    }
}

/// An error object sent in place of a chunk.
fn stream_error(error: WireError) -> Error {
    let message = error
        .message
        .unwrap_or_else(|| "the provider reported an error".into());
    let code = error
        .code
        .as_ref()
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let kind = error.kind.unwrap_or_default();
    if code == "context_length_exceeded" || is_overflow(StatusCode::BAD_REQUEST, &message) {
        return Error::ContextOverflow(message);
    }
    if code == "rate_limit_exceeded" || kind == "rate_limit_error" || kind == "tokens" {
        return Error::RateLimit {
            retry_after_ms: None,
            message,
        };
    }
    if kind == "invalid_request_error" {
        return Error::BadRequest(message);
    }
    Error::Server {
        status: 500,
        message,
    }
}
