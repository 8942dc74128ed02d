//! The engine: the coordinator's [`Work`] for sessions, and what every part of the runner
//! shares (the store, the settings, the claims this process holds, the live hub).
//!
//! A busy period: `started` claims the session (`execution.started`), `drain` runs
//! ([`super::drain`]), `cleanup` settles an interrupted execution in one fenced
//! transaction, `settled` releases the claim with `execution.settled`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{MessageId, SessionId};
use keel_schema::types::{ErrorInfo, InterruptReason, ModelRef, Outcome, Phase};
use tokio_util::sync::CancellationToken;

use super::fence::{Held, Ownership};
use super::{Agent, Error, Forwarder, Settings, live, shutdown};
use crate::coordinator::{BoxFuture, Request, Work};
use crate::event::{log, view};
use crate::execution;
use crate::provider::{Provider, ToolSpec};
use crate::store::Store;

/// The coordinator's work for sessions.
pub struct Engine {
    pub(super) store: Store,
    pub(super) settings: Arc<Settings>,
    /// The tool definitions requests carry, by agent (`build` always present).
    specs: HashMap<String, Arc<[ToolSpec]>>,
    pub(super) held: Mutex<HashMap<SessionId, Held>>,
    pub(super) live: live::Hub,
    /// Where wakes for sessions another node holds go (set once, on PostgreSQL).
    pub(super) forwarder: std::sync::OnceLock<Arc<dyn Forwarder>>,
    /// A planned shutdown is under way ([`super::shutdown`]).
    pub(super) stopping: AtomicBool,
}

impl Engine {
    pub(super) fn new(store: Store, settings: Settings) -> Self {
        Self {
            store,
            specs: {
                let mut specs = HashMap::from([(
                    "build".to_owned(),
                    super::tools::tool_specs(&settings.tools, &Agent::default()),
                )]);
                for (name, agent) in &settings.agents {
                    specs.insert(
                        name.clone(),
                        super::tools::tool_specs(&settings.tools, agent),
                    );
                }
                specs
            },
            settings: Arc::new(settings),
            held: Mutex::new(HashMap::new()),
            live: live::Hub::default(),
            forwarder: std::sync::OnceLock::new(),
            stopping: AtomicBool::new(false),
        }
    }

    /// Whether a planned shutdown is under way: no new execution, stop at the boundary.
    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Why an interrupt of this process's drains happens: the user's, or the shutdown's.
    /// Why `held`'s execution is being stopped: a user's interrupt wins over a shutdown
    /// in progress, so what the user stopped is never continued after the restart.
    pub(super) fn interrupt_reason(&self, held: &Held) -> InterruptReason {
        if self.stopping() && !held.ownership.interrupted.load(Ordering::SeqCst) {
            InterruptReason::Shutdown
        } else {
            InterruptReason::User
        }
    }

    pub(super) fn now(&self) -> i64 {
        self.store.clock().now_ms()
    }

    pub(super) fn held(&self, session: SessionId) -> Option<Held> {
        lock(&self.held).get(&session).cloned()
    }

    /// The built-in tool definitions of agent `name`'s requests.
    pub(super) fn specs(&self, agent: &str) -> Arc<[ToolSpec]> {
        self.specs
            .get(agent)
            .or_else(|| self.specs.get("build"))
            .cloned()
            .unwrap_or_default()
    }

    /// What a request of agent `name` offers the model: the built-in tools and those of
    /// the MCP servers (started here on first use) that `agent` offers.
    pub(super) async fn request_tools(&self, name: &str, agent: &Agent) -> Arc<[ToolSpec]> {
        let builtin = self.specs(name);
        if self.settings.mcp.is_empty() {
            return builtin;
        }
        let served: Vec<ToolSpec> = self
            .settings
            .mcp
            .tools()
            .await
            .iter()
            .filter(|t| agent.offers(t.name()))
            .map(|t| ToolSpec {
                name: t.name().into(),
                description: t.description().into(),
                input_schema: t.input_schema(),
            })
            .collect();
        if served.is_empty() {
            return builtin;
        }
        builtin.iter().cloned().chain(served).collect()
    }

    /// The tool named `name`: a built-in one, or one of a ready MCP server.
    pub(super) fn tool(&self, name: &str) -> Option<Arc<dyn crate::tool::Tool>> {
        self.settings
            .tools
            .get(name)
            .cloned()
            .or_else(|| self.settings.mcp.tool(name))
    }

    pub(super) fn agent(&self, name: &str) -> Result<Agent, Error> {
        self.settings
            .agent(name)
            .ok_or_else(|| Error::Config(format!("no agent named `{name}` is configured")))
    }

    /// The project instructions for a session in `directory` (none without one), read off
    /// the async threads: what [`crate::instructions::system_prompt`] adds to the agent's
    /// prompt. `None` when a file could not be read: the prompt in effect stays.
    pub(super) async fn project_instructions(&self, directory: Option<&str>) -> Option<String> {
        let Some(directory) = directory else {
            return Some(String::new());
        };
        let (instructions, directory) = (
            self.settings.instructions.clone(),
            std::path::PathBuf::from(directory),
        );
        tokio::task::spawn_blocking(move || instructions.read(&directory))
            .await
            .ok()
            .flatten()
    }

    /// What `usage` of `model` cost, by its configured prices (0 without).
    pub(super) fn cost(&self, model: &ModelRef, usage: &keel_schema::types::Usage) -> f64 {
        self.settings
            .prices
            .get(&model.to_string())
            .map_or(0.0, |prices| prices.cost(usage))
    }

    /// The session's directory, agent and model.
    pub(super) async fn session_info(
        &self,
        session: SessionId,
    ) -> Result<view::SessionInfo, Error> {
        self.store
            .read(move |c| view::session_info(c, session).map_err(Error::from))
            .await?
            .ok_or_else(|| Error::Config(format!("no session {session}")))
    }

    pub(super) async fn messages(&self, session: SessionId) -> Result<Vec<Message>, Error> {
        self.store
            .read(move |c| view::messages(c, session).map_err(Error::from))
            .await
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
                .write_for(claim.session_id, move |c| {
                    execution::release(c, clock.now_ms(), lease, &claim, outcome, error.clone())
                        .map_err(Error::from)
                })
                .await;
            match result {
                Ok(envelope) => {
                    self.publish(std::slice::from_ref(&envelope));
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

    /// The adapter that serves `model`.
    pub(super) fn provider(&self, model: &ModelRef) -> Result<Arc<dyn Provider>, Error> {
        self.settings
            .providers
            .get(&model.provider)
            .cloned()
            .ok_or_else(|| {
                Error::Config(format!(
                    "no provider `{}` is configured (model {model})",
                    model.provider
                ))
            })
    }

    /// Fails a step that broke off: every unresolved call, then `step.failed`, in one
    /// fenced transaction, retried a few times.
    pub(super) async fn fail_step(&self, held: &Held, assistant: MessageId, cause: &Error) {
        let session = held.claim.session_id;
        let error = ErrorInfo::new("execution.failed", cause.to_string());
        for attempt in 0..4 {
            let error = error.clone();
            let written = self
                .fenced(held, move |c, now| {
                    let open = view::unresolved_tools(c, session, assistant)?;
                    let mut events: Vec<DurableEvent> = open
                        .into_iter()
                        .map(|call_id| {
                            DurableEvent::ToolFailed(payload::ToolFailed {
                                call_id,
                                error: ErrorInfo::new(
                                    "tool.step-failed",
                                    "the step failed before this call's result was recorded",
                                ),
                            })
                        })
                        .collect();
                    events.push(DurableEvent::StepFailed(payload::StepFailed {
                        assistant_message_id: assistant,
                        error: error.clone(),
                        usage: None,
                    }));
                    crate::event::log::append(c, now, session, events).map_err(Error::from)
                })
                .await;
            match written {
                Ok(envelopes) => {
                    self.publish(&envelopes);
                    return;
                }
                Err(Error::OwnershipLost(_)) => return,
                Err(e) => {
                    tracing::warn!(%session, error = %e, attempt, "failing the broken step failed");
                }
            }
        }
    }
}

/// The end of an interrupted execution, in the caller's transaction: `step.interrupted`
/// for its step still open, if any (failing the calls it left), then the release. A
/// shutdown's interrupt also records the continuation for after the restart
/// ([`shutdown`]).
pub(super) fn interrupt_and_release(
    connection: &mut crate::store::Conn,
    now: i64,
    lease_ms: i64,
    claim: &execution::Claim,
    open_step: Option<MessageId>,
    reason: InterruptReason,
) -> Result<Vec<keel_schema::event::Envelope>, Error> {
    let mut written = Vec::new();
    if let Some(assistant) = open_step {
        written.extend(log::append(
            connection,
            now,
            claim.session_id,
            vec![DurableEvent::StepInterrupted(payload::StepInterrupted {
                assistant_message_id: assistant,
                reason,
            })],
        )?);
    }
    let shutdown = reason == InterruptReason::Shutdown;
    if shutdown {
        written.extend(shutdown::continue_after_restart(connection, now, claim)?);
    }
    written.push(execution::release(
        connection,
        now,
        lease_ms,
        claim,
        Outcome::Interrupted,
        shutdown.then(shutdown::shutdown_error),
    )?);
    Ok(written)
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Poisoning means a panic elsewhere mid-update of a plain map; the map itself is fine.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Work for Engine {
    type Key = SessionId;
    type Error = Error;

    fn started<'a>(&'a self, session: &'a SessionId) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if self.stopping() {
                // The work stays durable (its input, its wake's redrive) for after the restart.
                return Err(Error::ShuttingDown);
            }
            let (owner, lease) = (self.settings.owner, self.settings.lease_ms);
            let clock = self.store.clock().clone();
            let session = *session;
            let acquired = self
                .store
                .write_for(session, move |c| {
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
                    if let (Some(holder), Some(forwarder)) = (holder, self.forwarder.get())
                        && holder != owner
                    {
                        forwarder.forward_wake(holder, session);
                    }
                    return Err(Error::Busy(session));
                }
            };
            self.publish(std::slice::from_ref(&envelope));
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
        use tracing::Instrument as _;
        let execution = self.held(*session).map(|held| held.claim.id.to_string());
        let span = tracing::info_span!("execution", session = %session, execution);
        Box::pin(
            self.drain_session(*session, request, cancel)
                .instrument(span),
        )
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
            let reason = self.interrupt_reason(&held);
            let written = self
                .store
                .write_for(session, move |c| {
                    let now = clock.now_ms();
                    execution::check(c, now, lease, &claim)?;
                    let row = execution::get(c, session)?;
                    // An interrupt another process recorded on the claim is a user's too.
                    let reason = match &row {
                        Some(row) if row.phase == Phase::Cancelling => InterruptReason::User,
                        _ => reason,
                    };
                    let open = match row.and_then(|r| r.assistant_message_id) {
                        Some(assistant) => view::messages(c, session)?.into_iter().any(|m| {
                            matches!(m, Message::Assistant { id, end: None, .. } if id == assistant)
                        }).then_some(assistant),
                        None => None,
                    };
                    interrupt_and_release(c, now, lease, &claim, open, reason)
                })
                .await;
            match written {
                Ok(envelopes) => {
                    lock(&self.held).remove(&session);
                    self.publish(&envelopes);
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

    fn ends_busy_period(&self, error: &Error) -> bool {
        // The claim is another owner's now: a wake must claim afresh (or stop).
        matches!(error, Error::OwnershipLost(_))
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
                Err(Error::ShuttingDown) => {
                    (Outcome::Interrupted, Some(shutdown::shutdown_error()))
                }
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
