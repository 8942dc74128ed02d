//! The HTTP service (SPEC section 12): JSON routes, the log and event streams, bearer
//! token, body limit, and errors as `{"error": {"type", "message"}}`.

mod auth;
mod console;
pub mod cors;
mod error;
mod extract;
mod routes;
mod sse;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{get, post};

pub use auth::AuthFailures;
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
    /// Whether the server speaks TLS itself (its cookies are then `Secure`).
    pub tls: bool,
    /// Origins whose pages may call Keel from a browser ([`cors`]).
    pub cors: Vec<axum::http::HeaderValue>,
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
    let router = Router::new()
        .route("/api/health", get(routes::health))
        .route("/api/ready", get(routes::ready))
        .route("/api/login", post(auth::login))
        .route("/api/logout", post(auth::logout))
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
        .route("/openapi.json", get(routes::openapi));
    console::routes(router)
        .fallback(routes::not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authorize,
        ))
        .layer(DefaultBodyLimit::max(limits.body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), cors::cors))
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
