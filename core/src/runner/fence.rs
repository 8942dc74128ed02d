//! Fenced writing and live publishing on behalf of a held claim.
//!
//! Three words, used the same way everywhere in Keel:
//! - **commit**: write durable events in one transaction behind the fence of the claim
//!   ([`crate::execution::check`]), then publish them ([`Engine::commit`]);
//! - **publish**: hand events to this process's live subscribers ([`super::live::Hub`]):
//!   durable ones only after their commit, ephemeral ones only while the claim is owned;
//! - **forward**: send something to another node ([`crate::cluster`]).
//!
//! [`Ownership`] is what the runner knows of its claim without asking the database: a
//! fenced write that failed marks it lost for good, and each successful one (or a
//! renewal) moves its deadline. [`Engine::owns`] consults it before every external
//! action: a provider request, a tool start, a published delta.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use futures::FutureExt;
use futures::future::{self, Either};
use keel_schema::event::{DurableEvent, Envelope, EphemeralEnvelope, EphemeralEvent};

use super::{Engine, Error, Live};
use crate::event::log;
use crate::execution::{self, Claim};
use crate::store::{Conn, Durable};

/// Whether this process still owns an execution, as far as it can tell without asking the
/// database: no fenced write failed, and the lease it last renewed has not run out.
pub(super) struct Ownership {
    pub(super) lost: AtomicBool,
    pub(super) deadline: AtomicI64,
    /// A user interrupted the execution (here or through another node): it stops as the
    /// user's, even during a planned shutdown, and is not continued after a restart.
    pub(super) interrupted: AtomicBool,
}

impl Ownership {
    pub(super) fn new(deadline: i64) -> Self {
        Self {
            lost: AtomicBool::new(false),
            deadline: AtomicI64::new(deadline),
            interrupted: AtomicBool::new(false),
        }
    }

    /// Whether the claim is still this process's at `now`.
    pub(super) fn holds(&self, now: i64) -> bool {
        !self.lost.load(Ordering::SeqCst) && now < self.deadline.load(Ordering::SeqCst)
    }
}

/// A claim held by this process, with what it knows of its lease.
#[derive(Clone)]
pub(super) struct Held {
    pub(super) claim: Claim,
    pub(super) ownership: Arc<Ownership>,
}

impl Engine {
    /// Whether `held` may still act: publish output, start a tool, send a request.
    pub(super) fn owns(&self, held: &Held) -> bool {
        held.ownership.holds(self.now())
    }

    /// Runs `write` behind the fence of `held`'s claim, and records what it learns about
    /// the lease.
    pub(super) fn fenced<'a, T: Send + 'static>(
        &'a self,
        held: &'a Held,
        write: impl FnMut(&mut Conn, i64) -> Result<T, Error> + Send + 'static,
    ) -> impl Future<Output = Result<T, Error>> + Send + 'a {
        self.fenced_as(held, false, write)
            .map(|result| result.map(|(value, _on_disk)| value))
    }

    /// [`Engine::fenced`]; when `deferred`, answering once committed, before the commit
    /// is on disk ([`crate::store::Store::write_deferred`]), and the [`Durable`] says when
    /// it is.
    ///
    /// The write is handed to the store when this is called (and sent to the writer when
    /// the future is first polled), and the future is built of combinators rather than
    /// an `async` block: see [`crate::store::Store::write`] for why a write's future is
    /// kept small. A claim already known lost is refused before any of that.
    pub(super) fn fenced_as<'a, T: Send + 'static>(
        &'a self,
        held: &'a Held,
        deferred: bool,
        mut write: impl FnMut(&mut Conn, i64) -> Result<T, Error> + Send + 'static,
    ) -> impl Future<Output = Result<(T, Durable), Error>> + Send + 'a {
        let claim = held.claim;
        if held.ownership.lost.load(Ordering::SeqCst) {
            return Either::Left(future::ready(Err(Error::OwnershipLost(claim.session_id))));
        }
        let clock = self.store.clock().clone();
        let lease = self.settings.lease_ms;
        let fenced = move |c: &mut Conn| {
            let now = clock.now_ms();
            execution::check(c, now, lease, &claim)?;
            write(c, now).map(|value| (value, now))
        };
        let committed = if deferred {
            Either::Left(self.store.write_deferred(claim.session_id, fenced))
        } else {
            Either::Right(
                self.store
                    .write_for(claim.session_id, fenced)
                    .map(|result| result.map(|written| (written, Durable::now()))),
            )
        };
        Either::Right(committed.map(move |result| match result {
            Ok(((value, now), durable)) => {
                held.ownership.deadline.store(now + lease, Ordering::SeqCst);
                Ok((value, durable))
            }
            Err(Error::OwnershipLost(session)) => {
                held.ownership.lost.store(true, Ordering::SeqCst);
                Err(Error::OwnershipLost(session))
            }
            Err(e) => Err(e),
        }))
    }

    /// Appends `events` to the log behind the fence of `held`'s claim, without publishing
    /// them: for a caller that interleaves them with ephemeral events.
    pub(super) async fn append(
        &self,
        held: &Held,
        events: Vec<DurableEvent>,
    ) -> Result<Vec<Envelope>, Error> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let session = held.claim.session_id;
        self.fenced(held, move |c, now| {
            log::append(c, now, session, events.clone()).map_err(Error::from)
        })
        .await
    }

    /// Commits `events` behind the fence of `held`'s claim, then publishes them live.
    pub(super) async fn commit(
        &self,
        held: &Held,
        events: Vec<DurableEvent>,
    ) -> Result<Vec<Envelope>, Error> {
        let envelopes = self.append(held, events).await?;
        self.publish(&envelopes);
        Ok(envelopes)
    }

    /// Publishes committed events to this process's live subscribers.
    pub(super) fn publish(&self, envelopes: &[Envelope]) {
        crate::metrics::committed(envelopes.iter().map(|e| &e.event));
        for envelope in envelopes {
            self.live.publish(Live::Durable(envelope.clone()));
        }
    }

    /// Publishes events of a deferred commit live once `durable` says they are on disk;
    /// the session's later durable events wait behind them ([`super::live`]).
    pub(super) fn publish_when_durable(&self, envelopes: &[Envelope], durable: Durable) {
        let Some(session) = envelopes.first().map(|e| e.session_id) else {
            return;
        };
        crate::metrics::committed(envelopes.iter().map(|e| &e.event));
        let events = envelopes.iter().cloned().map(Live::Durable).collect();
        self.live.publish_when_durable(session, events, durable);
    }

    /// Publishes an ephemeral event, only while this process owns the execution.
    pub(super) fn publish_ephemeral(&self, held: &Held, event: EphemeralEvent) {
        self.publish_ephemeral_at(held, event, self.now());
    }

    /// [`Engine::publish_ephemeral`] for an event that happened at `time` (a delta: when
    /// its provider event arrived, [`super::receive`]).
    pub(super) fn publish_ephemeral_at(&self, held: &Held, event: EphemeralEvent, time: i64) {
        if !self.owns(held) {
            return;
        }
        self.live.publish(Live::Ephemeral(EphemeralEnvelope {
            session_id: held.claim.session_id,
            time,
            event,
        }));
    }
}
