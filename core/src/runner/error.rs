//! The runner's errors: why a drain or its busy period did not finish normally.

use std::sync::Arc;

use keel_schema::id::SessionId;
use keel_schema::types::ErrorInfo;

use crate::{execution, inbox, store};

/// Why a drain (or its busy period) did not finish normally. `Clone`, because the
/// coordinator hands one drain's outcome to every caller that joined it: causes are
/// shared behind an `Arc`, never flattened into text.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Another owner holds the session's claim.
    #[error("session {0} is being run by another owner")]
    Busy(SessionId),
    #[error("ownership of session {0}'s execution was lost; this process stopped working on it")]
    OwnershipLost(SessionId),
    #[error("interrupted")]
    Interrupted,
    /// A planned shutdown stopped the drain at a boundary; the work goes on after the
    /// restart.
    #[error("Keel is shutting down; the session continues when it starts again")]
    ShuttingDown,
    /// The model's step failed (the error is in `step.failed`).
    #[error("the step failed: {}", .0.message)]
    StepFailed(ErrorInfo),
    /// The session, agent, model or provider is not usable.
    #[error("{0}")]
    Config(String),
    #[error("store: {0}")]
    Store(#[source] Arc<store::Error>),
    /// The inbox refused a promotion (a store failure comes as [`Error::Store`]).
    #[error("inbox: {0}")]
    Inbox(#[source] Arc<inbox::Error>),
    /// A tool's task panicked or was cancelled from outside the runner.
    #[error("a tool task failed: {0}")]
    ToolTask(#[source] Arc<tokio::task::JoinError>),
}

impl Error {
    /// Whether the error broke a step off in a way this process must still settle (a
    /// write that failed, a setting that does not resolve, a tool task that died), rather
    /// than an interrupt, a lost claim (recovery's business) or a failure already written.
    pub(super) fn breaks_step(&self) -> bool {
        match self {
            Self::Store(_) | Self::Inbox(_) | Self::Config(_) | Self::ToolTask(_) => true,
            Self::Busy(_)
            | Self::OwnershipLost(_)
            | Self::Interrupted
            | Self::ShuttingDown
            | Self::StepFailed(_) => false,
        }
    }
}

impl From<store::Error> for Error {
    fn from(e: store::Error) -> Self {
        Self::Store(Arc::new(e))
    }
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        Self::from(store::Error::from(e))
    }
}

impl From<inbox::Error> for Error {
    fn from(e: inbox::Error) -> Self {
        match e {
            inbox::Error::Store(e) => Self::from(e),
            other => Self::Inbox(Arc::new(other)),
        }
    }
}

impl From<execution::Error> for Error {
    fn from(e: execution::Error) -> Self {
        match e {
            execution::Error::OwnershipLost { session_id, .. } => Self::OwnershipLost(session_id),
            execution::Error::Store(e) => Self::from(e),
        }
    }
}
