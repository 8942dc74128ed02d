//! Anthropic's Messages API, streamed.
//!
//! The request is `POST {base_url}/v1/messages` with `stream: true`, the `x-api-key` and
//! `anthropic-version` headers, the system prompt in `system`, the transcript as
//! alternating user and assistant messages of content blocks, and the tools with their
//! JSON Schemas as `input_schema` (see [`request`]).
//!
//! The response is a stream of named events: `message_start` (input usage), then per
//! content block `content_block_start`, its deltas and `content_block_stop`, then
//! `message_delta` (stop reason, output usage) and `message_stop`. `ping`s and event types
//! Keel does not know are skipped; an `error` event fails the response with the error it
//! names (see [`stream`]).
//!
//! What the replay keeps: thinking goes back with its signature (Anthropic refuses
//! unsigned thinking, so reasoning without one is left out), redacted thinking with its
//! data, and a tool Anthropic ran itself (`server_tool_use`) with its raw result block,
//! both inside the assistant message as Anthropic sent them.
//!
//! A refusal that says the prompt is too long (400 `invalid_request_error`, "prompt is too
//! long: N tokens > M maximum", or input plus `max_tokens` over the context limit) and a
//! 413 `request_too_large` are context overflows, so the runner compacts rather than
//! fails.

mod request;
mod stream;

use reqwest::StatusCode;

use super::{EventStream, Provider, Request, Timeouts, http};

/// Anthropic's own endpoint, used when no `base_url` is configured.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The API version Keel speaks (the `anthropic-version` header).
pub const API_VERSION: &str = "2023-06-01";

/// `max_tokens` when the request sets no output limit: the API requires one, and every
/// current Claude model accepts this many.
pub const DEFAULT_MAX_TOKENS: u32 = 8_192;

/// An Anthropic Messages API provider.
#[derive(Clone)]
pub struct Anthropic {
    connection: http::Connection,
    /// Without the trailing slash.
    base_url: String,
    api_key: Option<String>,
    /// Extended thinking's token budget, when it is on.
    thinking_budget: Option<u32>,
    /// Whether requests mark cache breakpoints (prompt caching).
    caching: bool,
}

impl Anthropic {
    /// A provider at `base_url` (Anthropic's when `None`), sending `api_key` if given, its
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
            thinking_budget: None,
            caching: true,
        })
    }

    /// Turns prompt caching off: no cache breakpoints in requests (it is on by default).
    pub fn without_caching(mut self) -> Self {
        self.caching = false;
        self
    }

    /// Turns on extended thinking with `budget_tokens` for it. Without an output limit in
    /// the request, `max_tokens` becomes the budget plus [`DEFAULT_MAX_TOKENS`]; a limit
    /// the request sets must be above the budget (Anthropic refuses it otherwise).
    pub fn with_thinking(mut self, budget_tokens: u32) -> Self {
        self.thinking_budget = Some(budget_tokens);
        self
    }
}

/// Leaves the key out, so a provider can be logged.
impl std::fmt::Debug for Anthropic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Anthropic")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("thinking_budget", &self.thinking_budget)
            .finish_non_exhaustive()
    }
}

impl Provider for Anthropic {
    fn stream(&self, request: &Request) -> EventStream {
        let mut builder = self
            .connection
            .post(format!("{}/v1/messages", self.base_url))
            .header("anthropic-version", API_VERSION)
            .json(&request::body(request, self.thinking_budget, self.caching));
        if let Some(key) = &self.api_key {
            builder = builder.header("x-api-key", key);
        }
        self.connection
            .stream(builder, is_overflow, stream::Blocks::default())
    }
}

/// Whether a refusal says the request does not fit the model's context: a 413 (the
/// request is over the API's size limit, which only shrinking the transcript fixes) or a
/// 400 whose message says the prompt is too long.
fn is_overflow(status: StatusCode, body: &str) -> bool {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => true,
        StatusCode::BAD_REQUEST => says_too_long(&http::error_message(body)),
        _ => false,
    }
}

/// Whether an `invalid_request_error` message is about the context window.
fn says_too_long(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    message.contains("prompt is too long")
        || (message.contains("exceed") && message.contains("context limit"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_a_413_or_a_400_about_the_prompt_length() {
        let too_long = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 214113 tokens > 200000 maximum"}}"#;
        let over_limit = r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 197000 + 8192 > 200000, decrease input length or `max_tokens` and try again"}}"#;
        let other = r#"{"type":"error","error":{"type":"invalid_request_error","message":"messages: roles must alternate"}}"#;
        assert!(is_overflow(StatusCode::BAD_REQUEST, too_long));
        assert!(is_overflow(StatusCode::BAD_REQUEST, over_limit));
        assert!(is_overflow(
            StatusCode::PAYLOAD_TOO_LARGE,
            "<html>413</html>"
        ));
        assert!(!is_overflow(StatusCode::BAD_REQUEST, other));
        assert!(!is_overflow(StatusCode::TOO_MANY_REQUESTS, too_long));
    }
}
