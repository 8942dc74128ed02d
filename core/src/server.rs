//! The HTTP service (SPEC section 12): JSON routes, the log and event streams, bearer
//! token, body limit, and errors as `{"error": {"type", "message"}}`.

mod error;
mod extract;
mod routes;
mod sse;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
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
        .route("/api/nodes", get(routes::nodes))
        .route("/openapi.json", get(routes::openapi))
        .fallback(routes::not_found)
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(limits.body_bytes))
        .with_state(state)
}

/// Requires the bearer token, when one is configured, on everything but health.
async fn authorize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if request.uri().path() == "/api/health" {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented == Some(token.as_str()) {
        next.run(request).await
    } else {
        ApiError::new(
            ErrorType::Unauthorized,
            "this server needs `Authorization: Bearer <KEEL_TOKEN>`",
        )
        .into_response()
    }
}
