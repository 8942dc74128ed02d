//! A burst: whatever the provider's stream has ready, committed in one fenced write and
//! then published live in the order the provider produced it.

use keel_schema::event::{DurableEvent, EphemeralEvent};

use super::Error;
use super::step::Step;
use super::translate::coalesce;

impl Step<'_> {
    /// Commits the burst's durable events in one fenced write, then publishes everything
    /// live in the order the provider produced it (runs of deltas coalesced).
    pub(super) async fn commit_burst(&mut self) -> Result<(), Error> {
        let Burst { durable, order } = std::mem::take(&mut self.burst);
        let mut deltas = Vec::new();
        let mut order = order.into_iter().peekable();
        // Deltas ahead of the first durable event follow what is already committed: they
        // need not wait for this commit.
        while let Some(Outgoing::Ephemeral(event, arrived)) =
            order.next_if(|o| matches!(o, Outgoing::Ephemeral(..)))
        {
            deltas.push((event, arrived));
        }
        self.publish_deltas(&mut deltas);
        if durable.is_empty() {
            return Ok(());
        }
        let mut committed = self.engine.append(self.held, durable).await?.into_iter();
        for item in order {
            match item {
                Outgoing::Ephemeral(event, arrived) => deltas.push((event, arrived)),
                Outgoing::Durable => {
                    self.publish_deltas(&mut deltas);
                    if let Some(envelope) = committed.next() {
                        self.engine.publish(std::slice::from_ref(&envelope));
                    }
                }
            }
        }
        self.publish_deltas(&mut deltas);
        Ok(())
    }

    /// Publishes deltas, each stamped with when its provider event arrived (a run
    /// coalesced into one carries its first delta's time).
    fn publish_deltas(&self, deltas: &mut Vec<(EphemeralEvent, i64)>) {
        for (event, arrived) in coalesce(std::mem::take(deltas)) {
            self.engine.publish_ephemeral_at(self.held, event, arrived);
        }
    }
}

/// A burst of the step's output, in the order the provider produced it, until it is
/// committed: everything the stream has ready commits in one write instead of one per
/// event.
#[derive(Debug, Default)]
pub(super) struct Burst {
    /// The durable events, to commit together.
    durable: Vec<DurableEvent>,
    /// Everything in order; `Durable` stands for the next of `durable`.
    order: Vec<Outgoing>,
}

#[derive(Debug)]
enum Outgoing {
    Durable,
    /// A delta, and when its provider event arrived.
    Ephemeral(EphemeralEvent, i64),
}

impl Burst {
    /// One provider event's output, which arrived at `arrived`: its durable events come
    /// before its deltas.
    pub(super) fn extend(
        &mut self,
        durable: Vec<DurableEvent>,
        ephemeral: Vec<EphemeralEvent>,
        arrived: i64,
    ) {
        self.order.extend(durable.iter().map(|_| Outgoing::Durable));
        self.durable.extend(durable);
        self.order.extend(
            ephemeral
                .into_iter()
                .map(|event| Outgoing::Ephemeral(event, arrived)),
        );
    }
}
