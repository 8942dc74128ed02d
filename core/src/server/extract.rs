//! What the routes take from a request: the session named by `{id}` and the request named
//! by `{request_id}`, parsed and, for [`ExistingSession`], looked up, so no handler
//! repeats that preamble (whether the text is no id at all or the id of nothing, the
//! answer is the same 404: the path names nothing that exists); and the JSON body,
//! [`Body`], which must be an object.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, RawPathParams, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use keel_schema::api::Session;
use keel_schema::id::{ParseIdError, RequestId, SessionId};
use serde::de::DeserializeOwned;

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

/// A JSON request body of type `T`. Like axum's `Json`, it needs an `application/json`
/// (or `+json`) content type and refuses what does not deserialize, plus one rule serde
/// does not have: the body is a JSON object. (Serde reads a struct from an array of its
/// fields in order too, so `[null, null]` would otherwise pass for a body whose fields are
/// all optional.)
pub struct Body<T>(pub T);

impl<T, S> FromRequest<S> for Body<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let json = request
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|mime| mime.trim().to_ascii_lowercase())
            .is_some_and(|mime| mime == "application/json" || mime.ends_with("+json"));
        if !json {
            return Err(ApiError::bad_request(
                "Expected request with `Content-Type: application/json`",
            ));
        }
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|e| ApiError::from(axum::extract::rejection::JsonRejection::from(e)))?;
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        if first.is_some_and(|b| *b != b'{') {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        let Json(body) = Json::<T>::from_bytes(&bytes)?;
        Ok(Self(body))
    }
}
