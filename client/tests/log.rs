//! `Client::session_log` against a fake log server on 127.0.0.1 that plays one scripted
//! answer per connection: the stream resumes with `Last-Event-ID`, heals gaps, replaces
//! silent connections, hands out each durable event once and in order, and ends with a
//! clear error when asking again cannot help.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keel_client::schema::api::{ErrorType, LogItem};
use keel_client::schema::event::{
    DurableEvent, Envelope, EphemeralEnvelope, EphemeralEvent, Example, payload,
};
use keel_client::schema::id::{EventId, SessionId};
use keel_client::{Client, Error, LogOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the fake server does with one connection.
#[derive(Clone)]
enum Answer {
    /// Sends this SSE text, then closes the connection.
    Close(String),
    /// Sends this SSE text, then keeps the connection open and silent.
    Hang(String),
    /// Answers this status with a JSON body.
    Status(&'static str, String),
}

/// A fake log server: connection `i` gets `answers[i]` (the last one repeats) and each
/// request's head is recorded.
struct Fake {
    base_url: String,
    requests: Arc<Mutex<Vec<String>>>,
}

impl Fake {
    async fn start(answers: Vec<Answer>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            for i in 0.. {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if socket.read(&mut byte).await.unwrap() == 0 {
                        break;
                    }
                    head.push(byte[0]);
                }
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head).into_owned());
                let answer = answers[i.min(answers.len() - 1)].clone();
                let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                           cache-control: no-cache\r\nconnection: close\r\n\r\n";
                match answer {
                    Answer::Close(body) => {
                        socket.write_all(sse.as_bytes()).await.unwrap();
                        socket.write_all(body.as_bytes()).await.unwrap();
                        socket.shutdown().await.unwrap();
                    }
                    Answer::Hang(body) => {
                        socket.write_all(sse.as_bytes()).await.unwrap();
                        socket.write_all(body.as_bytes()).await.unwrap();
                        held.push(socket);
                    }
                    Answer::Status(status, body) => {
                        let response = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        socket.write_all(response.as_bytes()).await.unwrap();
                        socket.shutdown().await.unwrap();
                    }
                }
            }
        });
        Self { base_url, requests }
    }

    fn client(&self) -> Client {
        Client::new(&self.base_url).unwrap()
    }

    /// The `Last-Event-ID` of each request so far.
    fn resume_points(&self) -> Vec<u64> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .map(|head| {
                head.lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("last-event-id")
                            .then(|| value.trim().parse().unwrap())
                    })
                    .expect("every request carries Last-Event-ID")
            })
            .collect()
    }
}

fn session() -> SessionId {
    "ses_01JZ0000000000000000000000".parse().unwrap()
}

/// One durable event as the server sends it.
fn durable(seq: u64) -> String {
    let envelope = Envelope {
        id: EventId::new(),
        session_id: session(),
        seq,
        time: 1_700_000_000_000,
        event: DurableEvent::Renamed(payload::Renamed {
            title: format!("title {seq}"),
        }),
    };
    format!(
        "id: {seq}\ndata: {}\n\n",
        serde_json::to_string(&envelope).unwrap()
    )
}

fn events(seqs: impl IntoIterator<Item = u64>) -> String {
    seqs.into_iter().map(durable).collect()
}

fn synced(last: u64) -> String {
    format!("event: synced\ndata: {{\"type\":\"synced\",\"last_seq\":{last}}}\n\n")
}

/// The durable seqs of a finished stream, and `s` for each `synced`.
async fn collect(client: &Client, options: LogOptions) -> (Vec<String>, Option<Error>) {
    let mut log = client.session_log_with(session(), options);
    let mut seen = Vec::new();
    while let Some(item) = log.next().await {
        match item {
            Ok(LogItem::Durable(envelope)) => seen.push(envelope.seq.to_string()),
            Ok(LogItem::Synced(marker)) => seen.push(format!("s{}", marker.last_seq)),
            Ok(LogItem::Ephemeral(_)) => seen.push("e".into()),
            Err(e) => return (seen, Some(e)),
        }
    }
    (seen, None)
}

fn history() -> LogOptions {
    LogOptions {
        follow: false,
        reconnect_delay: Duration::from_millis(1),
        ..LogOptions::default()
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn a_dropped_connection_resumes_after_the_last_event_handed_out() {
    let fake = Fake::start(vec![
        Answer::Close(events(1..=2)),
        Answer::Close(events(3..=4) + &synced(4)),
    ])
    .await;
    let (seen, error) = collect(&fake.client(), history()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["1", "2", "3", "4", "s4"]));
    assert_eq!(fake.resume_points(), vec![0, 2]);
}

#[tokio::test]
async fn the_first_request_starts_after_the_given_seq_and_repeats_are_dropped() {
    // A server that repeats events the stream already has (here seq 5 and 6) must not
    // make them appear twice.
    let fake = Fake::start(vec![
        Answer::Close(events(6..=7)),
        Answer::Close(events(5..=8) + &synced(8)),
    ])
    .await;
    let options = LogOptions {
        after: 5,
        ..history()
    };
    let (seen, error) = collect(&fake.client(), options).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["6", "7", "8", "s8"]));
    assert_eq!(fake.resume_points(), vec![5, 7]);
}

#[tokio::test]
async fn a_gap_in_seq_is_asked_for_again() {
    let fake = Fake::start(vec![
        Answer::Close(events([1, 3])),
        Answer::Close(events(2..=3) + &synced(3)),
    ])
    .await;
    let (seen, error) = collect(&fake.client(), history()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["1", "2", "3", "s3"]));
    assert_eq!(fake.resume_points(), vec![0, 1]);
}

#[tokio::test]
async fn a_gap_that_does_not_heal_ends_the_stream_with_an_error() {
    let fake = Fake::start(vec![Answer::Close(events([1, 3]))]).await;
    let (seen, error) = collect(&fake.client(), history()).await;
    assert_eq!(seen, strings(&["1"]));
    assert!(
        matches!(
            error,
            Some(Error::LogGap {
                expected: 2,
                got: 3
            })
        ),
        "{error:?}"
    );
    assert_eq!(fake.resume_points(), vec![0, 1, 1, 1]);
}

#[tokio::test]
async fn a_connection_without_heartbeats_is_replaced() {
    // The first connection sends one event and then nothing, not even a heartbeat.
    let fake = Fake::start(vec![
        Answer::Hang(events(1..=1)),
        Answer::Close(events(2..=2) + &synced(2)),
    ])
    .await;
    let options = LogOptions {
        heartbeat_timeout: Duration::from_millis(300),
        ..history()
    };
    let (seen, error) = collect(&fake.client(), options).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["1", "2", "s2"]));
    assert_eq!(fake.resume_points()[..2], [0, 1]);
}

#[tokio::test]
async fn heartbeats_keep_a_quiet_connection() {
    // Comments arrive while no event does; synced comes last. With follow the stream
    // would go on; without it, it ends after synced.
    let heartbeats = ":\n\n".repeat(3);
    let fake = Fake::start(vec![Answer::Close(
        events(1..=1) + &heartbeats + &events(2..=2) + &synced(2),
    )])
    .await;
    let (seen, error) = collect(&fake.client(), history()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["1", "2", "s2"]));
    assert_eq!(fake.resume_points(), vec![0]);
}

#[tokio::test]
async fn following_hands_out_synced_once_and_goes_on_across_reconnects() {
    let fake = Fake::start(vec![
        Answer::Close(events(1..=1) + &synced(1) + &events(2..=2)),
        Answer::Hang(events(3..=3) + &synced(3) + &events(4..=4)),
    ])
    .await;
    let mut log = fake.client().session_log(session(), 0);
    let mut seen = Vec::new();
    while seen.len() < 5 {
        match log.next().await.unwrap().unwrap() {
            LogItem::Durable(envelope) => seen.push(envelope.seq.to_string()),
            LogItem::Synced(marker) => seen.push(format!("s{}", marker.last_seq)),
            LogItem::Ephemeral(_) => unreachable!("not asked for"),
        }
    }
    assert_eq!(seen, strings(&["1", "s1", "2", "3", "4"]));
    assert_eq!(fake.resume_points(), vec![0, 2]);
}

#[tokio::test]
async fn ephemeral_events_are_asked_for_and_handed_out_between_durable_ones() {
    let delta = EphemeralEnvelope {
        session_id: session(),
        time: 1_700_000_000_000,
        event: EphemeralEvent::TextDelta(payload::TextDelta::example()),
    };
    let delta = format!("data: {}\n\n", serde_json::to_string(&delta).unwrap());
    let fake = Fake::start(vec![Answer::Close(
        events(1..=1) + &delta + &events(2..=2) + &synced(2),
    )])
    .await;
    let options = LogOptions {
        ephemeral: true,
        ..history()
    };
    let (seen, error) = collect(&fake.client(), options).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, strings(&["1", "e", "2", "s2"]));
    let request = fake.requests.lock().unwrap()[0].clone();
    assert!(
        request.starts_with(&format!(
            "GET /api/session/{}/log?follow=false&include=ephemeral ",
            session()
        )),
        "{request}"
    );
}

#[tokio::test]
async fn keel_refusing_the_stream_ends_it_with_the_api_error_and_the_token_is_sent() {
    let body = r#"{"error":{"type":"not_found","message":"no session"}}"#;
    let fake = Fake::start(vec![Answer::Status("404 Not Found", body.into())]).await;
    let client = fake.client().with_token("sesame");
    let (seen, error) = collect(&client, history()).await;
    assert!(seen.is_empty());
    match error {
        Some(Error::Api {
            status: 404,
            kind: ErrorType::NotFound,
            message,
        }) => assert_eq!(message, "no session"),
        other => panic!("expected the 404, got {other:?}"),
    }
    let requests = fake.requests.lock().unwrap();
    assert_eq!(requests.len(), 1, "a refusal is not retried");
    assert!(
        requests[0]
            .lines()
            .any(|l| l.eq_ignore_ascii_case("authorization: Bearer sesame")),
        "{}",
        requests[0]
    );
}

#[tokio::test]
async fn an_unreachable_server_is_retried_then_reported() {
    // A port nothing listens on.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let client = Client::new(format!("http://127.0.0.1:{port}")).unwrap();
    let options = LogOptions {
        max_reconnects: 3,
        ..history()
    };
    let (seen, error) = collect(&client, options).await;
    assert!(seen.is_empty());
    assert!(matches!(error, Some(Error::Stream(_))), "{error:?}");
}
