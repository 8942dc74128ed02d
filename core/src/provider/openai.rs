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
//!
//! `openai/request.rs` builds the body; `openai/stream.rs` decodes the chunks.

mod request;
mod stream;

use reqwest::StatusCode;

use self::request::body;
use self::stream::Chunks;
use super::{EventStream, Provider, Request, Timeouts, http};

/// OpenAI's own endpoint, used when no `base_url` is configured.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// An OpenAI-compatible provider.
#[derive(Clone)]
pub struct OpenAi {
    connection: http::Connection,
    /// Without the trailing slash.
    base_url: String,
    api_key: Option<String>,
}

impl OpenAi {
    /// A provider at `base_url` (OpenAI's when `None`), with a bearer key if given, its
    /// requests bounded by `timeouts`. Fails only when no HTTP client can be built.
    pub fn new(
        base_url: Option<String>,
        api_key: Option<String>,
        timeouts: Timeouts,
    ) -> Result<Self, reqwest::Error> {
        let base_url = base_url.unwrap_or_else(|| DEFAULT_BASE_URL.into());
        Ok(Self {
            connection: http::Connection::new(timeouts)?,
            base_url: base_url.trim_end_matches('/').to_owned(),
            api_key,
        })
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
            .connection
            .post(format!("{}/chat/completions", self.base_url))
            .json(&body(request, self.limit_field()));
        if let Some(key) = &self.api_key {
            builder = builder.bearer_auth(key);
        }
        self.connection
            .stream(builder, is_overflow, Chunks::default())
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

#[cfg(test)]
mod tests {
    use keel_schema::types::ModelRef;

    use super::*;
    use crate::provider::ToolChoice;

    #[test]
    fn the_output_limit_is_named_as_the_server_expects() {
        assert_eq!(
            OpenAi::new(None, None, Timeouts::default())
                .expect("an HTTP client")
                .limit_field(),
            "max_completion_tokens"
        );
        let local = OpenAi::new(
            Some("http://127.0.0.1:8080/v1/".into()),
            None,
            Timeouts::default(),
        )
        .expect("an HTTP client");
        assert_eq!(local.limit_field(), "max_tokens");
        let request = Request {
            model: ModelRef {
                provider: "local".into(),
                id: "llama".into(),
            },
            system: String::new(),
            turns: Default::default(),
            tools: std::sync::Arc::from([]),
            tool_choice: ToolChoice::Auto,
            max_output_tokens: Some(100),
            temperature: None,
        };
        let sent = body(&request, local.limit_field());
        assert_eq!(sent["max_tokens"], 100);
        assert!(sent.get("tools").is_none(), "no tools, no tool_choice");
        assert!(sent.get("temperature").is_none(), "the provider's default");
        let warm = Request {
            temperature: Some(0.25),
            ..request
        };
        assert_eq!(body(&warm, local.limit_field())["temperature"], 0.25);
    }
}
