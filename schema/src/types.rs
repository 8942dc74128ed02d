//! Value types shared by events and the HTTP API.
//!
//! Enums are closed on purpose: a new variant is a schema change, so an event that
//! carries one needs a new version (see [`crate::event`]).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A model, addressed in configuration and requests as `provider/id`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    /// The provider's name in `keel.toml` (`[provider.NAME]`).
    pub provider: String,
    /// The model's id at that provider.
    pub id: String,
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.provider, self.id)
    }
}

/// Why `provider/id` text is not a model reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a model: write it as `provider/model`, e.g. `openai/gpt-4.1`")]
pub struct ParseModelRefError(pub String);

impl FromStr for ModelRef {
    type Err = ParseModelRefError;

    /// Splits at the first `/`: model ids may themselves contain slashes
    /// (`openrouter/meta-llama/llama-3`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((provider, id)) if !provider.is_empty() && !id.is_empty() => Ok(Self {
                provider: provider.to_owned(),
                id: id.to_owned(),
            }),
            _ => Err(ParseModelRefError(s.to_owned())),
        }
    }
}

/// A piece of a user prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Part {
    /// Plain text.
    Text { text: String },
    /// A file: a `data:` URL carrying its bytes, or a path relative to the session directory.
    File {
        mime: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filename: Option<String>,
        url: String,
    },
}

/// When an admitted input joins the transcript.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// At the next step boundary of a running execution; pending steers coalesce into one turn.
    Steer,
    /// One at a time, only when the session would otherwise go idle.
    #[default]
    Queue,
}

/// What an input asks for.
///
/// A prompt becomes a user message when promoted. A control input asks the engine itself
/// for something (today: a compaction); it is promoted in admission order and blocks the
/// steering prompts admitted after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    #[default]
    Prompt,
    /// A request to compact the session's history (`POST …/compact`).
    Compact,
}

impl InputKind {
    /// Whether this is a control input rather than a prompt.
    pub fn is_control(self) -> bool {
        match self {
            Self::Prompt => false,
            Self::Compact => true,
        }
    }
}

/// Who produced an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InputSource {
    User,
    Synthetic,
    /// The continuation that recovery admits after taking over an abandoned execution.
    Recovery,
}

/// Why Keel itself added a message to the transcript.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SyntheticReason {
    Continue,
    Recovery,
    Notice,
}

/// How a busy period ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
    Interrupted,
    /// Settled by recovery after its owner died; a new execution continues the session.
    Recovered,
    /// Handed back while its step waits for a person (`step.awaiting`); the reply starts a
    /// new execution that resumes the step.
    Awaiting,
}

/// Whether a tool only reads or may change the world. Write tools are never re-run blindly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    Read,
    Write,
}

/// A reply to a permission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Allow this call.
    Once,
    /// Allow this call and remember the answer for the session.
    Always,
    /// Fail the call and interrupt the continuation.
    Reject,
}

/// Why a step's provider response finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// The model finished its turn.
    Stop,
    /// The model asked for tools; a continuation follows once they resolve.
    ToolCalls,
    /// The output token limit was reached.
    Length,
    /// The provider withheld output.
    ContentFilter,
    /// A reason the provider named that Keel does not distinguish.
    Other,
}

/// Why a step was cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum InterruptReason {
    /// `POST …/interrupt`.
    User,
    /// The server shut down gracefully while the step ran.
    Shutdown,
    /// A permission request was rejected.
    PermissionRejected,
    /// A question was dismissed.
    QuestionDismissed,
}

/// What started a compaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompactionReason {
    /// The estimated context reached the model's limit minus a buffer.
    Auto,
    /// `POST …/compact`.
    Manual,
    /// The provider rejected a request as too long.
    Overflow,
}

/// The phase of an execution claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Claimed; no assistant message yet.
    Claimed,
    /// A step with an assistant message is running.
    Running,
    /// History is being summarised.
    Compacting,
    /// An interrupt is being carried out.
    Cancelling,
}

/// Token usage of one or more provider requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
    pub reasoning: u64,
    pub cache_read: u64,
    pub cache_write: u64,
}

/// An error as recorded in events: a stable machine-readable type and a message for people.
///
/// Types are dotted and open-ended (`provider.context_overflow`, `tool.input-json`,
/// `tool.interrupted-by-crash`); the message says what happened and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorInfo {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

impl ErrorInfo {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            message: message.into(),
        }
    }
}

/// One piece of a tool's output as the model sees it. Media is stored here once, in full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToolContent {
    Text {
        text: String,
    },
    /// Binary output (an image read from disk, say), base64-encoded.
    Media {
        mime: String,
        data: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ref_splits_at_the_first_slash() {
        let model: ModelRef = "openrouter/meta-llama/llama-3".parse().unwrap();
        assert_eq!(
            model,
            ModelRef {
                provider: "openrouter".into(),
                id: "meta-llama/llama-3".into()
            }
        );
        assert_eq!(model.to_string(), "openrouter/meta-llama/llama-3");
    }

    #[test]
    fn model_ref_rejects_text_without_provider_or_model() {
        for bad in ["gpt-4.1", "/gpt-4.1", "openai/", ""] {
            assert_eq!(
                bad.parse::<ModelRef>(),
                Err(ParseModelRefError(bad.to_owned()))
            );
        }
    }
}
