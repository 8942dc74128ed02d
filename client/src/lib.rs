//! keel-client: a typed async client for Keel's HTTP API.
//!
//! ```no_run
//! # async fn demo() -> Result<(), keel_client::Error> {
//! use keel_client::Client;
//! use keel_schema::api::CreateSession;
//!
//! let client = Client::new("http://127.0.0.1:4096")?.with_token("secret");
//! let session = client.create_session(&CreateSession::default()).await?;
//! println!("created {}", session.id);
//! # Ok(()) }
//! ```
//!
//! The endpoint methods (`health`, `create_session`, `prompt`, …) are generated from the
//! route table that also produces `contracts/openapi.json`, by `cargo xtask regenerate`
//! into `generated.rs`. This file holds the hand-written transport they call.

#[rustfmt::skip]
mod generated;

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
        status: u16,
        kind: ErrorType,
        message: String,
    },
    /// Keel (or something in between) answered with a status and body Keel does not send.
    #[error("unexpected answer {status}: {body}")]
    UnexpectedStatus { status: u16, body: String },
    /// The request could not be sent or the answer not read.
    #[error("could not reach keel at {base_url}: {source}")]
    Transport {
        base_url: String,
        #[source]
        source: reqwest::Error,
    },
    /// A successful answer's body was not the documented type.
    #[error("keel's answer to {path} is not the documented shape: {source}")]
    Decode {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    /// The base URL given to [`Client::new`] is not an http(s) URL.
    #[error("`{0}` is not a Keel base URL: use http://host:port")]
    BaseUrl(String),
}

/// A connection to one Keel server. Cheap to clone; clones share a connection pool.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    token: Option<String>,
}

impl Client {
    /// A client for the server at `base_url`, e.g. `http://127.0.0.1:4096`.
    pub fn new(base_url: impl Into<String>) -> Result<Self, Error> {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(Error::BaseUrl(base_url));
        }
        Ok(Self {
            http: reqwest::Client::new(),
            base_url,
            token: None,
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
