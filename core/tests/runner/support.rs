//! The runner harness.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::RunQueryDsl;
use keel_core::clock::ManualClock;
use keel_core::coordinator::RunError;
use keel_core::inbox::{self, Admission};
use keel_core::instructions::Instructions;
use keel_core::provider::scripted::{Item, Response, Script, Scripted};
use keel_core::provider::{self, Event, EventStream, Provider};
use keel_core::runner::{self, Agent, Permissions, Runner, Settings};
use keel_core::store::{self, DbUrl, Failpoint, Options, Store};
use keel_core::tool::{self, Context, Output, Registry, Run, Tool};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{InputId, OwnerId, SessionId};
use keel_schema::types::{Delivery, Effect, ModelRef, Part, ToolContent};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

pub const LEASE: i64 = 30_000;

/// A tool that reports its start to the test and finishes when released (or fails when
/// cancelled).
pub struct Gate {
    pub started: mpsc::UnboundedSender<Value>,
    pub release: Arc<Notify>,
}

impl Tool for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }
    fn description(&self) -> &'static str {
        "Waits for the test."
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    fn input_schema(&self) -> Value {
        json!({"type": "object"})
    }
    fn permission_pattern(&self, _: &Value, _: &std::path::Path) -> String {
        "gate".into()
    }
    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            // The test may have stopped listening; the gate still works.
            drop(self.started.send(input));
            tokio::select! {
                () = self.release.notified() => Ok(Output {
                    structured: json!({"released": true}),
                    content: vec![ToolContent::Text { text: "released".into() }],
                }),
                () = context.cancel.cancelled() => Err(tool::Error::Interrupted),
            }
        })
    }
}

/// A tool that counts its runs and records, at each start, whether its `tool.called`
/// had already committed in the session the test names.
pub struct Probe {
    pub store: Mutex<Option<Store>>,
    pub session: Mutex<Option<SessionId>>,
    pub runs: AtomicUsize,
    pub called_before_start: Mutex<Vec<bool>>,
}

impl Tool for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }
    fn description(&self) -> &'static str {
        "Counts its runs."
    }
    fn effect(&self) -> Effect {
        Effect::Read
    }
    fn input_schema(&self) -> Value {
        json!({"type": "object"})
    }
    fn permission_pattern(&self, _: &Value, _: &std::path::Path) -> String {
        "probe".into()
    }
    fn run<'a>(&'a self, _: Value, _: &'a Context) -> Run<'a> {
        Box::pin(async move {
            self.runs.fetch_add(1, Ordering::SeqCst);
            let store = self.store.lock().unwrap().clone();
            let session = *self.session.lock().unwrap();
            if let (Some(store), Some(session)) = (store, session) {
                let log = store.read_log(session, 0, u32::MAX).await.unwrap();
                let called = log
                    .iter()
                    .any(|e| matches!(&e.event, DurableEvent::ToolCalled(c) if c.name == "probe"));
                self.called_before_start.lock().unwrap().push(called);
            }
            Ok(Output {
                structured: json!({"ok": true}),
                content: vec![ToolContent::Text {
                    text: "probed".into(),
                }],
            })
        })
    }
}

/// An event's type, without the common prefix.
pub fn kind(event: &DurableEvent) -> &'static str {
    event.type_name().trim_start_matches("session.next.")
}

/// A failpoint that holds the store's writer before one chosen commit until the test lets
/// it go, so an interrupt or another write can land while that commit is pending. The
/// writer runs nothing while held; the commit then goes ahead as usual.
pub struct Hold {
    at: Arc<AtomicU64>,
    reached: mpsc::UnboundedReceiver<u64>,
    go: std::sync::mpsc::Sender<()>,
}

impl Hold {
    /// The hold and the failpoint to build the store with (see [`Setup::failpoint`]).
    pub fn new() -> (Self, Failpoint) {
        let at = Arc::new(AtomicU64::new(u64::MAX));
        let (reached_tx, reached) = mpsc::unbounded_channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let target = at.clone();
        let failpoint = Failpoint(Arc::new(move |ordinal| {
            if ordinal == target.load(Ordering::SeqCst) {
                // A test that stopped listening, or went away (dropping `go`), lets the
                // writer go on.
                let _ = reached_tx.send(ordinal);
                let _ = go_rx.lock().unwrap().recv();
            }
            false
        }));
        (Self { at, reached, go }, failpoint)
    }

    /// Holds the commit with this ordinal ([`Store::stats`] counts the commits so far).
    pub fn at(&self, ordinal: u64) {
        self.at.store(ordinal, Ordering::SeqCst);
    }

    /// Waits until the writer is held.
    pub async fn reached(&mut self) {
        self.reached.recv().await.unwrap();
    }

    /// Lets the held commit go ahead.
    pub fn release(&self) {
        self.go.send(()).unwrap();
    }
}

/// A provider the test drives: each request takes the next channel the test queued.
#[derive(Default)]
pub struct Driven {
    pub streams: Mutex<Vec<mpsc::UnboundedReceiver<Result<Event, provider::Error>>>>,
    pub requests: Mutex<Vec<provider::Request>>,
}

impl Driven {
    /// Queues a response stream and returns its sender.
    pub fn queue(&self) -> mpsc::UnboundedSender<Result<Event, provider::Error>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.streams.lock().unwrap().push(rx);
        tx
    }
}

impl Provider for Driven {
    fn stream(&self, request: &provider::Request) -> EventStream {
        self.requests.lock().unwrap().push(request.clone());
        let mut streams = self.streams.lock().unwrap();
        if streams.is_empty() {
            return Box::pin(futures::stream::iter([Err(provider::Error::BadRequest(
                "the test queued no response".into(),
            ))]));
        }
        let rx = streams.remove(0);
        Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }))
    }
}

/// A provider that records every request and answers from a script.
pub struct Recording {
    pub inner: Scripted,
    pub requests: Mutex<Vec<provider::Request>>,
}

impl Provider for Recording {
    fn stream(&self, request: &provider::Request) -> EventStream {
        self.requests.lock().unwrap().push(request.clone());
        self.inner.stream(request)
    }
}

pub struct Harness {
    pub store: Store,
    pub runner: Runner,
    /// What `runner` was built with, for a second owner on the same store.
    settings: Settings,
    pub clock: Arc<ManualClock>,
    pub gate_started: mpsc::UnboundedReceiver<Value>,
    pub release: Arc<Notify>,
    pub probe: Arc<Probe>,
    pub recording: Arc<Recording>,
    pub driven: Arc<Driven>,
    /// The database file, for another process (see [`Harness::another_process`]).
    db: std::path::PathBuf,
    _dir: tempfile::TempDir,
    pub workspace: tempfile::TempDir,
}

pub fn script(responses: Vec<Vec<Item>>) -> Script {
    Script {
        responses: responses
            .into_iter()
            .map(|items| Response { items })
            .collect(),
    }
}

pub fn text(t: &str) -> Item {
    Item::Text {
        text: t.into(),
        chunks: Some(3),
        gap_ms: None,
    }
}

pub fn call(name: &str, input: Value) -> Item {
    Item::ToolCall {
        name: name.into(),
        input,
        raw: None,
        id: None,
    }
}

/// The built-in agent with every call allowed: what tests run with unless they set an
/// agent of their own (Keel's default asks before a tool that writes).
pub fn trusting() -> Agent {
    Agent {
        permissions: Permissions::allow_all(),
        ..Agent::default()
    }
}

#[derive(Default)]
pub struct Setup {
    pub script: Option<Script>,
    pub agent: Option<Agent>,
    pub failpoint: Option<Failpoint>,
    /// More providers by name (a real adapter pointed at a fake server, say); sessions
    /// use one through [`Harness::session_on`].
    pub providers: Vec<(String, Arc<dyn Provider>)>,
    /// The retry policy; Keel's default otherwise.
    pub retry: Option<runner::RetryPolicy>,
    /// Model limits by `provider/id` (automatic compaction).
    pub models: HashMap<String, runner::ModelLimits>,
    /// Project instructions; none by default, so no file of the machine is read.
    pub instructions: Option<Instructions>,
    /// Model prices, by `provider/id`.
    pub prices: HashMap<String, runner::Prices>,
    /// More tools, besides the gate, the probe and the built-ins.
    pub tools: Vec<Arc<dyn Tool>>,
    /// MCP servers.
    pub mcp: Vec<keel_core::mcp::Spec>,
    /// How long a deferred commit waits for a synced one before the writer syncs it;
    /// the store's default otherwise.
    pub flush_delay: Option<Duration>,
}

impl Harness {
    pub async fn new(setup: Setup) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(1_764_690_000_000));
        let db = dir.path().join("keel.db");
        let store = Store::open(
            DbUrl::Sqlite(db.clone()),
            Options {
                clock: clock.clone(),
                failpoint: setup.failpoint,
                flush_delay: setup.flush_delay.unwrap_or(Options::default().flush_delay),
                ..Options::default()
            },
        )
        .await
        .unwrap();
        let (gate_tx, gate_started) = mpsc::unbounded_channel();
        let release = Arc::new(Notify::new());
        let probe = Arc::new(Probe {
            store: Mutex::new(Some(store.clone())),
            session: Mutex::new(None),
            runs: AtomicUsize::new(0),
            called_before_start: Mutex::new(Vec::new()),
        });
        let recording = Arc::new(Recording {
            inner: Scripted::new(
                setup
                    .script
                    .unwrap_or_else(|| script(vec![vec![text("Hello.")]])),
            ),
            requests: Mutex::new(Vec::new()),
        });
        let driven = Arc::new(Driven::default());
        let mut tools: Vec<Arc<dyn Tool>> = vec![
            Arc::new(Gate {
                started: gate_tx,
                release: release.clone(),
            }),
            probe.clone(),
        ];
        tools.extend(tool::builtins().iter().cloned());
        tools.extend(setup.tools);
        let mut providers: HashMap<String, Arc<dyn Provider>> = HashMap::new();
        providers.insert("scripted".into(), recording.clone());
        providers.insert("other".into(), recording.clone());
        providers.insert("driven".into(), driven.clone());
        providers.extend(setup.providers);
        let mut agents = HashMap::new();
        agents.insert("build".into(), setup.agent.unwrap_or_else(trusting));
        let owner = OwnerId::new();
        let settings = Settings {
            owner,
            lease_ms: LEASE,
            agents,
            providers,
            tools: Registry::new(tools),
            limits: tool::Limits::default(),
            retry: setup.retry.unwrap_or_default(),
            models: setup.models,
            instructions: setup.instructions.unwrap_or_else(Instructions::none),
            prices: setup.prices,
            mcp: Arc::new(keel_core::mcp::Servers::new(setup.mcp)),
            protected: Arc::new(tool::sandbox::Protected::new(Some(&db), None, Vec::new())),
        };
        let runner = Runner::new(store.clone(), settings.clone());
        Self {
            store,
            runner,
            settings,
            clock,
            gate_started,
            release,
            probe,
            recording,
            driven,
            db,
            _dir: dir,
            workspace: tempfile::tempdir().unwrap(),
        }
    }

    /// A session on `provider` working in the harness's workspace.
    pub async fn session_on(&self, provider: &str) -> SessionId {
        let id = SessionId::new();
        self.store
            .append(
                id,
                vec![DurableEvent::Created(payload::Created {
                    title: None,
                    directory: self.workspace.path().to_string_lossy().into_owned(),
                    agent: "build".into(),
                    model: ModelRef {
                        provider: provider.into(),
                        id: "test".into(),
                    },
                    metadata: None,
                })],
            )
            .await
            .unwrap();
        id
    }

    pub async fn session(&self) -> SessionId {
        self.session_on("scripted").await
    }

    /// A new session with one queued prompt admitted (not yet run).
    pub async fn prompted(&self, text: &str) -> SessionId {
        let session = self.session().await;
        self.admit(session, text, Delivery::Queue).await;
        session
    }

    pub async fn admit(&self, session: SessionId, text: &str, delivery: Delivery) -> InputId {
        let clock = self.store.clock().clone();
        let admission = Admission {
            delivery,
            ..Admission::prompt(vec![Part::Text { text: text.into() }])
        };
        self.store
            .write(move |c| inbox::admit(c, clock.now_ms(), session, admission.clone()))
            .await
            .unwrap()
            .input
            .id
    }

    /// Runs the session in a task; the handle resolves when its busy period settled.
    pub fn spawn_run(
        &self,
        session: SessionId,
    ) -> tokio::task::JoinHandle<Result<(), RunError<runner::Error>>> {
        let runner = self.runner.clone();
        tokio::spawn(async move { runner.run(session).await })
    }

    /// Runs the session in a task and returns once the gate tool has started.
    pub async fn run_to_gate(
        &mut self,
        session: SessionId,
    ) -> tokio::task::JoinHandle<Result<(), RunError<runner::Error>>> {
        let run = self.spawn_run(session);
        self.gate_started.recv().await.unwrap();
        run
    }

    pub async fn log(&self, session: SessionId) -> Vec<Envelope> {
        self.store.read_log(session, 0, u32::MAX).await.unwrap()
    }

    /// The session's durable events as JSON for a snapshot: ids become `<prefix#n>` in
    /// order of first appearance, times `<time>` and the session directory `<directory>`, so the same run always gives
    /// the same text while every reference between events stays visible.
    pub async fn redacted_log(&self, session: SessionId) -> Vec<Value> {
        let mut names = HashMap::new();
        self.log(session)
            .await
            .iter()
            .map(|e| {
                let mut value = json!({
                    "seq": e.seq,
                    "type": kind(&e.event),
                    "data": e.event.data().unwrap(),
                });
                redact(&mut value, &mut names);
                value
            })
            .collect()
    }

    /// The session's event types, without the common prefix.
    pub async fn kinds(&self, session: SessionId) -> Vec<String> {
        self.log(session)
            .await
            .iter()
            .map(|e| kind(&e.event).to_owned())
            .collect()
    }

    /// Hands the session's claim to another owner, as a recovery elsewhere would.
    pub async fn steal(&self, session: SessionId) {
        let thief = OwnerId::new();
        self.store
            .write(move |c| {
                diesel::sql_query(format!(
                    "UPDATE session_execution SET owner_id = '{thief}' WHERE session_id = '{session}'"
                ))
                .execute(c)
                .map(|_| ())
                .map_err(store::Error::from)
            })
            .await
            .unwrap();
    }

    /// Another process on the same database with another configuration: the built-in
    /// agent's system prompt is `system`.
    pub fn runner_with_system(&self, system: &str) -> Runner {
        let mut settings = Settings {
            owner: OwnerId::new(),
            ..self.settings.clone()
        };
        settings.agents.insert(
            "build".into(),
            Agent {
                system: system.into(),
                ..trusting()
            },
        );
        Runner::new(self.store.clone(), settings)
    }

    /// Another process on the same database: same tools and providers, a new owner.
    pub fn other_runner(&self) -> Runner {
        Runner::new(
            self.store.clone(),
            Settings {
                owner: OwnerId::new(),
                ..self.settings.clone()
            },
        )
    }

    /// Another process on the same database file, with its own store and writer: it
    /// writes while this harness's writer is held ([`Hold`]), as a second node does while
    /// the first is paused or dead. Same tools, providers and clock; a new owner.
    pub async fn another_process(&self) -> Runner {
        let store = Store::open(
            DbUrl::Sqlite(self.db.clone()),
            Options {
                clock: self.clock.clone(),
                ..Options::default()
            },
        )
        .await
        .unwrap();
        Runner::new(
            store,
            Settings {
                owner: OwnerId::new(),
                ..self.settings.clone()
            },
        )
    }

    /// Waits until `runner` runs nothing for `session`: the execution a recovery pass's
    /// wake started (registered before the pass returns) has settled. An explicit run
    /// here instead would race that wake, and an explicit run resumes what a wake does not.
    pub async fn until_idle(&self, runner: &Runner, session: SessionId) {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while runner.is_busy(session) {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the session never became idle");
    }

    pub async fn claim_exists(&self, session: SessionId) -> bool {
        self.store
            .read(move |c| keel_core::execution::get(c, session))
            .await
            .unwrap()
            .is_some()
    }
}

/// Replaces Keel ids and times in `value` (see [`Harness::redacted_log`]).
fn redact(value: &mut Value, names: &mut HashMap<String, String>) {
    static ID: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let id = ID.get_or_init(|| regex::Regex::new("^([a-z]{2,5})_[0-9A-HJKMNP-TV-Z]{26}$").unwrap());
    match value {
        Value::String(text) => {
            if let Some(captures) = id.captures(text) {
                let prefix = captures[1].to_owned();
                let count = names.len() + 1;
                let name = names
                    .entry(text.clone())
                    .or_insert_with(|| format!("<{prefix}#{count}>"));
                *text = name.clone();
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| redact(v, names)),
        Value::Object(fields) => {
            for (key, field) in fields.iter_mut() {
                if matches!(key.as_str(), "time" | "at" | "time_created") && field.is_number() {
                    *field = Value::String("<time>".into());
                } else if key == "directory" {
                    *field = Value::String("<directory>".into());
                } else {
                    redact(field, names);
                }
            }
        }
        _ => {}
    }
}
