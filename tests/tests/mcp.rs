//! MCP tool servers end to end: `keel serve` with `[mcp.NAME]` servers (the repository's
//! fixture, `keel-mcp-fixture`, over stdio and over streamable HTTP), a fake
//! OpenAI-compatible model calling their tools, and the fixture's log of what it ran.

use std::path::Path;
use std::time::Duration;

use keel_client::Client;
use keel_client::schema::api::{CreateSession, McpState, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::SessionId;
use keel_client::schema::types::{Effect, Outcome, ToolContent};
use keel_tests::Server;
use keel_tests::fake_provider::{Canned, FakeProvider};
use serde_json::{Value, json};

const FIXTURE: &str = env!("CARGO_BIN_EXE_keel-mcp-fixture");

use keel_tests::{PATIENCE, read_until};

/// `keel.toml` for the fake model and the fixture over stdio, logging to `log`.
fn config(fake: &FakeProvider, log: &Path, extra: &str) -> String {
    format!(
        r#"
default_model = "local/m"
[provider.local]
kind = "openai"
base_url = "{}/v1"
[mcp.fixture]
command = "{FIXTURE}"
env = {{ FIXTURE_LOG = "{}" }}
timeout_ms = 20000
{extra}"#,
        fake.base_url,
        log.display()
    )
}

/// Rules that let every call run unasked.
const TRUSTING: &str = "[agent.build.permissions]\n\"*\" = \"allow\"\n";

/// `keel serve` with [`config`] and `args`, and a client of it.
fn start(fake: &FakeProvider, log: &Path, extra: &str, args: &[&str]) -> (Server, Client) {
    let mut all = vec!["--config", "keel.toml"];
    all.extend_from_slice(args);
    let server = Server::start_with(&[("keel.toml", &config(fake, log, extra))], &all);
    let client = Client::new(&server.base_url).unwrap();
    (server, client)
}

/// Waits until the fixture has logged `line`.
async fn until_logged(log: &Path, line: &str) {
    tokio::time::timeout(PATIENCE, async {
        while !fixture_log(log).iter().any(|l| l == line) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the fixture never logged `{line}`"));
}

fn call(tool: &str, input: Value) -> Canned {
    Canned::chat("", &[(tool, input)])
}

fn settled(envelope: &Envelope) -> bool {
    matches!(envelope.event, DurableEvent::ExecutionSettled(_))
}

async fn session(client: &Client, server: &Server) -> SessionId {
    let body = CreateSession {
        directory: Some(server.directory().to_string_lossy().into_owned()),
        ..CreateSession::default()
    };
    client.create_session(&body).await.unwrap().id
}

/// Prompts `session` and reads its log until the execution settles.
async fn run(client: &Client, session: SessionId, text: &str) -> Vec<Envelope> {
    let after = client.get_session(session).await.unwrap().last_seq;
    let mut log = client.session_log(session, after);
    client
        .prompt(session, &PromptRequest::text(text))
        .await
        .unwrap();
    read_until(&mut log, settled).await
}

/// The fixture's log: one line per call started, finished or cancelled.
fn fixture_log(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn results(events: &[Envelope]) -> Vec<&DurableEvent> {
    events
        .iter()
        .map(|e| &e.event)
        .filter(|e| {
            matches!(
                e,
                DurableEvent::ToolSuccess(_) | DurableEvent::ToolFailed(_)
            )
        })
        .collect()
}

#[tokio::test]
async fn a_stdio_server_lists_its_tools_with_their_effects_and_a_call_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_echo", json!({ "text": "hi" })),
        Canned::chat("Echoed.", &[]),
    ])
    .await;
    let (server, client) = start(&fake, &log, "", &[]);
    // Not started before its first use.
    let before = client.mcp_servers().await.unwrap().items;
    assert_eq!(before[0].state, McpState::Idle);

    let session = session(&client, &server).await;
    let events = run(&client, session, "say hi").await;
    let results = results(&events);
    assert!(
        matches!(results[..], [DurableEvent::ToolSuccess(s)]
            if s.content == [ToolContent::Text { text: "echo: hi".into() }]),
        "{results:?}"
    );
    assert_eq!(fixture_log(&log), ["call echo", "done echo"]);

    // The model was offered the server's tools, named after it, with their schemas.
    let first = &fake.received()[0].body;
    let offered: Vec<&Value> = first["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["function"]["name"] == "fixture_add")
        .collect();
    assert_eq!(offered.len(), 1);
    assert!(offered[0]["function"]["parameters"]["properties"]["a"].is_object());

    let servers = client.mcp_servers().await.unwrap().items;
    assert_eq!(servers[0].name, "fixture");
    assert_eq!(servers[0].transport, "stdio");
    assert_eq!(servers[0].state, McpState::Ready);
    let effect = |name: &str| {
        servers[0]
            .tools
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.effect)
    };
    assert_eq!(effect("fixture_echo"), Some(Effect::Read));
    assert_eq!(effect("fixture_add"), Some(Effect::Write));
    // Not annotated: not known to be read-only.
    assert_eq!(effect("fixture_idle"), Some(Effect::Write));
}

#[tokio::test]
async fn an_mcp_tool_not_known_to_be_read_only_asks_by_default_and_one_that_is_runs() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![Canned::chat(
        "",
        &[
            ("fixture_echo", json!({ "text": "a" })),
            ("fixture_add", json!({ "a": 2, "b": 3 })),
        ],
    )])
    .await;
    // With no permission rules at all: Keel's defaults.
    let (server, client) = start(&fake, &log, "", &[]);
    let session = session(&client, &server).await;
    let mut stream = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("go"))
        .await
        .unwrap();
    let events = read_until(&mut stream, |e| {
        matches!(e.event, DurableEvent::PermissionRequested(_))
    })
    .await;
    let DurableEvent::PermissionRequested(asked) = &events.last().unwrap().event else {
        unreachable!()
    };
    assert_eq!(asked.tool, "fixture_add");
    let status = client.session_status(session).await.unwrap();
    assert_eq!(status.awaiting_replies, 1);
    // `echo` ran without asking; `add` did not run.
    let log = fixture_log(&log);
    assert!(log.contains(&"done echo".to_owned()), "{log:?}");
    assert!(!log.iter().any(|l| l.ends_with(" add")), "{log:?}");
}

#[tokio::test]
async fn an_error_result_fails_the_call_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_fail", json!({})),
        Canned::chat("It failed; moving on.", &[]),
    ])
    .await;
    let (server, client) = start(&fake, &log, "", &[]);
    let session = session(&client, &server).await;
    let events = run(&client, session, "try it").await;
    let results = results(&events);
    assert!(
        matches!(results[..], [DurableEvent::ToolFailed(f)]
            if f.error.kind == "tool.error" && f.error.message == "it failed on purpose"),
        "{results:?}"
    );
    assert!(matches!(&events.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded));
}

#[tokio::test]
async fn a_server_that_dies_mid_call_fails_the_call_and_is_started_again_on_a_later_use() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_crash", json!({})),
        // Called again at once, during the server's backoff.
        call("fixture_echo", json!({ "text": "too soon" })),
        Canned::chat("The server died.", &[]),
    ])
    .await;
    let (server, client) = start(&fake, &log, TRUSTING, &[]);
    let session = session(&client, &server).await;
    let events = run(&client, session, "crash it").await;
    let ended = results(&events);
    assert!(
        matches!(ended[..], [DurableEvent::ToolFailed(crash), DurableEvent::ToolFailed(soon)]
            if crash.error.kind == "tool.unavailable" && crash.error.message.contains("fixture")
                && soon.error.kind == "tool.unavailable"
                && soon.error.message.contains("exited during a call")),
        "{ended:?}"
    );
    let servers = client.mcp_servers().await.unwrap().items;
    assert_eq!(servers[0].state, McpState::Failed, "{servers:?}");
    assert!(servers[0].error.is_some());

    // After its backoff (a second), the next use starts it again.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    fake.push([
        call("fixture_echo", json!({ "text": "back" })),
        Canned::chat("Back.", &[]),
    ]);
    let events = run(&client, session, "again").await;
    assert!(
        matches!(results(&events)[..], [DurableEvent::ToolSuccess(_)]),
        "{events:?}"
    );
    assert_eq!(fixture_log(&log), ["call crash", "call echo", "done echo"]);
}

#[tokio::test]
async fn a_slow_call_interrupted_by_the_user_is_cancelled_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![call("fixture_slow", json!({ "ms": 30_000 }))]).await;
    let (server, client) = start(&fake, &log, TRUSTING, &[]);
    let session = session(&client, &server).await;
    let mut stream = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("take your time"))
        .await
        .unwrap();
    read_until(&mut stream, |e| {
        matches!(e.event, DurableEvent::ToolCalled(_))
    })
    .await;
    // The request reached the server before the interrupt.
    until_logged(&log, "call slow").await;
    assert!(client.interrupt(session).await.unwrap().interrupted);
    // The step ends interrupted; its call (resolved by `step.interrupted`) never
    // succeeded.
    let events = read_until(&mut stream, settled).await;
    assert!(results(&events).is_empty(), "{events:?}");
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.event, DurableEvent::StepInterrupted(_))),
        "{events:?}"
    );
    // The server heard `notifications/cancelled` and stopped the call.
    until_logged(&log, "cancelled slow").await;
    assert!(!fixture_log(&log).contains(&"done slow".to_owned()));
}

#[tokio::test]
async fn a_streamable_http_server_is_reached_with_headers_from_the_environment() {
    let home = std::env::var("HOME").expect("HOME is set");
    let (mut fixture, url) = http_fixture(Some(&format!("X-Home={home}")), None);
    let fake = FakeProvider::start(vec![
        call("remote_add", json!({ "a": 2, "b": 3 })),
        call("remote_picture", json!({})),
        Canned::chat("Done.", &[]),
    ])
    .await;
    let config = format!(
        r#"
default_model = "local/m"
[provider.local]
kind = "openai"
base_url = "{}/v1"
[mcp.remote]
url = "{url}"
headers = {{ X-Home = "${{HOME}}" }}
start = "serve"
[agent.build.permissions]
"remote_*" = "allow"
"#,
        fake.base_url
    );
    let server = Server::start_with(&[("keel.toml", &config)], &["--config", "keel.toml"]);
    let client = Client::new(&server.base_url).unwrap();
    let session = session(&client, &server).await;
    let events = run(&client, session, "add and draw").await;
    let results = results(&events);
    let [
        DurableEvent::ToolSuccess(sum),
        DurableEvent::ToolSuccess(picture),
    ] = results[..]
    else {
        panic!("{results:?}")
    };
    assert_eq!(sum.content, [ToolContent::Text { text: "5".into() }]);
    // Text, the image (stored once, in the content), and the embedded resource's text.
    assert!(
        matches!(&picture.content[..], [
        ToolContent::Text { .. },
        ToolContent::Media { mime, .. },
        ToolContent::Text { text },
    ] if mime == "image/png" && text.contains("an embedded note")),
        "{:?}",
        picture.content
    );
    assert!(!picture.structured.to_string().contains("iVBOR"));
    let servers = client.mcp_servers().await.unwrap().items;
    assert_eq!(servers[0].transport, "http");
    drop(fixture.kill());
    drop(fixture.wait());
}

/// Runs a session whose model calls `tool` with `input`, SIGKILLs Keel once the fixture
/// has received the call, restarts it and reads the log until an execution succeeds.
/// Returns the client of the restarted server, the session and its events.
async fn killed_mid_call(
    fake: &FakeProvider,
    log: &Path,
    tool: &str,
) -> (Server, Client, SessionId, Vec<Envelope>) {
    let (mut server, client) = start(fake, log, TRUSTING, &["--lease-ms", "2000"]);
    let session = session(&client, &server).await;
    client
        .prompt(session, &PromptRequest::text("go"))
        .await
        .unwrap();
    until_logged(log, &format!("call {tool}")).await;
    server.kill_and_restart();
    let client = Client::new(&server.base_url).unwrap();
    let mut stream = client.session_log(session, 0);
    let events = read_until(
        &mut stream,
        |e| matches!(&e.event, DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded),
    )
    .await;
    (server, client, session, events)
}

#[tokio::test]
async fn a_call_cut_by_a_keel_kill_is_reported_interrupted_after_recovery_and_never_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_slow", json!({ "ms": 30_000 })),
        Canned::chat("It was cut off.", &[]),
    ])
    .await;
    let (_server, client, session, events) = killed_mid_call(&fake, &log, "slow").await;
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.event, DurableEvent::StepRecovered(_)))
    );
    // `step.recovered` resolves the cut call as interrupted by the crash; it never
    // succeeded, and the model was told and answered.
    assert!(results(&events).is_empty(), "{events:?}");
    let messages = serde_json::to_string(&client.messages(session).await.unwrap()).unwrap();
    assert!(messages.contains("tool.interrupted-by-crash"), "{messages}");
    // The call went to the server once; recovery did not send it again.
    let calls = fixture_log(&log)
        .iter()
        .filter(|l| *l == "call slow")
        .count();
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn an_idempotent_call_cut_by_a_keel_kill_runs_again_once_after_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_add", json!({ "a": 2, "b": 3, "ms": 1500 })),
        Canned::chat("The sum is 5.", &[]),
    ])
    .await;
    let (_server, _, _, events) = killed_mid_call(&fake, &log, "add").await;
    // Recovery spared the call, the continuation ran it again, and the model saw 5.
    let spared = events.iter().find_map(|e| match &e.event {
        DurableEvent::StepRecovered(r) => Some(r.rerun.clone()),
        _ => None,
    });
    assert_eq!(spared.map(|r| r.len()), Some(1), "{events:?}");
    assert!(
        matches!(results(&events)[..], [DurableEvent::ToolSuccess(s)]
            if s.content == [ToolContent::Text { text: "5".into() }]),
        "{events:?}"
    );
    let fixture = fixture_log(&log);
    let calls = fixture.iter().filter(|l| *l == "call add").count();
    assert_eq!(calls, 2, "{fixture:?}");
    assert!(
        fake.received()
            .last()
            .unwrap()
            .body
            .to_string()
            .contains("\"5\"")
    );
}

/// The `[mcp.…]` example of docs/tools.md, read from the file.
fn documented_servers() -> String {
    let docs = std::fs::read_to_string(keel_tests::workspace_root().join("docs/tools.md")).unwrap();
    let start = docs
        .find("[mcp.files]")
        .expect("docs/tools.md holds the MCP example");
    let block = &docs[start..];
    block[..block.find("```").expect("the example's block ends")].to_owned()
}

/// Starts the fixture over streamable HTTP, requiring `header` (`NAME=VALUE`) if given
/// and logging to `log` if given; returns the process and its URL.
fn http_fixture(header: Option<&str>, log: Option<&Path>) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut command = std::process::Command::new(FIXTURE);
    command.args(["--http", "127.0.0.1:0"]);
    if let Some(header) = header {
        command.args(["--require-header", header]);
    }
    if let Some(log) = log {
        command.env("FIXTURE_LOG", log);
    }
    let mut fixture = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(fixture.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    (fixture, url)
}

#[tokio::test]
async fn the_documented_servers_run_with_the_fixture_in_place_of_the_real_ones() {
    // The example as documented, but for where the servers are: the fixture stands in for
    // the filesystem server and for the HTTP one, which wants the documented bearer
    // token from Keel's environment.
    let (mut remote, url) = http_fixture(Some("Authorization=Bearer from-the-environment"), None);
    let example = documented_servers();
    let mut config = String::new();
    for line in example.lines() {
        let line = match line.split_whitespace().next() {
            Some("command") => format!("command = \"{FIXTURE}\""),
            Some("args") => "args = []".to_owned(),
            Some("url") => format!("url = \"{url}\""),
            _ => line.to_owned(),
        };
        config.push_str(&line);
        config.push('\n');
    }
    let fake = FakeProvider::start(vec![
        call("files_echo", json!({ "text": "documented" })),
        Canned::chat("Done.", &[]),
    ])
    .await;
    let config = format!(
        "default_model = \"local/m\"\n[provider.local]\nkind = \"openai\"\nbase_url = \"{}/v1\"\n{config}",
        fake.base_url
    );
    let server = Server::start_with_env(
        &[("keel.toml", &config)],
        &["--config", "keel.toml"],
        &[("GITHUB_TOKEN", "from-the-environment")],
    );
    let client = Client::new(&server.base_url).unwrap();
    let session = session(&client, &server).await;
    let events = run(&client, session, "echo something").await;
    assert!(
        matches!(results(&events)[..], [DurableEvent::ToolSuccess(s)]
            if s.content == [ToolContent::Text { text: "echo: documented".into() }]),
        "{events:?}"
    );
    let servers = client.mcp_servers().await.unwrap().items;
    let names: Vec<&str> = servers.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["files", "github"]);
    // `github` started with Keel (`start = "serve"`) and took the token from the
    // environment; its `tools` filter (`list_*`, `get_issue`) matches none of the
    // fixture's tools, so it offers none.
    assert_eq!(servers[1].state, McpState::Ready, "{servers:?}");
    assert!(servers[1].tools.is_empty(), "{servers:?}");
    assert!(servers[0].tools.iter().any(|t| t.name == "files_echo"));
    drop(remote.kill());
    drop(remote.wait());
}

#[tokio::test]
async fn a_server_that_cannot_start_is_reported_failed_and_the_session_goes_on() {
    let fake = FakeProvider::start(vec![Canned::chat("Hello without tools.", &[])]).await;
    let config = format!(
        "default_model = \"local/m\"\n[provider.local]\nkind = \"openai\"\n\
         base_url = \"{}/v1\"\n[mcp.broken]\ncommand = \"/nonexistent/mcp-server\"\n",
        fake.base_url
    );
    let server = Server::start_with(&[("keel.toml", &config)], &["--config", "keel.toml"]);
    let client = Client::new(&server.base_url).unwrap();
    let session = session(&client, &server).await;
    let events = run(&client, session, "hello").await;
    assert!(matches!(&events.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded));
    let servers = client.mcp_servers().await.unwrap().items;
    assert_eq!(servers[0].state, McpState::Failed);
    let error = servers[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("could not be started"), "{error}");
}

#[tokio::test]
async fn over_streamable_http_an_error_result_fails_the_call_and_an_interrupt_cancels_at_the_server()
 {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let (mut fixture, url) = http_fixture(None, Some(&log));
    let fake = FakeProvider::start(vec![
        call("remote_fail", json!({})),
        call("remote_slow", json!({ "ms": 30_000 })),
    ])
    .await;
    let config = format!(
        "default_model = \"local/m\"\n[provider.local]\nkind = \"openai\"\n\
         base_url = \"{}/v1\"\n[mcp.remote]\nurl = \"{url}\"\n{TRUSTING}",
        fake.base_url
    );
    let server = Server::start_with(&[("keel.toml", &config)], &["--config", "keel.toml"]);
    let client = Client::new(&server.base_url).unwrap();
    let session = session(&client, &server).await;
    let mut stream = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("fail, then wait"))
        .await
        .unwrap();
    until_logged(&log, "call slow").await;
    assert!(client.interrupt(session).await.unwrap().interrupted);
    let events = read_until(&mut stream, settled).await;
    assert!(
        matches!(results(&events)[..], [DurableEvent::ToolFailed(f)]
            if f.error.kind == "tool.error" && f.error.message == "it failed on purpose"),
        "{events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.event, DurableEvent::StepInterrupted(_)))
    );
    until_logged(&log, "cancelled slow").await;
    drop(fixture.kill());
    drop(fixture.wait());
}

#[tokio::test]
async fn a_stdio_server_is_closed_when_keel_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_echo", json!({ "text": "before stopping" })),
        Canned::chat("Echoed.", &[]),
    ])
    .await;
    let (server, client) = start(&fake, &log, "", &[]);
    let session = session(&client, &server).await;
    run(&client, session, "echo").await;
    assert!(!fixture_log(&log).contains(&"closed stdio".to_owned()));
    server.signal(libc::SIGTERM);
    until_logged(&log, "closed stdio").await;
}

#[tokio::test]
async fn a_call_the_server_never_answers_times_out_and_is_cancelled_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("fixture.log");
    let fake = FakeProvider::start(vec![
        call("fixture_slow", json!({ "ms": 60_000 })),
        Canned::chat("It never answered.", &[]),
    ])
    .await;
    // A stalled server: the call outlives the server's `timeout_ms`.
    let config = config(&fake, &log, TRUSTING).replace("timeout_ms = 20000", "timeout_ms = 2000");
    let server = Server::start_with(&[("keel.toml", &config)], &["--config", "keel.toml"]);
    let client = Client::new(&server.base_url).unwrap();
    let session = session(&client, &server).await;
    let events = run(&client, session, "wait for it").await;
    assert!(
        matches!(results(&events)[..], [DurableEvent::ToolFailed(f)] if f.error.kind == "tool.timeout"),
        "{events:?}"
    );
    assert!(matches!(&events.last().unwrap().event,
        DurableEvent::ExecutionSettled(s) if s.outcome == Outcome::Succeeded));
    // Giving up sent `notifications/cancelled`: the server stopped the call.
    until_logged(&log, "cancelled slow").await;
}
