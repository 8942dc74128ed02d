//! [`Runner`]: the handle the service uses to run sessions, cheap to clone.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use keel_schema::event::Envelope;
use keel_schema::id::{ExecutionId, OwnerId, RequestId, SessionId};
use keel_schema::types::{InterruptReason, Phase};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::engine::{Engine, interrupt_and_release, lock};
use super::{Error, Live, Settings, live};
use crate::coordinator::{Coordinator, RunError, Scope};
use crate::execution;
use crate::request::{self, Reply};
use crate::store::{self, Store};

/// Where a wake or an interrupt goes when another node holds the session's claim.
pub trait Forwarder: Send + Sync {
    /// `owner` holds `session`'s claim; tell it there is work.
    fn forward_wake(&self, owner: OwnerId, session: SessionId);
    /// `owner` holds `session`'s claim for `execution`, and an interrupt of it is
    /// recorded ([`execution::request_cancel`]); tell it to stop now rather than at its
    /// next renewal.
    fn forward_interrupt(&self, owner: OwnerId, session: SessionId, execution: ExecutionId);
}

/// The handle the service uses to run sessions.
#[derive(Clone)]
pub struct Runner {
    coordinator: Coordinator<Engine>,
}

impl Runner {
    pub fn new(store: Store, settings: Settings) -> Self {
        Self {
            coordinator: Coordinator::new(Engine::new(store, settings)),
        }
    }

    fn engine(&self) -> &Arc<Engine> {
        self.coordinator.work()
    }

    /// The agents, by name (`build` always among them), with the tools each offers.
    pub fn agents(&self) -> Vec<(String, super::Agent, Vec<String>)> {
        let engine = self.engine();
        let mut names: Vec<&String> = engine.settings.agents.keys().collect();
        let build = "build".to_owned();
        if !names.contains(&&build) {
            names.push(&build);
        }
        names.sort();
        names
            .into_iter()
            .filter_map(|name| {
                let agent = engine.settings.agent(name)?;
                let tools = engine.specs(name).iter().map(|s| s.name.clone()).collect();
                Some((name.clone(), agent, tools))
            })
            .collect()
    }

    /// The MCP tool servers.
    pub fn mcp(&self) -> &Arc<crate::mcp::Servers> {
        &self.engine().settings.mcp
    }

    /// The agent named `name`, if there is one.
    pub fn agent(&self, name: &str) -> Option<super::Agent> {
        self.engine().settings.agent(name)
    }

    /// The store the runner writes to.
    pub fn store(&self) -> &Store {
        &self.engine().store
    }

    /// Live events, durable ones after their commit.
    pub fn subscribe(&self) -> broadcast::Receiver<Live> {
        self.engine().live.subscribe()
    }

    /// Live events of one session, serialized; `committed` is a seq of its log known to
    /// be committed ([`live::Hub::follow`]).
    pub fn follow(
        &self,
        session: SessionId,
        committed: u64,
    ) -> broadcast::Receiver<Arc<live::Published>> {
        self.engine().live.follow(session, committed)
    }

    /// Forwards wakes for sessions another node holds through `forwarder` (set once).
    pub fn forward_through(&self, forwarder: Arc<dyn Forwarder>) {
        if self.engine().forwarder.set(forwarder).is_err() {
            tracing::warn!("a forwarder was set twice; the first one stays");
        }
    }

    /// Publishes events committed outside the runner (admission, renames) to this
    /// process's live subscribers.
    pub fn publish(&self, envelopes: &[Envelope]) {
        self.engine().publish(envelopes);
    }

    /// Publishes events another node committed to this process's live subscribers.
    pub fn publish_remote(&self, envelopes: &[Envelope]) {
        for envelope in envelopes {
            self.engine().live.publish(Live::Remote(envelope.clone()));
        }
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

    /// Records an explicit resume durably ([`crate::inbox::request_execution`]): a resume
    /// whose run is lost with its process is then redriven by recovery. The caller runs
    /// the session next ([`Runner::run`]).
    pub async fn record_resume(&self, session: SessionId) -> Result<(), Error> {
        let clock = self.store().clock().clone();
        let written = self
            .store()
            .write_for(session, move |c| {
                crate::inbox::request_execution(c, clock.now_ms(), session).map_err(Error::from)
            })
            .await?;
        self.publish(&written);
        Ok(())
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
    /// A step that waits for a person, with nobody running it, is ended right here.
    pub async fn interrupt(&self, session: SessionId) -> bool {
        if !self.is_busy(session) {
            match self.interrupt_waiting(session).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(%session, error = %e, "could not end the waiting step");
                }
            }
        }
        let engine = self.engine();
        if let Some(held) = engine.held(session) {
            held.ownership.interrupted.store(true, Ordering::SeqCst);
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

    /// Ends a step that waits for a person while no process holds the session: in one
    /// transaction the session is claimed, the step gets `step.interrupted` (which fails
    /// its unanswered calls and settles their requests) and the claim is released. False
    /// when no step waits, or another process holds the session.
    async fn interrupt_waiting(&self, session: SessionId) -> Result<bool, Error> {
        let engine = self.engine();
        let (owner, lease) = (engine.settings.owner, engine.settings.lease_ms);
        let clock = engine.store.clock().clone();
        let written = engine
            .store
            .write_for(session, move |c| {
                let Some(step) = request::waiting_step(c, session)? else {
                    return Ok(Vec::new());
                };
                let now = clock.now_ms();
                let Some((claim, started)) = execution::acquire(c, now, lease, session, owner)?
                else {
                    return Ok(Vec::new());
                };
                let mut written = vec![started];
                written.extend(interrupt_and_release(
                    c,
                    now,
                    lease,
                    &claim,
                    Some(step),
                    InterruptReason::User,
                )?);
                Ok::<_, Error>(written)
            })
            .await?;
        engine.publish(&written);
        Ok(!written.is_empty())
    }

    /// A planned shutdown ([`super::shutdown`]): no new execution from now on; running
    /// drains stop at their next boundary, and those still running after `grace` are
    /// interrupted as `shutdown`. Returns, once they have settled (or `settle` more has
    /// passed), how many the grace did not see finish.
    pub async fn shut_down(&self, grace: Duration, settle: Duration) -> usize {
        let engine = self.engine();
        engine.stopping.store(true, Ordering::SeqCst);
        self.until_idle(grace).await;
        let running: Vec<SessionId> = lock(&engine.held).keys().copied().collect();
        for session in &running {
            tracing::warn!(%session, "the shutdown grace ran out; stopping the step");
            self.coordinator.interrupt(session);
        }
        if !running.is_empty() {
            self.until_idle(settle).await;
        }
        running.len()
    }

    /// Waits until this process holds no execution, or `limit` passed.
    async fn until_idle(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.held() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Renews the leases of the executions this process runs, every third of the lease,
    /// until `shutdown` is cancelled. A failed renewal is logged and retried at the next
    /// tick; the fence keeps a lease that ran out meanwhile from being written through.
    pub async fn renew_leases(&self, shutdown: CancellationToken) {
        let lease = self.engine().settings.lease_ms;
        let period = std::time::Duration::from_millis(u64::try_from(lease / 3).unwrap_or(1).max(1));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(period) => {}
            }
            if let Err(e) = self.renew().await {
                tracing::warn!(error = %e, "renewing leases failed");
            }
        }
    }

    /// One renewal: the leases of the executions this process is running, and no other
    /// (a claim it stopped running, a release that failed say, is left to expire for
    /// recovery). Returns how many were renewed.
    pub async fn renew(&self) -> Result<usize, store::Error> {
        let engine = self.engine().clone();
        let claims: Vec<_> = lock(&engine.held).values().map(|h| h.claim.id).collect();
        if claims.is_empty() {
            return Ok(0);
        }
        let (owner, lease) = (engine.settings.owner, engine.settings.lease_ms);
        let clock = engine.store.clock().clone();
        let (now, renewed, live) = engine
            .store
            .write(move |c| {
                let now = clock.now_ms();
                let renewed = execution::renew(c, now, lease, owner, &claims)?;
                let live = execution::live_sessions(c, now, owner)?;
                Ok::<_, store::Error>((now, renewed, live))
            })
            .await?;
        // Only claims the database still gives this owner get a later deadline.
        let mut cancelled = Vec::new();
        for (session, held) in lock(&engine.held).iter() {
            if let Some((_, phase)) = live.iter().find(|(live, _)| live == session) {
                held.ownership
                    .deadline
                    .fetch_max(now + lease, Ordering::SeqCst);
                if *phase == Phase::Cancelling {
                    cancelled.push((*session, held.claim.id));
                }
            }
        }
        // An interrupt recorded by another node whose message never arrived.
        for (session, execution) in cancelled {
            self.stop_cancelled(session, execution);
        }
        Ok(renewed)
    }

    /// Stops this process's `execution` of `session`, whose interrupt is already recorded
    /// on its claim. False when that execution does not run here (it ended, and another
    /// may have started since) or is already stopping.
    pub fn stop_cancelled(&self, session: SessionId, execution: ExecutionId) -> bool {
        let Some(held) = self
            .engine()
            .held(session)
            .filter(|held| held.claim.id == execution)
        else {
            return false;
        };
        held.ownership.interrupted.store(true, Ordering::SeqCst);
        self.coordinator.interrupt(&session)
    }

    /// Interrupts `session`'s execution where this process does not run it: records the
    /// interrupt on the claim ([`execution::request_cancel`]), then tells the owner.
    /// Returns whether there was an execution to stop, once the interrupt is durable.
    pub async fn interrupt_elsewhere(&self, session: SessionId) -> Result<bool, Error> {
        let claim = self
            .store()
            .write_for(session, move |c| execution::request_cancel(c, session))
            .await?;
        let Some(claim) = claim else {
            return Ok(false);
        };
        let owner = claim.owner_id;
        tracing::info!(%session, %owner, execution = %claim.id, "interrupt recorded for the execution's owner");
        if owner == self.owner() {
            // Ours but not stopped by `interrupt`: a claim this process no longer runs
            // (its release failed), which recovery settles without continuing it; or
            // one it is already stopping, where nothing new happened.
            return Ok(!self.is_busy(session));
        }
        if let Some(forwarder) = self.engine().forwarder.get() {
            forwarder.forward_interrupt(owner, session, claim.id);
        }
        Ok(true)
    }

    /// Commits `reply` to `request` of `session` and wakes the session, which resumes the
    /// step that waits for it on whichever node claims it. Returns once the reply is
    /// durable; a refused reply wrote nothing.
    pub async fn reply(
        &self,
        session: SessionId,
        request: RequestId,
        reply: Reply,
    ) -> Result<(), request::Error> {
        let clock = self.store().clock().clone();
        let written = self
            .store()
            .write_for(session, move |c| {
                request::answer(c, clock.now_ms(), session, request, &reply)
            })
            .await?;
        self.publish(&written);
        self.wake(session, Scope::Input);
        Ok(())
    }
}
