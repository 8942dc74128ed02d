//! A fake model provider on 127.0.0.1: it answers each request with the next canned HTTP
//! response (usually a recorded transcript from `tests/fixtures/providers/`), streamed in
//! small pieces so clients meet every split of the bytes, and records what it was sent.
//!
//! A transcript file is an HTTP response as it travels, minus the framing: a status line,
//! headers, an empty line, then the body byte for byte.
//!
//! ```text
//! HTTP/1.1 200 OK
//! content-type: text/event-stream
//!
//! data: {"id":"chatcmpl-1", ...}
//!
//! data: [DONE]
//!
//! ```

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One canned response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Canned {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body is cut here and the connection dropped without ending the chunked body:
    /// a transport failure after the request was sent.
    pub cut_at: Option<usize>,
    /// The response stops here and the connection stays open, silent, until the client
    /// leaves: a provider that stalled.
    pub stall: Option<Stall>,
}

/// Where a stalled response stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// Before the status line: the request was read and never answered.
    BeforeHead,
    /// After this many bytes of the body.
    InBody(usize),
}

impl Canned {
    /// Parses a transcript (see the module documentation).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (head, body) = text
            .split_once("\n\n")
            .ok_or("a transcript needs an empty line between the headers and the body")?;
        let mut lines = head.lines();
        let status_line = lines
            .next()
            .ok_or("a transcript starts with a status line")?;
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("`{status_line}` is not a status line"))?;
        let headers = lines
            .map(|line| {
                let (name, value) = line
                    .split_once(':')
                    .ok_or_else(|| format!("`{line}` is not a header"))?;
                Ok((name.trim().to_owned(), value.trim().to_owned()))
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            status,
            headers,
            body: body.as_bytes().to_vec(),
            cut_at: None,
            stall: None,
        })
    }

    /// A Chat Completions stream written for a test rather than recorded: `text` (may be
    /// empty), then `calls` (tool name, arguments), finishing with `tool_calls` when there
    /// are calls and `stop` otherwise.
    pub fn chat(text: &str, calls: &[(&str, serde_json::Value)]) -> Self {
        let chunk = |delta: serde_json::Value, finish: Option<&str>| {
            let chunk = serde_json::json!({
                "id": "chatcmpl-test",
                "object": "chat.completion.chunk",
                "created": 1_764_690_000,
                "model": "test",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            });
            format!("data: {chunk}\n\n")
        };
        let mut body = chunk(
            serde_json::json!({"role": "assistant", "content": text}),
            None,
        );
        // Call ids unique across responses, as a provider's are.
        static NEXT_CALL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        for (index, (name, arguments)) in calls.iter().enumerate() {
            let id = NEXT_CALL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            body.push_str(&chunk(
                serde_json::json!({"tool_calls": [{
                    "index": index,
                    "id": format!("call_{id}"),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments.to_string()},
                }]}),
                None,
            ));
        }
        let finish = if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        body.push_str(&chunk(serde_json::json!({}), Some(finish)));
        body.push_str("data: [DONE]\n\n");
        Self {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: body.into_bytes(),
            cut_at: None,
            stall: None,
        }
    }

    /// Reads and parses a transcript file.
    pub fn file(path: &Path) -> Self {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading the transcript {}: {e}", path.display()));
        Self::parse(&text).unwrap_or_else(|e| panic!("transcript {}: {e}", path.display()))
    }

    /// The same response, its connection dropped after `at` bytes of the body.
    pub fn cut(mut self, at: usize) -> Self {
        self.cut_at = Some(at);
        self
    }

    /// The same response, stalling at `stall` until the client gives up.
    pub fn stall(mut self, stall: Stall) -> Self {
        self.stall = Some(stall);
        self
    }
}

/// A request the fake provider received.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
    pub body: serde_json::Value,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<Canned>,
    received: Vec<Received>,
}

/// The fake provider; it serves until dropped.
pub struct FakeProvider {
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

/// Bytes written per piece of a streamed body.
const PIECE: usize = 7;

impl FakeProvider {
    /// Starts serving `responses`, one per request, in order. A request past the last
    /// gets a 500 naming the problem.
    pub async fn start(responses: Vec<Canned>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the fake provider binds a loopback port");
        let base_url = format!("http://{}", listener.local_addr().expect("a local address"));
        let state = Arc::new(Mutex::new(State {
            queue: responses.into(),
            received: Vec::new(),
        }));
        let serving = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, serving.clone()));
            }
        });
        Self {
            base_url,
            state,
            task,
        }
    }

    /// The requests received so far.
    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    /// Adds responses to the end of the queue.
    pub fn push(&self, responses: impl IntoIterator<Item = Canned>) {
        self.lock().queue.extend(responses);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>) {
    // One request per connection: the response closes it.
    let Some(received) = read_request(&mut stream).await else {
        return;
    };
    let canned = {
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.received.push(received);
        state.queue.pop_front()
    };
    let canned = canned.unwrap_or_else(|| Canned {
        status: 500,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: b"the fake provider has no response left for this request".to_vec(),
        cut_at: None,
        stall: None,
    });
    drop(respond(&mut stream, &canned).await);
}

async fn read_request(stream: &mut TcpStream) -> Option<Received> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let mut lines = head.lines();
    let mut request_line = lines.next()?.split_whitespace();
    let method = request_line.next()?.to_owned();
    let path = request_line.next()?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buffer[head_end + 4..].to_vec();
    while body.len() < length {
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..read]);
    }
    let body = serde_json::from_slice(&body[..length]).unwrap_or(serde_json::Value::Null);
    Some(Received {
        method,
        path,
        headers,
        body,
    })
}

async fn respond(stream: &mut TcpStream, canned: &Canned) -> std::io::Result<()> {
    if canned.stall == Some(Stall::BeforeHead) {
        return silent_until_closed(stream).await;
    }
    let mut head = format!("HTTP/1.1 {} Fake\r\n", canned.status);
    for (name, value) in &canned.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("transfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    let stall_at = match canned.stall {
        Some(Stall::InBody(at)) => Some(at),
        _ => None,
    };
    let end = canned
        .cut_at
        .or(stall_at)
        .unwrap_or(canned.body.len())
        .min(canned.body.len());
    for piece in canned.body[..end].chunks(PIECE) {
        stream
            .write_all(format!("{:x}\r\n", piece.len()).as_bytes())
            .await?;
        stream.write_all(piece).await?;
        stream.write_all(b"\r\n").await?;
        stream.flush().await?;
        // Let the client read this piece on its own.
        tokio::task::yield_now().await;
    }
    if stall_at.is_some() {
        return silent_until_closed(stream).await;
    }
    if canned.cut_at.is_none() {
        stream.write_all(b"0\r\n\r\n").await?;
    }
    stream.flush().await?;
    stream.shutdown().await
}

/// Keeps the connection open and says nothing until the client closes it.
async fn silent_until_closed(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut ignored = [0u8; 256];
    while stream.read(&mut ignored).await? > 0 {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transcript_parses_into_status_headers_and_the_exact_body() {
        let canned =
            Canned::parse("HTTP/1.1 429 Too Many Requests\nretry-after: 3\n\n{\"e\":1}\n").unwrap();
        assert_eq!(canned.status, 429);
        assert_eq!(canned.headers, vec![("retry-after".into(), "3".into())]);
        assert_eq!(canned.body, b"{\"e\":1}\n");
        assert!(Canned::parse("no blank line").is_err());
    }
}
