//! `keel-mcp-fixture`: a small, predictable MCP server that Keel's end-to-end
//! tests connect to, so they exercise Keel's MCP client against a real server
//! (built on rmcp) instead of a mock of the protocol.
//!
//! Tools (annotations in brackets; "ro" = readOnlyHint, "idem" = idempotentHint,
//! "destr" = destructiveHint):
//! - `echo {text}` → `echo: <text>` [ro]
//! - `add {a, b, ms?}` → the sum as text, e.g. `5`, after `ms` milliseconds
//!   [ro=false, idem, destr=false]
//! - `fail {}` → a tool-level error (isError) saying `it failed on purpose` [ro]
//! - `crash {}` → the process exits with code 3 mid-call [ro=false, destr]
//! - `slow {ms}` → `slept <ms> ms` after waiting, unless cancelled first
//!   [ro=false, idem=false, destr]
//! - `record {path, text}` → appends `text` and a newline to `path`, returns
//!   `recorded` [ro=false, idem=false, destr]
//! - `picture {}` → a text, a 1x1 red PNG image and an embedded text resource [ro]
//! - `idle {}` → `idle` (no annotations at all, to test the defaults)
//!
//! Interface:
//! - no arguments: serve MCP over stdio.
//! - `--http ADDR` (e.g. `127.0.0.1:0`): serve streamable HTTP at `/mcp`; once
//!   listening, print `listening on http://<bound addr>/mcp` on stdout.
//! - `--require-header NAME=VALUE` (with `--http` only): answer 401 to any
//!   request that lacks that exact header value.
//! - `FIXTURE_LOG=<path>` (optional): append one line per tool-call event,
//!   `call NAME`, `done NAME` or `cancelled NAME`, so tests can see what the
//!   server did even when the client never got an answer; over stdio,
//!   `closed stdio` once the client closed the connection.

use std::{
    fs::File,
    io::Write,
    process::ExitCode,
    sync::{Arc, Mutex},
};

use axum::{
    extract::{Request, State},
    http::{HeaderName, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
};
use rmcp::{
    ErrorData, RoleServer, ServerHandler, ServiceExt,
    handler::server::{router::tool::ToolRouter, tool::ToolCallContext, wrapper::Parameters},
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
        ServerCapabilities, ServerConfig,
    },
    service::RequestContext,
    tool, tool_handler, tool_router,
    transport::{
        stdio,
        streamable_http_server::{
            StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
        },
    },
};
use schemars::JsonSchema;
use serde::Deserialize;

const USAGE: &str = "usage: keel-mcp-fixture [--http ADDR [--require-header NAME=VALUE]]";

/// A valid 1x1 PNG holding one opaque red pixel (8-bit RGB), base64-encoded.
const RED_PIXEL_PNG: &str =
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR42mP4z8AAAAMBAQD3A0FDAAAAAElFTkSuQmCC";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The `FIXTURE_LOG` event log. The file is unbuffered and each event is one
/// `write_all` to a file opened for appending, so a line is on disk before the
/// server goes on (which matters for `crash`, which exits right after logging).
struct EventLog(Option<Mutex<File>>);

impl EventLog {
    fn from_env() -> Result<Self, String> {
        let Some(path) = std::env::var_os("FIXTURE_LOG") else {
            return Ok(Self(None));
        };
        // Opened once, up front: a bad path is a broken test setup, better
        // reported at startup than as missing lines later.
        let file = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("cannot open FIXTURE_LOG {}: {e}", path.display()))?;
        Ok(Self(Some(Mutex::new(file))))
    }

    fn event(&self, kind: &str, tool: &str) {
        let Some(file) = &self.0 else { return };
        // A poisoned lock only means another call panicked mid-write; the file
        // itself is still usable.
        let mut file = file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Err(e) = file
            .write_all(format!("{kind} {tool}\n").as_bytes())
            .and_then(|()| file.flush())
        {
            eprintln!("keel-mcp-fixture: cannot write FIXTURE_LOG: {e}");
        }
    }
}

#[derive(Deserialize, JsonSchema)]
struct EchoArgs {
    /// The text to echo back.
    text: String,
}

#[derive(Deserialize, JsonSchema)]
struct AddArgs {
    a: i64,
    b: i64,
    /// How long to think first, in milliseconds (none by default): a call a test can
    /// cut off.
    #[serde(default)]
    ms: u64,
}

#[derive(Deserialize, JsonSchema)]
struct SlowArgs {
    /// How long to wait, in milliseconds.
    ms: u64,
}

#[derive(Deserialize, JsonSchema)]
struct RecordArgs {
    /// The file to append to (created if missing).
    path: String,
    /// The line to append.
    text: String,
}

/// The MCP server. One instance per connection (per HTTP session); they share
/// the event log.
#[derive(Clone)]
struct Fixture {
    log: Arc<EventLog>,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Fixture {
    fn new(log: Arc<EventLog>) -> Self {
        Self {
            log,
            tool_router: Self::tool_router(),
        }
    }

    /// Echo the text back, prefixed with `echo: `.
    #[tool(annotations(read_only_hint = true))]
    async fn echo(&self, Parameters(args): Parameters<EchoArgs>) -> String {
        format!("echo: {}", args.text)
    }

    /// Add two integers.
    #[tool(annotations(
        read_only_hint = false,
        idempotent_hint = true,
        destructive_hint = false
    ))]
    async fn add(&self, Parameters(args): Parameters<AddArgs>) -> Result<String, ErrorData> {
        tokio::time::sleep(std::time::Duration::from_millis(args.ms)).await;
        // Overflow is the caller's mistake, so it is reported as bad params
        // rather than wrapping or panicking.
        args.a
            .checked_add(args.b)
            .map(|sum| sum.to_string())
            .ok_or_else(|| ErrorData::invalid_params("a + b overflows a 64-bit integer", None))
    }

    /// Always fail, as a tool-level error (isError), not a protocol error.
    #[tool(annotations(read_only_hint = true))]
    async fn fail(&self) -> CallToolResult {
        CallToolResult::error(vec![ContentBlock::text("it failed on purpose")])
    }

    /// Kill the server process (exit code 3) in the middle of the call.
    #[tool(annotations(read_only_hint = false, destructive_hint = true))]
    async fn crash(&self) -> String {
        // `call crash` is already logged by `call_tool`, before dispatch.
        std::process::exit(3)
    }

    /// Wait `ms` milliseconds, then answer; stops early if the client cancels.
    #[tool(annotations(
        read_only_hint = false,
        idempotent_hint = false,
        destructive_hint = true
    ))]
    async fn slow(
        &self,
        Parameters(SlowArgs { ms }): Parameters<SlowArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<String, ErrorData> {
        let sleep = tokio::time::sleep(std::time::Duration::from_millis(ms));
        tokio::select! {
            () = sleep => Ok(format!("slept {ms} ms")),
            // rmcp cancels this token on `notifications/cancelled` and drops
            // whatever we return, so the error only ends the task promptly.
            () = context.ct.cancelled() => {
                Err(ErrorData::internal_error("cancelled by the client", None))
            }
        }
    }

    /// Append `text` and a newline to the file at `path`, creating it.
    #[tool(annotations(
        read_only_hint = false,
        idempotent_hint = false,
        destructive_hint = true
    ))]
    async fn record(&self, Parameters(args): Parameters<RecordArgs>) -> CallToolResult {
        // A blocking write is fine here: one short line to a local file.
        let appended = File::options()
            .create(true)
            .append(true)
            .open(&args.path)
            .and_then(|mut file| file.write_all(format!("{}\n", args.text).as_bytes()));
        match appended {
            Ok(()) => CallToolResult::success(vec![ContentBlock::text("recorded")]),
            // A bad path is the tool failing, not the protocol.
            Err(e) => {
                CallToolResult::error(vec![ContentBlock::text(format!("cannot append: {e}"))])
            }
        }
    }

    /// Return a text, a 1x1 red PNG and an embedded text resource.
    #[tool(annotations(read_only_hint = true))]
    async fn picture(&self) -> CallToolResult {
        CallToolResult::success(vec![
            ContentBlock::text("a red pixel"),
            ContentBlock::image(RED_PIXEL_PNG, "image/png"),
            // `embedded_text` sets the mime type to `text/plain`.
            ContentBlock::embedded_text("fixture://note.txt", "an embedded note"),
        ])
    }

    /// Do nothing; has no annotations, to test how clients treat the defaults.
    #[tool]
    async fn idle(&self) -> String {
        "idle".to_string()
    }
}

#[tool_handler]
impl ServerHandler for Fixture {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("keel-fixture", "1.0.0"))
    }

    /// Dispatches through the tool router, logging around every call in one
    /// place so the tools themselves stay free of bookkeeping.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        let cancellation = context.ct.clone();
        self.log.event("call", &name);
        let result = self
            .tool_router
            .call(ToolCallContext::new(self, request, context))
            .await;
        if cancellation.is_cancelled() {
            self.log.event("cancelled", &name);
        } else if result.is_ok() {
            // Protocol errors (unknown tool, bad arguments) are not a normal
            // return, so they get no `done` line.
            self.log.event("done", &name);
        }
        result
    }
}

/// The command line: `--http ADDR` selects HTTP, otherwise stdio.
#[derive(Default)]
struct Args {
    http: Option<String>,
    required_header: Option<(HeaderName, HeaderValue)>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args::default();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--http" => parsed.http = Some(value()?),
            "--require-header" => {
                let spec = value()?;
                let (name, val) = spec
                    .split_once('=')
                    .ok_or_else(|| format!("--require-header wants NAME=VALUE, got {spec:?}"))?;
                let name = HeaderName::try_from(name)
                    .map_err(|e| format!("bad header name {name:?}: {e}"))?;
                let val = HeaderValue::try_from(val)
                    .map_err(|e| format!("bad header value {val:?}: {e}"))?;
                parsed.required_header = Some((name, val));
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    // Silently ignoring the header on stdio would let a test believe it
    // checks authentication when it does not.
    if parsed.http.is_none() && parsed.required_header.is_some() {
        return Err("--require-header only applies with --http".into());
    }
    Ok(parsed)
}

async fn serve_stdio(log: Arc<EventLog>) -> Result<(), BoxError> {
    Fixture::new(log.clone())
        .serve(stdio())
        .await?
        .waiting()
        .await?;
    // The client closed the connection (Keel shut the server down, or exited).
    log.event("closed", "stdio");
    Ok(())
}

async fn serve_http(
    addr: &str,
    required_header: Option<(HeaderName, HeaderValue)>,
    log: Arc<EventLog>,
) -> Result<(), BoxError> {
    // The fixture only ever runs inside tests, so the DNS-rebinding guard
    // (Host allow-list) is off: whatever address the test binds, the printed
    // URL must work.
    let config = StreamableHttpServerConfig::default().disable_allowed_hosts();
    let service = StreamableHttpService::new(
        move || Ok(Fixture::new(log.clone())),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let mut router = axum::Router::new().nest_service("/mcp", service);
    if let Some(header) = required_header {
        router = router.layer(middleware::from_fn_with_state(header, require_header));
    }

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    // Tests read this line to learn the port, so it must be complete and
    // flushed before they try to connect.
    println!("listening on http://{bound}/mcp");
    std::io::stdout().flush()?;

    axum::serve(listener, router).await?;
    Ok(())
}

/// Refuses (401) any request whose header `name` is not exactly `value`.
async fn require_header(
    State((name, value)): State<(HeaderName, HeaderValue)>,
    request: Request,
    next: Next,
) -> Response {
    if request.headers().get(&name) == Some(&value) {
        next.run(request).await
    } else {
        StatusCode::UNAUTHORIZED.into_response()
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // Bad arguments or an unusable FIXTURE_LOG are a broken test setup.
    let setup = parse_args(std::env::args().skip(1))
        .and_then(|args| Ok((args, Arc::new(EventLog::from_env()?))));
    let (args, log) = match setup {
        Ok(setup) => setup,
        Err(message) => {
            eprintln!("keel-mcp-fixture: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match args.http {
        None => serve_stdio(log).await,
        Some(addr) => serve_http(&addr, args.required_header, log).await,
    };
    if let Err(e) = result {
        eprintln!("keel-mcp-fixture: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
