//! The web console (docs/console.md): `GET /` and its two assets, built from `console/`
//! (`console/dist/`, committed and checked fresh by `cargo xtask check`) and embedded in
//! the binary, so a running Keel needs nothing else and no CDN.
//!
//! The assets are served without the token: they hold no data, and the page asks for the
//! token itself. A strict Content-Security-Policy keeps anything but the console's own
//! script, style and API out of the page, and `frame-ancestors 'none'` keeps other sites
//! from framing it.

use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};

/// Paths of the console, served without the token.
pub const PATHS: [&str; 3] = ["/", SCRIPT, STYLE];
const SCRIPT: &str = "/console/console.js";
const STYLE: &str = "/console/console.css";

const INDEX_HTML: &str = include_str!("../../../console/dist/index.html");
const CONSOLE_JS: &str = include_str!("../../../console/dist/console.js");
const CONSOLE_CSS: &str = include_str!("../../../console/dist/console.css");

/// What the page may load: its own script and style, images from tool output (`data:`),
/// and requests to this server only.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
                      form-action 'none'; frame-ancestors 'none'";

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", CONSOLE_JS)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", CONSOLE_CSS)
}

/// Routes the console to a router.
pub fn routes<S: Clone + Send + Sync + 'static>(router: axum::Router<S>) -> axum::Router<S> {
    use axum::routing::get;
    router
        .route(PATHS[0], get(index))
        .route(SCRIPT, get(script))
        .route(STYLE, get(style))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Revalidated on every load, so a new Keel's console replaces an old one at once.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    headers.insert(
        HeaderName::from_static("x-content-type-options"),
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        HeaderName::from_static("referrer-policy"),
        HeaderValue::from_static("no-referrer"),
    );
    response
}
