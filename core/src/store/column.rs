//! How values are kept in columns: seqs and counts as `BIGINT`, unit enums (phases,
//! deliveries, statuses …) as their snake_case text, which the columns' CHECK constraints
//! list.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Error;

/// Converts a seq or count to the database's integer.
pub(crate) fn db_int(value: u64) -> Result<i64, Error> {
    i64::try_from(value).map_err(|_| Error::Corrupt(format!("{value} does not fit a BIGINT")))
}

/// Converts a database integer back to a seq or count.
pub(crate) fn from_db_int(value: i64) -> Result<u64, Error> {
    u64::try_from(value).map_err(|_| Error::Corrupt(format!("negative seq or count {value}")))
}

/// The text form of a unit enum (`"steer"`, `"prompt"` …), as stored in CHECKed columns.
pub(crate) fn text_of<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(Value::String(text)) => text,
        // Every type passed here is a unit enum with snake_case names.
        other => panic!("text_of takes unit enums, got {other:?}"),
    }
}

/// Parses a unit enum from its stored text form.
pub(crate) fn parse_text<T: for<'de> Deserialize<'de>>(
    column: &str,
    text: &str,
) -> Result<T, Error> {
    serde_json::from_value(Value::String(text.to_owned()))
        .map_err(|e| Error::Corrupt(format!("{column} `{text}`: {e}")))
}
