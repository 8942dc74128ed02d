//! HTTPS end to end: `keel serve --tls-cert --tls-key`, keel-client and the CLI trusting
//! a private CA, a client that does not trust it refused, and unusable files refused at
//! start with a clear error.

use std::process::Command;

use keel_client::schema::api::{CreateSession, PromptRequest};
use keel_client::schema::event::DurableEvent;
use keel_client::{Client, Error};
use keel_tests::{Server, keel_binary, read_until, workspace_root};

fn fixture(name: &str) -> String {
    workspace_root()
        .join("tests/fixtures/tls")
        .join(name)
        .display()
        .to_string()
}

fn https_server() -> Server {
    let (cert, key) = (fixture("server.pem"), fixture("server.key"));
    Server::start(&["--tls-cert", &cert, "--tls-key", &key])
}

fn ca() -> Vec<u8> {
    std::fs::read(fixture("ca.pem")).expect("the test CA")
}

#[tokio::test]
async fn a_session_runs_and_its_log_streams_over_https() {
    let server = https_server();
    assert!(
        server.base_url.starts_with("https://"),
        "{}",
        server.base_url
    );
    let client = Client::new(&server.base_url)
        .and_then(|c| c.with_ca_certificate(&ca()))
        .expect("a client trusting the test CA");
    let session = client
        .create_session(&CreateSession::default())
        .await
        .expect("created over https")
        .id;
    let mut log = client.session_log(session, 0);
    client
        .prompt(session, &PromptRequest::text("What is here?"))
        .await
        .expect("prompted over https");
    let events = read_until(&mut log, |e| {
        matches!(e.event, DurableEvent::ExecutionSettled(_))
    })
    .await;
    assert!(
        events
            .iter()
            .any(|e| matches!(e.event, DurableEvent::ToolCalled(_))),
        "the demo model's tool call came through the stream"
    );
    // Every seq once, in order, over the TLS stream.
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());

    let listed = Command::new(keel_binary())
        .args([
            "sessions",
            "--url",
            &server.base_url,
            "--ca-cert",
            &fixture("ca.pem"),
        ])
        .env_remove("KEEL_TOKEN")
        .output()
        .expect("keel sessions runs");
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(stdout.contains(&session.to_string()), "{stdout}");
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_certificate_is_refused() {
    let server = https_server();
    let untrusting = Client::new(&server.base_url).expect("a client with the system's roots");
    match untrusting.health().await {
        Err(Error::Transport { source, .. }) => {
            let chain = format!("{source:?}");
            assert!(chain.contains("UnknownIssuer"), "{chain}");
        }
        other => panic!("an untrusted certificate must fail the request: {other:?}"),
    }
    // Plain HTTP to the TLS port gets no answer from Keel.
    let plain = server.base_url.replacen("https://", "http://", 1);
    let answered = Client::new(&plain).expect("a plain client").health().await;
    assert!(answered.is_err(), "{answered:?}");
    // And the CLI says why.
    let refused = Command::new(keel_binary())
        .args(["sessions", "--url", &server.base_url])
        .env_remove("KEEL_TOKEN")
        .env_remove("KEEL_CA_CERT")
        .output()
        .expect("keel sessions runs");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("could not reach keel"), "{stderr}");
}

#[test]
fn unusable_tls_files_stop_keel_at_start_with_the_reason() {
    let serve = |args: &[&str]| {
        let data = tempfile::tempdir().expect("a temporary directory");
        let db = format!("sqlite://{}", data.path().join("keel.db").display());
        let output = Command::new(keel_binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--db", &db])
            .args(args)
            .env_remove("KEEL_TOKEN")
            .output()
            .expect("keel serve runs");
        assert!(!output.status.success(), "{args:?} must not start");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let (cert, key, ca) = (
        fixture("server.pem"),
        fixture("server.key"),
        fixture("ca.pem"),
    );
    let missing = serve(&["--tls-cert", "/nonexistent/cert.pem", "--tls-key", &key]);
    assert!(
        missing.contains("cannot read the TLS certificate /nonexistent/cert.pem"),
        "{missing}"
    );
    let not_a_key = serve(&["--tls-cert", &cert, "--tls-key", &cert]);
    assert!(
        not_a_key.contains("is not a PEM private key"),
        "{not_a_key}"
    );
    let mismatched = serve(&["--tls-cert", &ca, "--tls-key", &key]);
    assert!(
        mismatched.contains("do not make a usable pair"),
        "{mismatched}"
    );
    let half = serve(&["--tls-cert", &cert]);
    assert!(half.contains("--tls-key"), "{half}");
}
