//! Tool input: parsing a call's JSON into a tool's input type, that type's JSON Schema,
//! and the fields a permission pattern is taken from.
//!
//! Invariant: a tool sees only input that deserialized into its type, whose unknown fields
//! are refused (`deny_unknown_fields`), so a misspelt field is an error the model reads,
//! never silently ignored.

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::Error;

/// The call's input as `T`, or [`Error::InvalidInput`] with serde's message.
pub(crate) fn parse<T: DeserializeOwned>(input: Value) -> Result<T, Error> {
    serde_json::from_value(input).map_err(|e| Error::InvalidInput(e.to_string()))
}

/// The JSON Schema (draft 2020-12) of `T`.
pub(crate) fn schema<T: JsonSchema>() -> Value {
    schemars::schema_for!(T).to_value()
}

/// A string field of a call's input, or `default` when it is absent or not a string
/// (the call will then fail validation; the pattern only has to be well defined).
pub(crate) fn field<'a>(input: &'a Value, name: &str, default: &'a str) -> &'a str {
    input.get(name).and_then(Value::as_str).unwrap_or(default)
}
