//! OpenAI-compatible Chat Completions, streamed: OpenAI itself and the servers that speak
//! its dialect (vLLM, llama.cpp, Ollama, LM Studio, OpenRouter …).
//!
//! The request is `POST {base_url}/chat/completions` with `stream: true` and
//! `stream_options.include_usage`, the system prompt as the first message, the transcript
//! as user, assistant (with `tool_calls`) and `tool` messages, and the tools as functions
//! whose parameters are their JSON Schemas.
//!
//! The response is a stream of `chat.completion.chunk`s. Text arrives as
//! `delta.content`; reasoning, from servers that stream it, as `delta.reasoning_content`
//! or `delta.reasoning`; tool calls as `delta.tool_calls` entries keyed by `index`, the
//! first naming the call's id and function, the rest carrying pieces of its arguments, for
//! several calls at once. `finish_reason` ends the choice; a last chunk with no choices
//! carries the usage; `data: [DONE]` ends the stream. An `error` object in place of a
//! chunk fails the response.
//!
//! Compatibility choices: a response that called tools finishes `tool_calls` even when a
//! server says `stop`; a body that ends after `finish_reason` without `[DONE]` is complete;
//! reasoning is not sent back (Chat Completions has no field for it); calls a different
//! provider ran itself are left out of the replay together with their results.

use std::collections::BTreeMap;

use keel_schema::types::{Finish, Part, ToolContent, Usage};
use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::http::{self, Decoder, SseEvent};
use super::{
    AssistantItem, Error, Event, EventStream, Provider, Request, ToolChoice, ToolResult, Turn,
};

/// OpenAI's own endpoint, used when no `base_url` is configured.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// An OpenAI-compatible provider.
#[derive(Clone)]
pub struct OpenAi {
    client: reqwest::Client,
    /// Without the trailing slash.
    base_url: String,
    api_key: Option<String>,
}

impl OpenAi {
    /// A provider at `base_url` (OpenAI's when `None`), with a bearer key if given.
    pub fn new(base_url: Option<String>, api_key: Option<String>) -> Self {
        let base_url = base_url.unwrap_or_else(|| DEFAULT_BASE_URL.into());
        Self {
            client: reqwest::Client::new(),
            base_url: base_url.trim_end_matches('/').to_owned(),
            api_key,
        }
    }
}

impl OpenAi {
    /// OpenAI's own API takes the output limit as `max_completion_tokens` (its reasoning
    /// models refuse `max_tokens`); compatible servers know `max_tokens`.
    fn limit_field(&self) -> &'static str {
        if self.base_url.starts_with("https://api.openai.com") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }
}

impl std::fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key never reaches a log.
        f.debug_struct("OpenAi")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish_non_exhaustive()
    }
}

impl Provider for OpenAi {
    fn stream(&self, request: &Request) -> EventStream {
        let mut builder = self
            .client
            .post(format!("{}/chat/completions", self.base_url))
            .json(&body(request, self.limit_field()));
        if let Some(key) = &self.api_key {
            builder = builder.bearer_auth(key);
        }
        http::stream(builder, is_overflow, Chunks::default())
    }
}

/// Whether a refusal says the request is longer than the model's context, in the words
/// of OpenAI (`context_length_exceeded`), vLLM and OpenRouter ("maximum context length"),
/// llama.cpp (`exceed_context_size_error`) and LM Studio ("context length").
fn is_overflow(status: StatusCode, body: &str) -> bool {
    if !matches!(status.as_u16(), 400 | 413 | 422) {
        return false;
    }
    let body = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "maximum context length",
        "context length",
        "exceed_context_size",
        "exceeds the available context size",
    ]
    .iter()
    .any(|sign| body.contains(sign))
}

/// The request body; `limit_field` names the output limit.
fn body(request: &Request, limit_field: &str) -> Value {
    let mut messages = vec![json!({"role": "system", "content": request.system})];
    let mut hosted: Vec<&str> = Vec::new();
    for turn in &request.turns {
        match turn {
            Turn::User { parts } => {
                messages.push(json!({"role": "user", "content": user_content(parts)}))
            }
            Turn::Assistant { items } => messages.push(assistant(items, &mut hosted)),
            Turn::ToolResults { results } => messages.extend(
                results
                    .iter()
                    .filter(|r| !hosted.contains(&r.id.as_str()))
                    .map(tool_message),
            ),
        }
    }
    let mut body = json!({
        "model": request.model.id,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                json!({"type": "function", "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                }})
            })
            .collect();
        body["tool_choice"] = match request.tool_choice {
            ToolChoice::Auto => "auto",
            ToolChoice::None => "none",
        }
        .into();
    }
    if let Some(max) = request.max_output_tokens {
        body[limit_field] = max.into();
    }
    body
}

/// A user turn: plain text when it is only text, else content parts.
fn user_content(parts: &[Part]) -> Value {
    if let [Part::Text { text }] = parts {
        return text.as_str().into();
    }
    parts
        .iter()
        .map(|part| match part {
            Part::Text { text } => json!({"type": "text", "text": text}),
            Part::File { mime, url, .. }
                if mime.starts_with("image/") && url.starts_with("data:") =>
            {
                json!({"type": "image_url", "image_url": {"url": url}})
            }
            Part::File {
                mime,
                filename,
                url,
            } => json!({
                "type": "text",
                "text": format!("[file {} ({mime})]", filename.as_deref().unwrap_or(url)),
            }),
        })
        .collect()
}

/// An assistant turn; notes in `hosted` the calls another provider ran itself.
fn assistant<'a>(items: &'a [AssistantItem], hosted: &mut Vec<&'a str>) -> Value {
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in items {
        match item {
            AssistantItem::Text(t) => text.push_str(t),
            AssistantItem::Reasoning { .. } => {}
            AssistantItem::ToolCall {
                id,
                provider_executed: true,
                ..
            } => hosted.push(id),
            AssistantItem::ToolCall {
                id, name, input, ..
            } => calls.push(json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": input.to_string()},
            })),
        }
    }
    let mut message = json!({
        "role": "assistant",
        "content": if text.is_empty() { Value::Null } else { text.into() },
    });
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    message
}

/// A tool result: its text, media described (tool messages carry text only), or the
/// error the model should see.
fn tool_message(result: &ToolResult) -> Value {
    let content = match &result.output {
        Ok(content) => content
            .iter()
            .map(|c| match c {
                ToolContent::Text { text } => text.clone(),
                ToolContent::Media { mime, data } => {
                    format!("[{mime} output, {} bytes of base64, not shown]", data.len())
                }
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Err(error) => format!("Error ({}): {}", error.kind, error.message),
    };
    json!({"role": "tool", "tool_call_id": result.id, "content": content})
}

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
struct Chunks {
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

#[cfg(test)]
mod tests {
    use keel_schema::types::ModelRef;

    use super::*;

    #[test]
    fn the_output_limit_is_named_as_the_server_expects() {
        assert_eq!(
            OpenAi::new(None, None).limit_field(),
            "max_completion_tokens"
        );
        let local = OpenAi::new(Some("http://127.0.0.1:8080/v1/".into()), None);
        assert_eq!(local.limit_field(), "max_tokens");
        let request = Request {
            model: ModelRef {
                provider: "local".into(),
                id: "llama".into(),
            },
            system: String::new(),
            turns: Vec::new(),
            tools: std::sync::Arc::from([]),
            tool_choice: ToolChoice::Auto,
            max_output_tokens: Some(100),
        };
        let sent = body(&request, local.limit_field());
        assert_eq!(sent["max_tokens"], 100);
        assert!(sent.get("tools").is_none(), "no tools, no tool_choice");
    }
}
