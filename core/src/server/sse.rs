//! The event streams.
//!
//! `GET /api/session/{id}/log`: durable events after `after` (or `Last-Event-ID`), each
//! with `id: <seq>`, then one `event: synced`, then live events while `follow`. The
//! stream follows only its session ([`crate::runner::live`]), subscribing before the
//! history is read. A live durable event goes out as published when it is the next seq
//! after the last one sent; any other gap makes the stream read the log past that seq,
//! so a reconnect at any point yields every durable event exactly once, in order. A
//! periodic catch-up read covers anything a notification missed. Ephemeral events keep
//! the session's publish order too: one published before a durable event the stream has
//! already sent from the log is dropped ([`route`]).
//!
//! `GET /api/event`: live events of all sessions. Each subscriber has a bounded queue; one
//! that falls behind is sent `event: lagged` and disconnected, never silently skipped.

use std::convert::Infallible;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use keel_schema::api::{Lagged, LaggedType, LogQuery, Synced, SyncedType};
use keel_schema::event::Envelope;
use tokio::sync::{broadcast, mpsc};

use super::extract::SessionPath;
use super::{ApiError, AppState};
use crate::runner::Live;
use crate::runner::live::{Published, envelope_json};

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

fn stream(mut rx: mpsc::Receiver<Event>, heartbeat: std::time::Duration) -> Events {
    let events = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok)));
    let sse = Sse::new(Box::pin(events) as futures::stream::BoxStream<'static, _>)
        .keep_alive(KeepAlive::new().interval(heartbeat));
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
    let mut live = state.runner.follow(id, committed);
    let (tx, rx) = mpsc::channel(256);
    let heartbeat = state.heartbeat;
    let store = state.store.clone();
    tokio::spawn(async move {
        let _open = crate::metrics::stream_opened();
        let mut last = after;
        // Sends the log past `last`; false when the client is gone or the log unreadable.
        let catch_up = |last: u64| {
            let store = store.clone();
            let tx = tx.clone();
            async move {
                let mut last = last;
                loop {
                    let page = match store.read_log(id, last, PAGE).await {
                        Ok(page) => page,
                        Err(e) => {
                            tracing::error!(session = %id, error = %e, "reading the log failed");
                            return None;
                        }
                    };
                    let Some(end) = page.last().map(|e| e.seq) else {
                        return Some(last);
                    };
                    for envelope in &page {
                        if let Some(event) = durable(envelope)
                            && tx.send(event).await.is_err()
                        {
                            return None;
                        }
                    }
                    last = end;
                }
            }
        };
        let Some(synced) = catch_up(last).await else {
            return;
        };
        last = synced;
        let marker = Synced {
            kind: SyncedType::Synced,
            last_seq: last,
        };
        let data = serde_json::to_string(&marker).unwrap_or_default();
        if tx
            .send(Event::default().event("synced").data(data))
            .await
            .is_err()
            || !follow
        {
            return;
        }
        let mut tick = tokio::time::interval(heartbeat);
        loop {
            let read = tokio::select! {
                item = live.recv() => match item {
                    // The next durable event goes out as published; a later one means
                    // something was missed, and the log has it.
                    Ok(published) => match route(&published, last, ephemeral) {
                        Route::Send => {
                            let mut event = Event::default().data(&published.json);
                            if let Some(seq) = published.seq {
                                event = event.id(seq.to_string());
                                last = seq;
                            }
                            if tx.send(event).await.is_err() {
                                return;
                            }
                            false
                        }
                        Route::Skip => false,
                        Route::CatchUp => true,
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => true,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick() => true,
                () = tx.closed() => return,
            };
            if read {
                match catch_up(last).await {
                    Some(seq) => last = seq,
                    None => return,
                }
            }
        }
    });
    Ok(stream(rx, heartbeat))
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
    let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE + 1);
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
    stream(rx, state.heartbeat)
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
