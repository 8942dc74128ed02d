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
//!
//! Events of a deferred commit ([`crate::store::Durable`]) are published only once they
//! are on disk, and everything published for their session meanwhile waits behind them
//! ([`Hub::publish_when_durable`]): durable events so that they still go out in seq
//! order, deltas so that none goes out before the step boundary that precedes it (a
//! deferred commit is a boundary: the last step's results and end, the next step's
//! start). Within a step a delta may still go out before the durable event that opened
//! its fragment ([`super::outbox`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use keel_schema::event::{Envelope, EphemeralEnvelope};
use keel_schema::id::SessionId;
use tokio::sync::broadcast;

use crate::store::Durable;

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
    /// For an ephemeral event, the seq of the last durable event of its session published
    /// before it (or known committed when the session was first followed). A follower
    /// that has already sent a later durable event (read from the log) drops it: the
    /// event is behind what the follower has shown, say a delta of a text whose end went
    /// out already.
    pub follows: u64,
    /// The event as JSON: an envelope, or an ephemeral envelope.
    pub json: String,
}

#[derive(Clone)]
pub struct Hub {
    all: broadcast::Sender<Live>,
    sessions: Arc<Mutex<Followed>>,
    waiting: Arc<Waiting>,
}

/// Sessions whose events wait for a deferred commit to reach the disk.
#[derive(Default)]
struct Waiting {
    /// How many sessions are in `sessions`: publishing checks it before taking the lock.
    count: AtomicUsize,
    sessions: Mutex<HashMap<SessionId, Queue>>,
}

/// A session's events waiting to be published, and the commits they wait for.
#[derive(Default)]
struct Queue {
    events: Vec<Live>,
    commits: VecDeque<Durable>,
}

/// The followed sessions' channels. A channel whose last follower left is dropped at
/// the session's next event, or by a sweep once the map has doubled since the last one.
#[derive(Default)]
struct Followed {
    channels: HashMap<SessionId, Channel>,
    sweep_at: usize,
}

/// A followed session's channel, and the last durable seq published through it.
struct Channel {
    sender: broadcast::Sender<Arc<Published>>,
    last_seq: u64,
}

impl Default for Hub {
    fn default() -> Self {
        Self {
            all: broadcast::channel(CAPACITY).0,
            sessions: Arc::default(),
            waiting: Arc::default(),
        }
    }
}

impl Hub {
    /// Every event, from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Live> {
        self.all.subscribe()
    }

    /// The events of `session`, from now on. `committed` is a seq of its log known to be
    /// committed (its last, read before following): ephemeral events published before
    /// any later durable one count as following it ([`Published::follows`]).
    pub fn follow(
        &self,
        session: SessionId,
        committed: u64,
    ) -> broadcast::Receiver<Arc<Published>> {
        let mut followed = lock(&self.sessions);
        if followed.channels.len() >= followed.sweep_at {
            followed
                .channels
                .retain(|_, c| c.sender.receiver_count() > 0);
            followed.sweep_at = (2 * followed.channels.len()).max(64);
        }
        let channel = followed.channels.entry(session).or_insert_with(|| Channel {
            sender: broadcast::channel(SESSION_CAPACITY).0,
            last_seq: 0,
        });
        channel.last_seq = channel.last_seq.max(committed);
        channel.sender.subscribe()
    }

    /// Hands `live` to every subscriber and to the followers of its session, after
    /// whatever of its session waits for the disk.
    pub fn publish(&self, live: Live) {
        if self.waiting.count.load(Ordering::Acquire) > 0 {
            let mut waiting = lock(&self.waiting.sessions);
            if let Some(queue) = waiting.get_mut(&session_of(&live)) {
                queue.events.push(live);
                return;
            }
        }
        self.send(live);
    }

    /// Publishes `events`, committed by a deferred write, once `durable` says they are on
    /// disk; their session's later events wait behind them. If the sync fails they are
    /// not published at all: a follower finds them in the log once a later commit has
    /// made them durable.
    pub fn publish_when_durable(
        &self,
        session: SessionId,
        events: Vec<Live>,
        mut durable: Durable,
    ) {
        let mut waiting = lock(&self.waiting.sessions);
        if let Some(queue) = waiting.get_mut(&session) {
            queue.events.extend(events);
            queue.commits.push_back(durable);
            return;
        }
        if durable.is_durable() {
            drop(waiting);
            for live in events {
                self.send(live);
            }
            return;
        }
        waiting.insert(
            session,
            Queue {
                events,
                commits: VecDeque::from([durable]),
            },
        );
        self.waiting.count.fetch_add(1, Ordering::Release);
        drop(waiting);
        let hub = self.clone();
        tokio::spawn(async move { hub.release_when_durable(session).await });
    }

    /// Waits for each commit `session`'s queue waits for (later commits reach the disk
    /// no earlier than earlier ones), then publishes the queue.
    async fn release_when_durable(&self, session: SessionId) {
        let mut synced = true;
        loop {
            let durable = {
                let mut waiting = lock(&self.waiting.sessions);
                let Some(queue) = waiting.get_mut(&session) else {
                    return;
                };
                match queue.commits.pop_front() {
                    Some(durable) => durable,
                    None => {
                        // Published under the lock, and counted out only after, so that
                        // nothing published meanwhile overtakes the queue: `publish` skips
                        // the lock only once no queue is counted.
                        let queue = waiting.remove(&session).unwrap_or_default();
                        // Without the sync only the deltas go: the durable events are
                        // found in the log once a later commit has made them durable.
                        for live in queue.events {
                            if synced || matches!(live, Live::Ephemeral(_)) {
                                self.send(live);
                            }
                        }
                        self.waiting.count.fetch_sub(1, Ordering::Release);
                        return;
                    }
                }
            };
            if let Err(e) = durable.wait().await {
                tracing::error!(%session, error = %e, "events not on disk are not published");
                synced = false;
            }
        }
    }

    fn send(&self, live: Live) {
        let session = session_of(&live);
        let seq = match &live {
            Live::Durable(envelope) | Live::Remote(envelope) => Some(envelope.seq),
            Live::Ephemeral(_) => None,
        };
        let followers = {
            let mut followed = lock(&self.sessions);
            match followed.channels.get_mut(&session) {
                Some(channel) if channel.sender.receiver_count() == 0 => {
                    followed.channels.remove(&session);
                    None
                }
                Some(channel) => {
                    channel.last_seq = channel.last_seq.max(seq.unwrap_or(0));
                    Some((channel.sender.clone(), channel.last_seq))
                }
                None => None,
            }
        };
        if let Some((followers, follows)) = followers {
            let json = match &live {
                Live::Durable(envelope) | Live::Remote(envelope) => envelope_json(envelope),
                Live::Ephemeral(event) => serde_json::to_string(event).ok(),
            };
            if let Some(json) = json {
                // A follower that left meanwhile is fine.
                drop(followers.send(Arc::new(Published { seq, follows, json })));
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

fn session_of(live: &Live) -> SessionId {
    match live {
        Live::Durable(envelope) | Live::Remote(envelope) => envelope.session_id,
        Live::Ephemeral(event) => event.session_id,
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
pub(crate) mod tests {
    use keel_schema::event::{DurableEvent, EphemeralEnvelope, EphemeralEvent, payload};
    use keel_schema::id::{EventId, MessageId};

    use super::*;

    pub(crate) fn durable(session: SessionId, seq: u64) -> Live {
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

    pub(crate) fn delta(session: SessionId) -> Live {
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
        let mut first = hub.follow(mine, 0);
        let mut second = hub.follow(mine, 0);
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

    /// Receives what `follower` gets within a moment.
    async fn received(follower: &mut broadcast::Receiver<Arc<Published>>) -> Vec<Option<u64>> {
        let mut seqs = Vec::new();
        while let Ok(Ok(event)) =
            tokio::time::timeout(std::time::Duration::from_millis(200), follower.recv()).await
        {
            seqs.push(event.seq);
        }
        seqs
    }

    #[tokio::test]
    async fn a_deferred_commits_events_go_out_once_on_disk_and_what_follows_waits_behind() {
        let hub = Hub::default();
        let (mine, other) = (SessionId::new(), SessionId::new());
        let mut follower = hub.follow(mine, 0);
        let mut others = hub.follow(other, 0);
        let (synced, on_disk) = tokio::sync::oneshot::channel();
        hub.publish_when_durable(
            mine,
            vec![durable(mine, 5), durable(mine, 6)],
            Durable::later(on_disk),
        );
        hub.publish(delta(mine));
        hub.publish(durable(mine, 7));
        hub.publish(durable(other, 1));
        assert_eq!(received(&mut follower).await, [], "nothing before the sync");
        assert_eq!(
            received(&mut others).await,
            [Some(1)],
            "other sessions go on"
        );

        synced.send(Ok(())).unwrap();
        assert_eq!(
            received(&mut follower).await,
            [Some(5), Some(6), None, Some(7)]
        );
        hub.publish(durable(mine, 8));
        assert_eq!(received(&mut follower).await, [Some(8)], "no longer held");
    }

    /// The released queue and an event published while it goes out race on two threads;
    /// the event must come after the whole queue, every time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_event_published_while_a_queue_is_released_goes_out_after_it() {
        let hub = Hub::default();
        let session = SessionId::new();
        let mut all = hub.subscribe();
        let (mut seq, mut received) = (0, 0);
        for _ in 0..2_000 {
            let (synced, on_disk) = tokio::sync::oneshot::channel();
            let queued = (1..=8).map(|i| durable(session, seq + i)).collect();
            hub.publish_when_durable(session, queued, Durable::later(on_disk));
            synced.send(Ok(())).unwrap();
            tokio::task::yield_now().await;
            hub.publish(durable(session, seq + 9));
            seq += 9;
            while received < seq {
                let Ok(Live::Durable(envelope)) = all.recv().await else {
                    panic!("only durable events are published");
                };
                received += 1;
                assert_eq!(envelope.seq, received, "published out of order");
            }
        }
    }

    #[tokio::test]
    async fn events_whose_sync_failed_are_left_to_the_log() {
        let hub = Hub::default();
        let session = SessionId::new();
        let mut follower = hub.follow(session, 0);
        let (synced, on_disk) = tokio::sync::oneshot::channel();
        hub.publish_when_durable(session, vec![durable(session, 2)], Durable::later(on_disk));
        hub.publish(delta(session));
        synced.send(Err("no disk".into())).unwrap();
        assert_eq!(received(&mut follower).await, [None]);
    }

    #[test]
    fn a_session_nobody_follows_any_more_is_forgotten() {
        let hub = Hub::default();
        let session = SessionId::new();
        drop(hub.follow(session, 0));
        hub.publish(durable(session, 1));
        assert!(lock(&hub.sessions).channels.is_empty());
    }
}
