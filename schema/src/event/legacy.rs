//! Earlier versions of event payloads, kept decodable forever.
//!
//! Each struct is the payload exactly as it was published, with an upcast (`From`) into
//! the latest shape. Readers never see these types: [`super::DurableEvent::decode`] upcasts.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::Example;
use super::payload::{self, sample};
use crate::id::{CallId, ExecutionId, MessageId, RequestId};
use crate::types::{Effect, ErrorInfo, Finish, Outcome, ToolContent, Usage};

/// `session.next.tool.success` version 1: every result carried its raw `result` beside the
/// text the model saw, so large outputs were stored twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolSuccessV1 {
    pub call_id: CallId,
    /// What the model saw.
    pub output: String,
    /// The tool's raw result.
    pub result: Value,
}

impl From<ToolSuccessV1> for payload::ToolSuccess {
    /// The raw result becomes the structured output (where version 2 keeps it) and the
    /// text becomes the only content; `result` stays unset, as only provider-executed
    /// tools keep it and version 1 holds the same value in `structured`.
    fn from(old: ToolSuccessV1) -> Self {
        Self {
            call_id: old.call_id,
            structured: old.result,
            content: vec![ToolContent::Text { text: old.output }],
            result: None,
        }
    }
}

impl Example for ToolSuccessV1 {
    fn example() -> Self {
        Self {
            call_id: sample::call(),
            output: "1: #[test]\n2: fn login() {}".into(),
            result: json!({"path": "tests/login.rs", "lines": 2}),
        }
    }
}

/// Token counts as `session.next.step.ended` version 1 recorded them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokensV1 {
    pub input: u64,
    pub output: u64,
}

/// `session.next.step.ended` version 1: input and output tokens only, no cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepEndedV1 {
    pub assistant_message_id: MessageId,
    pub finish: Finish,
    pub tokens: TokensV1,
}

impl From<StepEndedV1> for payload::StepEnded {
    /// Version 1 did not split reasoning or cache tokens nor price steps: those are 0.
    fn from(old: StepEndedV1) -> Self {
        Self {
            assistant_message_id: old.assistant_message_id,
            finish: old.finish,
            usage: Usage {
                input: old.tokens.input,
                output: old.tokens.output,
                ..Usage::default()
            },
            cost: 0.0,
        }
    }
}

impl Example for StepEndedV1 {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            finish: Finish::ToolCalls,
            tokens: TokensV1 {
                input: 900,
                output: 40,
            },
        }
    }
}

/// How a busy period ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeV1 {
    Succeeded,
    Failed,
    Interrupted,
    /// Settled by recovery after its owner died; a new execution continues the session.
    Recovered,
}

impl From<OutcomeV1> for Outcome {
    fn from(old: OutcomeV1) -> Self {
        match old {
            OutcomeV1::Succeeded => Self::Succeeded,
            OutcomeV1::Failed => Self::Failed,
            OutcomeV1::Interrupted => Self::Interrupted,
            OutcomeV1::Recovered => Self::Recovered,
        }
    }
}

/// A busy period ended; the last event of its busy period. The claim is released in the
/// same transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecutionSettledV1 {
    pub execution_id: ExecutionId,
    pub outcome: OutcomeV1,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

impl From<ExecutionSettledV1> for payload::ExecutionSettled {
    /// Version 1 had no `awaiting` outcome; every other outcome is the same.
    fn from(old: ExecutionSettledV1) -> Self {
        Self {
            execution_id: old.execution_id,
            outcome: old.outcome.into(),
            error: old.error,
        }
    }
}

impl Example for ExecutionSettledV1 {
    fn example() -> Self {
        Self {
            execution_id: sample::execution(),
            outcome: OutcomeV1::Succeeded,
            error: None,
        }
    }
}

/// `session.next.permission.requested` version 1: no permission rules yet, so no `rule`;
/// an `always` answer allowed every later call of the tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PermissionRequestedV1 {
    pub request_id: RequestId,
    pub call_id: CallId,
    pub tool: String,
    /// What the permission would cover, e.g. a command or a path.
    pub pattern: String,
}

impl From<PermissionRequestedV1> for payload::PermissionRequested {
    /// The rule is `*`: what an `always` answer to a version 1 request allowed.
    fn from(old: PermissionRequestedV1) -> Self {
        Self {
            request_id: old.request_id,
            call_id: old.call_id,
            tool: old.tool,
            pattern: old.pattern,
            rule: Some("*".into()),
        }
    }
}

impl Example for PermissionRequestedV1 {
    fn example() -> Self {
        Self {
            request_id: sample::request(),
            call_id: sample::call(),
            tool: "bash".into(),
            pattern: "cargo test".into(),
        }
    }
}

/// `session.next.tool.called` version 1: no call could run again after a crash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolCalledV1 {
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
}

impl From<ToolCalledV1> for payload::ToolCalled {
    /// Version 1 calls were never run again.
    fn from(old: ToolCalledV1) -> Self {
        Self {
            assistant_message_id: old.assistant_message_id,
            call_id: old.call_id,
            name: old.name,
            input: old.input,
            provider_executed: old.provider_executed,
            effect: old.effect,
            provider_call_id: old.provider_call_id,
            rerun: false,
        }
    }
}

impl Example for ToolCalledV1 {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            call_id: sample::call(),
            name: "read".into(),
            input: json!({"path": "tests/login.rs"}),
            provider_executed: false,
            effect: Effect::Read,
            provider_call_id: Some("call_9f2c1a".into()),
        }
    }
}

/// `session.next.step.recovered` version 1: every unresolved call failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRecoveredV1 {
    pub assistant_message_id: MessageId,
    /// The abandoned execution.
    pub execution_id: ExecutionId,
}

impl From<StepRecoveredV1> for payload::StepRecovered {
    /// Version 1 ran nothing again.
    fn from(old: StepRecoveredV1) -> Self {
        Self {
            assistant_message_id: old.assistant_message_id,
            execution_id: old.execution_id,
            rerun: Vec::new(),
        }
    }
}

impl Example for StepRecoveredV1 {
    fn example() -> Self {
        Self {
            assistant_message_id: sample::assistant(),
            execution_id: sample::execution(),
        }
    }
}
