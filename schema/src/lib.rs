//! keel-schema: the data Keel speaks, and nothing else.
//!
//! - [`id`]: prefixed, time-sortable identifiers (`ses_01J…`), validated on parse.
//! - [`types`]: value types shared by events and the HTTP API (models, parts, usage, errors).
//! - [`event`]: the versioned event catalog, the envelopes, and decoding of any stored
//!   `<type>.<version>` into the latest shape (upcasting).
//! - [`api`]: request and response bodies of the HTTP service.
//!
//! Every type derives serde and schemars; the contracts under `contracts/` are generated
//! from them by `keel-codegen`. This crate does no I/O.

pub mod api;
pub mod event;
pub mod id;
pub mod types;
