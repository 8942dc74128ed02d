//! The generated endpoint methods speak the documented HTTP: method, path, query, body,
//! bearer token, and the error body. A one-request fake server on 127.0.0.1 answers.

use keel_client::{Client, Error};
use keel_schema::api::{
    CreateSession, Decision, ErrorType, ListSessionsQuery, PermissionReply, RequestId, SessionId,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the fake server received.
#[derive(Debug)]
struct Received {
    request_line: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Serves one request, answering `status` with `body` (none when `body` is null), and
/// hands back what it received.
async fn serve_once(status: &'static str, body: Value) -> (String, JoinHandle<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the client closed before sending a whole request");
            buffer.extend_from_slice(&chunk[..n]);
            if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
        };
        let head = String::from_utf8(buffer[..head_end].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let request_line = lines.next().unwrap().to_owned();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .unwrap_or(0);
        let mut received_body = buffer[head_end + 4..].to_vec();
        while received_body.len() < length {
            let n = socket.read(&mut chunk).await.unwrap();
            received_body.extend_from_slice(&chunk[..n]);
        }
        let text = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        let response = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{text}",
            text.len()
        );
        socket.write_all(response.as_bytes()).await.unwrap();
        socket.shutdown().await.unwrap();
        Received {
            request_line,
            headers,
            body: received_body,
        }
    });
    (base, task)
}

fn session_json(id: &str) -> Value {
    json!({
        "id": id,
        "title": "Fix the flaky test",
        "directory": "/tmp",
        "agent": "build",
        "model": {"provider": "scripted", "id": "demo"},
        "time_created": 1,
        "time_updated": 2,
        "usage": {"input": 0, "output": 0, "reasoning": 0, "cache_read": 0, "cache_write": 0},
        "cost": 0.0,
        "last_seq": 1,
    })
}

#[tokio::test]
async fn create_session_posts_the_body_with_the_token_and_decodes_the_session() {
    let id = SessionId::new();
    let (base, server) = serve_once("201 Created", session_json(&id.to_string())).await;
    let client = Client::new(base).unwrap().with_token("s3cret");
    let session = client
        .create_session(&CreateSession {
            title: Some("Fix the flaky test".into()),
            ..CreateSession::default()
        })
        .await
        .unwrap();
    assert_eq!(session.id, id);
    assert_eq!(session.title.as_deref(), Some("Fix the flaky test"));

    let received = server.await.unwrap();
    assert_eq!(received.request_line, "POST /api/session HTTP/1.1");
    assert_eq!(received.header("authorization"), Some("Bearer s3cret"));
    assert_eq!(received.json(), json!({"title": "Fix the flaky test"}));
}

#[tokio::test]
async fn list_sessions_sends_its_query_and_no_token_when_none_is_set() {
    let (base, server) = serve_once("200 OK", json!({"items": [], "next_cursor": null})).await;
    let client = Client::new(format!("{base}/")).unwrap();
    let page = client
        .list_sessions(&ListSessionsQuery {
            cursor: Some("abc".into()),
            limit: Some(5),
        })
        .await
        .unwrap();
    assert!(page.items.is_empty());
    let received = server.await.unwrap();
    assert_eq!(
        received.request_line,
        "GET /api/session?cursor=abc&limit=5 HTTP/1.1"
    );
    assert_eq!(received.header("authorization"), None);
}

#[tokio::test]
async fn path_parameters_are_placed_in_the_path() {
    let session = SessionId::new();
    let request = RequestId::new();
    let (base, server) = serve_once("200 OK", json!({"accepted": true})).await;
    let client = Client::new(base).unwrap();
    let ack = client
        .reply_permission(
            session,
            request,
            &PermissionReply {
                decision: Decision::Always,
            },
        )
        .await
        .unwrap();
    assert!(ack.accepted);
    let received = server.await.unwrap();
    assert_eq!(
        received.request_line,
        format!("POST /api/session/{session}/permission/{request} HTTP/1.1")
    );
    assert_eq!(received.json(), json!({"decision": "always"}));
}

#[tokio::test]
async fn an_error_body_becomes_a_typed_api_error() {
    let (base, server) = serve_once(
        "404 Not Found",
        json!({"error": {"type": "not_found", "message": "no session ses_x"}}),
    )
    .await;
    let client = Client::new(base).unwrap();
    let err = client.get_session(SessionId::new()).await.unwrap_err();
    server.await.unwrap();
    match err {
        Error::Api {
            status,
            kind,
            message,
        } => {
            assert_eq!((status, kind), (404, ErrorType::NotFound));
            assert_eq!(message, "no session ses_x");
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_success_body_of_the_wrong_shape_is_a_decode_error_naming_the_path() {
    let (base, server) = serve_once("200 OK", json!({"ok": "yes"})).await;
    let err = Client::new(base).unwrap().health().await.unwrap_err();
    server.await.unwrap();
    assert!(
        matches!(&err, Error::Decode { path, .. } if path == "/api/health"),
        "{err:?}"
    );
}

#[tokio::test]
async fn delete_session_expects_no_body() {
    let id = SessionId::new();
    let (base, server) = serve_once("204 No Content", Value::Null).await;
    Client::new(base).unwrap().delete_session(id).await.unwrap();
    let received = server.await.unwrap();
    assert_eq!(
        received.request_line,
        format!("DELETE /api/session/{id} HTTP/1.1")
    );
}

#[test]
fn a_base_url_without_a_scheme_is_refused() {
    assert!(matches!(
        Client::new("127.0.0.1:4096"),
        Err(Error::BaseUrl(url)) if url == "127.0.0.1:4096"
    ));
}
