//! The response stream: Anthropic's events as Keel's.
//!
//! Each content block is opened by `content_block_start`, filled by deltas and closed by
//! `content_block_stop`, all naming the block's `index`. A `text` block is a text
//! fragment; a `thinking` block a reasoning fragment whose `signature_delta`s are kept as
//! its metadata (`{"signature": …}`); a `redacted_thinking` block an empty reasoning
//! fragment carrying `{"redacted_data": …}`. A `tool_use` block streams a call's input as
//! `input_json_delta`s and becomes the call when it stops; a `server_tool_use` block is
//! the same for a tool Anthropic runs itself, whose `*_tool_result` block arrives whole in
//! its `content_block_start` and becomes the call's result. `message_stop` is the finish,
//! with the stop reason of `message_delta` and the usage of both message events. Nothing
//! after it counts, and a body that ends before it is incomplete.

use std::collections::HashMap;

use keel_schema::types::{ErrorInfo, Finish, ToolContent, Usage};
use serde::Deserialize;
use serde_json::{Value, json};

use super::says_too_long;
use crate::provider::http::{Decoder, SseEvent};
use crate::provider::{Error, Event};

/// How much of a hosted result's raw content its text rendering keeps.
const RENDERING: usize = 2_000;

/// The decoder's state across one response.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    /// Content blocks started and not yet stopped, by index.
    open: HashMap<u64, Block>,
    /// Names of the calls Anthropic runs itself, by its id, to match their results.
    hosted: HashMap<String, String>,
    usage: Usage,
    stop_reason: Option<String>,
    finished: bool,
}

#[derive(Debug)]
enum Block {
    Text,
    Thinking {
        signature: String,
    },
    Tool {
        id: String,
        name: String,
        input: String,
        provider_executed: bool,
    },
    /// Complete at its start (redacted thinking, a hosted result) or of a type Keel does
    /// not read: its deltas and stop are ignored.
    Done,
}

/// One event of the stream, by its `type`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Wire {
    MessageStart {
        message: Started,
    },
    ContentBlockStart {
        index: u64,
        content_block: Value,
    },
    ContentBlockDelta {
        index: u64,
        delta: Delta,
    },
    ContentBlockStop {
        index: u64,
    },
    MessageDelta {
        delta: MessageDelta,
        #[serde(default)]
        usage: Option<WireUsage>,
    },
    MessageStop,
    Ping,
    Error {
        error: WireError,
    },
    /// Anthropic may add event types; the ones Keel does not know are skipped.
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Deserialize)]
struct Started {
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// A content block delta, by its `type` (`text_delta` …).
#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
enum Delta {
    #[serde(rename = "text_delta")]
    Text { text: String },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: String },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: String },
    #[serde(rename = "signature_delta")]
    Signature { signature: String },
    /// Citations and kinds Keel does not read.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct MessageDelta {
    #[serde(default)]
    stop_reason: Option<String>,
}

/// Usage as either message event reports it; counts are totals so far, and a field left
/// out keeps the last value.
#[derive(Debug, Deserialize)]
struct WireUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct WireError {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    message: String,
}

fn protocol(message: impl Into<String>) -> Error {
    Error::Protocol(message.into())
}

impl Decoder for Blocks {
    fn event(&mut self, event: SseEvent) -> Result<Vec<Event>, Error> {
        if self.finished {
            return Ok(Vec::new());
        }
        let wire: Wire = serde_json::from_str(&event.data).map_err(|e| {
            protocol(format!(
                "a `{}` event is not valid JSON ({e}): {}",
                event.event, event.data
            ))
        })?;
        let mut out = Vec::new();
        match wire {
            Wire::MessageStart { message } => self.update_usage(message.usage),
            Wire::ContentBlockStart {
                index,
                content_block,
            } => {
                let block = self.start(&content_block, &mut out)?;
                if self.open.insert(index, block).is_some() {
                    return Err(protocol(format!("content block {index} started twice")));
                }
            }
            Wire::ContentBlockDelta { index, delta } => {
                let Some(block) = self.open.get_mut(&index) else {
                    return Err(protocol(format!(
                        "a delta for content block {index}, which is not open"
                    )));
                };
                delta_into(block, delta, &mut out)?;
            }
            Wire::ContentBlockStop { index } => {
                let Some(block) = self.open.remove(&index) else {
                    return Err(protocol(format!(
                        "content block {index} stopped without starting"
                    )));
                };
                stop(block, &mut out);
            }
            Wire::MessageDelta { delta, usage } => {
                if delta.stop_reason.is_some() {
                    self.stop_reason = delta.stop_reason;
                }
                self.update_usage(usage);
            }
            Wire::MessageStop => {
                self.finished = true;
                out.push(Event::Finish {
                    finish: finish(self.stop_reason.as_deref()),
                    usage: self.usage,
                });
            }
            Wire::Ping | Wire::Unknown => {}
            Wire::Error { error } => return Err(stream_error(error)),
        }
        Ok(out)
    }

    fn end(&mut self) -> Result<Vec<Event>, Error> {
        if self.finished {
            Ok(Vec::new())
        } else {
            Err(Error::Incomplete(
                "the response ended before `message_stop`".into(),
            ))
        }
    }
}

impl Blocks {
    /// Takes the counts a message event reports; each is the total so far.
    fn update_usage(&mut self, usage: Option<WireUsage>) {
        let Some(usage) = usage else { return };
        let now = &mut self.usage;
        now.input = usage.input_tokens.unwrap_or(now.input);
        now.output = usage.output_tokens.unwrap_or(now.output);
        now.cache_read = usage.cache_read_input_tokens.unwrap_or(now.cache_read);
        now.cache_write = usage.cache_creation_input_tokens.unwrap_or(now.cache_write);
    }

    /// Opens a content block, with the events its start already completes.
    fn start(&mut self, block: &Value, out: &mut Vec<Event>) -> Result<Block, Error> {
        let kind = block
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let text = |field: &str| block.get(field).and_then(Value::as_str).unwrap_or_default();
        Ok(match kind {
            "text" => {
                out.push(Event::TextStart);
                if !text("text").is_empty() {
                    out.push(Event::TextDelta(text("text").to_owned()));
                }
                Block::Text
            }
            "thinking" => {
                out.push(Event::ReasoningStart);
                if !text("thinking").is_empty() {
                    out.push(Event::ReasoningDelta(text("thinking").to_owned()));
                }
                Block::Thinking {
                    signature: text("signature").to_owned(),
                }
            }
            "redacted_thinking" => {
                out.push(Event::ReasoningStart);
                out.push(Event::ReasoningEnd {
                    metadata: Some(json!({"redacted_data": text("data")})),
                });
                Block::Done
            }
            "tool_use" | "server_tool_use" => {
                let (id, name) = (text("id").to_owned(), text("name").to_owned());
                if id.is_empty() || name.is_empty() {
                    return Err(protocol(format!("a `{kind}` block without its id or name")));
                }
                let provider_executed = kind == "server_tool_use";
                if provider_executed {
                    self.hosted.insert(id.clone(), name.clone());
                }
                out.push(Event::ToolInputStart {
                    id: id.clone(),
                    name: name.clone(),
                });
                // The input streams as deltas from `{}`; anything else here is the input.
                let input = match block.get("input") {
                    Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()).to_string(),
                    _ => String::new(),
                };
                if !input.is_empty() {
                    out.push(Event::ToolInputDelta {
                        id: id.clone(),
                        delta: input.clone(),
                    });
                }
                Block::Tool {
                    id,
                    name,
                    input,
                    provider_executed,
                }
            }
            kind if kind.ends_with("_tool_result") => {
                let id = text("tool_use_id");
                // A result for a call this response did not make (an MCP connector's,
                // say) is not one Keel can place; it is skipped.
                if let Some(name) = self.hosted.get(id) {
                    out.push(hosted_result(id, name, block));
                }
                Block::Done
            }
            _ => Block::Done,
        })
    }
}

/// Applies a delta to its open block.
fn delta_into(block: &mut Block, delta: Delta, out: &mut Vec<Event>) -> Result<(), Error> {
    match (block, delta) {
        (Block::Text, Delta::Text { text }) => out.push(Event::TextDelta(text)),
        (Block::Thinking { .. }, Delta::Thinking { thinking }) => {
            out.push(Event::ReasoningDelta(thinking));
        }
        (Block::Thinking { signature }, Delta::Signature { signature: piece }) => {
            signature.push_str(&piece);
        }
        (Block::Tool { id, input, .. }, Delta::InputJson { partial_json }) => {
            if !partial_json.is_empty() {
                input.push_str(&partial_json);
                out.push(Event::ToolInputDelta {
                    id: id.clone(),
                    delta: partial_json,
                });
            }
        }
        (Block::Done, _) | (_, Delta::Other) => {}
        (block, delta) => {
            let block = match block {
                Block::Text => "text",
                Block::Thinking { .. } => "thinking",
                Block::Tool { .. } => "tool input",
                Block::Done => "finished",
            };
            let delta = match delta {
                Delta::Text { .. } => "text_delta",
                Delta::InputJson { .. } => "input_json_delta",
                Delta::Thinking { .. } => "thinking_delta",
                Delta::Signature { .. } => "signature_delta",
                Delta::Other => "unknown",
            };
            return Err(protocol(format!("a `{delta}` in a {block} block")));
        }
    }
    Ok(())
}

/// The events that close a block.
fn stop(block: Block, out: &mut Vec<Event>) {
    match block {
        Block::Text => out.push(Event::TextEnd),
        Block::Thinking { signature } => out.push(Event::ReasoningEnd {
            metadata: (!signature.is_empty()).then(|| json!({"signature": signature})),
        }),
        Block::Tool {
            id,
            name,
            input,
            provider_executed,
        } => {
            out.push(Event::ToolInputEnd { id: id.clone() });
            out.push(Event::ToolCall {
                id,
                name,
                input: if input.is_empty() { "{}".into() } else { input },
                provider_executed,
            });
        }
        Block::Done => {}
    }
}

/// Keel's finish for Anthropic's stop reason.
fn finish(stop_reason: Option<&str>) -> Finish {
    match stop_reason {
        Some("end_turn" | "stop_sequence") => Finish::Stop,
        Some("tool_use") => Finish::ToolCalls,
        Some("max_tokens") => Finish::Length,
        Some("refusal") => Finish::ContentFilter,
        // `pause_turn`, `model_context_window_exceeded`, reasons added later, or none.
        _ => Finish::Other,
    }
}

/// The result of a hosted call: the raw block, a short text of it, and the error when
/// its content is an error object (`web_search_tool_result_error` and its kin).
fn hosted_result(id: &str, name: &str, block: &Value) -> Event {
    let content = block.get("content").unwrap_or(&Value::Null);
    let failed = content
        .get("type")
        .and_then(Value::as_str)
        .filter(|kind| kind.ends_with("_error"));
    let error = failed.map(|kind| {
        let code = content
            .get("error_code")
            .and_then(Value::as_str)
            .unwrap_or(kind);
        ErrorInfo::new(
            "provider.tool_failed",
            format!("Anthropic's {name} tool failed: {code}"),
        )
    });
    let text = match &error {
        Some(error) => error.message.clone(),
        None => render(content),
    };
    Event::ToolResult {
        id: id.to_owned(),
        result: block.clone(),
        content: vec![ToolContent::Text { text }],
        error,
    }
}

/// A short text of a hosted result's content: one line per search result (title and
/// URL), a code run's output, or the JSON itself, shortened.
fn render(content: &Value) -> String {
    if let Some(items) = content.as_array() {
        let lines: Vec<String> = items
            .iter()
            .map(|item| {
                let field = |name: &str| item.get(name).and_then(Value::as_str);
                match (field("title"), field("url")) {
                    (Some(title), Some(url)) => format!("{title} <{url}>"),
                    (None, Some(url)) => url.to_owned(),
                    _ => shorten(&item.to_string()),
                }
            })
            .collect();
        return lines.join("\n");
    }
    let output = ["stdout", "stderr"]
        .iter()
        .filter_map(|name| content.get(name).and_then(Value::as_str))
        .filter(|text| !text.is_empty())
        .collect::<Vec<_>>();
    if !output.is_empty() {
        return shorten(&output.join("\n"));
    }
    shorten(&content.to_string())
}

fn shorten(text: &str) -> String {
    if text.len() <= RENDERING {
        return text.to_owned();
    }
    let mut end = RENDERING;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// The typed error of an `error` event.
fn stream_error(error: WireError) -> Error {
    let message = format!("{}: {}", error.kind, error.message);
    match error.kind.as_str() {
        "overloaded_error" => Error::Server {
            status: 529,
            message,
        },
        "rate_limit_error" => Error::RateLimit {
            retry_after_ms: None,
            message,
        },
        "authentication_error" | "permission_error" => Error::Auth(message),
        "request_too_large" => Error::ContextOverflow(message),
        "invalid_request_error" if says_too_long(&error.message) => Error::ContextOverflow(message),
        "invalid_request_error" | "not_found_error" | "billing_error" => Error::BadRequest(message),
        "timeout_error" => Error::Server {
            status: 504,
            message,
        },
        // `api_error`, and kinds added later: a failure on Anthropic's side.
        _ => Error::Server {
            status: 500,
            message,
        },
    }
}

#[cfg(test)]
mod tests;
