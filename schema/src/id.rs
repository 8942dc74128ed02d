//! Identifiers.
//!
//! Every id is a short prefix naming its kind, an underscore, and a ULID in canonical
//! (upper-case Crockford base32) form: `ses_01JDQ3V5Y6Z8ABCDEFGHJKMNPQ`. The ULID's first
//! 48 bits are a millisecond timestamp, so ids of one kind sort by creation time, both as
//! values and as strings. Parsing checks the prefix and the ULID and accepts only the
//! canonical spelling, so an id has exactly one text form (safe as a database key).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use ulid::Ulid;

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseIdError {
    #[error("`{got}` is not a {kind} id: it must start with `{prefix}_`")]
    WrongPrefix {
        kind: &'static str,
        prefix: &'static str,
        got: String,
    },
    #[error(
        "`{got}` is not a {kind} id: after `{prefix}_` it needs a 26-character upper-case ULID"
    )]
    InvalidUlid {
        kind: &'static str,
        prefix: &'static str,
        got: String,
    },
}

/// Parses `<prefix>_<ULID>`, accepting only the canonical spelling.
fn parse_prefixed(s: &str, kind: &'static str, prefix: &'static str) -> Result<Ulid, ParseIdError> {
    let rest = s
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('_'))
        .ok_or_else(|| ParseIdError::WrongPrefix {
            kind,
            prefix,
            got: s.to_owned(),
        })?;
    let invalid = || ParseIdError::InvalidUlid {
        kind,
        prefix,
        got: s.to_owned(),
    };
    let ulid = Ulid::from_string(rest).map_err(|_| invalid())?;
    // `from_string` also accepts lower case; one id must have one spelling.
    if ulid.to_string() != rest {
        return Err(invalid());
    }
    Ok(ulid)
}

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Ulid);

        impl $name {
            /// The text before the underscore.
            pub const PREFIX: &'static str = $prefix;

            /// A fresh id stamped with the current time.
            #[allow(clippy::new_without_default)] // a default id would hide where ids come from
            pub fn new() -> Self {
                Self(Ulid::generate())
            }

            /// The id for a known ULID (for ids derived from other ids, and tests).
            pub const fn from_ulid(ulid: Ulid) -> Self {
                Self(ulid)
            }

            /// The ULID after the prefix.
            pub const fn ulid(self) -> Ulid {
                self.0
            }

            /// Milliseconds since the Unix epoch at which the id was made.
            pub fn timestamp_ms(self) -> u64 {
                self.0.timestamp_ms()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}_{}", $prefix, self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = ParseIdError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                parse_prefixed(s, $kind, $prefix).map(Self)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = Cow::<'de, str>::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                Cow::Borrowed(stringify!($name))
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({
                    "type": "string",
                    "description": concat!(
                        "A ", $kind, " id: `", $prefix, "_` followed by a ULID (time-sortable)."
                    ),
                    "pattern": concat!("^", $prefix, "_[0-9A-HJKMNP-TV-Z]{26}$"),
                })
            }
        }
    };
}

prefixed_id!(
    /// A session: one conversation with its own event sequence.
    SessionId, "ses", "session"
);
prefixed_id!(
    /// An input admitted into a session's inbox. Clients may choose it to make retries idempotent.
    InputId, "inp", "input"
);
prefixed_id!(
    /// A message of the transcript (user, assistant or synthetic).
    MessageId, "msg", "message"
);
prefixed_id!(
    /// One busy period of a session, from claim to settlement.
    ExecutionId, "exe", "execution"
);
prefixed_id!(
    /// One durable event.
    EventId, "evt", "event"
);
prefixed_id!(
    /// One tool call of an assistant message.
    CallId, "call", "call"
);
prefixed_id!(
    /// A permission request or a question waiting for a reply.
    RequestId, "req", "request"
);
prefixed_id!(
    /// A running Keel process (one per start); the owner of execution claims.
    OwnerId, "own", "owner"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_as_prefix_and_canonical_ulid_and_parses_back() {
        let id = SessionId::from_ulid(Ulid::from_parts(1_764_690_000_000, 42));
        let text = id.to_string();
        assert_eq!(text, "ses_01KBFVGY40000000000000001A");
        assert_eq!(text.parse::<SessionId>(), Ok(id));
        assert_eq!(id.timestamp_ms(), 1_764_690_000_000);
    }

    #[test]
    fn ids_sort_by_creation_time_as_values_and_as_text() {
        let early = MessageId::from_ulid(Ulid::from_parts(1_000, u128::MAX >> 48));
        let late = MessageId::from_ulid(Ulid::from_parts(1_001, 0));
        assert!(early < late);
        assert!(early.to_string() < late.to_string());
    }

    #[test]
    fn rejects_another_kinds_prefix() {
        let input = InputId::new().to_string();
        assert_eq!(
            input.parse::<SessionId>(),
            Err(ParseIdError::WrongPrefix {
                kind: "session",
                prefix: "ses",
                got: input.clone(),
            })
        );
    }

    #[test]
    fn rejects_malformed_lower_case_and_overflowing_ulids() {
        for bad in [
            "ses_",
            "ses_123",
            "ses_01KBFVGY40000000000000001",   // 25 characters
            "ses_01KBFVGY40000000000000001A6", // 27 characters
            "ses_01kbc5fk400000000000000016",  // lower case
            "ses_01KBFVGY40000000000000001U",  // U is not Crockford base32
            "ses_81KBC5FK400000000000000016",  // more than 128 bits
        ] {
            let expected = ParseIdError::InvalidUlid {
                kind: "session",
                prefix: "ses",
                got: bad.to_owned(),
            };
            assert_eq!(bad.parse::<SessionId>(), Err(expected), "{bad}");
        }
        assert!(matches!(
            "ses01KBFVGY400000000000000016".parse::<SessionId>(),
            Err(ParseIdError::WrongPrefix { .. })
        ));
    }

    #[test]
    fn serde_uses_the_text_form_and_validates() {
        let id = CallId::new();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<CallId>(&json).unwrap(), id);
        let err = serde_json::from_str::<CallId>("\"call_nope\"").unwrap_err();
        assert!(err.to_string().contains("is not a call id"), "{err}");
    }
}
