//! keel-codegen: Keel's contracts, generated from keel-schema.
//!
//! [`generate`] produces every generated file of the repository, in memory:
//! - `contracts/events/<type>.<version>.json`: the JSON Schema of each event version's payload;
//! - `contracts/events/index.json`: the catalog;
//! - `contracts/openapi.json`: the HTTP API as OpenAPI 3.1, from the route table in [`routes`];
//! - `client/src/generated.rs`: keel-client's endpoint layer, from the same route table.
//!
//! [`check`] compares generated files with those on disk and with published versions.
//! Writing files and reading git belong to `xtask`; this crate does no I/O.

pub mod check;
pub mod client;
pub mod events;
pub mod openapi;
pub mod routes;

/// One generated file: its path relative to the workspace root (with `/`), and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct File {
    pub path: String,
    pub contents: String,
}

/// Where event contracts live, relative to the workspace root.
pub const EVENTS_DIR: &str = "contracts/events";
/// The catalog file.
pub const INDEX_PATH: &str = "contracts/events/index.json";
/// The OpenAPI document.
pub const OPENAPI_PATH: &str = "contracts/openapi.json";
/// The client's generated endpoint layer.
pub const CLIENT_PATH: &str = "client/src/generated.rs";

/// Every generated file, in a stable order.
pub fn generate() -> Vec<File> {
    let mut files = events::schema_files();
    files.push(events::index_file());
    files.push(File {
        path: OPENAPI_PATH.to_owned(),
        contents: pretty(&openapi::document()),
    });
    files.push(File {
        path: CLIENT_PATH.to_owned(),
        contents: client::source(),
    });
    files
}

/// JSON as committed: two-space indentation and a final newline.
pub fn pretty(value: &serde_json::Value) -> String {
    let mut text = serde_json::to_string_pretty(value)
        .expect("serde_json::Value always serializes: its map keys are strings");
    text.push('\n');
    text
}
