//! The payload of every event type at its latest version.
//!
//! (Longer than Keel's other files on purpose: it is the catalog's data, one small struct
//! per event with its example, read one struct at a time; splitting it would scatter what
//! the catalog in `mod.rs` lists in one place.)
//!
//! A payload's doc comment becomes the description of its contract file. Changing a
//! field of a published payload is a new version: add it here, move the old struct to
//! [`super::legacy`] with an upcast into this one, and list both in the catalog.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::Example;
use crate::id::{CallId, ExecutionId, InputId, MessageId, OwnerId, RequestId};
use crate::types::{
    CompactionReason, Decision, Delivery, Effect, ErrorInfo, Finish, InputKind, InputSource,
    InterruptReason, ModelRef, Outcome, Part, SyntheticReason, ToolContent, Usage,
};

/// Deterministic ids for examples: the same contract bytes on every run.
pub(crate) mod sample {
    use ulid::Ulid;

    use crate::id::*;

    const T: u64 = 1_764_690_000_000;

    pub fn ulid(n: u128) -> Ulid {
        Ulid::from_parts(T, n)
    }
    #[cfg(test)]
    pub fn session() -> SessionId {
        SessionId::from_ulid(ulid(1))
    }
    pub fn input() -> InputId {
        InputId::from_ulid(ulid(2))
    }
    pub fn message() -> MessageId {
        MessageId::from_ulid(ulid(3))
    }
    pub fn assistant() -> MessageId {
        MessageId::from_ulid(ulid(4))
    }
    pub fn execution() -> ExecutionId {
        ExecutionId::from_ulid(ulid(5))
    }
    pub fn owner() -> OwnerId {
        OwnerId::from_ulid(ulid(6))
    }
    pub fn call() -> CallId {
        CallId::from_ulid(ulid(7))
    }
    pub fn request() -> RequestId {
        RequestId::from_ulid(ulid(8))
    }
    #[cfg(test)]
    pub fn event() -> EventId {
        EventId::from_ulid(ulid(9))
    }
    pub fn model() -> crate::types::ModelRef {
        crate::types::ModelRef {
            provider: "openai".into(),
            id: "gpt-4.1".into(),
        }
    }
    pub fn usage() -> crate::types::Usage {
        crate::types::Usage {
            input: 1200,
            output: 85,
            reasoning: 0,
            cache_read: 1024,
            cache_write: 0,
        }
    }
}

/// A session was created.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Created {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The directory the session's tools work in.
    pub directory: String,
    pub agent: String,
    pub model: ModelRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

impl Example for Created {
    fn example() -> Self {
        Self {
            title: Some("Fix the flaky test".into()),
            directory: "/home/dev/project".into(),
            agent: "build".into(),
            model: sample::model(),
            metadata: Some(Map::from_iter([("ticket".to_owned(), json!("KEEL-42"))])),
        }
    }
}

/// The session's title changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Renamed {
    pub title: String,
}

impl Example for Renamed {
    fn example() -> Self {
        Self {
            title: "Fix the flaky login test".into(),
        }
    }
}

/// Later steps use another agent (system prompt, tools, limits).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentSwitched {
    pub agent: String,
}

impl Example for AgentSwitched {
    fn example() -> Self {
        Self {
            agent: "plan".into(),
        }
    }
}

/// Later steps use another model; a tool-driven continuation reloads it first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSwitched {
    pub model: ModelRef,
}

impl Example for ModelSwitched {
    fn example() -> Self {
        Self {
            model: ModelRef {
                provider: "anthropic".into(),
                id: "claude-sonnet-4-5".into(),
            },
        }
    }
}

/// The session was deleted; its log is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Deleted {}

impl Example for Deleted {
    fn example() -> Self {
        Self {}
    }
}

/// An input was admitted into the session's inbox. It joins the transcript when promoted
/// (`session.next.prompted`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptAdmitted {
    pub input_id: InputId,
    pub kind: InputKind,
    pub delivery: Delivery,
    pub parts: Vec<Part>,
    pub source: InputSource,
    /// Whether the admission also asked for execution (then `prompt.execution_requested`
    /// follows in the same transaction).
    pub request_execution: bool,
}

impl Example for PromptAdmitted {
    fn example() -> Self {
        Self {
            input_id: sample::input(),
            kind: InputKind::Prompt,
            delivery: Delivery::Queue,
            parts: vec![Part::Text {
                text: "Why does test_login fail on CI?".into(),
            }],
            source: InputSource::User,
            request_execution: true,
        }
    }
}

/// Durable intent that the input must be executed, written with its admission and before
/// any wake, so recovery can redrive a wake that was lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptExecutionRequested {
    pub input_id: InputId,
}

impl Example for PromptExecutionRequested {
    fn example() -> Self {
        Self {
            input_id: sample::input(),
        }
    }
}

/// A pending input was cancelled before promotion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptCancelled {
    pub input_id: InputId,
}

impl Example for PromptCancelled {
    fn example() -> Self {
        Self {
            input_id: sample::input(),
        }
    }
}

/// An input was promoted into the transcript as a user message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Prompted {
    pub input_id: InputId,
    pub message_id: MessageId,
}

impl Example for Prompted {
    fn example() -> Self {
        Self {
            input_id: sample::input(),
            message_id: sample::message(),
        }
    }
}

/// Keel added a message of its own to the transcript.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Synthetic {
    pub message_id: MessageId,
    pub text: String,
    pub reason: SyntheticReason,
}

impl Example for Synthetic {
    fn example() -> Self {
        Self {
            message_id: sample::message(),
            text: "Continue where you left off.".into(),
            reason: SyntheticReason::Continue,
        }
    }
}

/// A busy period began: `owner_id` claimed the session's execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutionStarted {
    pub execution_id: ExecutionId,
    pub owner_id: OwnerId,
}

impl Example for ExecutionStarted {
    fn example() -> Self {
        Self {
            execution_id: sample::execution(),
            owner_id: sample::owner(),
        }
    }
}

/// A busy period ended; the last event of its busy period. The claim is released in the
/// same transaction. Version 2 adds the outcome `awaiting`: the execution was handed back
/// while its step waits for a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutionSettled {
    pub execution_id: ExecutionId,
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

impl Example for ExecutionSettled {
    fn example() -> Self {
        Self {
            execution_id: sample::execution(),
            outcome: Outcome::Succeeded,
            error: None,
        }
    }
}

/// A step began: one provider request whose response is the assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepStarted {
    pub assistant_message_id: MessageId,
    /// 1 for the first step of a turn, counting continuations.
    pub step: u32,
    pub agent: String,
    pub model: ModelRef,
}

impl Example for StepStarted {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            step: 1,
            agent: "build".into(),
            model: sample::model(),
        }
    }
}

/// A text fragment of the assistant message opened; deltas follow as ephemeral events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TextStarted {
    pub assistant_message_id: MessageId,
    /// Position among this message's text fragments, from 0.
    pub ordinal: u32,
}

impl Example for TextStarted {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
        }
    }
}

/// A text fragment closed with its full text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TextEnded {
    pub assistant_message_id: MessageId,
    pub ordinal: u32,
    pub text: String,
}

impl Example for TextEnded {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
            text: "The test reads the clock twice; I will pin it.".into(),
        }
    }
}

/// A reasoning fragment opened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasoningStarted {
    pub assistant_message_id: MessageId,
    pub ordinal: u32,
    /// Opaque provider data replayed on later turns (e.g. a redacted thinking block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_metadata: Option<Value>,
}

impl Example for ReasoningStarted {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
            provider_metadata: None,
        }
    }
}

/// A reasoning fragment closed with its full text and the provider data to replay it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasoningEnded {
    pub assistant_message_id: MessageId,
    pub ordinal: u32,
    pub text: String,
    /// Opaque provider data replayed on later turns (e.g. a thinking signature).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_metadata: Option<Value>,
}

impl Example for ReasoningEnded {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
            text: "The failure only happens across a second boundary.".into(),
            provider_metadata: Some(json!({"anthropic": {"signature": "EqQBCgIYAhIM"}})),
        }
    }
}

/// The model began streaming a tool call's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolInputStarted {
    pub assistant_message_id: MessageId,
    pub call_id: CallId,
    pub name: String,
}

impl Example for ToolInputStarted {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            call_id: sample::call(),
            name: "read".into(),
        }
    }
}

/// A tool call's input finished streaming; `text` is the raw input as the model wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolInputEnded {
    pub assistant_message_id: MessageId,
    pub call_id: CallId,
    pub text: String,
}

impl Example for ToolInputEnded {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            call_id: sample::call(),
            text: r#"{"path":"tests/login.rs"}"#.into(),
        }
    }
}

/// The model called a tool. A local tool starts only after this event commits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolCalled {
    pub assistant_message_id: MessageId,
    pub call_id: CallId,
    pub name: String,
    pub input: Value,
    /// The provider runs this tool itself (a hosted tool); its result arrives in the stream.
    pub provider_executed: bool,
    pub effect: Effect,
    /// The provider's own id for the call, kept to replay it faithfully.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_call_id: Option<String>,
    /// The call may run again, once, if a crash cuts it off: its tool only reads, or is
    /// idempotent (an MCP tool's `idempotentHint`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rerun: bool,
}

impl Example for ToolCalled {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            call_id: sample::call(),
            name: "read".into(),
            input: json!({"path": "tests/login.rs"}),
            provider_executed: false,
            effect: Effect::Read,
            provider_call_id: Some("call_9f2c1a".into()),
            rerun: true,
        }
    }
}

/// A tool call succeeded.
///
/// `structured` is the tool's machine-readable output and `content` what the model sees;
/// media lives only in `content`. `result` is kept only for provider-executed tools, whose
/// raw result is replayed to the provider on later turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolSuccess {
    pub call_id: CallId,
    pub structured: Value,
    pub content: Vec<ToolContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

impl Example for ToolSuccess {
    fn example() -> Self {
        Self {
            call_id: sample::call(),
            structured: json!({"path": "tests/login.rs", "lines": 2}),
            content: vec![ToolContent::Text {
                text: "1: #[test]\n2: fn login() {}".into(),
            }],
            result: None,
        }
    }
}

/// A tool call failed; the error is what the model sees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolFailed {
    pub call_id: CallId,
    pub error: ErrorInfo,
}

impl Example for ToolFailed {
    fn example() -> Self {
        Self {
            call_id: sample::call(),
            error: ErrorInfo::new(
                "tool.input-json",
                "the input is not valid JSON: expected `}` at line 1 column 22",
            ),
        }
    }
}

/// A tool whose policy is `ask` waits for a reply (`POST …/permission/{request_id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PermissionRequested {
    pub request_id: RequestId,
    pub call_id: CallId,
    pub tool: String,
    /// What the call would touch, e.g. a command or a path.
    pub pattern: String,
    /// The pattern of the agent's permission rule that asked (`git push *`), when one
    /// did: an `always` reply allows every later call it matches. Absent: an `always`
    /// allows only calls with this exact `pattern`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

impl Example for PermissionRequested {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
            call_id: sample::call(),
            tool: "bash".into(),
            pattern: "cargo test".into(),
            rule: Some("cargo *".into()),
        }
    }
}

/// A permission request was answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PermissionReplied {
    pub request_id: RequestId,
    pub decision: Decision,
}

impl Example for PermissionReplied {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
            decision: Decision::Once,
        }
    }
}

/// The model asked the user a question (`POST …/question/{request_id}` answers it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuestionAsked {
    pub request_id: RequestId,
    pub call_id: CallId,
    pub question: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Example for QuestionAsked {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
            call_id: sample::call(),
            question: "Pin the clock or retry the test?".into(),
            options: vec!["pin".into(), "retry".into()],
        }
    }
}

/// A question was answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuestionAnswered {
    pub request_id: RequestId,
    pub answer: String,
}

impl Example for QuestionAnswered {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
            answer: "pin".into(),
        }
    }
}

/// A question was dismissed; the continuation is interrupted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuestionDismissed {
    pub request_id: RequestId,
}

impl Example for QuestionDismissed {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
        }
    }
}

/// A retryable provider error before any visible output; the request is sent again at `at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryScheduled {
    pub assistant_message_id: MessageId,
    /// 1 for the first retry.
    pub attempt: u32,
    /// When the next attempt is sent, in milliseconds since the Unix epoch.
    pub at: i64,
    pub error: ErrorInfo,
}

impl Example for RetryScheduled {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            attempt: 1,
            at: 1_764_690_002_000,
            error: ErrorInfo::new("provider.rate_limit", "429 Too Many Requests"),
        }
    }
}

/// A step finished normally.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepEnded {
    pub assistant_message_id: MessageId,
    pub finish: Finish,
    pub usage: Usage,
    /// Cost of the step in US dollars, 0 when the model's price is unknown.
    pub cost: f64,
}

impl Example for StepEnded {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            finish: Finish::Stop,
            usage: sample::usage(),
            cost: 0.0031,
        }
    }
}

/// A step failed; the error is persisted as the assistant message's error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepFailed {
    pub assistant_message_id: MessageId,
    pub error: ErrorInfo,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl Example for StepFailed {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            error: ErrorInfo::new(
                "provider.context_overflow",
                "the request is longer than the model's context even after compaction",
            ),
            usage: None,
        }
    }
}

/// The step's response is over and the calls it made ran, except those waiting for a
/// person (a permission request or a question): the step stays open, and the execution is
/// handed back until a reply comes. The reply resumes the step from the log; `finish` and
/// `usage` are what its `step.ended` will carry once every call is resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepAwaiting {
    pub assistant_message_id: MessageId,
    pub finish: Finish,
    pub usage: Usage,
}

impl Example for StepAwaiting {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            finish: Finish::ToolCalls,
            usage: sample::usage(),
        }
    }
}

/// A step was cut short. Its projection fails every unresolved tool call of the step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepInterrupted {
    pub assistant_message_id: MessageId,
    pub reason: InterruptReason,
}

impl Example for StepInterrupted {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            reason: InterruptReason::User,
        }
    }
}

/// Recovery settled a step abandoned by a dead owner. Its projection fails every
/// unresolved tool call of the step except those in `rerun`; a call that may change
/// something is never run again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRecovered {
    pub assistant_message_id: MessageId,
    /// The abandoned execution.
    pub execution_id: ExecutionId,
    /// Unresolved calls marked `rerun` in their `tool.called`: they run again, once,
    /// before the model continues. Cut off a second time, they fail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rerun: Vec<CallId>,
}

impl Example for StepRecovered {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            execution_id: sample::execution(),
            rerun: vec![sample::call()],
        }
    }
}

/// History is being summarised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionStarted {
    pub reason: CompactionReason,
    /// The control input this compaction promotes, for a requested (manual) compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_id: Option<InputId>,
}

impl Example for CompactionStarted {
    fn example() -> Self {
        Self {
            reason: CompactionReason::Manual,
            input_id: Some(sample::input()),
        }
    }
}

/// The summary replaces every message before `boundary_seq` in later requests. Commits
/// together with the continuation it enables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionEnded {
    pub summary: String,
    pub boundary_seq: u64,
    pub usage: Usage,
}

impl Example for CompactionEnded {
    fn example() -> Self {
        Self {
            summary: "The user asked why test_login fails; the clock is read twice.".into(),
            boundary_seq: 40,
            usage: sample::usage(),
        }
    }
}

/// Summarising failed; the history is unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionFailed {
    pub error: ErrorInfo,
}

impl Example for CompactionFailed {
    fn example() -> Self {
        Self {
            error: ErrorInfo::new("provider.server", "502 Bad Gateway"),
        }
    }
}

/// A context epoch began: the system prompt every request of the epoch starts with,
/// fixed until the next epoch so provider prompt caches keep hitting. Epoch 1 comes with
/// the session's first step; each later one with a completed compaction, whose summary
/// stands for the history before `baseline_seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextEpochStarted {
    /// 1, then one more than the epoch before.
    pub epoch: u32,
    pub system: String,
    /// The first seq whose messages are sent as they are (0: the whole log).
    pub baseline_seq: u64,
}

impl Example for ContextEpochStarted {
    fn example() -> Self {
        Self {
            epoch: 2,
            system: "You are Keel's build agent, a careful software engineer.".into(),
            baseline_seq: 40,
        }
    }
}

/// The agent's system prompt changed during the epoch (new configuration, another
/// agent): the new text is added to the transcript as a message, and the epoch's system
/// prompt stays as it was. The next epoch starts from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextSystemUpdated {
    pub message_id: MessageId,
    pub system: String,
}

impl Example for ContextSystemUpdated {
    fn example() -> Self {
        Self {
            message_id: sample::message(),
            system: "You are Keel's review agent: read, never write.".into(),
        }
    }
}

/// Streamed text of an open text fragment (ephemeral, batched).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TextDelta {
    pub assistant_message_id: MessageId,
    pub ordinal: u32,
    pub delta: String,
}

impl Example for TextDelta {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
            delta: "The test reads".into(),
        }
    }
}

/// Streamed text of an open reasoning fragment (ephemeral, batched).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasoningDelta {
    pub assistant_message_id: MessageId,
    pub ordinal: u32,
    pub delta: String,
}

impl Example for ReasoningDelta {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            ordinal: 0,
            delta: "The failure only".into(),
        }
    }
}

/// Streamed raw input of a tool call (ephemeral).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolInputDelta {
    pub call_id: CallId,
    pub delta: String,
}

impl Example for ToolInputDelta {
    fn example() -> Self {
        Self {
            call_id: sample::call(),
            delta: r#"{"path":"#.into(),
        }
    }
}

/// Progress of a running tool (ephemeral), e.g. output lines of a command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolProgress {
    pub call_id: CallId,
    pub metadata: Value,
}

impl Example for ToolProgress {
    fn example() -> Self {
        Self {
            call_id: sample::call(),
            metadata: json!({"output": "running 12 tests\n"}),
        }
    }
}

/// Streamed text of a summary being written (ephemeral).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionDelta {
    pub text: String,
}

impl Example for CompactionDelta {
    fn example() -> Self {
        Self {
            text: "The user asked".into(),
        }
    }
}
