//! The event streams.
//!
//! `GET /api/session/{id}/log`: durable events after `after` (or `Last-Event-ID`), each
//! with `id: <seq>`, then one `event: synced`, then live events while `follow`. The
//! stream follows only its session ([`crate::runner::live`]), subscribing before the
//! history is read, and is driven by the response body itself ([`LogStream`]): an event
//! goes from the session's channel to the connection with no task or queue between. A
//! live durable event goes out as published when it is the next seq after the last one
//! sent; any other gap makes the stream read the log past that seq, so a reconnect at
//! any point yields every durable event exactly once, in order. A periodic catch-up read
//! covers anything a notification missed. Ephemeral events keep the session's publish
//! order too: one published before a durable event the stream has already sent from the
//! log is dropped ([`route`]).
//!
//! `GET /api/event`: live events of all sessions. Each subscriber has a bounded queue; one
//! that falls behind is sent `event: lagged` and disconnected, never silently skipped.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use keel_schema::api::{Lagged, LaggedType, LogQuery, Synced, SyncedType};
use keel_schema::event::Envelope;
use keel_schema::id::SessionId;
use tokio::sync::{broadcast, mpsc};

use super::extract::SessionPath;
use super::{ApiError, AppState};
use crate::runner::Live;
use crate::runner::live::{Published, envelope_json};
use crate::store::Store;

/// An event stream, with `X-Accel-Buffering: no` so a reverse proxy that buffers
/// responses (nginx) passes each event on at once.
type Events = (
    [(axum::http::HeaderName, &'static str); 1],
    Sse<
        axum::response::sse::KeepAliveStream<
            futures::stream::BoxStream<'static, Result<Event, Infallible>>,
        >,
    >,
);

/// How many events are read from the log at a time.
const PAGE: u32 = 500;

fn stream(
    events: futures::stream::BoxStream<'static, Result<Event, Infallible>>,
    heartbeat: std::time::Duration,
) -> Events {
    let sse = Sse::new(events).keep_alive(KeepAlive::new().interval(heartbeat));
    (
        [(
            axum::http::HeaderName::from_static("x-accel-buffering"),
            "no",
        )],
        sse,
    )
}

fn durable(envelope: &Envelope) -> Option<Event> {
    envelope_json(envelope).map(|json| Event::default().id(envelope.seq.to_string()).data(json))
}

pub async fn session_log(
    State(state): State<AppState>,
    SessionPath(id): SessionPath,
    query: Result<Query<LogQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Events, ApiError> {
    let Query(query) = query?;
    let ephemeral = match query.include.as_deref() {
        None => false,
        Some("ephemeral") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "include=`{other}` is not known (use include=ephemeral)"
            )));
        }
    };
    let resume = headers
        .get("last-event-id")
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| ApiError::bad_request("Last-Event-ID must be a seq"))
        })
        .transpose()?;
    let after = resume.or(query.after).unwrap_or(0);
    let follow = query.follow.unwrap_or(true);
    let Some(committed) = state.store.last_seq(id).await? else {
        return Err(ApiError::not_found(format!("no session {id}")));
    };

    // Subscribe before reading the history, so nothing committed meanwhile is missed.
    let live = state.runner.follow(id, committed);
    let log = LogStream {
        store: state.store.clone(),
        id,
        live,
        ephemeral,
        follow,
        last: after,
        read: VecDeque::new(),
        phase: Phase::History,
        tick: {
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + state.heartbeat,
                state.heartbeat,
            );
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick
        },
        _open: crate::metrics::stream_opened(),
    };
    let events = futures::stream::unfold(log, |mut log| async move {
        let event = log.next().await?;
        Some((Ok(event), log))
    });
    Ok(stream(Box::pin(events), state.heartbeat))
}

/// A session's log stream, driven by the response body that sends it: no task or queue
/// of its own between the session's channel and the connection.
struct LogStream {
    store: Store,
    id: SessionId,
    live: broadcast::Receiver<Arc<Published>>,
    ephemeral: bool,
    follow: bool,
    /// The last durable seq sent.
    last: u64,
    /// Events read from the log, not sent yet.
    read: VecDeque<Event>,
    phase: Phase,
    /// A catch-up read every heartbeat, for anything a notification missed.
    tick: tokio::time::Interval,
    _open: crate::metrics::StreamGuard,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading the history; `synced` follows it.
    History,
    /// Reading the log past what was sent, then following again.
    CatchUp,
    Following,
    Ended,
}

impl LogStream {
    /// The next event to send; `None` ends the stream.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.read.pop_front() {
                return Some(event);
            }
            match self.phase {
                Phase::Ended => return None,
                Phase::History | Phase::CatchUp => {
                    let page = match self.store.read_log(self.id, self.last, PAGE).await {
                        Ok(page) => page,
                        Err(e) => {
                            tracing::error!(session = %self.id, error = %e, "reading the log failed");
                            self.phase = Phase::Ended;
                            return None;
                        }
                    };
                    if let Some(end) = page.last().map(|e| e.seq) {
                        self.read.extend(page.iter().filter_map(durable));
                        self.last = end;
                        continue;
                    }
                    if self.phase == Phase::CatchUp {
                        self.phase = Phase::Following;
                        continue;
                    }
                    self.phase = if self.follow {
                        Phase::Following
                    } else {
                        Phase::Ended
                    };
                    let marker = Synced {
                        kind: SyncedType::Synced,
                        last_seq: self.last,
                    };
                    let data = serde_json::to_string(&marker).unwrap_or_default();
                    return Some(Event::default().event("synced").data(data));
                }
                Phase::Following => {
                    tokio::select! {
                        item = self.live.recv() => match item {
                            // The next durable event goes out as published; a later one
                            // means something was missed, and the log has it.
                            Ok(published) => match route(&published, self.last, self.ephemeral) {
                                Route::Send => {
                                    let mut event = Event::default().data(&published.json);
                                    if let Some(seq) = published.seq {
                                        event = event.id(seq.to_string());
                                        self.last = seq;
                                    }
                                    return Some(event);
                                }
                                Route::Skip => {}
                                Route::CatchUp => self.phase = Phase::CatchUp,
                            },
                            Err(broadcast::error::RecvError::Lagged(_)) => self.phase = Phase::CatchUp,
                            Err(broadcast::error::RecvError::Closed) => {
                                self.phase = Phase::Ended;
                            }
                        },
                        _ = self.tick.tick() => self.phase = Phase::CatchUp,
                    }
                }
            }
        }
    }
}

/// What a log stream does with a live event, given the last durable seq it sent.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Send,
    Skip,
    /// Something was missed: the log has it.
    CatchUp,
}

/// The next durable event goes out as published; a later one means something was
/// missed. An ephemeral event goes out only while the stream has sent nothing past the
/// durable event it follows: once a catch-up read has sent a later one (a fragment's
/// end, say), a delta published before that event reached the stream is behind what
/// the client has, and the durable event already carries its content.
fn route(published: &Published, last: u64, ephemeral: bool) -> Route {
    match published.seq {
        Some(seq) if seq == last + 1 => Route::Send,
        Some(seq) if seq > last => Route::CatchUp,
        Some(_) => Route::Skip,
        None if ephemeral && published.follows >= last => Route::Send,
        None => Route::Skip,
    }
}

/// Events a `/api/event` subscriber may have waiting before it counts as fallen behind.
const SUBSCRIBER_QUEUE: usize = 256;

pub async fn events(State(state): State<AppState>) -> Events {
    let mut live = state.runner.subscribe();
    // One slot more than the queue, kept for the `lagged` message.
    let (tx, mut rx) = mpsc::channel(SUBSCRIBER_QUEUE + 1);
    tokio::spawn(async move {
        let _open = crate::metrics::stream_opened();
        let lagged = |reason: String| {
            crate::metrics::stream_lagged();
            tracing::warn!(%reason, "an /api/event subscriber fell behind and is disconnected");
            let lagged = Lagged {
                kind: LaggedType::Lagged,
                reason: format!("{reason}; reconnect and catch up from each session's log"),
            };
            let data = serde_json::to_string(&lagged).unwrap_or_default();
            // The reserved slot is free: this task is the only sender.
            drop(tx.try_send(Event::default().event("lagged").data(data)));
        };
        loop {
            let event = tokio::select! {
                event = live.recv() => event,
                () = tx.closed() => return,
            };
            let event = match event {
                Ok(Live::Durable(envelope) | Live::Remote(envelope)) => {
                    serde_json::to_string(&envelope)
                }
                Ok(Live::Ephemeral(event)) => serde_json::to_string(&event),
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    return lagged(format!(
                        "this subscriber missed {missed} events and is disconnected"
                    ));
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            let Ok(data) = event else { continue };
            if tx.capacity() <= 1 {
                return lagged(format!(
                    "this subscriber left {SUBSCRIBER_QUEUE} events unread and is disconnected"
                ));
            }
            if tx.send(Event::default().data(data)).await.is_err() {
                return;
            }
        }
    });
    let events = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok)));
    stream(Box::pin(events), state.heartbeat)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use keel_schema::id::SessionId;

    use super::*;
    use crate::runner::live::Hub;
    use crate::runner::live::tests::{delta, durable};

    /// What a stream whose catch-up read reached `last` does with each live event.
    fn routes(live: &mut broadcast::Receiver<Arc<Published>>, mut last: u64) -> Vec<Route> {
        let mut routes = Vec::new();
        while let Ok(published) = live.try_recv() {
            let route = route(&published, last, true);
            if route == Route::Send
                && let Some(seq) = published.seq
            {
                last = seq;
            }
            routes.push(route);
        }
        routes
    }

    #[test]
    fn a_delta_published_before_a_durable_event_the_stream_already_sent_is_dropped() {
        let hub = Hub::default();
        let session = SessionId::new();
        // Seq 4 is committed when the stream opens; its catch-up read then finds 5 too,
        // committed before the delta that was published ahead of it reached the stream.
        let mut live = hub.follow(session, 4);
        hub.publish(delta(session));
        hub.publish(durable(session, 5));
        hub.publish(delta(session));
        assert_eq!(
            routes(&mut live, 5),
            [Route::Skip, Route::Skip, Route::Send],
            "the delta behind seq 5 is dropped, seq 5 is not sent twice, the next delta goes out",
        );
    }

    #[test]
    fn a_stream_in_step_with_the_hub_sends_everything_in_order() {
        let hub = Hub::default();
        let session = SessionId::new();
        let mut live = hub.follow(session, 4);
        hub.publish(delta(session));
        hub.publish(durable(session, 5));
        hub.publish(delta(session));
        hub.publish(durable(session, 7));
        assert_eq!(
            routes(&mut live, 4),
            [Route::Send, Route::Send, Route::Send, Route::CatchUp],
        );
    }

    #[test]
    fn a_stream_without_ephemeral_events_skips_them() {
        let published = Published {
            seq: None,
            follows: 3,
            json: String::new(),
        };
        assert_eq!(route(&published, 3, false), Route::Skip);
        assert_eq!(route(&published, 3, true), Route::Send);
    }
}
