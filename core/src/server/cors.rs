//! Cross-origin requests (`keel serve --cors-origin ORIGIN`, off by default): a page
//! served from one of the listed origins may call Keel from a browser. Preflights from a
//! listed origin are answered before the token is asked for (browsers send none with
//! them); every answer to a listed origin names it in `Access-Control-Allow-Origin`.
//! Other origins get no CORS headers, so browsers keep their pages out. Credentials
//! (cookies) are not allowed across origins: a cross-origin client sends the bearer
//! token, which the preflight allows.

use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;

/// The request headers Keel's API reads.
const HEADERS: &str = "authorization, content-type, idempotency-key, last-event-id";
const METHODS: &str = "GET, POST, PATCH, DELETE";

/// Checks an origin given on the command line: `scheme://host[:port]`, nothing more, and
/// never `*` (a token-guarded API open to every page is not a default to offer).
pub fn parse_origin(text: &str) -> Result<HeaderValue, String> {
    let refuse = |why: &str| Err(format!("--cors-origin `{text}`: {why}"));
    if text.contains('*') {
        return refuse("no wildcard: list each origin whose pages may call Keel");
    }
    let Some((scheme, rest)) = text.split_once("://") else {
        return refuse("write it as scheme://host[:port], e.g. https://console.example.com");
    };
    if !matches!(scheme, "http" | "https") {
        return refuse("the scheme must be http or https");
    }
    if rest.is_empty() || rest.contains(['/', '?', '#', ' ']) {
        return refuse("an origin is scheme://host[:port], without a path");
    }
    HeaderValue::from_str(text).or_else(|_| refuse("not a valid header value"))
}

/// The middleware; outermost, so preflights never reach the token check.
pub(super) async fn cors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let allowed = request
        .headers()
        .get(ORIGIN)
        .filter(|origin| state.cors.iter().any(|a| a == *origin))
        .cloned();
    let Some(origin) = allowed else {
        return next.run(request).await;
    };
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        headers.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(METHODS),
        );
        headers.insert(
            ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(HEADERS),
        );
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        response
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.append(VARY, HeaderValue::from_static("origin"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_scheme_host_and_port_only() {
        for good in ["https://console.example.com", "http://127.0.0.1:5173"] {
            assert!(parse_origin(good).is_ok(), "{good}");
        }
        for bad in [
            "*",
            "console.example.com",
            "ftp://x",
            "https://x/app",
            "https://",
            "https://*.x",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad}");
        }
    }
}
