//! What the routes take from a request's path: the session named by `{id}` and the
//! request named by `{request_id}`, parsed (a malformed id is a 400) and, for
//! [`ExistingSession`], looked up (an unknown or deleted session is a 404), so no handler
//! repeats that preamble.

use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use keel_schema::api::Session;
use keel_schema::id::{ParseIdError, RequestId, SessionId};

use super::{ApiError, AppState};
use crate::event::view;

/// The parameter `name` of the route's path, parsed as `T`.
async fn parameter<T>(parts: &mut Parts, state: &AppState, name: &str) -> Result<T, ApiError>
where
    T: std::str::FromStr<Err = ParseIdError>,
{
    let parameters = RawPathParams::from_request_parts(parts, state)
        .await
        .map_err(|e| ApiError::bad_request(e.body_text()))?;
    let (_, text) = parameters
        .iter()
        .find(|(key, _)| *key == name)
        .ok_or_else(|| ApiError::bad_request(format!("the path has no `{name}`")))?;
    text.parse()
        .map_err(|e: ParseIdError| ApiError::bad_request(e.to_string()))
}

/// The session id of the route's `{id}`, whether or not such a session exists.
pub struct SessionPath(pub SessionId);

impl FromRequestParts<AppState> for SessionPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        parameter(parts, state, "id").await.map(Self)
    }
}

/// The session of the route's `{id}`, as the API shows it: it exists and is not deleted.
pub struct ExistingSession(pub Session);

impl FromRequestParts<AppState> for ExistingSession {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let SessionPath(id) = SessionPath::from_request_parts(parts, state).await?;
        existing(state, id).await.map(Self)
    }
}

/// The session `id`, unless it is unknown or deleted.
pub async fn existing(state: &AppState, id: SessionId) -> Result<Session, ApiError> {
    state
        .store
        .read(move |c| view::session(c, id))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no session {id}")))
}

/// The permission request or question of the route's `{request_id}`.
pub struct RequestPath(pub RequestId);

impl FromRequestParts<AppState> for RequestPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        parameter(parts, state, "request_id").await.map(Self)
    }
}
