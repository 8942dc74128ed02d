//! The scripted provider: responses come from a JSON script, not a network.
//!
//! Used by tests, benchmarks and the built-in demo model. Selection is a pure function of
//! the request: the response at index *n* answers a transcript holding *n* assistant turns
//! (past the end, the last response repeats), so re-sending a request after a crash gets
//! the same answer.
//!
//! ```json
//! {"responses": [
//!   {"items": [{"type": "text", "text": "Let me look."},
//!              {"type": "tool_call", "name": "list", "input": {"path": "."}}]},
//!   {"items": [{"type": "text", "text": "Done."}]}
//! ]}
//! ```
//!
//! A response without a `finish` item finishes with `tool_calls` when it called a tool and
//! `stop` otherwise.

use std::time::Duration;

use futures::StreamExt;
use keel_schema::types::{Finish, ToolContent, Usage};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Error, Event, EventStream, Provider, Request};

/// A whole script.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub responses: Vec<Response>,
}

/// One response: what the model "says" for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Response {
    pub items: Vec<Item>,
}

/// The kinds of a provider error a script can raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    ContextOverflow,
    RateLimit,
    Server,
    Auth,
    BadRequest,
    TransportBeforeSend,
    TransportAfterSend,
    Incomplete,
}

/// One scripted thing the model does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Item {
    /// Text, streamed in `chunks` deltas (default 1), `gap_ms` apart (default: at once).
    Text {
        text: String,
        #[serde(default)]
        chunks: Option<usize>,
        #[serde(default)]
        gap_ms: Option<u64>,
    },
    Reasoning {
        text: String,
        #[serde(default)]
        metadata: Option<Value>,
    },
    /// A call of a local tool. `raw` (when set) is sent as the input text instead of
    /// `input`, to script malformed JSON.
    ToolCall {
        name: String,
        #[serde(default)]
        input: Value,
        #[serde(default)]
        raw: Option<String>,
        #[serde(default)]
        id: Option<String>,
    },
    /// A tool the provider runs itself, with its result (omitted: left unresolved).
    HostedTool {
        name: String,
        #[serde(default)]
        input: Value,
        #[serde(default)]
        result: Option<Value>,
        #[serde(default)]
        id: Option<String>,
    },
    /// Ends the stream with this error.
    Error {
        kind: ErrorKind,
        message: String,
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// Waits before the next item.
    Delay { ms: u64 },
    Finish {
        reason: Finish,
        #[serde(default)]
        usage: Option<Usage>,
    },
}

/// A provider that plays a script.
#[derive(Debug, Clone)]
pub struct Scripted {
    script: Script,
}

impl Scripted {
    pub fn new(script: Script) -> Self {
        Self { script }
    }

    /// Parses a script from JSON.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text).map(Self::new)
    }

    /// The built-in demo model: it lists the session directory, then explains itself.
    pub fn demo() -> Self {
        Self::new(Script {
            responses: vec![
                Response {
                    items: vec![
                        Item::Text {
                            text: "Let me look at the session directory.".into(),
                            chunks: Some(4),
                            gap_ms: None,
                        },
                        Item::ToolCall {
                            name: "list".into(),
                            input: json!({"path": "."}),
                            raw: None,
                            id: None,
                        },
                    ],
                },
                Response {
                    items: vec![Item::Text {
                        text: "That is the session directory. I am Keel's built-in demo \
                               model, which plays a script; configure a provider in \
                               keel.toml to talk to a real model."
                            .into(),
                        chunks: Some(6),
                        gap_ms: None,
                    }],
                },
            ],
        })
    }
}

fn split(text: &str, chunks: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(chunks.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

fn usage_for(request: &Request, output: &str) -> Usage {
    // A stand-in count (about four characters a token) so totals move like a real model's.
    Usage {
        input: (request.approximate_chars() / 4) as u64,
        output: (output.len() / 4) as u64,
        ..Usage::default()
    }
}

impl Provider for Scripted {
    fn stream(&self, request: &Request) -> EventStream {
        let responses = &self.script.responses;
        let Some(response) = responses
            .get(request.assistant_turns())
            .or_else(|| responses.last())
        else {
            return Box::pin(futures::stream::iter([Err(Error::BadRequest(
                "the script has no responses".into(),
            ))]));
        };
        let mut steps: Vec<(u64, Result<Event, Error>)> = Vec::new();
        let mut delay = 0;
        let mut called = false;
        let mut finished = false;
        let mut said = String::new();
        let push = |steps: &mut Vec<_>, delay: &mut u64, item| {
            steps.push((std::mem::take(delay), item));
        };
        for (n, item) in response.items.iter().enumerate() {
            let default_id = || format!("scripted_{n}");
            match item {
                Item::Delay { ms } => delay += ms,
                Item::Text {
                    text,
                    chunks,
                    gap_ms,
                } => {
                    said.push_str(text);
                    push(&mut steps, &mut delay, Ok(Event::TextStart));
                    for (n, piece) in split(text, chunks.unwrap_or(1)).into_iter().enumerate() {
                        if n > 0 {
                            delay += gap_ms.unwrap_or(0);
                        }
                        push(&mut steps, &mut delay, Ok(Event::TextDelta(piece)));
                    }
                    push(&mut steps, &mut delay, Ok(Event::TextEnd));
                }
                Item::Reasoning { text, metadata } => {
                    push(&mut steps, &mut delay, Ok(Event::ReasoningStart));
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ReasoningDelta(text.clone())),
                    );
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ReasoningEnd {
                            metadata: metadata.clone(),
                        }),
                    );
                }
                Item::ToolCall {
                    name,
                    input,
                    raw,
                    id,
                } => {
                    called = true;
                    let id = id.clone().unwrap_or_else(default_id);
                    let text = raw.clone().unwrap_or_else(|| input.to_string());
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ToolInputStart {
                            id: id.clone(),
                            name: name.clone(),
                        }),
                    );
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ToolInputDelta {
                            id: id.clone(),
                            delta: text.clone(),
                        }),
                    );
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ToolInputEnd { id: id.clone() }),
                    );
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ToolCall {
                            id,
                            name: name.clone(),
                            input: text,
                            provider_executed: false,
                        }),
                    );
                }
                Item::HostedTool {
                    name,
                    input,
                    result,
                    id,
                } => {
                    let id = id.clone().unwrap_or_else(default_id);
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::ToolCall {
                            id: id.clone(),
                            name: name.clone(),
                            input: input.to_string(),
                            provider_executed: true,
                        }),
                    );
                    if let Some(result) = result {
                        push(
                            &mut steps,
                            &mut delay,
                            Ok(Event::ToolResult {
                                id,
                                result: result.clone(),
                                content: vec![ToolContent::Text {
                                    text: result.to_string(),
                                }],
                                error: None,
                            }),
                        );
                    }
                }
                Item::Error {
                    kind,
                    message,
                    retry_after_ms,
                } => {
                    let message = message.clone();
                    let error = match kind {
                        ErrorKind::ContextOverflow => Error::ContextOverflow(message),
                        ErrorKind::RateLimit => Error::RateLimit {
                            retry_after_ms: *retry_after_ms,
                            message,
                        },
                        ErrorKind::Server => Error::Server {
                            status: 500,
                            message,
                        },
                        ErrorKind::Auth => Error::Auth(message),
                        ErrorKind::BadRequest => Error::BadRequest(message),
                        ErrorKind::TransportBeforeSend => Error::TransportBeforeSend(message),
                        ErrorKind::TransportAfterSend => Error::TransportAfterSend(message),
                        ErrorKind::Incomplete => Error::Incomplete(message),
                    };
                    push(&mut steps, &mut delay, Err(error));
                    finished = true;
                    break;
                }
                Item::Finish { reason, usage } => {
                    let usage = usage.unwrap_or_else(|| usage_for(request, &said));
                    push(
                        &mut steps,
                        &mut delay,
                        Ok(Event::Finish {
                            finish: *reason,
                            usage,
                        }),
                    );
                    finished = true;
                    break;
                }
            }
        }
        if !finished {
            let finish = if called {
                Finish::ToolCalls
            } else {
                Finish::Stop
            };
            let usage = usage_for(request, &said);
            push(&mut steps, &mut delay, Ok(Event::Finish { finish, usage }));
        }
        Box::pin(
            futures::stream::iter(steps).then(|(delay, item)| async move {
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                item
            }),
        )
    }
}
