//! Tools the model can call.
//!
//! A tool has a name, a JSON Schema for its input, an effect (`read` or `write`), and a
//! function from input to output. Tools are confined to the session directory: paths are
//! relative to it, an absolute path is accepted only when it resolves inside it, and
//! `..` or a symlink that leads out is refused. Output is truncated to a configured size
//! with a note saying so. Media (an image read from disk) is returned once, base64-encoded,
//! in the output's content; structured output never repeats it.
//!
//! Running a tool is not the runner's business beyond this interface: the runner decides
//! *whether* to run it (permissions, ownership) and records the outcome durably.
//!
//! The built-ins ([`builtins`]) live one per module: [`read`], [`write`](mod@write), [`edit`],
//! [`list`], [`glob`], [`grep`] and [`bash`]. They share path confinement (`path`), output
//! truncation (`truncate`) and input parsing (`input`). `question` is not a tool here: the
//! runner answers it.

pub mod bash;
pub mod edit;
pub mod glob;
pub mod grep;
mod input;
pub mod list;
mod path;
pub mod read;
pub mod sandbox;
mod truncate;
mod walk;
pub mod write;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use keel_schema::id::{CallId, SessionId};
use keel_schema::types::{Effect, ErrorInfo, ToolContent};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a tool run may use.
#[derive(Debug, Clone)]
pub struct Context {
    /// The session directory, canonicalized. Every path a tool touches is inside it.
    pub directory: PathBuf,
    /// Cancelled when the run is interrupted; a tool stops promptly and returns
    /// [`Error::Interrupted`] (killing any process it started).
    pub cancel: CancellationToken,
    pub limits: Limits,
    /// Where to send progress (published as ephemeral `tool.progress` events), if anywhere.
    pub progress: Option<mpsc::Sender<Value>>,
    /// The session and the call this run is for, when run by a session. `bash` exports
    /// them to its command as `KEEL_SESSION_ID` and `KEEL_CALL_ID` (an idempotency key
    /// for scripts that change the world).
    pub call: Option<(SessionId, CallId)>,
    /// The sandbox `bash` runs its command in; `None`: none (the agent's `sandbox = "off"`).
    pub sandbox: Option<sandbox::Sandbox>,
}

/// Output limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Text output beyond this many bytes is cut, with a note saying how much was left out.
    pub max_output_bytes: usize,
    /// `read` returns at most this many lines unless asked for fewer.
    pub max_lines: usize,
    /// `bash` runs at most this long unless the call asks for less (or more, up to
    /// `max_timeout_ms`).
    pub default_timeout_ms: u64,
    pub max_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_output_bytes: 50 * 1024,
            max_lines: 2000,
            default_timeout_ms: 120_000,
            max_timeout_ms: 600_000,
        }
    }
}

/// A successful tool run.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Machine-readable result (never contains media bytes).
    pub structured: Value,
    /// What the model sees.
    pub content: Vec<ToolContent>,
}

/// Why a tool run failed. Each maps to the error the model sees ([`Error::info`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The input does not match the tool's schema.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A path leads outside the session directory.
    #[error("`{0}` is outside the session directory")]
    PathEscape(String),
    #[error("`{0}` does not exist")]
    NotFound(String),
    /// `edit` found its `old` text zero or several times.
    #[error("{0}")]
    EditMatch(String),
    #[error("timed out after {0} ms")]
    Timeout(u64),
    #[error("interrupted")]
    Interrupted,
    #[error("{0}")]
    Io(String),
    /// An MCP server could not take the call: it failed to start, or exited.
    #[error("{0}")]
    Unavailable(String),
    /// An MCP tool answered with an error result.
    #[error("{0}")]
    Failed(String),
    /// The sandbox refused the call before it ran ([`sandbox`]).
    #[error("blocked by sandbox: {0}")]
    Sandbox(String),
}

impl Error {
    /// The error as recorded in `tool.failed` and shown to the model.
    pub fn info(&self) -> ErrorInfo {
        let kind = match self {
            Self::InvalidInput(_) => "tool.input",
            Self::PathEscape(_) => "tool.path-escape",
            Self::NotFound(_) => "tool.not-found",
            Self::EditMatch(_) => "tool.edit-match",
            Self::Timeout(_) => "tool.timeout",
            Self::Interrupted => "tool.interrupted",
            Self::Io(_) => "tool.io",
            Self::Unavailable(_) => "tool.unavailable",
            Self::Failed(_) => "tool.error",
            Self::Sandbox(_) => "tool.sandbox",
        };
        ErrorInfo::new(kind, self.to_string())
    }
}

/// A boxed future of a tool run.
pub type Run<'a> = Pin<Box<dyn Future<Output = Result<Output, Error>> + Send + 'a>>;

/// A tool.
pub trait Tool: Send + Sync {
    fn name(&self) -> &str;
    /// One or two sentences for the model.
    fn description(&self) -> &str;
    fn effect(&self) -> Effect;
    /// Whether a call a crash cut off may run again, once: by default when the tool only
    /// reads.
    fn rerun_safe(&self) -> bool {
        self.effect() == Effect::Read
    }
    /// The JSON Schema of the input (draft 2020-12).
    fn input_schema(&self) -> Value;
    /// What a permission for this call would cover, matched against permission rules: the
    /// command for `bash`; for file tools the path where it really is, relative to the
    /// session directory `root` ([`path::permission_path`]), so `./a`, an absolute path and
    /// a symlink are all checked as what they reach.
    fn permission_pattern(&self, input: &Value, root: &Path) -> String;
    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a>;
}

/// The tools a session can use, by name.
#[derive(Clone, Default)]
pub struct Registry {
    tools: Vec<Arc<dyn Tool>>,
}

impl Registry {
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Self {
        Self { tools }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.iter().find(|t| t.name() == name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Tool>> {
        self.tools.iter()
    }
}

/// The built-in tools: `read`, `write`, `edit`, `list`, `glob`, `grep` and `bash`.
pub fn builtins() -> Registry {
    Registry::new(vec![
        Arc::new(read::Read),
        Arc::new(write::Write),
        Arc::new(edit::Edit),
        Arc::new(list::List),
        Arc::new(glob::Glob),
        Arc::new(grep::Grep),
        Arc::new(bash::Bash),
    ])
}

impl Error {
    /// An I/O failure on `shown` (a path as the model sees it): a missing file is
    /// [`Error::NotFound`], anything else [`Error::Io`] naming the path.
    pub(crate) fn from_io(shown: &str, error: &std::io::Error) -> Self {
        match error.kind() {
            std::io::ErrorKind::NotFound => Self::NotFound(shown.to_owned()),
            _ => Self::Io(format!("`{shown}`: {error}")),
        }
    }
}

/// Runs blocking file-system work off the async threads. A cancelled run still waits for
/// the work to finish, since it cannot be stopped midway: a `write` or `edit` the step was
/// interrupted in lands before the step ends, never after, and its result (it happened)
/// is the call's. Work that walks directories checks the cancellation itself and stops
/// early with [`Error::Interrupted`].
pub(crate) async fn blocking<T, F>(work: F) -> Result<T, Error>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, Error> + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Io(format!("tool task failed: {e}")))?
}

/// Plain text for the model.
pub(crate) fn text(text: impl Into<String>) -> Vec<ToolContent> {
    vec![ToolContent::Text { text: text.into() }]
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.tools.iter().map(|t| t.name()))
            .finish()
    }
}
