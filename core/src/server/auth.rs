//! Who may call: the bearer token on every route but the probes and the login, compared
//! in constant time; and, for reads only, the read cookie a browser gets from
//! `POST /api/login`, so the web console's event streams authenticate without the
//! token in a URL (where logs keep it) and without JavaScript able to read it.
//!
//! The cookie carries a digest of the token, not the token: it proves the token was
//! presented once, and opens `GET` requests only. Anything that changes state still
//! needs the `Authorization` header, so a page elsewhere that makes the browser send the
//! cookie (`SameSite=Strict` already stops that in current browsers) can change nothing.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::{AUTHORIZATION, COOKIE, SET_COOKIE, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use keel_schema::api::{ErrorType, LoginRequest};

use super::extract::Body;
use super::{ApiError, AppState};

/// The read cookie's name.
pub const COOKIE_NAME: &str = "keel_read";

/// Paths served without the token: the probes, the login that checks it itself, and the
/// console's page and assets, which hold no data (the page asks for the token).
fn public(path: &str) -> bool {
    ["/api/health", "/api/ready", "/api/login", "/api/logout"].contains(&path)
        || super::console::PATHS.contains(&path)
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

/// Requires the bearer token, when one is configured, on everything but the probes. The
/// token is compared in constant time (as digests, so not even its length shows); a
/// refusal says how to authenticate (`WWW-Authenticate: Bearer`), and failures are logged
/// with the peer's address: the first, then each time the count doubles.
pub(super) async fn authorize(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if public(request.uri().path()) {
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
    let reading = matches!(*request.method(), Method::GET | Method::HEAD);
    if reading
        && read_cookie(request.headers()).is_some_and(|c| same_token(c, &cookie_value(token)))
    {
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

/// The read cookie's value for `token`: a digest, so the cookie is not the token.
fn cookie_value(token: &str) -> String {
    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(format!("keel read cookie\0{token}").as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The read cookie among the request's cookies.
fn read_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE_NAME)?.strip_prefix('='))
}

/// `Secure` when the browser reached Keel over https: directly, or through a proxy that
/// says so (a false claim only makes the cookie stricter).
fn secure(request_is_tls: bool, headers: &HeaderMap) -> &'static str {
    let forwarded = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    if request_is_tls || forwarded {
        "; Secure"
    } else {
        ""
    }
}

/// `POST /api/login`: checks `{"token"}` and sets the read cookie (HttpOnly,
/// SameSite=Strict, for the browser session). Without a configured token there is
/// nothing to log into and no cookie is set.
pub async fn login(
    State(state): State<AppState>,
    extensions: axum::http::Extensions,
    headers: HeaderMap,
    body: Result<Body<LoginRequest>, ApiError>,
) -> Result<Response, ApiError> {
    let Body(body) = body?;
    let Some(token) = &state.token else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    if !same_token(&body.token, token) {
        if let Some(ConnectInfo(peer)) = extensions.get::<ConnectInfo<SocketAddr>>() {
            let count = state.auth_failures.record(peer.ip());
            if count.is_power_of_two() {
                tracing::warn!(peer = %peer.ip(), failures = count, path = "/api/login", "a login was refused: wrong token");
            }
        }
        return Err(ApiError::new(ErrorType::Unauthorized, "wrong token"));
    }
    let cookie = format!(
        "{COOKIE_NAME}={}; Path=/; HttpOnly; SameSite=Strict{}",
        cookie_value(token),
        secure(state.tls, &headers)
    );
    Ok(cookie_response(&cookie))
}

/// `POST /api/logout`: clears the read cookie.
pub async fn logout(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let cookie = format!(
        "{COOKIE_NAME}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{}",
        secure(state.tls, &headers)
    );
    cookie_response(&cookie)
}

fn cookie_response(cookie: &str) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    if let Ok(value) = HeaderValue::from_str(cookie) {
        response.headers_mut().insert(SET_COOKIE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_cookie_is_found_among_others_and_is_not_the_token() {
        let mut headers = HeaderMap::new();
        headers.insert(COOKIE, HeaderValue::from_static("a=1; keel_read=abc; b=2"));
        assert_eq!(read_cookie(&headers), Some("abc"));
        headers.insert(COOKIE, HeaderValue::from_static("keel_readx=abc"));
        assert_eq!(read_cookie(&headers), None);
        assert_ne!(cookie_value("s3cret"), "s3cret");
        assert_eq!(cookie_value("s3cret"), cookie_value("s3cret"));
        assert_ne!(cookie_value("s3cret"), cookie_value("s3cret2"));
    }

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
