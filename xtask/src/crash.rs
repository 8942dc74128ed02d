//! `cargo xtask crash [--iterations N] [--seed S] [--sessions M]`: the proof that a killed
//! Keel loses nothing.
//!
//! Starts the real `keel serve` on a temporary SQLite database with a scripted model
//! whose turns stream text, read files, write files, run `bash` commands that record
//! every real execution (by `KEEL_CALL_ID`) in a side file of their session directory
//! (the commands run sandboxed, as by default), and call two tools of an MCP
//! server (the repository's `keel-mcp-fixture` over stdio): `echo`, read-only, and
//! `record`, which appends to a file and is neither read-only nor idempotent. Clients prompt (queued and
//! steering, with client-chosen ids) and interrupt many sessions concurrently while the
//! server is SIGKILLed at random moments and restarted on the same database. Prompts whose
//! answer was lost to a kill are retried with the same id. After the last restart it waits
//! until every session is idle and checks, from the logs and the side file:
//! - every admitted input was promoted or cancelled, exactly once, and every prompt a
//!   client sent was admitted;
//! - no `bash` call ran twice, and every call that ran was recorded before it ran;
//! - every step has exactly one terminal event, every execution exactly one settlement,
//!   every tool call at most one result (none only when its step was interrupted or
//!   recovered, which fails it);
//! - each session's seq is gapless;
//! - the MCP server received no more `record` calls than were durably called (a call cut
//!   by a kill is never sent again), and finished at least as many as succeeded;
//! - no claim is left behind.
//!
//! It prints `N kills, M sessions, V violations` and fails on any violation, keeping the
//! directory (database, server log, side file) for inspection.
//!
//! With `--postgres` the run uses a fresh database on a PostgreSQL server
//! (`KEEL_TEST_POSTGRES_URL`, or the local one), and with `--nodes K` it runs K nodes on
//! it: clients talk to any of them, each kill takes a random node down and restarts it,
//! and the survivors take the dead node's sessions over.
//!
//! With `--permissions`, `bash` and `write` ask for permission, and clients reply to the
//! requests they find in the logs (`once`, `always` or `reject`, through any node) while
//! the kills go on; a reply whose answer a kill swallowed is sent again. The run then
//! also checks that every acknowledged reply is in the log, that no request was answered
//! twice, that no call ran without an allowing reply or after a rejection, and that no
//! session is left waiting for a person.

mod check;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use keel_client::schema::api::{CreateSession, LogItem, PermissionReply, PromptRequest};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::{InputId, RequestId, SessionId};
use keel_client::schema::types::{Decision, Delivery, Part};
use keel_client::{Client, LogOptions};
use keel_tests::PostgresDb;

const USAGE: &str = "usage: cargo xtask crash [--iterations N] [--seed S] [--sessions M] \
    [--postgres] [--nodes K] [--permissions]";

/// The PostgreSQL server `--postgres` uses unless `KEEL_TEST_POSTGRES_URL` names another.
const POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The lease the server runs with: short, so a killed process's claims run out quickly.
const LEASE_MS: &str = "1000";

/// The tools that ask for permission with `--permissions`.
const ASKING: &[&str] = &["bash", "write"];

/// How long the sessions may take to become idle after the last restart.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(180);

struct Options {
    iterations: u32,
    seed: u64,
    sessions: usize,
    /// The PostgreSQL server to create the run's database on; SQLite otherwise.
    postgres: Option<String>,
    nodes: usize,
    /// Tools ask for permission, and clients reply around the kills.
    permissions: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        iterations: 10,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        sessions: 6,
        postgres: None,
        nodes: 1,
        permissions: false,
    };
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        if flag == "--postgres" {
            let url = std::env::var("KEEL_TEST_POSTGRES_URL").unwrap_or_else(|_| POSTGRES.into());
            options.postgres = Some(url);
            continue;
        }
        if flag == "--permissions" {
            options.permissions = true;
            continue;
        }
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: std::num::ParseIntError| anyhow::anyhow!("{flag} {value}: {e}\n{USAGE}");
        match flag.as_str() {
            "--iterations" => options.iterations = value.parse().map_err(bad)?,
            "--seed" => options.seed = value.parse().map_err(bad)?,
            "--sessions" => options.sessions = value.parse().map_err(bad)?,
            "--nodes" => options.nodes = value.parse().map_err(bad)?,
            _ => bail!("unknown flag {flag}\n{USAGE}"),
        }
    }
    if options.sessions == 0 {
        bail!("--sessions must be at least 1");
    }
    if options.nodes == 0 || (options.nodes > 1 && options.postgres.is_none()) {
        bail!("--nodes must be at least 1, and more than one needs --postgres\n{USAGE}");
    }
    Ok(options)
}

pub fn run(root: &Path, args: &[String]) -> Result<()> {
    let options = parse(args)?;
    println!(
        "crash: {} iterations, {} sessions, {} node(s) on {}{}, seed {}",
        options.iterations,
        options.sessions,
        options.nodes,
        if options.postgres.is_some() {
            "PostgreSQL"
        } else {
            "SQLite"
        },
        if options.permissions {
            ", tools asking for permission"
        } else {
            ""
        },
        options.seed
    );
    let built = build(root)?;
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    // The run restarts its own copies: a build in the meantime replaces cargo's.
    for (name, path) in &built {
        std::fs::copy(path, dir.path().join(name))
            .with_context(|| format!("copying {} into the run's directory", path.display()))?;
    }
    let binary = dir.path().join("keel");
    let database = options
        .postgres
        .as_deref()
        .map(|server| PostgresDb::create(server, "keel_crash"));
    let db = database
        .as_ref()
        .map_or_else(|| "sqlite://keel.db".to_owned(), |d| d.url.clone());
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let outcome = runtime.block_on(campaign(&binary, dir.path(), &db, &options));
    if outcome.as_ref().map_or(true, |v| !v.is_empty())
        && let Some(database) = database
    {
        eprintln!("the database is kept: {}", database.keep());
    }
    match outcome {
        Ok(violations) if violations.is_empty() => Ok(()),
        Ok(violations) => {
            for violation in &violations {
                eprintln!("violation: {violation}");
            }
            let kept = dir.keep();
            bail!(
                "{} violations (seed {}); the database, server log and side file are in {}",
                violations.len(),
                options.seed,
                kept.display()
            )
        }
        Err(e) => {
            let kept = dir.keep();
            Err(e.context(format!(
                "the crash run could not finish (seed {}); its files are in {}",
                options.seed,
                kept.display()
            )))
        }
    }
}

/// The MCP server the model's tools come from, beside `keel` in the run's directory.
const FIXTURE: &str = "keel-mcp-fixture";

/// Builds `keel` and the MCP fixture with the cargo running xtask; returns each
/// executable by name.
fn build(root: &Path) -> Result<Vec<(&'static str, PathBuf)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "--quiet",
            "--message-format=json",
            "--package",
            "keel-core",
            "--package",
            "keel-tests",
            "--bin",
            "keel",
            "--bin",
            FIXTURE,
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo build")?;
    if !output.status.success() {
        bail!("building keel failed");
    }
    let messages: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    ["keel", FIXTURE]
        .into_iter()
        .map(|name| {
            messages
                .iter()
                .filter(|message| message["target"]["name"] == name)
                .find_map(|message| message["executable"].as_str().map(PathBuf::from))
                .map(|path| (name, path))
                .with_context(|| format!("cargo did not report the {name} executable"))
        })
        .collect()
}

/// The file each session's `bash` calls record their runs in, in its directory.
const SIDE_FILE: &str = "executions.log";

/// How many times the script's round of turns repeats.
const ROUNDS: usize = 40;

/// The model's turns, in the order a session reaches them (the scripted model plays the
/// response whose index is the number of assistant turns so far; the last repeats).
fn script(records: &Path) -> serde_json::Value {
    // In the session directory: the only place a sandboxed command may write.
    let record = format!("echo \"$KEEL_CALL_ID\" >> {SIDE_FILE}; sleep 0.1");
    let text = |t: &str| serde_json::json!({ "type": "text", "text": t, "chunks": 4 });
    let delay = |ms: u64| serde_json::json!({ "type": "delay", "ms": ms });
    let call = |name: &str, input: serde_json::Value| serde_json::json!({ "type": "tool_call", "name": name, "input": input });
    let bash = call("bash", serde_json::json!({ "command": record }));
    let read = call("read", serde_json::json!({ "path": "notes.txt" }));
    let write = call(
        "write",
        serde_json::json!({ "path": "out.txt", "content": "written by the model\n" }),
    );
    let echo = call("fixture_echo", serde_json::json!({ "text": "hello" }));
    let record = call(
        "fixture_record",
        serde_json::json!({ "path": records.display().to_string(), "text": "recorded" }),
    );
    let round = vec![
        vec![text("Reading the notes."), read.clone()],
        vec![text("Recording a run."), delay(30), bash.clone()],
        vec![text("Writing a file."), write.clone()],
        vec![text("Done with that."), delay(50), text("Anything else?")],
        vec![text("Two things at once."), bash.clone(), read.clone()],
        vec![delay(40), text("Both finished.")],
        vec![text("Once more."), bash.clone(), write],
        vec![text("All recorded."), delay(30), text("Ready.")],
        vec![bash],
        vec![text("Idle again.")],
        vec![text("Asking the MCP server."), echo, record],
        vec![text("It answered.")],
    ];
    // The round, again and again, so sessions keep calling tools however long the run.
    let turns: Vec<_> = std::iter::repeat_n(round, ROUNDS).flatten().collect();
    serde_json::json!({
        "responses": turns
            .into_iter()
            .map(|items| serde_json::json!({ "items": items }))
            .collect::<Vec<_>>()
    })
}

/// A running `keel serve`.
struct Keel {
    child: Child,
    client: Client,
}

impl Keel {
    /// Starts node `node` (its log is `keel.log`, or `keel-N.log` among several).
    fn start(binary: &Path, dir: &Path, db: &str, node: Option<usize>) -> Result<Self> {
        let log_name = node.map_or_else(|| "keel.log".to_owned(), |n| format!("keel-{n}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(log_name))
            .context("opening the server log")?;
        let mut child = Command::new(binary)
            .args(["serve", "--listen", "127.0.0.1:0", "--config", "keel.toml"])
            .args(["--db", db, "--lease-ms", LEASE_MS])
            .current_dir(dir)
            .env_remove("KEEL_TOKEN")
            .env_remove("KEEL_CONFIG")
            .env_remove("KEEL_DB")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting keel")?;
        let stdout = child.stdout.take().context("keel's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading where keel listens")?;
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .with_context(|| format!("keel did not say where it listens: {line:?}"))?;
        Ok(Self {
            client: Client::new(url)?,
            child,
        })
    }

    fn kill(mut self) -> Result<()> {
        self.child.kill().context("killing keel")?;
        self.child.wait().context("reaping keel")?;
        Ok(())
    }
}

/// splitmix64: a small deterministic generator for the run's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A prompt a client sent, and whether Keel's answer arrived.
#[derive(Debug, Clone)]
struct Sent {
    session: SessionId,
    request: PromptRequest,
    acknowledged: bool,
}

type Ledger = Arc<Mutex<Vec<Sent>>>;

/// A reply to a permission request a client sent, and how Keel answered it.
#[derive(Debug, Clone)]
struct Replied {
    session: SessionId,
    request: RequestId,
    decision: Decision,
    answer: Answer,
}

/// How Keel answered a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// No answer (the server was killed, or not listening yet).
    Lost,
    /// 2xx: the reply is durable.
    Accepted,
    /// 404 or 409: already answered, or settled with its step; nothing changed.
    Refused,
}

type Replies = Arc<Mutex<Vec<Replied>>>;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Pending inputs a session may have before clients stop prompting it.
const MAX_BACKLOG: u32 = 8;

/// The session's pending inputs; none while the server cannot answer.
async fn backlog(client: &Client, session: SessionId) -> u32 {
    client
        .session_status(session)
        .await
        .map_or(0, |status| status.pending_inputs)
}

/// Clients acting on the sessions until `stop`: prompts (queued or steering) and
/// interrupts, a few milliseconds apart.
async fn act(
    clients: Vec<Client>,
    sessions: Vec<SessionId>,
    ledgers: (Ledger, Option<Replies>),
    mut rng: Rng,
    stop: Arc<AtomicBool>,
) {
    let (ledger, replies) = ledgers;
    while !stop.load(Ordering::SeqCst) {
        let session = sessions[rng.below(sessions.len() as u64) as usize];
        // Any node admits and interrupts; the claim decides which one runs the session.
        let client = &clients[rng.below(clients.len() as u64) as usize];
        match rng.below(10) {
            // Clients wait for the session to catch up, so the backlog (and the final
            // wait for idle) stays bounded however long the campaign runs.
            0..=5 if backlog(client, session).await >= MAX_BACKLOG => {}
            0..=5 => {
                let delivery = if rng.below(3) == 0 {
                    Delivery::Steer
                } else {
                    Delivery::Queue
                };
                let request = PromptRequest {
                    id: Some(InputId::new().to_string()),
                    parts: vec![Part::Text {
                        text: format!("task {}", rng.next() % 10_000),
                    }],
                    delivery: Some(delivery),
                    request_execution: None,
                };
                let index = {
                    let mut ledger = lock(&ledger);
                    ledger.push(Sent {
                        session,
                        request: request.clone(),
                        acknowledged: false,
                    });
                    ledger.len() - 1
                };
                if client.prompt(session, &request).await.is_ok() {
                    lock(&ledger)[index].acknowledged = true;
                }
            }
            6 => {
                // Errors (the server is being killed) are part of the game.
                drop(client.interrupt(session).await);
            }
            7 | 8 => {
                if let Some(replies) = &replies {
                    let decision = match rng.below(10) {
                        0..=5 => Decision::Once,
                        6 => Decision::Always,
                        _ => Decision::Reject,
                    };
                    if let Ok(pending) = pending_requests(client, session).await
                        && let Some(&request) =
                            pending.get(rng.below(pending.len() as u64) as usize)
                    {
                        reply(client, replies, session, request, decision).await;
                    }
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(5 + rng.below(60))).await;
    }
}

async fn campaign(binary: &Path, dir: &Path, db: &str, options: &Options) -> Result<Vec<String>> {
    let (records, fixture_log) = (dir.join("mcp-records.txt"), dir.join("mcp.log"));
    std::fs::write(dir.join("script.json"), script(&records).to_string())?;
    let mut config = "default_model = \"crash/scripted\"\n[provider.crash]\nkind = \"scripted\"\n\
         script = \"script.json\"\n"
        .to_owned();
    config.push_str(&format!(
        "[mcp.fixture]\ncommand = \"{}\"\nenv = {{ FIXTURE_LOG = \"{}\" }}\n",
        dir.join(FIXTURE).display(),
        fixture_log.display()
    ));
    // Every tool runs unasked (Keel's default asks before a write), except with
    // `--permissions`, where the asking tools ask.
    config.push_str("[agent.build.permissions]\n\"*\" = \"allow\"\n");
    if options.permissions {
        for tool in ASKING {
            config.push_str(&format!("{tool} = \"ask\"\n"));
        }
    }
    std::fs::write(dir.join("keel.toml"), config)?;
    let replies: Option<Replies> = options.permissions.then(Replies::default);
    let mut rng = Rng(options.seed);
    let numbered = |n: usize| (options.nodes > 1).then_some(n);
    let mut nodes = (0..options.nodes)
        .map(|n| Keel::start(binary, dir, db, numbered(n)))
        .collect::<Result<Vec<_>>>()?;
    let mut sessions = Vec::new();
    for i in 0..options.sessions {
        let directory = dir.join("sessions").join(i.to_string());
        std::fs::create_dir_all(&directory)?;
        std::fs::write(
            directory.join("notes.txt"),
            format!("notes of session {i}\n"),
        )?;
        let session = nodes[i % nodes.len()]
            .client
            .create_session(&CreateSession {
                directory: Some(directory.display().to_string()),
                ..CreateSession::default()
            })
            .await?;
        sessions.push(session.id);
    }

    let ledger: Ledger = Arc::new(Mutex::new(Vec::new()));
    for iteration in 1..=options.iterations {
        retry_unacknowledged(&nodes[0].client, &ledger).await;
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<Client> = nodes.iter().map(|n| n.client.clone()).collect();
        let actors: Vec<_> = (0..3)
            .map(|_| {
                tokio::spawn(act(
                    clients.clone(),
                    sessions.clone(),
                    (ledger.clone(), replies.clone()),
                    Rng(rng.next()),
                    stop.clone(),
                ))
            })
            .collect();
        let alive = Duration::from_millis(100 + rng.below(1_400));
        tokio::time::sleep(alive).await;
        let victim = rng.below(nodes.len() as u64) as usize;
        let killed = nodes.remove(victim);
        killed.kill()?;
        stop.store(true, Ordering::SeqCst);
        for actor in actors {
            actor.await?;
        }
        let sent = lock(&ledger).len();
        let which = numbered(victim).map_or_else(String::new, |n| format!(" of node {n}"));
        println!("kill {iteration}{which}: after {alive:?}, {sent} prompts sent so far");
        nodes.insert(victim, Keel::start(binary, dir, db, numbered(victim))?);
    }
    let keel = nodes.remove(0);

    // Every prompt whose answer a kill swallowed is sent again with its id: Keel admits it
    // once either way.
    if !retry_unacknowledged(&keel.client, &ledger).await {
        bail!("prompts could not be sent to the restarted server");
    }
    let settling = Instant::now();
    let settled = wait_until_idle(&keel.client, &sessions, replies.as_ref()).await?;
    println!(
        "sessions {} after {:.1?}",
        if settled { "idle" } else { "still busy" },
        settling.elapsed()
    );
    let mut violations = Vec::new();
    if !settled {
        violations.push(format!(
            "sessions were still busy or had pending input {SETTLE_TIMEOUT:?} after the last restart"
        ));
    }
    let ledger = lock(&ledger).clone();
    let executed: String = (0..options.sessions)
        .map(|i| {
            let file = dir.join("sessions").join(i.to_string()).join(SIDE_FILE);
            std::fs::read_to_string(file).unwrap_or_default()
        })
        .collect();
    let mut runs: HashMap<&str, usize> = HashMap::new();
    for call in executed.lines() {
        *runs.entry(call).or_default() += 1;
    }
    let mut called = HashSet::new();
    let replies = replies.map(|r| lock(&r).clone());
    let mut logs = Vec::new();
    for &session in &sessions {
        let log = read_log(&keel.client, session).await?;
        check::check_session(session, &log, &ledger, &mut called, &mut violations);
        if let Some(replies) = &replies {
            check::check_permissions(session, &log, replies, ASKING, &runs, &mut violations);
        }
        logs.push(log);
        let status = keel.client.session_status(session).await?;
        if let Some(execution) = status.execution {
            violations.push(format!("{session}: claim {} left behind", execution.id));
        }
    }
    let mcp_log = std::fs::read_to_string(&fixture_log).unwrap_or_default();
    check::check_mcp_records(&mcp_log, &logs, &mut violations);
    for (call, count) in &runs {
        if *count > 1 {
            violations.push(format!("bash call {call} ran {count} times"));
        }
        if !called.contains(*call) {
            violations.push(format!(
                "bash call {call} ran without a durable tool.called"
            ));
        }
    }
    keel.kill()?;
    for node in nodes {
        node.kill()?;
    }
    let replied = replies.as_ref().map_or_else(String::new, |replies| {
        let accepted = replies
            .iter()
            .filter(|r| r.answer == Answer::Accepted)
            .count();
        format!(", {} replies ({accepted} accepted)", replies.len())
    });
    let mcp_calls = mcp_log.lines().filter(|l| l.starts_with("call ")).count();
    // Read-only and idempotent calls a kill cut off, which recovery let run again.
    let rerun: usize = logs
        .iter()
        .flatten()
        .filter_map(|e| match &e.event {
            DurableEvent::StepRecovered(r) => Some(r.rerun.len()),
            _ => None,
        })
        .sum();
    println!(
        "{} kills, {} sessions, {} violations ({} prompts, {} bash runs, {mcp_calls} MCP calls, \
         {rerun} calls run again{replied})",
        options.iterations,
        sessions.len(),
        violations.len(),
        ledger.len(),
        runs.len()
    );
    Ok(violations)
}

/// Sends again every prompt without an answer; true when all have one now.
async fn retry_unacknowledged(client: &Client, ledger: &Ledger) -> bool {
    let pending: Vec<(usize, Sent)> = lock(ledger)
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.acknowledged)
        .map(|(i, s)| (i, s.clone()))
        .collect();
    let mut all = true;
    for (index, sent) in pending {
        match client.prompt(sent.session, &sent.request).await {
            Ok(_) => lock(ledger)[index].acknowledged = true,
            Err(e) => {
                eprintln!("retrying a prompt failed: {e}");
                all = false;
            }
        }
    }
    all
}

/// Polls until no session is busy, has pending input or waits for a reply; false on
/// timeout. With `replies`, a person answers every request still open (`once`), and
/// replies whose answer was lost are sent again.
async fn wait_until_idle(
    client: &Client,
    sessions: &[SessionId],
    replies: Option<&Replies>,
) -> Result<bool> {
    let started = Instant::now();
    loop {
        let mut idle = true;
        for &session in sessions {
            let status = client.session_status(session).await?;
            idle &= !status.busy && status.pending_inputs == 0 && status.awaiting_replies == 0;
            if let Some(replies) = replies {
                let lost: Vec<Replied> = lock(replies)
                    .iter()
                    .filter(|r| r.session == session && r.answer == Answer::Lost)
                    .cloned()
                    .collect();
                for r in lost {
                    reply(client, replies, session, r.request, r.decision).await;
                }
                if status.awaiting_replies > 0 {
                    for request in pending_requests(client, session).await? {
                        reply(client, replies, session, request, Decision::Once).await;
                    }
                }
            }
        }
        if idle {
            return Ok(true);
        }
        if started.elapsed() > SETTLE_TIMEOUT {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn read_log(client: &Client, session: SessionId) -> Result<Vec<Envelope>> {
    read_log_with(
        client,
        session,
        LogOptions {
            follow: false,
            ..LogOptions::default()
        },
    )
    .await
}

async fn read_log_with(
    client: &Client,
    session: SessionId,
    options: LogOptions,
) -> Result<Vec<Envelope>> {
    let mut log = client.session_log_with(session, options);
    let mut events = Vec::new();
    while let Some(item) = log.next().await {
        if let LogItem::Durable(envelope) = item? {
            events.push(envelope);
        }
    }
    Ok(events)
}

/// The permission requests of `session` that wait for a reply, as its log tells: no
/// reply yet, and their step not cut short (an interrupt or a recovery settles its
/// requests). Gives up at once when the server is down (it is killed all the time),
/// rather than reconnecting.
async fn pending_requests(client: &Client, session: SessionId) -> Result<Vec<RequestId>> {
    let options = LogOptions {
        follow: false,
        max_reconnects: 0,
        ..LogOptions::default()
    };
    let log = read_log_with(client, session, options).await?;
    let mut replied = HashSet::new();
    let mut step_of = HashMap::new();
    let mut cut_short = HashSet::new();
    for envelope in &log {
        match &envelope.event {
            DurableEvent::PermissionReplied(r) => {
                replied.insert(r.request_id);
            }
            DurableEvent::ToolCalled(c) => {
                step_of.insert(c.call_id, c.assistant_message_id);
            }
            DurableEvent::StepInterrupted(s) => {
                cut_short.insert(s.assistant_message_id);
            }
            DurableEvent::StepRecovered(s) => {
                cut_short.insert(s.assistant_message_id);
            }
            DurableEvent::StepFailed(s) => {
                cut_short.insert(s.assistant_message_id);
            }
            _ => {}
        }
    }
    Ok(log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::PermissionRequested(r)
                if !replied.contains(&r.request_id)
                    && !step_of
                        .get(&r.call_id)
                        .is_some_and(|step| cut_short.contains(step)) =>
            {
                Some(r.request_id)
            }
            _ => None,
        })
        .collect())
}

/// Replies to `request` and records how Keel answered. A lost answer is recorded as the
/// same reply again, so retrying it replaces the record.
async fn reply(
    client: &Client,
    replies: &Replies,
    session: SessionId,
    request: RequestId,
    decision: Decision,
) {
    let answer = match client
        .reply_permission(session, request, &PermissionReply { decision })
        .await
    {
        Ok(_) => Answer::Accepted,
        Err(keel_client::Error::Api {
            status: 404 | 409, ..
        }) => Answer::Refused,
        Err(_) => Answer::Lost,
    };
    let mut replies = lock(replies);
    match replies
        .iter_mut()
        .find(|r| r.request == request && r.decision == decision && r.answer == Answer::Lost)
    {
        Some(lost) => lost.answer = answer,
        None => replies.push(Replied {
            session,
            request,
            decision,
            answer,
        }),
    }
}
