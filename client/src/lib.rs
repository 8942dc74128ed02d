//! keel-client: a typed async client for Keel's HTTP API.
//!
//! Keel runs the agent loop of a coding agent as a durable service; this crate drives it
//! from Rust: one typed async method per route, and [`Client::session_log`], the
//! session's durable event log as a stream that survives dropped connections.
//!
//! ```no_run
//! # async fn demo() -> Result<(), keel_client::Error> {
//! use futures::StreamExt;
//! use keel_client::Client;
//! use keel_client::schema::api::{CreateSession, LogItem, Part, PromptRequest};
//! use keel_client::schema::event::DurableEvent;
//!
//! let client = Client::new("http://127.0.0.1:4096")?;
//! let session = client.create_session(&CreateSession::default()).await?;
//! client
//!     .prompt(session.id, &PromptRequest::text("What is in this directory?"))
//!     .await?;
//! let mut log = client.session_log(session.id, 0);
//! while let Some(item) = log.next().await {
//!     if let LogItem::Durable(envelope) = item? {
//!         if let DurableEvent::ExecutionSettled(_) = envelope.event {
//!             break;
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! The endpoint methods (`health`, `create_session`, `prompt`, …) are generated from the
//! route table that also produces `contracts/openapi.json`, by `cargo xtask regenerate`
//! into `generated.rs`; the transport they call, and the log stream, are written by hand.
//! The types are keel-schema's, re-exported as [`schema`].

#![warn(missing_docs)]

#[rustfmt::skip]
mod generated;
mod log;
mod tls;

pub use keel_schema as schema;
pub use log::{LogOptions, LogStream};

use keel_schema::api::{ErrorBody, ErrorType};
use reqwest::Method;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What can go wrong calling Keel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Keel answered with an error body.
    #[error("keel answered {status} ({kind:?}): {message}")]
    Api {
        /// The HTTP status.
        status: u16,
        /// The error's `type`.
        kind: ErrorType,
        /// What Keel said went wrong.
        message: String,
    },
    /// Keel (or something in between) answered with a status and body Keel does not send.
    #[error("unexpected answer {status}: {body}")]
    UnexpectedStatus {
        /// The HTTP status.
        status: u16,
        /// The body, as text.
        body: String,
    },
    /// The request could not be sent or the answer not read.
    #[error("could not reach keel at {base_url}: {source}")]
    Transport {
        /// The server the request was for.
        base_url: String,
        /// What failed.
        #[source]
        source: reqwest::Error,
    },
    /// A successful answer's body was not the documented type.
    #[error("keel's answer to {path} is not the documented shape: {source}")]
    Decode {
        /// The path the answer came from.
        path: String,
        /// Why it did not decode.
        #[source]
        source: serde_json::Error,
    },
    /// The TLS setup failed: a CA certificate that is not PEM, or no trusted roots.
    #[error("TLS: {0}")]
    Tls(String),
    /// The base URL given to [`Client::new`] is not an http or https URL.
    #[error("`{0}` is not a Keel base URL: use http://host:port")]
    BaseUrl(String),
    /// A log stream could not be read, or its connection broke (the stream reconnects
    /// on its own; this ends it only after [`LogOptions::max_reconnects`]).
    #[error("the log stream failed: {0}")]
    Stream(String),
    /// A log stream's connection sent nothing, not even a heartbeat, for this long.
    #[error("the log stream sent no heartbeat for {0:?}")]
    Heartbeat(std::time::Duration),
    /// The log skipped from one seq to a later one and asking again did not fill the gap.
    #[error("the log jumped to seq {got} when {expected} was next")]
    LogGap {
        /// The seq that should have come next.
        expected: u64,
        /// The seq that came.
        got: u64,
    },
}

/// A connection to one Keel server. Cheap to clone; clones share a connection pool.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    token: Option<String>,
    /// For an https server: the TLS configuration the log streams connect with (the
    /// REST requests' client was built with the same one).
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Client {
    /// A client for the server at `base_url`: `http://127.0.0.1:4096`, or an https URL
    /// whose certificate the system trusts (see [`Client::with_ca_certificate`] for a
    /// private CA).
    pub fn new(base_url: impl Into<String>) -> Result<Self, Error> {
        Self::build(base_url.into(), &[])
    }

    /// Also trusts the CA certificates in `pem` (PEM `CERTIFICATE` blocks) for an https
    /// server, besides the system's roots: for a Keel whose certificate a private CA
    /// signed, or a self-signed one.
    pub fn with_ca_certificate(self, pem: &[u8]) -> Result<Self, Error> {
        let extra = tls::certificates(pem)?;
        let rebuilt = Self::build(self.base_url, &extra)?;
        Ok(Self {
            token: self.token,
            ..rebuilt
        })
    }

    fn build(
        base_url: String,
        extra_roots: &[rustls::pki_types::CertificateDer<'static>],
    ) -> Result<Self, Error> {
        let base_url = base_url.trim_end_matches('/').to_owned();
        let (http, tls) = if base_url.starts_with("https://") {
            let tls = tls::config(extra_roots)?;
            let http = reqwest::Client::builder()
                .tls_backend_preconfigured((*tls).clone())
                .build()
                .map_err(|e| Error::Tls(format!("cannot build the https client: {e}")))?;
            (http, Some(tls))
        } else if base_url.starts_with("http://") {
            (reqwest::Client::new(), None)
        } else {
            return Err(Error::BaseUrl(base_url));
        };
        Ok(Self {
            http,
            base_url,
            token: None,
            tls,
        })
    }

    /// Sends `token` as the bearer token (the server's `KEEL_TOKEN`).
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The base URL requests go to.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Sends a request; returns the body of a successful answer.
    async fn send<Q, B>(
        &self,
        method: Method,
        path: &str,
        query: Option<&Q>,
        body: Option<&B>,
    ) -> Result<Vec<u8>, Error>
    where
        Q: Serialize + ?Sized,
        B: Serialize + ?Sized,
    {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base_url));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(query) = query {
            request = request.query(query);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let transport = |source| Error::Transport {
            base_url: self.base_url.clone(),
            source,
        };
        let response = request.send().await.map_err(transport)?;
        let status = response.status();
        let body = response.bytes().await.map_err(transport)?;
        if status.is_success() {
            return Ok(body.to_vec());
        }
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(ErrorBody { error }) => Error::Api {
                status: status.as_u16(),
                kind: error.kind,
                message: error.message,
            },
            Err(_) => Error::UnexpectedStatus {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).into_owned(),
            },
        })
    }

    /// Sends a request and decodes a JSON answer.
    async fn call_json<Q, B, R>(
        &self,
        method: Method,
        path: String,
        query: Option<&Q>,
        body: Option<&B>,
    ) -> Result<R, Error>
    where
        Q: Serialize + ?Sized,
        B: Serialize + ?Sized,
        R: DeserializeOwned,
    {
        let answer = self.send(method, &path, query, body).await?;
        serde_json::from_slice(&answer).map_err(|source| Error::Decode { path, source })
    }

    /// Sends a request whose successful answer has no body.
    async fn call_empty<Q, B>(
        &self,
        method: Method,
        path: String,
        query: Option<&Q>,
        body: Option<&B>,
    ) -> Result<(), Error>
    where
        Q: Serialize + ?Sized,
        B: Serialize + ?Sized,
    {
        self.send(method, &path, query, body).await.map(|_| ())
    }
}
