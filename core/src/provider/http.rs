//! What the HTTP adapters share: a connection with timeouts, sending a request, turning a
//! refusal into a typed [`Error`], and reading a server-sent-events body.
//!
//! A transport failure is `TransportBeforeSend` only when the request certainly never
//! left (the connection could not be made); anything later is `TransportAfterSend`, since
//! the provider may have seen it. Every wait has a bound ([`Timeouts`]): the connection,
//! the response's head, and each gap between pieces of its body; one that runs out is
//! [`Error::Timeout`], so a stalled provider can never hold a step (and its session) busy.

use std::collections::VecDeque;
use std::time::Duration;

use futures::{Stream, StreamExt};
use reqwest::header::HeaderMap;
use reqwest::{RequestBuilder, Response, StatusCode};

use super::{Error, Event, EventStream, Stage, Timeouts};

/// The longest `retry-after` a provider may ask for that is honoured as given; longer
/// waits are cut to this (the retry policy caps it again).
pub const RETRY_AFTER_CAP: Duration = Duration::from_secs(60);

/// How much of an error body is kept in a message.
const BODY_EXCERPT: usize = 2_000;

/// Recognises a provider's context-overflow refusal from its status and body.
pub type OverflowTest = fn(StatusCode, &str) -> bool;

/// An adapter's way to its provider: a client whose connections give up after
/// `timeouts.connect`, and the other waits, enforced on every response it streams.
#[derive(Debug, Clone)]
pub struct Connection {
    client: reqwest::Client,
    timeouts: Timeouts,
}

impl Connection {
    /// Fails only when the HTTP client cannot be built at all (no usable TLS backend).
    pub fn new(timeouts: Timeouts) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            .build()?;
        Ok(Self { client, timeouts })
    }

    /// A POST to `url`, to be sent by [`Connection::stream`].
    pub fn post(&self, url: String) -> RequestBuilder {
        self.client.post(url)
    }

    /// A provider response as an [`EventStream`]: sends `request` when first polled, then
    /// decodes its SSE body with `decoder`. The stream ends after the first error.
    pub fn stream(
        &self,
        request: RequestBuilder,
        overflow: OverflowTest,
        decoder: impl Decoder,
    ) -> EventStream {
        stream(request, overflow, decoder, self.timeouts)
    }
}

/// The error of a wait of `after` that ran out at `stage`.
fn timed_out(stage: Stage, after: Duration) -> Error {
    Error::Timeout {
        stage,
        after_ms: u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Sends `request`; a refusal (any status but 2xx) becomes a typed error. The connection
/// must be made within `timeouts.connect` and the response's head (and a refusal's body)
/// arrive within `timeouts.first_byte`.
async fn send(
    request: RequestBuilder,
    overflow: OverflowTest,
    timeouts: Timeouts,
) -> Result<Response, Error> {
    tokio::time::timeout(
        timeouts.first_byte,
        send_unbounded(request, overflow, timeouts),
    )
    .await
    .unwrap_or_else(|_| Err(timed_out(Stage::FirstByte, timeouts.first_byte)))
}

async fn send_unbounded(
    request: RequestBuilder,
    overflow: OverflowTest,
    timeouts: Timeouts,
) -> Result<Response, Error> {
    let response = request.send().await.map_err(|e| {
        if e.is_connect() && e.is_timeout() {
            timed_out(Stage::Connect, timeouts.connect)
        } else {
            transport(e)
        }
    })?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let headers = response.headers().clone();
    let body = response
        .text()
        .await
        .map_err(|e| Error::TransportAfterSend(format!("reading the {status} body: {e}")))?;
    Err(refusal(status, &headers, &body, overflow))
}

/// The typed error for a refused request.
pub fn refusal(
    status: StatusCode,
    headers: &HeaderMap,
    body: &str,
    overflow: OverflowTest,
) -> Error {
    let reason = status.canonical_reason().unwrap_or(match status.as_u16() {
        529 => "Overloaded",
        _ => "Error",
    });
    let message = format!("{} {reason}: {}", status.as_u16(), error_message(body));
    if overflow(status, body) {
        return Error::ContextOverflow(message);
    }
    match status.as_u16() {
        429 => Error::RateLimit {
            retry_after_ms: retry_after(headers)
                .map(|d| u64::try_from(d.min(RETRY_AFTER_CAP).as_millis()).unwrap_or(u64::MAX)),
            message,
        },
        401 | 403 => Error::Auth(message),
        408 | 409 | 500..=599 => Error::Server {
            status: status.as_u16(),
            message,
        },
        _ => Error::BadRequest(message),
    }
}

/// A reqwest failure while sending or reading.
pub fn transport(e: reqwest::Error) -> Error {
    if e.is_connect() || e.is_builder() {
        Error::TransportBeforeSend(e.to_string())
    } else {
        Error::TransportAfterSend(e.to_string())
    }
}

/// The most useful text of an error body: the `error.message` (or `message`) of a JSON
/// body, else the body itself, shortened.
pub fn error_message(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let found = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error").filter(|e| e.is_string()))
            .and_then(|m| m.as_str())
            .map(str::to_owned)
    });
    let text = found.unwrap_or_else(|| body.trim().to_owned());
    if text.len() <= BODY_EXCERPT {
        return text;
    }
    let mut end = BODY_EXCERPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// The wait a 429 asks for: `retry-after-ms` (milliseconds), else `retry-after` in seconds
/// or as an HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.parse::<f64>().ok()) {
        return (ms.is_finite() && ms >= 0.0).then(|| Duration::from_secs_f64(ms / 1000.0));
    }
    let value = header("retry-after")?;
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Turns one provider's SSE events into Keel's [`Event`]s.
pub trait Decoder: Send + 'static {
    /// The events one SSE event completes; an error ends the response.
    fn event(&mut self, event: SseEvent) -> Result<Vec<Event>, Error>;
    /// What the end of the body means: the last events, or an error when the response
    /// was cut short.
    fn end(&mut self) -> Result<Vec<Event>, Error>;
}

/// See [`Connection::stream`].
fn stream(
    request: RequestBuilder,
    overflow: OverflowTest,
    decoder: impl Decoder,
    timeouts: Timeouts,
) -> EventStream {
    type Body = std::pin::Pin<Box<dyn Stream<Item = Result<SseEvent, Error>> + Send>>;
    enum State<D> {
        // Boxed: a request builder is far larger than the other states.
        Unsent(Box<RequestBuilder>, D),
        Reading(Body, D),
        Done,
    }
    let start = (
        State::Unsent(Box::new(request), decoder),
        VecDeque::<Result<Event, Error>>::new(),
    );
    Box::pin(futures::stream::unfold(
        start,
        move |(mut state, mut ready)| async move {
            loop {
                if let Some(item) = ready.pop_front() {
                    if item.is_err() {
                        ready.clear();
                        state = State::Done;
                    }
                    return Some((item, (state, ready)));
                }
                state = match state {
                    State::Done => return None,
                    State::Unsent(request, decoder) => {
                        match send(*request, overflow, timeouts).await {
                            Ok(response) => {
                                State::Reading(Box::pin(events(response, timeouts.idle)), decoder)
                            }
                            Err(e) => {
                                ready.push_back(Err(e));
                                State::Done
                            }
                        }
                    }
                    State::Reading(mut body, mut decoder) => match body.next().await {
                        Some(Ok(event)) => {
                            ready.extend(flatten(decoder.event(event)));
                            State::Reading(body, decoder)
                        }
                        Some(Err(e)) => {
                            ready.push_back(Err(e));
                            State::Done
                        }
                        None => {
                            ready.extend(flatten(decoder.end()));
                            State::Done
                        }
                    },
                };
            }
        },
    ))
}

fn flatten(decoded: Result<Vec<Event>, Error>) -> Vec<Result<Event, Error>> {
    match decoded {
        Ok(events) => events.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e)],
    }
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; `message` when absent.
    pub event: String,
    pub data: String,
}

/// The events of an SSE body, as the bytes arrive. A failure of the body is
/// `TransportAfterSend`, a body silent for `idle` a [`Stage::Idle`] timeout; an event cut
/// off by the end of the body is dropped (the adapter notices the missing end of the
/// response).
pub fn events(
    response: Response,
    idle: Duration,
) -> impl Stream<Item = Result<SseEvent, Error>> + Send {
    let body = response.bytes_stream();
    futures::stream::unfold(
        (body, Parser::default(), VecDeque::new(), false),
        move |(mut body, mut parser, mut ready, mut done)| async move {
            loop {
                if let Some(event) = ready.pop_front() {
                    return Some((Ok(event), (body, parser, ready, done)));
                }
                if done {
                    return None;
                }
                let Ok(piece) = tokio::time::timeout(idle, body.next()).await else {
                    done = true;
                    return Some((
                        Err(timed_out(Stage::Idle, idle)),
                        (body, parser, ready, done),
                    ));
                };
                match piece {
                    Some(Ok(bytes)) => ready.extend(parser.feed(&bytes)),
                    Some(Err(e)) => {
                        done = true;
                        let error = Error::TransportAfterSend(format!("reading the stream: {e}"));
                        return Some((Err(error), (body, parser, ready, done)));
                    }
                    None => done = true,
                }
            }
        },
    )
}

/// An incremental SSE parser (the WHATWG event-stream rules Keel's providers need:
/// `event`, `data`, comments, LF or CRLF line ends; `id` and `retry` are ignored).
#[derive(Debug, Default)]
pub struct Parser {
    /// Bytes of a line not yet ended.
    line: Vec<u8>,
    event: Option<String>,
    data: Option<String>,
}

impl Parser {
    /// Feeds bytes; returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut complete = Vec::new();
        for &byte in bytes {
            if byte != b'\n' {
                self.line.push(byte);
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if let Some(event) = self.line_ended(&String::from_utf8_lossy(&line)) {
                complete.push(event);
            }
        }
        complete
    }

    fn line_ended(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let data = self.data.take();
            let event = self.event.take();
            return data.map(|data| SseEvent {
                event: event.unwrap_or_else(|| "message".into()),
                data,
            });
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => self.event = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    fn never(_: StatusCode, _: &str) -> bool {
        false
    }

    #[test]
    fn events_survive_any_split_of_the_bytes() {
        let body = "event: a\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\n: keep-alive\n\ndata: two\n\n";
        let expected = vec![
            SseEvent {
                event: "a".into(),
                data: "{\"x\":\n1}".into(),
            },
            SseEvent {
                event: "message".into(),
                data: "two".into(),
            },
        ];
        for size in 1..body.len() {
            let mut parser = Parser::default();
            let got: Vec<SseEvent> = body
                .as_bytes()
                .chunks(size)
                .flat_map(|chunk| parser.feed(chunk))
                .collect();
            assert_eq!(got, expected, "chunks of {size}");
        }
    }

    #[test]
    fn an_event_cut_off_by_the_end_is_not_delivered() {
        let mut parser = Parser::default();
        assert!(parser.feed(b"data: half").is_empty());
        assert!(parser.feed(b"\n").is_empty());
    }

    #[test]
    fn refusals_are_typed_by_status() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("7"));
        let body = r#"{"error":{"message":"slow down","type":"rate_limit"}}"#;
        assert_eq!(
            refusal(StatusCode::TOO_MANY_REQUESTS, &headers, body, never),
            Error::RateLimit {
                retry_after_ms: Some(7_000),
                message: "429 Too Many Requests: slow down".into()
            }
        );
        let plain = HeaderMap::new();
        assert!(matches!(
            refusal(StatusCode::UNAUTHORIZED, &plain, "no", never),
            Error::Auth(_)
        ));
        assert!(matches!(
            refusal(
                StatusCode::from_u16(529).unwrap(),
                &plain,
                "overloaded",
                never
            ),
            Error::Server { status: 529, .. }
        ));
        assert!(matches!(
            refusal(StatusCode::BAD_REQUEST, &plain, "bad", never),
            Error::BadRequest(_)
        ));
        assert!(matches!(
            refusal(StatusCode::BAD_REQUEST, &plain, "too long", |_, b| b
                .contains("long")),
            Error::ContextOverflow(_)
        ));
    }

    #[test]
    fn retry_after_reads_milliseconds_seconds_and_dates_and_is_capped() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after-ms", HeaderValue::from_static("1500"));
        headers.insert("retry-after", HeaderValue::from_static("9"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(1500)));
        headers.remove("retry-after-ms");
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(9)));
        headers.insert(
            "retry-after",
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), Some(Duration::ZERO));
        headers.insert("retry-after", HeaderValue::from_static("3600"));
        let Error::RateLimit { retry_after_ms, .. } =
            refusal(StatusCode::TOO_MANY_REQUESTS, &headers, "", never)
        else {
            panic!("a 429 is a rate limit");
        };
        assert_eq!(retry_after_ms, Some(60_000));
    }
}
