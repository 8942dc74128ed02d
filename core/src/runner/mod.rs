//! The runner: drains a session's inbox through the model and its tools.
//!
//! A drain promotes input at a boundary, loads the transcript, and runs steps until the
//! model stops or nothing is left. Every durable write goes through the fence of the
//! execution's claim ([`crate::execution`]); after ownership is lost the runner makes no
//! provider request, starts no tool and publishes nothing, durable or ephemeral.
//!
//! [`Engine`] is the coordinator's [`Work`]: `started` claims the session, `drain` runs,
//! `cleanup` settles an interrupted execution, `settled` releases the claim with
//! `execution.settled`. [`Runner`] is the handle the service uses.

mod compaction;
mod context;
pub mod live;
mod publisher;
mod retry;
mod step;
mod tools;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use keel_schema::api::{Message, StepEnd};
use keel_schema::event::{DurableEvent, Envelope, EphemeralEnvelope, EphemeralEvent, payload};
use keel_schema::id::{MessageId, OwnerId, RequestId, SessionId};
use keel_schema::types::{Decision, ErrorInfo, Finish, InterruptReason, Outcome, Phase};
use tokio::sync::{broadcast, oneshot};
use tokio_util::sync::CancellationToken;

use crate::coordinator::{BoxFuture, Coordinator, Request, RunError, Scope, Work};
use crate::event::log;
use crate::event::projector::{self, Transcript};
use crate::execution::{self, Claim};
use crate::inbox::{self, Boundary, Promotion};
use crate::provider::Provider;
use crate::store::{self, Conn, Store};
use crate::tool::{self, Registry};

pub use compaction::{ModelLimits, needs_compaction};
pub use retry::RetryPolicy;
pub use step::StepSummary;

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
    fn breaks_step(&self) -> bool {
        match self {
            Self::Store(_) | Self::Inbox(_) | Self::Config(_) | Self::ToolTask(_) => true,
            Self::Busy(_) | Self::OwnershipLost(_) | Self::Interrupted | Self::StepFailed(_) => {
                false
            }
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

/// A tool's permission policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    Allow,
    /// Publish `permission.requested` and wait for a reply.
    Ask,
    Deny,
}

/// An agent: a system prompt, its tools' policies and a step limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    pub system: String,
    pub max_steps: u32,
    /// Per tool; tools not named are allowed.
    pub permissions: HashMap<String, Policy>,
}

impl Default for Agent {
    fn default() -> Self {
        Self {
            system: "You are Keel's build agent, a careful software engineer. Use the tools to \
                     inspect and change files in the session directory."
                .into(),
            max_steps: 50,
            permissions: HashMap::new(),
        }
    }
}

/// Everything a runner needs.
#[derive(Clone)]
pub struct Settings {
    pub owner: OwnerId,
    pub lease_ms: i64,
    pub agents: HashMap<String, Agent>,
    /// Providers by the name models use (`provider/model`).
    pub providers: HashMap<String, Arc<dyn Provider>>,
    pub tools: Registry,
    pub limits: tool::Limits,
    /// How failed provider requests are retried.
    pub retry: RetryPolicy,
    /// Limits of the models that have them configured, by `provider/id`: the output
    /// limit of each request and the threshold of automatic compaction. A model without
    /// limits is never compacted automatically.
    pub models: HashMap<String, ModelLimits>,
}

impl Settings {
    /// Whether a step of a session with `info` may start in the boundary's transaction:
    /// its agent and provider resolve (a step that cannot gets its error before
    /// `step.started`), and its model has no limits (automatic compaction, which comes
    /// before `step.started`, cannot be due).
    fn starts_directly(&self, info: &projector::SessionInfo) -> bool {
        (info.agent == "build" || self.agents.contains_key(&info.agent))
            && self.providers.contains_key(&info.model.provider)
            && !self.models.contains_key(&info.model.to_string())
    }
}

/// Something published live, after its commit for durable events.
#[derive(Debug, Clone, PartialEq)]
pub enum Live {
    /// Committed by this process.
    Durable(Envelope),
    Ephemeral(EphemeralEnvelope),
    /// Committed by another node and read back from the log ([`crate::cluster`]).
    Remote(Envelope),
}

/// Where a wake goes when another node holds the session's claim.
pub trait Router: Send + Sync {
    /// `owner` holds `session`'s claim; tell it there is work.
    fn wake_elsewhere(&self, owner: OwnerId, session: SessionId);
}

/// A reply to a permission request or a question.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Permission(Decision),
    Answer(String),
    Dismiss,
}

/// Whether this process still owns an execution, as far as it can tell without asking the
/// database: no fenced write failed, and the lease it last renewed has not run out.
struct Ownership {
    lost: AtomicBool,
    deadline: AtomicI64,
}

impl Ownership {
    fn new(deadline: i64) -> Self {
        Self {
            lost: AtomicBool::new(false),
            deadline: AtomicI64::new(deadline),
        }
    }
}

/// A claim held by this process, with what it knows of its lease.
#[derive(Clone)]
struct Held {
    claim: Claim,
    ownership: Arc<Ownership>,
}

/// The coordinator's work for sessions.
pub struct Engine {
    store: Store,
    settings: Arc<Settings>,
    /// The tool definitions every request carries.
    specs: Arc<[crate::provider::ToolSpec]>,
    held: Mutex<HashMap<SessionId, Held>>,
    live: live::Hub,
    waiting: Mutex<HashMap<RequestId, oneshot::Sender<Reply>>>,
    router: std::sync::OnceLock<Arc<dyn Router>>,
}

/// The handle the service uses to run sessions.
#[derive(Clone)]
pub struct Runner {
    coordinator: Coordinator<Engine>,
}

impl Runner {
    pub fn new(store: Store, settings: Settings) -> Self {
        Self {
            coordinator: Coordinator::new(Engine {
                store,
                specs: tools::tool_specs(&settings.tools),
                settings: Arc::new(settings),
                held: Mutex::new(HashMap::new()),
                live: live::Hub::default(),
                waiting: Mutex::new(HashMap::new()),
                router: std::sync::OnceLock::new(),
            }),
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        self.coordinator.work()
    }

    /// Live events, durable ones after their commit.
    pub fn subscribe(&self) -> broadcast::Receiver<Live> {
        self.engine().live.subscribe()
    }

    /// Live events of one session, serialized.
    pub fn follow(&self, session: SessionId) -> broadcast::Receiver<Arc<live::Published>> {
        self.engine().live.follow(session)
    }

    /// Sends wakes for sessions another node holds through `router` (set once).
    pub fn route_through(&self, router: Arc<dyn Router>) {
        if self.engine().router.set(router).is_err() {
            tracing::warn!("a router was set twice; the first one stays");
        }
    }

    /// Publishes events another node committed to this process's live subscribers.
    pub fn relay(&self, envelopes: &[Envelope]) {
        for envelope in envelopes {
            self.engine().live.send(Live::Remote(envelope.clone()));
        }
    }

    /// Publishes events committed outside the runner (admission, renames) to live
    /// subscribers.
    pub fn announce(&self, envelopes: &[Envelope]) {
        self.engine().broadcast(envelopes);
    }

    /// This process's owner id.
    pub fn owner(&self) -> OwnerId {
        self.engine().settings.owner
    }

    /// How many executions this process holds.
    pub fn held(&self) -> usize {
        lock(&self.engine().held).len()
    }

    /// Asks for a drain of the session (an advisory wake).
    pub fn wake(&self, session: SessionId, scope: Scope) {
        self.coordinator.wake(session, scope);
    }

    /// Runs (or joins) the session's execution and waits for its busy period to settle.
    pub async fn run(&self, session: SessionId) -> Result<(), RunError<Error>> {
        self.coordinator.run(session).await
    }

    /// Whether this process is running the session.
    pub fn is_busy(&self, session: SessionId) -> bool {
        self.coordinator.is_busy(&session)
    }

    /// Interrupts the session's execution: phase `cancelling` (fenced), then the runner's
    /// cancellation. Returns before cleanup finishes; false when there was nothing to stop.
    pub async fn interrupt(&self, session: SessionId) -> bool {
        let engine = self.engine();
        if let Some(held) = engine.held(session) {
            let claim = held.claim;
            let marked = engine
                .fenced(&held, move |c, _| {
                    execution::set_phase(c, &claim, Phase::Cancelling, None).map_err(Error::from)
                })
                .await;
            if let Err(e) = marked {
                tracing::warn!(%session, error = %e, "could not mark the execution cancelling");
            }
        }
        self.coordinator.interrupt(&session)
    }

    /// Renews every lease this process holds, every third of the lease, until `shutdown`
    /// is cancelled. A failed renewal is logged and retried at the next tick; the fence
    /// keeps a lease that ran out meanwhile from being written through.
    pub async fn renew_leases(&self, shutdown: CancellationToken) {
        let engine = self.engine().clone();
        let lease = engine.settings.lease_ms;
        let period = std::time::Duration::from_millis(u64::try_from(lease / 3).unwrap_or(1).max(1));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(period) => {}
            }
            let (owner, clock) = (engine.settings.owner, engine.store.clock().clone());
            let renewed = engine
                .store
                .write(move |c| {
                    let now = clock.now_ms();
                    execution::renew_all(c, now, lease, owner)?;
                    let live = execution::live_sessions(c, now, owner)?;
                    Ok::<_, store::Error>((now, live))
                })
                .await;
            match renewed {
                Ok((now, live)) => {
                    // Only claims the database still gives this owner get a later deadline.
                    for (session, held) in lock(&engine.held).iter() {
                        if live.contains(session) {
                            held.ownership
                                .deadline
                                .fetch_max(now + lease, Ordering::SeqCst);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "renewing leases failed"),
            }
        }
    }

    /// Delivers a reply to a waiting permission request or question. False when nothing
    /// in this process waits for it.
    pub fn reply(&self, request: RequestId, reply: Reply) -> bool {
        let waiter = lock(&self.engine().waiting).remove(&request);
        match waiter {
            Some(waiter) => waiter.send(reply).is_ok(),
            None => false,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Poisoning means a panic elsewhere mid-update of a plain map; the map itself is fine.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Engine {
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn now(&self) -> i64 {
        self.store.clock().now_ms()
    }

    fn held(&self, session: SessionId) -> Option<Held> {
        lock(&self.held).get(&session).cloned()
    }

    /// Whether `held` may still act: publish output, start a tool, send a request.
    fn owns(&self, held: &Held) -> bool {
        !held.ownership.lost.load(Ordering::SeqCst)
            && self.now() < held.ownership.deadline.load(Ordering::SeqCst)
    }

    /// Runs `write` behind the fence of `held`'s claim, and records what it learns about
    /// the lease.
    async fn fenced<T: Send + 'static>(
        &self,
        held: &Held,
        write: impl FnOnce(&mut Conn, i64) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        if held.ownership.lost.load(Ordering::SeqCst) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let clock = self.store.clock().clone();
        let lease = self.settings.lease_ms;
        let claim = held.claim;
        let result = self
            .store
            .write(move |c| {
                let now = clock.now_ms();
                execution::check(c, now, lease, &claim)?;
                write(c, now).map(|value| (value, now))
            })
            .await;
        match result {
            Ok((value, now)) => {
                held.ownership.deadline.store(now + lease, Ordering::SeqCst);
                Ok(value)
            }
            Err(Error::OwnershipLost(session)) => {
                held.ownership.lost.store(true, Ordering::SeqCst);
                Err(Error::OwnershipLost(session))
            }
            Err(e) => Err(e),
        }
    }

    /// Appends events behind the fence and publishes them live after the commit.
    async fn publish(
        &self,
        held: &Held,
        events: Vec<DurableEvent>,
    ) -> Result<Vec<Envelope>, Error> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let session = held.claim.session_id;
        let envelopes = self
            .fenced(held, move |c, now| {
                log::append(c, now, session, events).map_err(Error::from)
            })
            .await?;
        self.broadcast(&envelopes);
        Ok(envelopes)
    }

    fn broadcast(&self, envelopes: &[Envelope]) {
        for envelope in envelopes {
            self.live.send(Live::Durable(envelope.clone()));
        }
    }

    /// Publishes an ephemeral event, only while this process owns the execution.
    fn publish_ephemeral(&self, held: &Held, event: EphemeralEvent) {
        if !self.owns(held) {
            return;
        }
        self.live.send(Live::Ephemeral(EphemeralEnvelope {
            session_id: held.claim.session_id,
            time: self.now(),
            event,
        }));
    }

    fn agent(&self, name: &str) -> Result<Agent, Error> {
        match self.settings.agents.get(name) {
            Some(agent) => Ok(agent.clone()),
            None if name == "build" => Ok(Agent::default()),
            None => Err(Error::Config(format!(
                "no agent named `{name}` is configured"
            ))),
        }
    }

    /// The session's directory, agent and model.
    async fn session_info(&self, session: SessionId) -> Result<projector::SessionInfo, Error> {
        self.store
            .read(move |c| projector::session_info(c, session).map_err(Error::from))
            .await?
            .ok_or_else(|| Error::Config(format!("no session {session}")))
    }

    async fn messages(&self, session: SessionId) -> Result<Vec<Message>, Error> {
        self.store
            .read(move |c| projector::messages(c, session).map_err(Error::from))
            .await
    }

    /// Registers a waiter for a reply to `request`.
    fn wait_for(&self, request: RequestId) -> oneshot::Receiver<Reply> {
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(request, tx);
        rx
    }

    /// Releases `held`'s claim with `execution.settled`, retrying a failed commit a few
    /// times: a stranded claim would keep the session busy until recovery.
    async fn release(
        &self,
        held: &Held,
        outcome: Outcome,
        error: Option<ErrorInfo>,
    ) -> Result<(), Error> {
        let mut attempt = 0;
        loop {
            let claim = held.claim;
            let lease = self.settings.lease_ms;
            let error = error.clone();
            let clock = self.store.clock().clone();
            let result = self
                .store
                .write(move |c| {
                    execution::release(c, clock.now_ms(), lease, &claim, outcome, error)
                        .map_err(Error::from)
                })
                .await;
            match result {
                Ok(envelope) => {
                    self.broadcast(std::slice::from_ref(&envelope));
                    return Ok(());
                }
                Err(Error::Store(cause)) if attempt < 3 => {
                    attempt += 1;
                    tracing::warn!(session = %claim.session_id, error = %cause, attempt, "releasing the claim failed; retrying");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One drain: promotion at boundaries, steps until the model stops or nothing is left.
    async fn drain_session(
        &self,
        session: SessionId,
        request: Request,
        cancel: CancellationToken,
    ) -> Result<(), Error> {
        let held = self.held(session).ok_or(Error::OwnershipLost(session))?;
        let mut boundary = Boundary::Idle;
        let mut step_number = 0u32;
        let mut first = true;
        // Held across steps and brought up to date at each boundary, in the boundary's
        // own transaction: a step reads only what changed, not the whole history.
        let mut transcript = Transcript::default();
        // The end of the step before this boundary, committed with the boundary's work.
        let mut ended: Option<step::Ended> = None;
        loop {
            if cancel.is_cancelled() {
                if let Some(ended) = ended.take() {
                    self.close_step(&held, ended).await?;
                }
                return Err(Error::Interrupted);
            }
            let ending = ended.take().map(|e| (e.assistant, e.closing));
            let assistant = ending.as_ref().map(|(assistant, _)| *assistant);
            let (settings, claim, force) = (self.settings.clone(), held.claim, request.force);
            let counted = step_number;
            let boundary_work = self
                .fenced(&held, move |c, now| {
                    let mut written = match ending {
                        Some((_, closing)) => log::append(c, now, session, closing)?,
                        None => Vec::new(),
                    };
                    let promotion = inbox::promote_into(c, now, session, boundary, &mut written)?;
                    transcript.refresh(c, session)?;
                    let info = projector::session_info(c, session)?;
                    let next = next_step(
                        &promotion,
                        boundary,
                        first,
                        force,
                        transcript.messages(),
                        counted,
                    );
                    // The step's start rides along when nothing has to come before it.
                    let started = match (&info, next) {
                        (Some(info), Some(number)) if settings.starts_directly(info) => {
                            let (started, envelopes) =
                                step::start_step(c, now, &claim, info, number)?;
                            written.extend(envelopes);
                            Some(started)
                        }
                        _ => None,
                    };
                    Ok((promotion, written, transcript, info, next, started))
                })
                .await;
            let (promotion, envelopes, refreshed, info, next, started) = match boundary_work {
                Ok(done) => done,
                Err(error) => {
                    if let Some(assistant) = assistant {
                        self.step_not_closed(&held, assistant, &error).await;
                    }
                    return Err(error);
                }
            };
            transcript = refreshed;
            self.broadcast(&envelopes);
            if let Promotion::Control(input) = &promotion {
                // The only control input is `compact`; its outcome is in its events, and
                // a failed compaction leaves the history as it was.
                let compacted = self
                    .compact(
                        &held,
                        keel_schema::types::CompactionReason::Manual,
                        Some(input.id),
                        None,
                        &cancel,
                    )
                    .await?;
                if compacted == compaction::Compacted::Interrupted {
                    return Err(Error::Interrupted);
                }
                continue;
            }
            first = false;
            let Some(number) = next else {
                return Ok(());
            };
            step_number = number;
            let info = info.ok_or_else(|| Error::Config(format!("no session {session}")))?;
            let step = self
                .step(
                    &held,
                    step_number,
                    transcript.messages(),
                    info,
                    started,
                    &cancel,
                )
                .await?;
            boundary = if step.summary.continues() {
                Boundary::Step
            } else {
                Boundary::Idle
            };
            ended = Some(step);
        }
    }

    /// Writes a step's end on its own (the drain stops before another boundary).
    async fn close_step(&self, held: &Held, ended: step::Ended) -> Result<(), Error> {
        let assistant = ended.assistant;
        if let Err(error) = self.publish(held, ended.closing).await {
            self.step_not_closed(held, assistant, &error).await;
            return Err(error);
        }
        Ok(())
    }

    /// A step's end could not be written: a database failure fails the step, so it still
    /// ends with exactly one terminal event and no call left running; a lost claim leaves
    /// it to recovery.
    async fn step_not_closed(&self, held: &Held, assistant: MessageId, error: &Error) {
        if error.breaks_step() {
            self.fail_step(held, assistant, error).await;
        }
    }
}

/// The number of the step that follows a boundary, or `None` when none does. New prompts
/// run a step (from step 1 after an idle boundary); past the first boundary, otherwise,
/// only a tool-driven continuation does, or a step whose tool calls were refused would
/// loop; the first boundary also runs one when the transcript waits for the model. A
/// control input runs no step here (the drain carries it out first).
fn next_step(
    promotion: &Promotion,
    boundary: Boundary,
    first: bool,
    force: bool,
    messages: &[Message],
    step_number: u32,
) -> Option<u32> {
    let (go, counted) = match promotion {
        Promotion::Control(_) => return None,
        Promotion::Prompts(_) if boundary == Boundary::Idle => (true, 0),
        Promotion::Prompts(_) => (true, step_number),
        Promotion::Nothing => (
            boundary == Boundary::Step || (first && awaits_model(messages, force)),
            step_number,
        ),
    };
    go.then_some(counted + 1)
}

/// Whether the transcript waits for the model: its last message is the user's. `resume`
/// (an explicit run) also continues a step that asked for tools or was cut short; a mere
/// wake does not, so a spurious wake never restarts a finished tool loop.
fn awaits_model(messages: &[Message], resume: bool) -> bool {
    match messages.last() {
        None => false,
        Some(Message::User { .. } | Message::Synthetic { .. }) => true,
        // A summary ends a manual compaction; an automatic one is followed by its
        // continuation.
        Some(Message::Summary { .. }) => false,
        Some(Message::Assistant { end, .. }) => match end {
            Some(StepEnd::Ended {
                finish: Finish::ToolCalls,
            }) => true,
            Some(
                StepEnd::Interrupted { .. } | StepEnd::Recovered { .. } | StepEnd::Failed { .. },
            ) => resume,
            Some(StepEnd::Ended { .. }) | None => false,
        },
    }
}

impl Work for Engine {
    type Key = SessionId;
    type Error = Error;

    fn started<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let (owner, lease) = (self.settings.owner, self.settings.lease_ms);
            let clock = self.store.clock().clone();
            let session = *session;
            let acquired = self
                .store
                .write(move |c| {
                    let now = clock.now_ms();
                    match execution::acquire(c, now, lease, session, owner)? {
                        Some((claim, envelope)) => {
                            Ok::<_, execution::Error>(Ok((claim, envelope, now)))
                        }
                        None => Ok(Err(
                            execution::get(c, session)?.map(|row| row.claim.owner_id)
                        )),
                    }
                })
                .await
                .map_err(Error::from)?;
            let (claim, envelope, now) = match acquired {
                Ok(acquired) => acquired,
                Err(holder) => {
                    // Another node runs the session: the wake is its to carry out.
                    if let (Some(holder), Some(router)) = (holder, self.router.get())
                        && holder != owner
                    {
                        router.wake_elsewhere(holder, session);
                    }
                    return Err(Error::Busy(session));
                }
            };
            self.broadcast(std::slice::from_ref(&envelope));
            lock(&self.held).insert(
                session,
                Held {
                    claim,
                    ownership: Arc::new(Ownership::new(now + lease)),
                },
            );
            Ok(())
        })
    }

    fn drain<'a>(
        &'a self,
        session: &'a SessionId,
        request: Request,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.drain_session(*session, request, cancel))
    }

    fn cleanup<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let Some(held) = self.held(*session) else {
                return Ok(());
            };
            // One fenced transaction: an incomplete assistant gets exactly one
            // `step.interrupted`; then the claim is released.
            let session = *session;
            let claim = held.claim;
            let lease = self.settings.lease_ms;
            let clock = self.store.clock().clone();
            let written = self
                .store
                .write(move |c| {
                    let now = clock.now_ms();
                    execution::check(c, now, lease, &claim)?;
                    let mut envelopes = Vec::new();
                    let row = execution::get(c, session)?;
                    if let Some(assistant) = row.and_then(|r| r.assistant_message_id) {
                        let open = projector::messages(c, session)?.into_iter().any(|m| {
                            matches!(m, Message::Assistant { id, end: None, .. } if id == assistant)
                        });
                        if open {
                            envelopes.extend(log::append(
                                c,
                                now,
                                session,
                                vec![DurableEvent::StepInterrupted(payload::StepInterrupted {
                                    assistant_message_id: assistant,
                                    reason: InterruptReason::User,
                                })],
                            )?);
                        }
                    }
                    envelopes.push(execution::release(
                        c,
                        now,
                        lease,
                        &claim,
                        Outcome::Interrupted,
                        None,
                    )?);
                    Ok::<_, Error>(envelopes)
                })
                .await;
            match written {
                Ok(envelopes) => {
                    lock(&self.held).remove(&session);
                    self.broadcast(&envelopes);
                    Ok(())
                }
                Err(e) => {
                    // The claim stays (in `cancelling`) for recovery; the cause surfaces.
                    lock(&self.held).remove(&session);
                    tracing::error!(%session, error = %e, "cleaning up an interrupted execution failed");
                    Err(e)
                }
            }
        })
    }

    fn settled<'a>(
        &'a self,
        session: &'a SessionId,
        outcome: &'a Result<(), Error>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(held) = lock(&self.held).remove(session) else {
                return;
            };
            let (outcome, error) = match outcome {
                Ok(()) => (Outcome::Succeeded, None),
                Err(Error::OwnershipLost(_)) => {
                    tracing::warn!(%session, "ownership lost; leaving the execution to its new owner");
                    return;
                }
                Err(Error::Interrupted) => (Outcome::Interrupted, None),
                Err(Error::StepFailed(info)) => (Outcome::Failed, Some(info.clone())),
                Err(e) => (
                    Outcome::Failed,
                    Some(ErrorInfo::new("execution.failed", e.to_string())),
                ),
            };
            if let Err(e) = self.release(&held, outcome, error).await {
                tracing::error!(%session, error = %e, "the claim could not be released; recovery will take it");
            }
        })
    }
}
