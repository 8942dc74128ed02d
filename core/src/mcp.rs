//! MCP tool servers: the tools of `[mcp.NAME]` servers offered to the model beside the
//! built-in ones, through rmcp's client (a child process over stdio, or streamable HTTP).
//!
//! A server's tool `TOOL` is offered as `NAME_TOOL` ([`exposed_name`]) with the server's
//! input schema. An MCP call is a tool call like any other: `tool.called` commits before
//! the request is sent, ownership is checked before sending, and its result or failure
//! commits once. Its effect class comes from the tool's annotations (`readOnlyHint`)
//! unless `keel.toml` sets it: `read` tools run unasked by default, others ask.
//!
//! Lifecycle: a server starts on first use (a step about to be sent lists the tools of
//! every enabled server) or when the node starts (`start = "serve"`). One that fails to
//! start, or exits, is marked failed with its reason, and started again on a later use
//! once its backoff has passed (1 s, doubling up to 60 s); meanwhile its tools are not
//! offered, and a call of one fails with `tool.unavailable`, which the model sees; the
//! session goes on. [`Servers::shut_down`] closes them all (a child process is killed).
//! An interrupted call is abandoned with MCP's `notifications/cancelled`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_schema::types::{Effect, ToolContent};
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{Peer, RoleClient, RunningService, ServiceError};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::permission;
use crate::tool::{self, Context, Output, Run, Tool};

/// How long a server may take to start, and a call to answer, unless configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest tool name the providers accept.
const MAX_NAME: usize = 64;
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// How Keel reaches a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        command: String,
        args: Vec<String>,
        env: HashMap<String, String>,
    },
    /// A streamable-HTTP endpoint; header values are resolved already.
    Http {
        url: String,
        headers: Vec<(String, String)>,
    },
}

/// A configured server.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub name: String,
    pub transport: Transport,
    /// How long it may take to start, and each call to answer.
    pub timeout: Duration,
    /// Which of its tools are offered, as name patterns; all when `None`.
    pub tools: Option<Vec<String>>,
    /// Started when the node starts rather than on first use.
    pub eager: bool,
    /// Effect classes set in `keel.toml`, by the server's tool name.
    pub effects: HashMap<String, Class>,
}

/// What a tool's calls do, as far as Keel must know: whether they may change anything
/// (the permission default) and whether one a crash cut off may run again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Only reads (`readOnlyHint`): runs unasked by default, may run again.
    Read,
    /// Changes something, the same way however often it runs (`idempotentHint`): asks
    /// by default, may run again.
    Idempotent,
    /// Anything else: asks by default, never runs again.
    Write,
}

impl Class {
    /// The class the tool's annotations give.
    fn annotated(annotations: Option<&rmcp::model::ToolAnnotations>) -> Self {
        match annotations {
            Some(a) if a.read_only_hint == Some(true) => Self::Read,
            Some(a) if a.idempotent_hint == Some(true) => Self::Idempotent,
            _ => Self::Write,
        }
    }

    fn effect(self) -> Effect {
        match self {
            Self::Read => Effect::Read,
            Self::Idempotent | Self::Write => Effect::Write,
        }
    }
}

/// The name a server's tool is offered under: `SERVER_TOOL`, with characters the
/// providers refuse replaced by `_`, at most 64 characters.
pub fn exposed_name(server: &str, tool: &str) -> String {
    format!("{server}_{tool}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME)
        .collect()
}

/// Where a server is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Not started yet (it starts on first use).
    Idle,
    Starting,
    Ready,
    /// It failed to start or exited; the reason.
    Failed(String),
}

/// A server as `GET /api/mcp` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub name: String,
    /// `stdio` or `http`.
    pub transport: &'static str,
    pub state: State,
    /// Its offered tools: (offered name, effect), when ready.
    pub tools: Vec<(String, Effect)>,
}

/// Every configured server.
#[derive(Default)]
pub struct Servers {
    servers: Vec<Arc<Server>>,
}

impl Servers {
    pub fn new(specs: Vec<Spec>) -> Self {
        Self {
            servers: specs
                .into_iter()
                .map(|spec| {
                    Arc::new(Server {
                        spec,
                        running: tokio::sync::Mutex::new(None),
                        seen: Mutex::new(Seen::default()),
                    })
                })
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Starts the servers configured to start with the node, concurrently; failures are
    /// recorded in their status.
    pub async fn start_eager(&self) {
        let eager = self.servers.iter().filter(|s| s.spec.eager);
        futures::future::join_all(eager.map(|server| server.peer())).await;
    }

    /// The tools of every server, starting those not started (or due a restart); a
    /// server that cannot start offers none.
    pub async fn tools(&self) -> Vec<Arc<dyn Tool>> {
        futures::future::join_all(self.servers.iter().map(|server| server.peer())).await;
        self.ready_tools()
    }

    /// The tools of the servers ready now, without starting any: what requests offer.
    pub fn ready_tools(&self) -> Vec<Arc<dyn Tool>> {
        self.servers
            .iter()
            .flat_map(|server| {
                let seen = lock(&server.seen);
                match seen.state {
                    State::Ready => seen.tools.clone(),
                    _ => Vec::new(),
                }
            })
            .map(|tool| tool as Arc<dyn Tool>)
            .collect()
    }

    /// Every tool a server offered when it was last ready, ready now or not: a call the
    /// model makes of one whose server has failed since fails with the server's reason
    /// (`tool.unavailable`) rather than as an unknown tool.
    pub fn known_tools(&self) -> Vec<Arc<dyn Tool>> {
        self.servers
            .iter()
            .flat_map(|server| lock(&server.seen).tools.clone())
            .map(|tool| tool as Arc<dyn Tool>)
            .collect()
    }

    /// The tool called `name` that a server offered when it was last ready.
    pub fn tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.servers.iter().find_map(|server| {
            lock(&server.seen)
                .tools
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.clone() as Arc<dyn Tool>)
        })
    }

    pub fn statuses(&self) -> Vec<Status> {
        self.servers
            .iter()
            .map(|server| {
                let seen = lock(&server.seen);
                Status {
                    name: server.spec.name.clone(),
                    transport: match server.spec.transport {
                        Transport::Stdio { .. } => "stdio",
                        Transport::Http { .. } => "http",
                    },
                    tools: match seen.state {
                        State::Ready => seen
                            .tools
                            .iter()
                            .map(|t| (t.name.clone(), t.class.effect()))
                            .collect(),
                        _ => Vec::new(),
                    },
                    state: seen.state.clone(),
                }
            })
            .collect()
    }

    /// Closes every server (a child process is killed).
    pub async fn shut_down(&self) {
        for server in &self.servers {
            if let Some(service) = server.running.lock().await.take() {
                drop(service.cancel().await);
            }
            let mut seen = lock(&server.seen);
            seen.state = State::Idle;
            seen.tools.clear();
        }
    }
}

/// What is known of a server without waiting for it.
struct Seen {
    state: State,
    tools: Vec<Arc<McpTool>>,
    /// Failures in a row, for the backoff.
    failures: u32,
    /// No start is tried before this, after a failure.
    retry_at: Option<Instant>,
}

impl Default for Seen {
    fn default() -> Self {
        Self {
            state: State::Idle,
            tools: Vec::new(),
            failures: 0,
            retry_at: None,
        }
    }
}

struct Server {
    spec: Spec,
    /// The client, once started; held while starting, so one start runs at a time.
    running: tokio::sync::Mutex<Option<RunningService<RoleClient, ()>>>,
    seen: Mutex<Seen>,
}

impl Server {
    /// A handle to the running server, starting it when it is not running and not
    /// waiting out a backoff.
    async fn peer(self: &Arc<Self>) -> Result<Peer<RoleClient>, String> {
        let mut running = self.running.lock().await;
        if let Some(service) = running.as_ref() {
            if !service.is_closed() {
                return Ok(service.peer().clone());
            }
            *running = None;
            self.failed("the server exited".into());
        }
        {
            let mut seen = lock(&self.seen);
            if let (State::Failed(reason), Some(at)) = (&seen.state, seen.retry_at)
                && Instant::now() < at
            {
                return Err(reason.clone());
            }
            seen.state = State::Starting;
        }
        let started = tokio::time::timeout(self.spec.timeout, self.connect()).await;
        match started {
            Ok(Ok((service, tools))) => {
                let peer = service.peer().clone();
                *running = Some(service);
                let mut seen = lock(&self.seen);
                *seen = Seen {
                    state: State::Ready,
                    tools,
                    ..Seen::default()
                };
                tracing::info!(server = %self.spec.name, tools = seen.tools.len(), "MCP server ready");
                Ok(peer)
            }
            Ok(Err(reason)) => Err(self.failed(reason)),
            Err(_) => Err(self.failed(format!(
                "it did not start within {} ms",
                self.spec.timeout.as_millis()
            ))),
        }
    }

    /// Records a failure and its backoff; returns the reason.
    fn failed(&self, reason: String) -> String {
        let mut seen = lock(&self.seen);
        seen.failures += 1;
        let backoff = BACKOFF_FIRST
            .saturating_mul(1 << (seen.failures - 1).min(6))
            .min(BACKOFF_MAX);
        seen.retry_at = Some(Instant::now() + backoff);
        // The tools stay known, so a call of one fails with this reason.
        seen.state = State::Failed(reason.clone());
        tracing::warn!(server = %self.spec.name, %reason, retry_in_ms = backoff.as_millis() as u64, "MCP server failed");
        reason
    }

    /// Starts the client and lists the tools it offers.
    async fn connect(
        self: &Arc<Self>,
    ) -> Result<(RunningService<RoleClient, ()>, Vec<Arc<McpTool>>), String> {
        let service = match &self.spec.transport {
            Transport::Stdio { command, args, env } => {
                let mut child = tokio::process::Command::new(command);
                child.args(args).envs(env);
                let transport = rmcp::transport::TokioChildProcess::new(child)
                    .map_err(|e| format!("`{command}` could not be started: {e}"))?;
                ().serve(transport).await.map_err(|e| e.to_string())?
            }
            Transport::Http { url, headers } => {
                use reqwest::header::{HeaderName, HeaderValue};
                use rmcp::transport::StreamableHttpClientTransport;
                use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
                let mut custom = HashMap::new();
                for (name, value) in headers {
                    let name = HeaderName::try_from(name.as_str())
                        .map_err(|e| format!("header `{name}`: {e}"))?;
                    let value = HeaderValue::try_from(value.as_str())
                        .map_err(|e| format!("header `{name}`: {e}"))?;
                    custom.insert(name, value);
                }
                let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                    .custom_headers(custom);
                let transport = StreamableHttpClientTransport::from_config(config);
                ().serve(transport).await.map_err(|e| e.to_string())?
            }
        };
        let listed = service
            .list_all_tools()
            .await
            .map_err(|e| format!("listing its tools failed: {e}"))?;
        let tools = listed
            .into_iter()
            .filter(|t| {
                self.spec
                    .tools
                    .as_ref()
                    .is_none_or(|patterns| patterns.iter().any(|p| permission::matches(p, &t.name)))
            })
            .map(|t| {
                let class = self
                    .spec
                    .effects
                    .get(t.name.as_ref())
                    .copied()
                    .unwrap_or_else(|| Class::annotated(t.annotations.as_ref()));
                Arc::new(McpTool {
                    name: exposed_name(&self.spec.name, &t.name),
                    tool: t.name.to_string(),
                    description: t.description.as_deref().unwrap_or_default().to_owned(),
                    schema: Value::Object((*t.input_schema).clone()),
                    class,
                    server: self.clone(),
                })
            })
            .collect();
        Ok((service, tools))
    }

    /// Calls `tool` with `input`; an interrupt abandons the request
    /// (`notifications/cancelled`).
    async fn call(
        self: &Arc<Self>,
        tool: &str,
        input: Value,
        cancel: &CancellationToken,
    ) -> Result<Output, tool::Error> {
        let name = &self.spec.name;
        let peer = self.peer().await.map_err(|reason| {
            tool::Error::Unavailable(format!(
                "the MCP server `{name}` is not available: {reason}"
            ))
        })?;
        let arguments = match input {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => {
                return Err(tool::Error::InvalidInput(format!(
                    "the arguments must be an object, not {other}"
                )));
            }
        };
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        // Dropping the call (interrupt, timeout) sends `notifications/cancelled`.
        let answered = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(tool::Error::Interrupted),
            answered = tokio::time::timeout(self.spec.timeout, peer.call_tool(params)) => answered,
        };
        let result = match answered {
            Err(_) => {
                return Err(tool::Error::Timeout(
                    u64::try_from(self.spec.timeout.as_millis()).unwrap_or(u64::MAX),
                ));
            }
            Ok(Err(error)) => {
                if matches!(
                    error,
                    ServiceError::TransportClosed | ServiceError::TransportSend(_)
                ) {
                    // The server is gone: the next use starts it again, after a backoff.
                    self.running.lock().await.take();
                    self.failed(format!("it exited during a call of `{tool}`"));
                }
                return Err(tool::Error::Unavailable(format!(
                    "the MCP server `{name}` failed during the call: {error}"
                )));
            }
            Ok(Ok(result)) => result,
        };
        let content = result
            .content
            .iter()
            .map(|block| serde_json::to_value(block).map(|block| content_of(&block)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tool::Error::Failed(format!("the result does not serialize: {e}")))?;
        if result.is_error == Some(true) {
            let text: Vec<&str> = content
                .iter()
                .filter_map(|c| match c {
                    ToolContent::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            return Err(tool::Error::Failed(if text.is_empty() {
                format!("`{tool}` of the MCP server `{name}` failed")
            } else {
                text.join("\n")
            }));
        }
        Ok(Output {
            structured: json!({
                "server": name,
                "tool": tool,
                "structured": result.structured_content,
            }),
            content,
        })
    }
}

/// An MCP content block (as on the wire) as what the model sees: text as text, an image
/// as media (stored once, in the content), an embedded resource's text with its URI, and
/// anything else described in a line.
fn content_of(block: &Value) -> ToolContent {
    let text = |s: String| ToolContent::Text { text: s };
    let str_of = |v: &Value, key: &str| v[key].as_str().unwrap_or_default().to_owned();
    match block["type"].as_str() {
        Some("text") => text(str_of(block, "text")),
        Some("image") => ToolContent::Media {
            mime: str_of(block, "mimeType"),
            data: str_of(block, "data"),
        },
        Some("resource") => {
            let resource = &block["resource"];
            let uri = str_of(resource, "uri");
            match resource["text"].as_str() {
                Some(body) => text(format!("{uri}:\n{body}")),
                None => {
                    let mime = str_of(resource, "mimeType");
                    if mime.starts_with("image/") {
                        ToolContent::Media {
                            mime,
                            data: str_of(resource, "blob"),
                        }
                    } else {
                        text(format!("[a binary resource {uri} ({mime}) was left out]"))
                    }
                }
            }
        }
        Some("resource_link") => text(format!("[a link to the resource {}]", str_of(block, "uri"))),
        other => text(format!(
            "[content of type {} was left out]",
            other.unwrap_or("unknown")
        )),
    }
}

/// One tool of a server, as Keel's tools are.
struct McpTool {
    /// The name the model sees.
    name: String,
    /// The server's name for it.
    tool: String,
    description: String,
    schema: Value,
    class: Class,
    server: Arc<Server>,
}

impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn effect(&self) -> Effect {
        self.class.effect()
    }

    fn rerun_safe(&self) -> bool {
        self.class != Class::Write
    }

    fn input_schema(&self) -> Value {
        self.schema.clone()
    }

    /// Rules for MCP tools are by name: nothing narrower to match.
    fn permission_pattern(&self, _: &Value, _: &std::path::Path) -> String {
        String::new()
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(self.server.call(&self.tool, input, &context.cancel))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_names_join_server_and_tool_in_the_characters_providers_accept() {
        assert_eq!(exposed_name("github", "list_issues"), "github_list_issues");
        assert_eq!(
            exposed_name("my.server", "do it/now"),
            "my_server_do_it_now"
        );
        assert_eq!(exposed_name("s", &"x".repeat(100)).len(), 64);
    }

    #[test]
    fn content_maps_text_images_and_embedded_resources() {
        assert_eq!(
            content_of(&json!({"type": "text", "text": "hi"})),
            ToolContent::Text { text: "hi".into() }
        );
        assert_eq!(
            content_of(&json!({"type": "image", "mimeType": "image/png", "data": "AAAA"})),
            ToolContent::Media {
                mime: "image/png".into(),
                data: "AAAA".into()
            }
        );
        assert_eq!(
            content_of(&json!({"type": "resource", "resource": {"uri": "f://a", "text": "body"}})),
            ToolContent::Text {
                text: "f://a:\nbody".into()
            }
        );
        assert!(matches!(
            content_of(&json!({"type": "audio", "data": "x"})),
            ToolContent::Text { text } if text.contains("audio")
        ));
    }
}
