//! Request and response bodies of the HTTP service (SPEC section 12).
//!
//! Times are milliseconds since the Unix epoch. Request bodies refuse unknown fields, so a
//! misspelt option is a 400, not silently ignored.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::event::{Envelope, EphemeralEnvelope};
pub use crate::id::*;
pub use crate::types::*;

/// `GET /api/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Health {
    pub ok: bool,
    pub version: String,
}

/// `GET /api/ready`: every check passed (a failed one is a 503 naming it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Ready {
    pub ok: bool,
    /// What was checked: `database`, `writer`, and on PostgreSQL `notifications`.
    pub checks: Vec<String>,
}

/// `POST /api/session`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Where the session's tools work: an existing directory inside the server's root
    /// (`keel serve --root`, by default its working directory), which is the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub directory: Option<String>,
    /// An agent named in `keel.toml`; defaults to `build`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// `provider/model`; defaults to the agent's model, then the configured default model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = MODEL_PATTERN))]
    pub model: Option<String>,
}

/// What `provider/model` text must look like ([`crate::types::ModelRef`]'s parse): a
/// provider without `/`, a `/`, and a non-empty model id (which may hold more slashes).
pub const MODEL_PATTERN: &str = r"^[^/]+/[\s\S]+$";

/// `POST /api/login`: the server's token, exchanged for a read cookie (see the route).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    pub token: String,
}

/// `PATCH /api/session/{id}`: rename, or switch agent or model for later steps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSession {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Switching to an agent with its own model switches to that model too, unless
    /// `model` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// `provider/model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = MODEL_PATTERN))]
    pub model: Option<String>,
}

/// A session as projected from its log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Session {
    pub id: SessionId,
    pub title: Option<String>,
    pub directory: String,
    pub agent: String,
    pub model: ModelRef,
    pub time_created: i64,
    pub time_updated: i64,
    /// Token usage of all steps so far.
    pub usage: Usage,
    /// Cost of all steps so far in US dollars.
    pub cost: f64,
    /// The seq of the session's latest durable event.
    pub last_seq: u64,
}

/// `GET /api/session?cursor=&limit=`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSessionsQuery {
    /// `next_cursor` of the previous page (a session id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Tighter than `SessionId`'s published pattern, which can no longer change: a ULID's
    // first character is at most `7` (more overflows 128 bits), and a cursor the pattern
    // lets through must parse.
    #[schemars(regex(pattern = r"^ses_[0-7][0-9A-HJKMNP-TV-Z]{25}$"))]
    pub cursor: Option<String>,
    /// Page size, 1 to 200 (default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 200))]
    pub limit: Option<u32>,
}

/// A page of sessions, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionList {
    pub items: Vec<Session>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// The execution currently claimed for a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExecutionStatus {
    pub id: ExecutionId,
    pub owner_id: OwnerId,
    pub phase: Phase,
    pub expires_at: i64,
    /// Set when recovery found the abandoned claim invalid and set it aside
    /// (quarantined): it is not retried, and the session stays busy until an operator
    /// removes the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_error: Option<String>,
}

/// `GET /api/session/{id}/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionStatus {
    pub busy: bool,
    pub execution: Option<ExecutionStatus>,
    /// Admitted inputs not yet promoted or cancelled.
    pub pending_inputs: u32,
    /// Permission requests and questions waiting for a reply.
    pub awaiting_replies: u32,
    /// Token usage of all steps so far.
    pub usage: Usage,
    /// What all steps so far cost, by the prices `keel.toml` gives the models (0 without).
    pub cost: f64,
}

/// `POST /api/session/{id}/prompt`.
///
/// Retrying with the same idempotency key (`id`, or the `Idempotency-Key` header) and the
/// same content (parts, delivery, request_execution) returns the original input with
/// `replayed: true`; other content is a 409.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptRequest {
    /// The client's idempotency key: any 1–128 characters, none of them a control
    /// character, unique per session. Keel assigns the input its own id; the key maps to
    /// it. (An `inp_` id is used as the input's id itself.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[schemars(length(min = 1))]
    pub parts: Vec<Part>,
    /// Defaults to `queue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
    /// Defaults to true: wake an execution for this input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_execution: Option<bool>,
}

impl PromptRequest {
    /// A prompt of one text part, queued, with the server choosing its id.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            id: None,
            parts: vec![Part::Text { text: text.into() }],
            delivery: None,
            request_execution: None,
        }
    }
}

/// Where an admitted input stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InputStatus {
    Pending,
    Promoted,
    Cancelled,
}

/// An admitted input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Input {
    pub id: InputId,
    pub session_id: SessionId,
    pub kind: InputKind,
    pub delivery: Delivery,
    pub parts: Vec<Part>,
    pub source: InputSource,
    pub request_execution: bool,
    pub status: InputStatus,
    pub admitted_seq: u64,
    pub promoted_seq: Option<u64>,
}

/// Response to `POST /api/session/{id}/prompt`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PromptResponse {
    pub input: Input,
    /// True when this was a retry of an input already admitted; nothing new was written.
    pub replayed: bool,
}

/// Response to `POST /api/session/{id}/interrupt`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InterruptResponse {
    /// True when this node interrupted the execution, or sent the interrupt to the node
    /// running it; false when the session was idle or already stopping.
    pub interrupted: bool,
}

/// `POST /api/session/{id}/permission/{request_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PermissionReply {
    pub decision: Decision,
}

/// `POST /api/session/{id}/question/{request_id}`: an answer, or a dismissal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum QuestionReply {
    Answer {
        answer: String,
    },
    /// `{"dismiss": true}`; the continuation is interrupted.
    Dismiss {
        #[schemars(extend("const" = true))]
        dismiss: bool,
    },
}

/// Acknowledges a request that changes state asynchronously.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Accepted {
    pub accepted: bool,
}

/// One part of an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AssistantPart {
    Text {
        ordinal: u32,
        text: String,
    },
    Reasoning {
        ordinal: u32,
        text: String,
        provider_metadata: Option<Value>,
    },
    Tool {
        call_id: CallId,
        name: String,
        input: Value,
        effect: Effect,
        provider_executed: bool,
        status: ToolStatus,
        /// What the model sees of a completed call.
        content: Vec<ToolContent>,
        /// Why a call failed.
        error: Option<ErrorInfo>,
        /// The provider's own record of a call it ran itself (a hosted tool's result
        /// block), replayed to it on later turns.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider_result: Option<Value>,
    },
}

/// Where a tool call stands. Every call ends `completed` or `error`, exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    Pending,
    Running,
    Completed,
    Error,
}

/// How an assistant message ended, once it has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StepEnd {
    Ended { finish: Finish },
    Failed { error: ErrorInfo },
    Interrupted { reason: InterruptReason },
    Recovered { execution_id: ExecutionId },
}

/// A message of the projected transcript, in log order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    User {
        id: MessageId,
        /// The seq of the event that created the message.
        seq: u64,
        input_id: InputId,
        parts: Vec<Part>,
    },
    Assistant {
        id: MessageId,
        seq: u64,
        step: u32,
        agent: String,
        model: ModelRef,
        parts: Vec<AssistantPart>,
        /// Absent while the step runs.
        end: Option<StepEnd>,
        usage: Usage,
        cost: f64,
    },
    Synthetic {
        id: MessageId,
        seq: u64,
        text: String,
        reason: SyntheticReason,
    },
    /// The agent's system prompt as changed during a context epoch: from here on the model
    /// follows it instead of the epoch's system prompt.
    System {
        id: MessageId,
        seq: u64,
        system: String,
    },
    /// A compaction summary; it stands for every message before `boundary_seq`.
    Summary {
        seq: u64,
        boundary_seq: u64,
        summary: String,
    },
}

/// `GET /api/session/{id}/messages`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MessageList {
    pub items: Vec<Message>,
}

/// `GET /api/session/{id}/log` query.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// Send durable events with seq greater than this (default 0). `Last-Event-ID` wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maximum" = u64::MAX))]
    pub after: Option<u64>,
    /// Keep the stream open for live events after `synced` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
    /// `ephemeral` interleaves live deltas (without `id:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["ephemeral"]))]
    pub include: Option<String>,
}

/// One message of the log stream: a durable event (`id:` = seq), an ephemeral event when
/// asked for, or the `synced` marker between history and live events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum LogItem {
    Durable(Envelope),
    Ephemeral(EphemeralEnvelope),
    Synced(Synced),
}

/// Sent once on the log stream (as `event: synced`) when the history has been sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Synced {
    #[serde(rename = "type")]
    pub kind: SyncedType,
    pub last_seq: u64,
}

/// The `type` of [`Synced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SyncedType {
    Synced,
}

/// One message of `GET /api/event`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum LiveItem {
    Durable(Envelope),
    Ephemeral(EphemeralEnvelope),
    Lagged(Lagged),
}

/// The last message to a subscriber that fell behind (`event: lagged`); it is then
/// disconnected, never silently skipped. Reconnect and catch up from each session's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Lagged {
    #[serde(rename = "type")]
    pub kind: LaggedType,
    /// Why the subscriber was disconnected.
    pub reason: String,
}

/// The `type` of [`Lagged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LaggedType {
    Lagged,
}

/// A running Keel process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Node {
    pub id: OwnerId,
    pub host: String,
    pub pid: u32,
    pub started_at: i64,
    pub heartbeat_at: i64,
    /// Sessions whose execution this node owns now.
    pub sessions: u32,
}

/// `GET /api/nodes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeList {
    pub items: Vec<Node>,
}

/// An agent of `keel.toml` (or the built-in `build`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentInfo {
    pub name: String,
    /// The model its sessions use unless they choose one; absent: the default model.
    pub model: Option<ModelRef>,
    /// The tools the model is offered under this agent.
    pub tools: Vec<String>,
    pub max_steps: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
}

/// `GET /api/agents`, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentList {
    pub items: Vec<AgentInfo>,
}

/// Where an MCP server is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpState {
    /// Not started yet: it starts on first use.
    Idle,
    Starting,
    Ready,
    /// It failed to start or exited (`error` says why); it is started again on a later
    /// use, after a backoff.
    Failed,
}

/// A tool an MCP server offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct McpTool {
    /// The name the model sees: `SERVER_TOOL`.
    pub name: String,
    pub effect: Effect,
}

/// An MCP server of `keel.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct McpServer {
    pub name: String,
    /// `stdio` or `http`.
    pub transport: String,
    pub state: McpState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its tools, once it is ready.
    pub tools: Vec<McpTool>,
}

/// `GET /api/mcp`, by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct McpServerList {
    pub items: Vec<McpServer>,
}

/// The kind of an API error; each maps to one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// 400: malformed JSON, wrong types, unknown fields, bad ids.
    BadRequest,
    /// 401: no or bad bearer token.
    Unauthorized,
    /// 404: unknown route, session or request.
    NotFound,
    /// 409: conflicts with the current state (an id reused with other content).
    Conflict,
    /// 413: the body is over the limit.
    PayloadTooLarge,
    /// 422: well-formed but invalid (an unknown model, a directory that does not exist).
    Unprocessable,
    /// 500: a fault in Keel or its database; the message says what failed.
    Internal,
    /// 503: the server is shutting down or its database is unreachable.
    Unavailable,
}

impl ErrorType {
    /// The HTTP status this error is sent with.
    pub fn status(self) -> u16 {
        match self {
            Self::BadRequest => 400,
            Self::Unauthorized => 401,
            Self::NotFound => 404,
            Self::Conflict => 409,
            Self::PayloadTooLarge => 413,
            Self::Unprocessable => 422,
            Self::Internal => 500,
            Self::Unavailable => 503,
        }
    }
}

/// The body of every error response: `{"error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: ErrorType,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::types::ModelRef;

    proptest! {
        /// The contract's pattern for `provider/model` text accepts exactly what the
        /// server parses, so a schema-valid model is never refused for its form.
        #[test]
        fn the_model_pattern_accepts_what_parses(text in "[a-z/ \n\u{e9}]{0,8}") {
            let pattern = regex::Regex::new(MODEL_PATTERN).unwrap();
            prop_assert_eq!(pattern.is_match(&text), text.parse::<ModelRef>().is_ok(), "{:?}", text);
        }
    }

    #[test]
    fn prompt_request_refuses_unknown_fields() {
        let err = serde_json::from_value::<PromptRequest>(
            json!({"parts": [{"type": "text", "text": "hi"}], "deliver": "steer"}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `deliver`"), "{err}");
    }

    #[test]
    fn question_reply_reads_an_answer_or_a_dismissal() {
        assert_eq!(
            serde_json::from_value::<QuestionReply>(json!({"answer": "pin"})).unwrap(),
            QuestionReply::Answer {
                answer: "pin".into()
            }
        );
        assert_eq!(
            serde_json::from_value::<QuestionReply>(json!({"dismiss": true})).unwrap(),
            QuestionReply::Dismiss { dismiss: true }
        );
    }

    #[test]
    fn synced_marker_has_the_documented_shape() {
        let synced = Synced {
            kind: SyncedType::Synced,
            last_seq: 9,
        };
        assert_eq!(
            serde_json::to_value(&synced).unwrap(),
            json!({"type": "synced", "last_seq": 9})
        );
    }

    #[test]
    fn error_body_has_the_documented_shape() {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: ErrorType::PayloadTooLarge,
                message: "the body is over the 16 MiB limit".into(),
            },
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"error": {"type": "payload_too_large", "message": "the body is over the 16 MiB limit"}})
        );
        assert_eq!(body.error.kind.status(), 413);
    }
}
