//! A step's output on its way out: deltas go live as soon as they are read, durable
//! events commit behind them, one fenced write at a time.
//!
//! The step never waits for a commit to go on reading its response. Whatever the stream
//! has ready is translated; its deltas are published at once (runs of them coalesced),
//! and its durable events join the [`Outbox`]. While one commit is under way, the durable
//! events read meanwhile wait, and commit together in the next write as soon as it is
//! done, so a session has at most one commit in the writer's queue and a busy writer
//! makes fewer, larger commits instead of holding deltas back. A committed write's events
//! are published when it is done, in seq order.
//!
//! So a delta may go out before the durable event that opened its fragment
//! (`text.started`) and before the end of the fragment before it, though never before an
//! earlier step's events ([`super::live`]): a delta is live only, and that event is its
//! fragment's durable record; readers attach a delta to its fragment by (message,
//! ordinal) or call, whichever arrives first. What must be durable
//! before something acts on it waits for [`Step::flush`]: a local call starts only after
//! its `tool.called` committed, a call's result, a retry and the step's end commit after
//! everything before them. A step that breaks off drops what it has not committed, as a
//! crash would: its `step.failed` closes it, and no output read after a failed commit
//! is committed, so the log has no gap inside a fragment.

use std::future::Future;
use std::pin::Pin;

use keel_schema::event::{DurableEvent, Envelope, EphemeralEvent};

use super::Error;
use super::step::Step;
use super::translate::coalesce;

/// A fenced commit under way.
type Commit<'a> = Pin<Box<dyn Future<Output = Result<Vec<Envelope>, Error>> + Send + 'a>>;

/// The step's durable output not yet published (see the module documentation), and the
/// deltas read since the last batch went out.
#[derive(Default)]
pub(super) struct Outbox<'a> {
    /// Read while the commit under way was: the next commit's.
    waiting: Vec<DurableEvent>,
    underway: Option<Commit<'a>>,
    /// Deltas of the batch being read, each with when its provider event arrived.
    deltas: Vec<(EphemeralEvent, i64)>,
}

impl<'a> Outbox<'a> {
    /// One provider event's output, which arrived at `arrived`.
    pub(super) fn extend(
        &mut self,
        durable: Vec<DurableEvent>,
        ephemeral: Vec<EphemeralEvent>,
        arrived: i64,
    ) {
        self.waiting.extend(durable);
        self.deltas
            .extend(ephemeral.into_iter().map(|event| (event, arrived)));
    }

    /// Whether a commit is under way.
    pub(super) fn is_committing(&self) -> bool {
        self.underway.is_some()
    }

    /// Whether nothing waits to be committed or published.
    fn is_empty(&self) -> bool {
        self.underway.is_none() && self.waiting.is_empty()
    }

    /// The commit under way, once done. `select!` builds every arm's future, enabled or
    /// not, so with none under way this waits forever instead. Cancel-safe: the commit
    /// is kept until it is done.
    pub(super) async fn committed(&mut self) -> Result<Vec<Envelope>, Error> {
        let Some(commit) = &mut self.underway else {
            return std::future::pending().await;
        };
        let result = commit.await;
        self.underway = None;
        result
    }
}

impl<'a> Step<'a> {
    /// Publishes the deltas read so far, and starts committing the durable events read
    /// so far unless a commit is under way (they go with the next one).
    pub(super) fn send(&mut self) {
        self.publish_deltas();
        if self.outbox.underway.is_none() && !self.outbox.waiting.is_empty() {
            let events = std::mem::take(&mut self.outbox.waiting);
            let (engine, held) = (self.engine, self.held);
            self.outbox.underway = Some(Box::pin(engine.append(held, events)));
        }
    }

    /// A commit finished: its events are published, and what was read meanwhile starts
    /// committing.
    pub(super) fn on_committed(
        &mut self,
        result: Result<Vec<Envelope>, Error>,
    ) -> Result<(), Error> {
        self.engine.publish(&result?);
        self.send();
        Ok(())
    }

    /// Sends everything read so far and waits until all of it is committed and published:
    /// before anything that must follow it in the log or act on it.
    pub(super) async fn flush(&mut self) -> Result<(), Error> {
        self.send();
        while !self.outbox.is_empty() {
            let result = self.outbox.committed().await;
            self.on_committed(result)?;
        }
        Ok(())
    }

    /// Publishes the deltas read so far, each stamped with when its provider event
    /// arrived (a run coalesced into one carries its first delta's time).
    fn publish_deltas(&mut self) {
        for (event, arrived) in coalesce(std::mem::take(&mut self.outbox.deltas)) {
            self.engine.publish_ephemeral_at(self.held, event, arrived);
        }
    }
}
