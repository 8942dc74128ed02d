//! Following a session's durable log: `GET /api/session/{id}/log` as a typed stream.
//!
//! The stream owns its reconnects instead of leaving them to the SSE library, because
//! only it knows the last seq it handed out:
//! - every connection asks for the events after that seq (`Last-Event-ID`), so a dropped
//!   connection resumes without losing or repeating an event;
//! - a durable event whose seq is not the next one is a gap: the connection is dropped
//!   and the missing events are asked for again; a gap that does not heal is an error;
//! - the server sends a comment heartbeat (every 15 s by default); a connection that
//!   stays silent for [`LogOptions::heartbeat_timeout`] is presumed dead and replaced;
//! - answers Keel gives on purpose (401, 404, 400 …) end the stream with [`Error::Api`];
//!   a server that cannot be reached is retried with backoff, up to
//!   [`LogOptions::max_reconnects`] attempts in a row without progress.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use eventsource_client as es;
use eventsource_client::Client as _;
use futures::{Stream, StreamExt};
use keel_schema::api::{ErrorBody, LogItem, Synced};
use keel_schema::event::{Envelope, EphemeralEnvelope};
use keel_schema::id::SessionId;
use launchdarkly_sdk_transport::{ByteStream, HyperTransport};

use crate::{Client, Error};

/// How a [`LogStream`] reads the log. `LogOptions::default()` follows from the start.
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// Send durable events with seq greater than this.
    pub after: u64,
    /// Keep following live events after the history (`synced`); when false the stream
    /// ends after `synced`.
    pub follow: bool,
    /// Interleave ephemeral events (text and reasoning deltas, tool progress).
    pub ephemeral: bool,
    /// A connection that sends nothing, not even a heartbeat, for this long is replaced.
    /// Keep it a few times the server's heartbeat interval.
    pub heartbeat_timeout: Duration,
    /// The wait before the first reconnect; it doubles on each failure in a row.
    pub reconnect_delay: Duration,
    /// The longest wait between reconnects.
    pub max_reconnect_delay: Duration,
    /// Failed connections in a row, without a single event between them, before the
    /// stream gives up with the last error.
    pub max_reconnects: u32,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            after: 0,
            follow: true,
            ephemeral: false,
            heartbeat_timeout: Duration::from_secs(45),
            reconnect_delay: Duration::from_millis(250),
            max_reconnect_delay: Duration::from_secs(10),
            max_reconnects: 10,
        }
    }
}

/// How often one gap may be asked for again before the stream reports it.
const GAP_RETRIES: u32 = 3;

/// The largest error body read from a refused stream request.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Durable events in seq order, each exactly once, with the `synced` marker after the
/// history and, when asked for, ephemeral events between them. Ends after `synced` when
/// not following, and after an error (the last item is then an `Err`).
pub struct LogStream {
    inner: Pin<Box<dyn Stream<Item = Result<LogItem, Error>> + Send>>,
}

impl std::fmt::Debug for LogStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStream").finish_non_exhaustive()
    }
}

impl Stream for LogStream {
    type Item = Result<LogItem, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl Client {
    /// Follows session `id`'s durable log from the event after `after` (0: the start).
    /// See [`LogStream`] and [`LogOptions`]; [`Client::session_log_with`] sets the rest.
    pub fn session_log(&self, id: SessionId, after: u64) -> LogStream {
        self.session_log_with(
            id,
            LogOptions {
                after,
                ..LogOptions::default()
            },
        )
    }

    /// Reads session `id`'s log as `options` say.
    pub fn session_log_with(&self, id: SessionId, options: LogOptions) -> LogStream {
        let reader = Reader {
            client: self.clone(),
            id,
            last: options.after,
            options,
            connection: None,
            synced: false,
            failures: 0,
            gap: None,
            last_error: None,
            done: false,
        };
        let inner = futures::stream::unfold(reader, |mut reader| async move {
            let item = reader.next().await?;
            Some((item, reader))
        });
        LogStream {
            inner: Box::pin(inner),
        }
    }
}

type Connection = es::BoxStream<es::Result<es::SSE>>;

struct Reader {
    client: Client,
    id: SessionId,
    options: LogOptions,
    /// The last seq handed out.
    last: u64,
    connection: Option<Connection>,
    /// Whether `synced` has been handed out (it is, once per stream).
    synced: bool,
    /// Connections in a row that failed before any event arrived.
    failures: u32,
    /// The gap last seen (expected seq, received seq) and how often it was asked for.
    gap: Option<((u64, u64), u32)>,
    /// Why the last connection was dropped, reported if the stream gives up.
    last_error: Option<Error>,
    done: bool,
}

/// What one SSE message means to the reader.
enum Accepted {
    Item(Box<LogItem>),
    Skip,
    /// Durable seq `got` arrived when `expected` was next.
    Gap {
        expected: u64,
        got: u64,
    },
}

impl Reader {
    async fn next(&mut self) -> Option<Result<LogItem, Error>> {
        loop {
            if self.done {
                return None;
            }
            let Some(connection) = self.connection.as_mut() else {
                if self.failures > 0 {
                    tokio::time::sleep(self.backoff()).await;
                }
                match self.connect() {
                    Ok(connection) => self.connection = Some(connection),
                    Err(e) => return self.fail(e),
                }
                continue;
            };
            let message =
                match tokio::time::timeout(self.options.heartbeat_timeout, connection.next()).await
                {
                    Ok(message) => message,
                    Err(_silent) => {
                        self.reconnect(Error::Heartbeat(self.options.heartbeat_timeout));
                        if let Some(error) = self.given_up() {
                            return Some(Err(error));
                        }
                        continue;
                    }
                };
            match message {
                Some(Ok(es::SSE::Connected(_) | es::SSE::Comment(_))) => {}
                Some(Ok(es::SSE::Event(event))) => match self.accept(event) {
                    Ok(Accepted::Item(item)) => {
                        let item = *item;
                        self.failures = 0;
                        if matches!(item, LogItem::Synced(_)) && !self.options.follow {
                            self.done = true;
                        }
                        return Some(Ok(item));
                    }
                    Ok(Accepted::Skip) => {}
                    Ok(Accepted::Gap { expected, got }) => {
                        let retries = match self.gap {
                            Some((gap, retries)) if gap == (expected, got) => retries + 1,
                            _ => 1,
                        };
                        if retries > GAP_RETRIES {
                            return self.fail(Error::LogGap { expected, got });
                        }
                        self.gap = Some(((expected, got), retries));
                        self.connection = None;
                    }
                    Err(e) => return self.fail(e),
                },
                Some(Err(es::Error::UnexpectedResponse(response, body))) => {
                    let error = refused(response.status(), body.into_stream()).await;
                    // Keel's own answers (bad token, unknown session …) do not change by
                    // asking again; anything else (a proxy's 502 …) may.
                    if matches!(error, Error::Api { .. }) {
                        return self.fail(error);
                    }
                    self.reconnect(error);
                    if let Some(error) = self.given_up() {
                        return Some(Err(error));
                    }
                }
                Some(Err(e)) => {
                    self.reconnect(Error::Stream(e.to_string()));
                    if let Some(error) = self.given_up() {
                        return Some(Err(error));
                    }
                }
                None => {
                    self.reconnect(Error::Stream("the server closed the stream".into()));
                    if let Some(error) = self.given_up() {
                        return Some(Err(error));
                    }
                }
            }
        }
    }

    fn connect(&self) -> Result<Connection, Error> {
        let mut url = format!(
            "{}/api/session/{}/log?follow={}",
            self.client.base_url, self.id, self.options.follow
        );
        if self.options.ephemeral {
            url.push_str("&include=ephemeral");
        }
        let invalid = |e: es::Error| Error::Stream(format!("cannot request {url}: {e}"));
        let mut builder = es::ClientBuilder::for_url(&url)
            .map_err(invalid)?
            .last_event_id(self.last.to_string())
            .reconnect(es::ReconnectOptions::reconnect(false).build());
        if let Some(token) = &self.client.token {
            builder = builder
                .header("authorization", &format!("Bearer {token}"))
                .map_err(invalid)?;
        }
        let setup = |e: std::io::Error| Error::Stream(format!("cannot set up HTTP: {e}"));
        Ok(match &self.client.tls {
            None => {
                let transport = HyperTransport::builder().build_http().map_err(setup)?;
                builder.build_with_transport(transport).stream()
            }
            Some(tls) => {
                let connector = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config((**tls).clone())
                    .https_only()
                    .enable_http1()
                    .build();
                let transport = HyperTransport::builder()
                    .build_with_connector(connector)
                    .map_err(setup)?;
                builder.build_with_transport(transport).stream()
            }
        })
    }

    /// Decodes one SSE message and checks its seq against the last one handed out.
    fn accept(&mut self, event: es::Event) -> Result<Accepted, Error> {
        let decode = |source| Error::Decode {
            path: format!("/api/session/{}/log", self.id),
            source,
        };
        if event.event_type == "synced" {
            let marker: Synced = serde_json::from_str(&event.data).map_err(decode)?;
            if self.synced {
                return Ok(Accepted::Skip);
            }
            self.synced = true;
            return Ok(Accepted::Item(Box::new(LogItem::Synced(marker))));
        }
        // Durable events carry a seq; ephemeral ones do not. (`event.id` cannot tell
        // them apart: SSE keeps the last id for messages that do not set one.)
        let data: serde_json::Value = serde_json::from_str(&event.data).map_err(decode)?;
        if data.get("seq").is_none() {
            let ephemeral: EphemeralEnvelope = serde_json::from_value(data).map_err(decode)?;
            return Ok(Accepted::Item(Box::new(LogItem::Ephemeral(ephemeral))));
        }
        let envelope: Envelope = serde_json::from_value(data).map_err(decode)?;
        if envelope.session_id != self.id {
            return Err(Error::Stream(format!(
                "the log of {} sent an event of {}",
                self.id, envelope.session_id
            )));
        }
        let expected = self.last + 1;
        if envelope.seq < expected {
            return Ok(Accepted::Skip);
        }
        if envelope.seq > expected {
            return Ok(Accepted::Gap {
                expected,
                got: envelope.seq,
            });
        }
        self.last = envelope.seq;
        self.gap = None;
        Ok(Accepted::Item(Box::new(LogItem::Durable(envelope))))
    }

    /// Drops the connection so the next poll makes a new one, remembering why.
    fn reconnect(&mut self, why: Error) {
        self.connection = None;
        self.failures += 1;
        self.last_error = Some(why);
    }

    /// The error to end with once too many connections in a row have failed.
    fn given_up(&mut self) -> Option<Error> {
        if self.failures <= self.options.max_reconnects {
            return None;
        }
        self.done = true;
        self.last_error.take()
    }

    fn fail(&mut self, error: Error) -> Option<Result<LogItem, Error>> {
        self.done = true;
        self.connection = None;
        Some(Err(error))
    }

    fn backoff(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(16);
        self.options
            .reconnect_delay
            .saturating_mul(1 << doublings)
            .min(self.options.max_reconnect_delay)
    }
}

/// The error for a stream request the server answered with a non-success status.
async fn refused(status: u16, mut chunks: ByteStream) -> Error {
    let mut bytes = Vec::new();
    while let Some(Ok(chunk)) = chunks.next().await {
        bytes.extend_from_slice(&chunk);
        if bytes.len() > ERROR_BODY_LIMIT {
            break;
        }
    }
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(ErrorBody { error }) => Error::Api {
            status,
            kind: error.kind,
            message: error.message,
        },
        Err(_) => Error::UnexpectedStatus {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        },
    }
}
