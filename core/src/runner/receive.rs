//! Reading a model's response ahead of the step, each event stamped when it arrives.
//!
//! A step is sometimes busy with something else than reading its response: committing a
//! burst, starting a tool. Read on the step's own task, the stream would wait in the
//! socket meanwhile, and a delta's time could only be stamped when the step got to it. So
//! the response is read on a task of its own, which stamps each event the moment the
//! provider's adapter yields it (its bytes parsed), and hands it over through a bounded
//! channel; the delta's envelope carries that time, so a client's latency counts every
//! wait inside Keel, commits included.
//!
//! The task is aborted when the step drops the response (an interrupt, a failure), so a
//! provider connection never outlives the step that asked for it. A panic inside the
//! adapter ends the response with an error rather than a silent end.

use std::panic::AssertUnwindSafe;

use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use crate::clock::SharedClock;
use crate::provider::{self, Event, EventStream};

/// Events the reading task may get ahead of the step by.
const AHEAD: usize = 256;

/// A provider event, or the error that ended the response, and when it arrived (the
/// engine's clock, milliseconds).
pub(super) type Received = (Result<Event, provider::Error>, i64);

/// A response being read ahead (see the module documentation).
pub(super) struct ReadAhead {
    /// Boxed: a channel's slots are allocated 32 at a time, and an unboxed event is 176
    /// bytes, which would add 5.5 KiB to every streaming session.
    events: mpsc::Receiver<Box<Received>>,
    reader: tokio::task::JoinHandle<()>,
}

impl ReadAhead {
    /// Starts reading `stream` on its own task.
    pub(super) fn start(stream: EventStream, clock: SharedClock) -> Self {
        let (sender, events) = mpsc::channel(AHEAD);
        let reader = tokio::spawn(async move {
            let read = async {
                let mut stream = stream;
                while let Some(item) = stream.next().await {
                    if sender.send(Box::new((item, clock.now_ms()))).await.is_err() {
                        return;
                    }
                }
            };
            if AssertUnwindSafe(read).catch_unwind().await.is_err() {
                let error = provider::Error::Incomplete("the provider's adapter panicked".into());
                drop(sender.send(Box::new((Err(error), clock.now_ms()))).await);
            }
        });
        Self { events, reader }
    }

    /// The next event; `None` once the response ended.
    pub(super) async fn next(&mut self) -> Option<Received> {
        self.events.recv().await.map(|received| *received)
    }

    /// The next event if one is ready: `Some(None)` once the response ended, `None` when
    /// nothing has arrived yet.
    pub(super) fn ready(&mut self) -> Option<Option<Received>> {
        match self.events.try_recv() {
            Ok(received) => Some(Some(*received)),
            Err(TryRecvError::Disconnected) => Some(None),
            Err(TryRecvError::Empty) => None,
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;

    fn clock(at: i64) -> (Arc<ManualClock>, SharedClock) {
        let clock = Arc::new(ManualClock::new(at));
        (clock.clone(), clock)
    }

    #[tokio::test]
    async fn events_are_stamped_when_they_arrive_not_when_the_step_reads_them() {
        let (manual, shared) = clock(1_000);
        let (sender, receiver) = futures::channel::mpsc::unbounded();
        let stream: EventStream = Box::pin(receiver);
        let mut ahead = ReadAhead::start(stream, shared);
        sender.unbounded_send(Ok(Event::TextStart)).unwrap();
        // Let the reader take it, then move the clock as a busy step would.
        tokio::time::sleep(Duration::from_millis(50)).await;
        manual.advance(7);
        sender
            .unbounded_send(Ok(Event::TextDelta("hi".into())))
            .unwrap();
        drop(sender);
        let (first, at) = ahead.next().await.unwrap();
        assert!(matches!(first, Ok(Event::TextStart)));
        assert_eq!(at, 1_000);
        let (second, at) = ahead.next().await.unwrap();
        assert!(matches!(second, Ok(Event::TextDelta(_))));
        assert_eq!(at, 1_007);
        assert!(ahead.next().await.is_none(), "the response ended");
    }

    #[tokio::test]
    async fn a_dropped_response_stops_its_reader_and_a_panic_is_an_error() {
        let (_, shared) = clock(0);
        let stalled: EventStream = Box::pin(futures::stream::pending());
        let ahead = ReadAhead::start(stalled, shared.clone());
        let reader = ahead.reader.abort_handle();
        drop(ahead);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(reader.is_finished(), "no reader outlives its response");

        let panicking: EventStream = Box::pin(futures::stream::poll_fn(|_| panic!("adapter bug")));
        let mut ahead = ReadAhead::start(panicking, shared);
        let (item, _) = ahead.next().await.expect("an error, not a silent end");
        assert!(
            matches!(item, Err(provider::Error::Incomplete(_))),
            "{item:?}"
        );
    }
}
