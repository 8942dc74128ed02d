//! Live delivery: every event the process publishes, to every subscriber that wants it.
//!
//! Two kinds of subscription share one [`Hub`]:
//! - [`Hub::subscribe`]: everything, as [`Live`] values (`/api/event`, the cluster bus);
//! - [`Hub::follow`]: one session's events, each already serialized once for all its
//!   followers ([`Published`]), so a session's log streams are neither woken by other
//!   sessions' events nor each serializing the same event again.
//!
//! Live delivery is best effort (a subscriber that falls behind is told so by its
//! receiver); the log is the truth.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_schema::event::{Envelope, EphemeralEnvelope};
use keel_schema::id::SessionId;
use tokio::sync::broadcast;

/// Something published live, after its commit for durable events.
#[derive(Debug, Clone, PartialEq)]
pub enum Live {
    /// Committed by this process.
    Durable(Envelope),
    Ephemeral(EphemeralEnvelope),
    /// Committed by another node and read back from the log ([`crate::cluster`]).
    Remote(Envelope),
}

/// Events all subscribers may have waiting before the slowest is told it lagged.
const CAPACITY: usize = 4096;
/// The same, per followed session (a channel's slots are allocated up front).
const SESSION_CAPACITY: usize = 256;

/// One event of a followed session, serialized.
#[derive(Debug)]
pub struct Published {
    /// The seq of a durable event; `None` for an ephemeral one.
    pub seq: Option<u64>,
    /// The event as JSON: an envelope, or an ephemeral envelope.
    pub json: String,
}

#[derive(Clone)]
pub struct Hub {
    all: broadcast::Sender<Live>,
    sessions: Arc<Mutex<Followed>>,
}

/// The followed sessions' channels. A channel whose last follower left is dropped at
/// the session's next event, or by a sweep once the map has doubled since the last one.
#[derive(Default)]
struct Followed {
    channels: HashMap<SessionId, broadcast::Sender<Arc<Published>>>,
    sweep_at: usize,
}

impl Default for Hub {
    fn default() -> Self {
        Self {
            all: broadcast::channel(CAPACITY).0,
            sessions: Arc::default(),
        }
    }
}

impl Hub {
    /// Every event, from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Live> {
        self.all.subscribe()
    }

    /// The events of `session`, from now on.
    pub fn follow(&self, session: SessionId) -> broadcast::Receiver<Arc<Published>> {
        let mut followed = lock(&self.sessions);
        if followed.channels.len() >= followed.sweep_at {
            followed.channels.retain(|_, s| s.receiver_count() > 0);
            followed.sweep_at = (2 * followed.channels.len()).max(64);
        }
        followed
            .channels
            .entry(session)
            .or_insert_with(|| broadcast::channel(SESSION_CAPACITY).0)
            .subscribe()
    }

    /// Hands `live` to every subscriber and to the followers of its session.
    pub fn publish(&self, live: Live) {
        let (session, seq) = match &live {
            Live::Durable(envelope) | Live::Remote(envelope) => {
                (envelope.session_id, Some(envelope.seq))
            }
            Live::Ephemeral(event) => (event.session_id, None),
        };
        let followers = {
            let mut followed = lock(&self.sessions);
            match followed.channels.get(&session) {
                Some(sender) if sender.receiver_count() == 0 => {
                    followed.channels.remove(&session);
                    None
                }
                other => other.cloned(),
            }
        };
        if let Some(followers) = followers {
            let json = match &live {
                Live::Durable(envelope) | Live::Remote(envelope) => envelope_json(envelope),
                Live::Ephemeral(event) => serde_json::to_string(event).ok(),
            };
            if let Some(json) = json {
                // A follower that left meanwhile is fine.
                drop(followers.send(Arc::new(Published { seq, json })));
            }
        }
        // No subscriber is fine too.
        drop(self.all.send(live));
    }
}

/// `envelope` as JSON, as every stream sends it; a failure is logged (and the event is
/// left to the log).
pub(crate) fn envelope_json(envelope: &Envelope) -> Option<String> {
    serde_json::to_string(envelope)
        .inspect_err(
            |e| tracing::error!(seq = envelope.seq, error = %e, "an event did not serialize"),
        )
        .ok()
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use keel_schema::event::{DurableEvent, EphemeralEnvelope, EphemeralEvent, payload};
    use keel_schema::id::{EventId, MessageId};

    use super::*;

    fn durable(session: SessionId, seq: u64) -> Live {
        Live::Durable(Envelope {
            id: EventId::new(),
            session_id: session,
            seq,
            time: 1,
            event: DurableEvent::Renamed(payload::Renamed {
                title: format!("title {seq}"),
            }),
        })
    }

    fn delta(session: SessionId) -> Live {
        Live::Ephemeral(EphemeralEnvelope {
            session_id: session,
            time: 1,
            event: EphemeralEvent::TextDelta(payload::TextDelta {
                assistant_message_id: MessageId::new(),
                ordinal: 0,
                delta: "hi".into(),
            }),
        })
    }

    #[test]
    fn a_follower_gets_only_its_session_serialized_once_and_everyone_gets_everything() {
        let hub = Hub::default();
        let (mine, other) = (SessionId::new(), SessionId::new());
        let mut all = hub.subscribe();
        let mut first = hub.follow(mine);
        let mut second = hub.follow(mine);
        hub.publish(durable(other, 1));
        hub.publish(durable(mine, 7));
        hub.publish(delta(mine));

        for follower in [&mut first, &mut second] {
            let event = follower.try_recv().unwrap();
            assert_eq!(event.seq, Some(7));
            let Live::Durable(expected) = durable(mine, 7) else {
                unreachable!()
            };
            let sent: Envelope = serde_json::from_str(&event.json).unwrap();
            assert_eq!((sent.session_id, sent.seq), (expected.session_id, 7));
            let event = follower.try_recv().unwrap();
            assert_eq!(event.seq, None);
            assert!(event.json.contains("\"delta\":\"hi\""), "{}", event.json);
            assert!(follower.try_recv().is_err(), "nothing of the other session");
        }
        // Both followers got the very same serialization.
        hub.publish(durable(mine, 8));
        let (a, b) = (first.try_recv().unwrap(), second.try_recv().unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(std::iter::from_fn(|| all.try_recv().ok()).count(), 4);
    }

    #[test]
    fn a_session_nobody_follows_any_more_is_forgotten() {
        let hub = Hub::default();
        let session = SessionId::new();
        drop(hub.follow(session));
        hub.publish(durable(session, 1));
        assert!(lock(&hub.sessions).channels.is_empty());
    }
}
