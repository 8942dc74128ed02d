//! What the routes take from a request's path: the session named by `{id}` and the
//! request named by `{request_id}`, parsed and, for [`ExistingSession`], looked up, so no
//! handler repeats that preamble. Whether the text is no id at all or the id of nothing,
//! the answer is the same 404: the path names nothing that exists.

use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use keel_schema::api::Session;
use keel_schema::id::{ParseIdError, RequestId, SessionId};

use super::{ApiError, AppState};
use crate::event::view;

/// The parameter `name` of the route's path, parsed as `T`. Text that is no such id names
/// nothing that exists: it is a 404 saying so (`what` names the kind of thing), like an
/// id that is well formed but unknown.
async fn parameter<T>(
    parts: &mut Parts,
    state: &AppState,
    name: &str,
    what: &str,
) -> Result<T, ApiError>
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
        .map_err(|e: ParseIdError| ApiError::not_found(format!("no {what} `{text}` ({e})")))
}

/// The session id of the route's `{id}`, whether or not such a session exists.
pub struct SessionPath(pub SessionId);

impl FromRequestParts<AppState> for SessionPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        parameter(parts, state, "id", "session").await.map(Self)
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
        parameter(parts, state, "request_id", "request")
            .await
            .map(Self)
    }
}
