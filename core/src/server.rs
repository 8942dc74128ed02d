//! The HTTP service (SPEC section 12): JSON routes, the log and event streams, bearer
//! token, body limit, and errors as `{"error": {"type", "message"}}`.

mod error;
mod extract;
mod routes;
mod sse;
pub mod tls;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request, State};
use axum::http::HeaderValue;
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use keel_schema::api::ErrorType;

pub use error::ApiError;

use crate::config::Config;
use crate::runner::Runner;
use crate::store::Store;

/// What the handlers share.
pub struct Shared {
    pub store: Store,
    pub runner: Runner,
    pub config: Config,
    pub token: Option<String>,
    pub heartbeat: Duration,
    pub started_at: i64,
    /// The lease, which also bounds how long a silent node is listed.
    pub lease_ms: i64,
    /// The other nodes, on PostgreSQL.
    pub bus: Option<crate::cluster::Bus>,
    /// Failed authentications by peer address, for the log.
    pub auth_failures: AuthFailures,
    /// Sessions' directories must be inside this one (canonical).
    pub root: std::path::PathBuf,
}

/// How many requests each peer address sent with a missing or wrong token.
#[derive(Debug, Default)]
pub struct AuthFailures(Mutex<HashMap<IpAddr, u64>>);

impl AuthFailures {
    /// Most addresses remembered; past it the counts start again (the log is what
    /// matters, not exact totals).
    const MAX_PEERS: usize = 4096;

    /// Counts a failure from `peer`; returns how many there were.
    fn record(&self, peer: IpAddr) -> u64 {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if counts.len() >= Self::MAX_PEERS && !counts.contains_key(&peer) {
            counts.clear();
        }
        let count = counts.entry(peer).or_default();
        *count += 1;
        *count
    }
}

pub type AppState = Arc<Shared>;

/// Service options.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Request bodies over this many bytes are refused with 413.
    pub body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            body_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Every route.
pub fn router(state: AppState, limits: &Limits) -> Router {
    Router::new()
        .route("/api/health", get(routes::health))
        .route("/api/ready", get(routes::ready))
        .route(
            "/api/session",
            post(routes::create_session).get(routes::list_sessions),
        )
        .route(
            "/api/session/{id}",
            get(routes::get_session)
                .patch(routes::update_session)
                .delete(routes::delete_session),
        )
        .route("/api/session/{id}/status", get(routes::session_status))
        .route("/api/session/{id}/prompt", post(routes::prompt))
        .route("/api/session/{id}/interrupt", post(routes::interrupt))
        .route("/api/session/{id}/resume", post(routes::resume))
        .route("/api/session/{id}/compact", post(routes::compact))
        .route(
            "/api/session/{id}/permission/{request_id}",
            post(routes::reply_permission),
        )
        .route(
            "/api/session/{id}/question/{request_id}",
            post(routes::reply_question),
        )
        .route("/api/session/{id}/messages", get(routes::messages))
        .route("/api/session/{id}/log", get(sse::session_log))
        .route("/api/event", get(sse::events))
        .route("/api/agents", get(routes::agents))
        .route("/api/mcp", get(routes::mcp_servers))
        .route("/api/nodes", get(routes::nodes))
        .route("/metrics", get(routes::metrics))
        .layer(axum::middleware::from_fn(in_request_span))
        .route("/openapi.json", get(routes::openapi))
        .fallback(routes::not_found)
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(limits.body_bytes))
        .with_state(state)
}

/// `GET /metrics` alone, without the token: what `keel serve --metrics-listen` serves on its
/// second address, for a scraper that should not hold the token. Anything else is a 404.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .with_state(state)
}

/// Requires the bearer token, when one is configured, on everything but the probes. The
/// token is compared in constant time (as digests, so not even its length shows); a
/// refusal says how to authenticate (`WWW-Authenticate: Bearer`), and failures are logged
/// with the peer's address: the first, then each time the count doubles.
async fn authorize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if matches!(request.uri().path(), "/api/health" | "/api/ready") {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented.is_some_and(|presented| same_token(presented, token)) {
        return next.run(request).await;
    }
    if let Some(ConnectInfo(peer)) = request.extensions().get::<ConnectInfo<SocketAddr>>() {
        let count = state.auth_failures.record(peer.ip());
        if count.is_power_of_two() {
            tracing::warn!(peer = %peer.ip(), failures = count, path = request.uri().path(), "a request was refused: missing or wrong token");
        }
    }
    let mut refused = ApiError::new(
        ErrorType::Unauthorized,
        "this server needs `Authorization: Bearer <KEEL_TOKEN>`",
    )
    .into_response();
    refused.headers_mut().insert(
        WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"keel\""),
    );
    refused
}

/// Whether `presented` is `token`, in time that depends on neither.
fn same_token(presented: &str, token: &str) -> bool {
    use sha1::{Digest, Sha1};
    use subtle::ConstantTimeEq;
    let digest = |text: &str| Sha1::digest(text.as_bytes());
    digest(presented).ct_eq(&digest(token)).into()
}

/// Runs a request inside a `request` span (method and path, never the query, which may
/// carry ids a log should not multiply), and logs its answer at debug level.
async fn in_request_span(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tracing::Instrument as _;
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path()
    );
    let began = std::time::Instant::now();
    async move {
        let response = next.run(request).await;
        tracing::debug!(
            status = response.status().as_u16(),
            ms = began.elapsed().as_millis() as u64,
            "answered"
        );
        response
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_is_the_same() {
        assert!(same_token("s3cret", "s3cret"));
        for other in ["", "s3cre", "s3cret ", "S3cret", "s3cret\0"] {
            assert!(!same_token(other, "s3cret"), "{other:?}");
        }
    }

    #[test]
    fn failures_are_counted_per_address() {
        let failures = AuthFailures::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert_eq!(failures.record(a), 1);
        assert_eq!(failures.record(a), 2);
        assert_eq!(failures.record(b), 1);
    }
}
