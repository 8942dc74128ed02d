//! Providers: turn a model request into a stream of LLM events.
//!
//! [`Provider::stream`] takes a [`Request`] (system prompt, transcript turns, tool
//! definitions, limits) and yields [`Event`]s: fragments of text and reasoning, streamed
//! tool input, tool calls, results of tools the provider ran itself, and one finish with
//! usage; or a typed [`Error`]. Adapters: [`anthropic`] (Anthropic's Messages API),
//! [`openai`] (OpenAI-compatible Chat Completions), [`scripted`] (a JSON script; tests,
//! benches and the built-in demo model).
//! [`http`] holds what the HTTP adapters share.

pub mod anthropic;
pub mod http;
pub mod openai;
pub mod scripted;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use keel_schema::types::{ErrorInfo, Finish, ModelRef, Part, ToolContent, Usage};
use serde_json::Value;

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

/// Whether the model may call tools in this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    /// The last allowed step: tool definitions stay in the request, calls are disabled.
    None,
}

/// One entry of the transcript sent to the model.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    User {
        parts: Vec<Part>,
    },
    Assistant {
        items: Vec<AssistantItem>,
    },
    /// Exactly one result per call of the preceding assistant turn.
    ToolResults {
        results: Vec<ToolResult>,
    },
}

impl Turn {
    fn approximate_chars(&self) -> usize {
        match self {
            Turn::User { parts } => parts
                .iter()
                .map(|part| match part {
                    Part::Text { text } => text.len(),
                    Part::File { mime, url, .. } => mime.len() + url.len(),
                })
                .sum(),
            Turn::Assistant { items } => items
                .iter()
                .map(|item| match item {
                    AssistantItem::Text(text) | AssistantItem::Reasoning { text, .. } => text.len(),
                    AssistantItem::ToolCall { name, input, .. } => name.len() + json_len(input),
                })
                .sum(),
            Turn::ToolResults { results } => results
                .iter()
                .map(|result| {
                    let output = match &result.output {
                        Ok(content) => content
                            .iter()
                            .map(|c| match c {
                                ToolContent::Text { text } => text.len(),
                                ToolContent::Media { data, .. } => data.len(),
                            })
                            .sum(),
                        Err(error) => error.message.len(),
                    };
                    output + result.provider_result.as_ref().map_or(0, json_len)
                })
                .sum(),
        }
    }
}

/// A request's turns, as shared blocks: the turns of a long session's settled history are
/// built once and shared by every later request (the runner's turn cache), so building a
/// request costs the same at step 10,000 as at step 10, and a block carries its size so
/// [`Request::approximate_chars`] does not walk the history either.
#[derive(Clone, Default)]
pub struct Turns {
    blocks: Vec<Arc<TurnBlock>>,
}

/// Consecutive turns with their size, built once.
#[derive(Debug, PartialEq)]
pub struct TurnBlock {
    turns: Vec<Turn>,
    chars: usize,
    assistant: usize,
}

impl TurnBlock {
    pub fn new(turns: Vec<Turn>) -> Self {
        Self {
            chars: turns.iter().map(Turn::approximate_chars).sum(),
            assistant: turns
                .iter()
                .filter(|t| matches!(t, Turn::Assistant { .. }))
                .count(),
            turns,
        }
    }

    pub fn turns(&self) -> &[Turn] {
        &self.turns
    }
}

impl Turns {
    /// Turns made of `blocks`, in order.
    pub fn from_blocks(blocks: Vec<Arc<TurnBlock>>) -> Self {
        Self { blocks }
    }

    /// The blocks, shared with the cache they came from.
    pub fn blocks(&self) -> &[Arc<TurnBlock>] {
        &self.blocks
    }

    /// Every turn, in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Turn> + Clone {
        self.blocks.iter().flat_map(|b| b.turns.iter())
    }

    pub fn len(&self) -> usize {
        self.blocks.iter().map(|b| b.turns.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(|b| b.turns.is_empty())
    }

    pub fn get(&self, index: usize) -> Option<&Turn> {
        self.iter().nth(index)
    }

    pub fn first(&self) -> Option<&Turn> {
        self.iter().next()
    }

    pub fn last(&self) -> Option<&Turn> {
        self.iter().next_back()
    }
}

impl From<Vec<Turn>> for Turns {
    fn from(turns: Vec<Turn>) -> Self {
        Self::from_blocks(vec![Arc::new(TurnBlock::new(turns))])
    }
}

impl FromIterator<Turn> for Turns {
    fn from_iter<I: IntoIterator<Item = Turn>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

impl<'a> IntoIterator for &'a Turns {
    type Item = &'a Turn;
    type IntoIter = Box<dyn Iterator<Item = &'a Turn> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl std::ops::Index<usize> for Turns {
    type Output = Turn;
    fn index(&self, index: usize) -> &Turn {
        self.get(index)
            .unwrap_or_else(|| panic!("turn {index} of {}", self.len()))
    }
}

impl PartialEq for Turns {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl std::fmt::Debug for Turns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The length of `value` as compact JSON, counted without building the string.
pub(crate) fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing into a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Part of an assistant turn, replayed to the provider.
#[derive(Debug, Clone, PartialEq)]
pub enum AssistantItem {
    Text(String),
    Reasoning {
        text: String,
        metadata: Option<Value>,
    },
    ToolCall {
        /// Keel's id for the call: consistent between a call and its result, which is
        /// all the providers ask of a replayed id.
        id: String,
        name: String,
        input: Value,
        provider_executed: bool,
    },
}

/// The result of one tool call, as the model sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResult {
    pub id: String,
    pub name: String,
    pub output: Result<Vec<ToolContent>, ErrorInfo>,
    /// For a call the provider ran itself: its raw result, as the provider sent it.
    pub provider_result: Option<Value>,
}

/// A model request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub model: ModelRef,
    pub system: String,
    pub turns: Turns,
    /// Shared: the same definitions go with every request.
    pub tools: Arc<[ToolSpec]>,
    pub tool_choice: ToolChoice,
    pub max_output_tokens: Option<u32>,
    /// Sampling temperature; the provider's default when `None`.
    pub temperature: Option<f64>,
}

impl Request {
    /// A rough size of what the request sends, in characters: the system prompt and every
    /// turn's text, inputs and results (tool definitions are not counted). About four
    /// characters make a token; for estimates only (automatic compaction, the scripted
    /// model's usage), computed without building the request's text.
    pub fn approximate_chars(&self) -> usize {
        self.system.len() + self.turns.blocks.iter().map(|b| b.chars).sum::<usize>()
    }

    /// How many assistant turns the transcript holds.
    pub fn assistant_turns(&self) -> usize {
        self.turns.blocks.iter().map(|b| b.assistant).sum()
    }
}

/// One event of a provider's response stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    TextStart,
    TextDelta(String),
    TextEnd,
    ReasoningStart,
    ReasoningDelta(String),
    ReasoningEnd {
        metadata: Option<Value>,
    },
    /// The model began streaming a tool call's input.
    ToolInputStart {
        id: String,
        name: String,
    },
    ToolInputDelta {
        id: String,
        delta: String,
    },
    ToolInputEnd {
        id: String,
    },
    /// A complete tool call; `input` is the raw JSON text the model wrote.
    ToolCall {
        id: String,
        name: String,
        input: String,
        provider_executed: bool,
    },
    /// The result of a tool the provider ran itself.
    ToolResult {
        id: String,
        result: Value,
        content: Vec<ToolContent>,
        error: Option<ErrorInfo>,
    },
    Finish {
        finish: Finish,
        usage: Usage,
    },
}

/// How long an HTTP provider's request may wait at each stage. A wait that runs out is a
/// [`Error::Timeout`], retried like any transport failure before output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// For the connection (TCP and TLS) to be made.
    pub connect: Duration,
    /// From sending the request to the response's status line and headers.
    pub first_byte: Duration,
    /// Between two pieces of the response body: a stream silent this long has stalled.
    pub idle: Duration,
}

impl Default for Timeouts {
    /// 10 s to connect; 120 s for the answer to start and between its pieces, room for a
    /// real model that thinks before it speaks.
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            first_byte: Duration::from_secs(120),
            idle: Duration::from_secs(120),
        }
    }
}

/// The stage of a request whose wait ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Connect,
    FirstByte,
    Idle,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Connect => "did not accept the connection",
            Self::FirstByte => "did not start its response",
            Self::Idle => "stopped sending its response",
        })
    }
}

/// A provider failure, typed so the runner can decide to retry, compact or fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("the request is longer than the model's context: {0}")]
    ContextOverflow(String),
    #[error("rate limited: {message}")]
    RateLimit {
        retry_after_ms: Option<u64>,
        message: String,
    },
    #[error("the provider failed ({status}): {message}")]
    Server { status: u16, message: String },
    #[error("the provider refused the credentials: {0}")]
    Auth(String),
    #[error("the provider refused the request: {0}")]
    BadRequest(String),
    #[error("could not send the request: {0}")]
    TransportBeforeSend(String),
    #[error("the connection failed after the request was sent: {0}")]
    TransportAfterSend(String),
    #[error("the response stream ended early: {0}")]
    Incomplete(String),
    /// A wait of [`Timeouts`] ran out.
    #[error("the provider {stage} within {after_ms} ms")]
    Timeout { stage: Stage, after_ms: u64 },
    /// The stream broke the protocol (a duplicate start, a result for an unknown call …).
    #[error("the provider's stream broke the protocol: {0}")]
    Protocol(String),
}

impl Error {
    /// Whether sending the request again may succeed: rate limits, server errors,
    /// transport failures, timeouts and streams cut short. (Only before visible output: the runner
    /// decides that.) Overflow, auth and bad requests fail the same way every time.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Self::RateLimit { .. }
                | Self::Server { .. }
                | Self::TransportBeforeSend(_)
                | Self::TransportAfterSend(_)
                | Self::Incomplete(_)
                | Self::Timeout { .. }
        )
    }

    /// The error as recorded in `step.failed` and `retry.scheduled`.
    pub fn info(&self) -> ErrorInfo {
        let kind = match self {
            Self::ContextOverflow(_) => "provider.context_overflow",
            Self::RateLimit { .. } => "provider.rate_limit",
            Self::Server { .. } => "provider.server",
            Self::Auth(_) => "provider.auth",
            Self::BadRequest(_) => "provider.bad_request",
            Self::TransportBeforeSend(_) => "provider.transport",
            Self::TransportAfterSend(_) => "provider.transport_after_send",
            Self::Incomplete(_) => "provider.incomplete",
            Self::Timeout { .. } => "provider.timeout",
            Self::Protocol(_) => "provider.protocol",
        };
        ErrorInfo::new(kind, self.to_string())
    }
}

/// A provider's response stream.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, Error>> + Send>>;

/// An LLM provider.
pub trait Provider: Send + Sync {
    /// Starts a request. Nothing is sent until the stream is first polled.
    fn stream(&self, request: &Request) -> EventStream;
}
