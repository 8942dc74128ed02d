//! The versioned event catalog.
//!
//! Every event has a type (`session.next.step.ended`), a version, and a durability.
//! Durable events are stored in a session's log with a gapless `seq` and replayed forever;
//! ephemeral events (token deltas, progress) are live only. The two are different Rust
//! types, [`DurableEvent`] and [`EphemeralEvent`], each holding the latest payload shape.
//!
//! Stored events are keyed `<type>.<version>`. [`DurableEvent::decode`] turns any version
//! this build knows into the latest shape (upcasting through [`legacy`]), so readers deal
//! with one shape per type. Writers always write the latest version.
//!
//! [`catalog()`] lists every (type, version) with its payload's JSON Schema and an example;
//! the contracts under `contracts/events/` are generated from it, and a published version
//! never changes: a new field means a new version.

pub mod legacy;
pub mod payload;

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::id::{EventId, SessionId};

/// A payload with a canonical example, used in contracts and round-trip tests.
pub trait Example {
    fn example() -> Self;
}

/// Whether an event is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// Stored with a `seq`, replayed forever.
    Durable,
    /// Live only: never stored, has no `seq`.
    Ephemeral,
}

/// One (type, version) of the catalog.
#[derive(Clone, Copy)]
pub struct CatalogEntry {
    pub type_name: &'static str,
    pub version: u32,
    pub durability: Durability,
    /// Whether this is the version writers produce (older versions are only read).
    pub latest: bool,
    /// The payload's JSON Schema as a root schema of the given generator.
    pub schema: fn(&mut SchemaGenerator) -> Schema,
    /// The payload's example, as JSON of this version.
    pub example: fn() -> Value,
}

impl CatalogEntry {
    /// The stored type key, e.g. `session.next.step.ended.2`.
    pub fn key(&self) -> String {
        format!("{}.{}", self.type_name, self.version)
    }
}

impl std::fmt::Debug for CatalogEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogEntry")
            .field("type_name", &self.type_name)
            .field("version", &self.version)
            .field("durability", &self.durability)
            .field("latest", &self.latest)
            .finish_non_exhaustive()
    }
}

/// Every event type and version Keel knows, durable first, each type's versions ascending.
pub fn catalog() -> impl Iterator<Item = &'static CatalogEntry> {
    DURABLE_ENTRIES.iter().chain(EPHEMERAL_ENTRIES)
}

/// Why stored or received event data could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "unknown {durability:?} event `{type_name}.{version}`: not in this build's catalog \
         (written by a newer keel?)"
    )]
    Unknown {
        durability: Durability,
        type_name: String,
        version: u32,
    },
    #[error("event `{type_name}.{version}` does not match its schema: {source}")]
    Invalid {
        type_name: String,
        version: u32,
        #[source]
        source: serde_json::Error,
    },
}

fn decode_as<T: DeserializeOwned>(
    type_name: &str,
    version: u32,
    data: Value,
) -> Result<T, DecodeError> {
    serde_json::from_value(data).map_err(|source| DecodeError::Invalid {
        type_name: type_name.to_owned(),
        version,
        source,
    })
}

fn schema_of<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    generator.root_schema_for::<T>()
}

fn example_of<T: Example + Serialize>() -> Value {
    // Examples are plain structs of strings, numbers and string-keyed maps, which always
    // serialize; a failure here is a bug in an example and must be loud.
    serde_json::to_value(T::example()).expect("event examples serialize to JSON")
}

/// Defines an event enum over latest payloads, its decoder (with upcasts from legacy
/// versions) and its catalog entries, from one list so they cannot disagree.
macro_rules! events {
    (
        $(#[$enum_doc:meta])*
        pub enum $enum:ident: $durability:ident, entries $entries:ident {
            $(
                $(#[$doc:meta])*
                $variant:ident($payload:ty) = $type:literal @ $version:literal
                    $(, legacy [$($old_version:literal => $old_payload:ty),+])?;
            )+
        }
    ) => {
        $(#[$enum_doc])*
        #[derive(Debug, Clone, PartialEq)]
        pub enum $enum {
            $($(#[$doc])* $variant($payload),)+
        }

        impl $enum {
            /// The event type, e.g. `session.next.step.ended`.
            pub fn type_name(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $type,)+
                }
            }

            /// The version this build writes for the event's type.
            pub fn version(&self) -> u32 {
                match self {
                    $(Self::$variant(_) => $version,)+
                }
            }

            /// The payload as JSON of the latest version.
            pub fn data(&self) -> Result<Value, serde_json::Error> {
                match self {
                    $(Self::$variant(payload) => serde_json::to_value(payload),)+
                }
            }

            /// The payload as JSON text of the latest version, written without building a
            /// [`Value`] first (the same text, as maps keep their order).
            pub fn data_json(&self) -> Result<String, serde_json::Error> {
                match self {
                    $(Self::$variant(payload) => serde_json::to_string(payload),)+
                }
            }

            /// Writes the payload of the latest version to `serializer`.
            fn serialize_data<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                match self {
                    $(Self::$variant(payload) => payload.serialize(serializer),)+
                }
            }

            /// Reads a payload stored as `type_name.version`, upcasting older versions.
            pub fn decode(type_name: &str, version: u32, data: Value) -> Result<Self, DecodeError> {
                match (type_name, version) {
                    $(
                        ($type, $version) => decode_as::<$payload>(type_name, version, data).map(Self::$variant),
                        $($(
                            ($type, $old_version) => decode_as::<$old_payload>(type_name, version, data)
                                .map(|old| Self::$variant(old.into())),
                        )+)?
                    )+
                    _ => Err(DecodeError::Unknown {
                        durability: Durability::$durability,
                        type_name: type_name.to_owned(),
                        version,
                    }),
                }
            }

            /// (type, version, payload schema) of each type's latest version, for envelope schemas.
            fn latest_schemas(generator: &mut SchemaGenerator) -> Vec<(&'static str, u32, Schema)> {
                vec![$(($type, $version, generator.subschema_for::<$payload>()),)+]
            }
        }

        static $entries: &[CatalogEntry] = &[
            $(
                $($(
                    CatalogEntry {
                        type_name: $type,
                        version: $old_version,
                        durability: Durability::$durability,
                        latest: false,
                        schema: schema_of::<$old_payload>,
                        example: example_of::<$old_payload>,
                    },
                )+)?
                CatalogEntry {
                    type_name: $type,
                    version: $version,
                    durability: Durability::$durability,
                    latest: true,
                    schema: schema_of::<$payload>,
                    example: example_of::<$payload>,
                },
            )+
        ];
    };
}

events! {
    /// A durable event at its latest version.
    pub enum DurableEvent: Durable, entries DURABLE_ENTRIES {
        Created(payload::Created) = "session.next.created" @ 1;
        Renamed(payload::Renamed) = "session.next.renamed" @ 1;
        AgentSwitched(payload::AgentSwitched) = "session.next.agent.switched" @ 1;
        ModelSwitched(payload::ModelSwitched) = "session.next.model.switched" @ 1;
        Deleted(payload::Deleted) = "session.next.deleted" @ 1;
        PromptAdmitted(payload::PromptAdmitted) = "session.next.prompt.admitted" @ 1;
        PromptExecutionRequested(payload::PromptExecutionRequested) = "session.next.prompt.execution_requested" @ 1;
        PromptCancelled(payload::PromptCancelled) = "session.next.prompt.cancelled" @ 1;
        Prompted(payload::Prompted) = "session.next.prompted" @ 1;
        Synthetic(payload::Synthetic) = "session.next.synthetic" @ 1;
        ExecutionStarted(payload::ExecutionStarted) = "session.next.execution.started" @ 1;
        ExecutionSettled(payload::ExecutionSettled) = "session.next.execution.settled" @ 2,
            legacy [1 => legacy::ExecutionSettledV1];
        StepStarted(payload::StepStarted) = "session.next.step.started" @ 1;
        TextStarted(payload::TextStarted) = "session.next.text.started" @ 1;
        TextEnded(payload::TextEnded) = "session.next.text.ended" @ 1;
        ReasoningStarted(payload::ReasoningStarted) = "session.next.reasoning.started" @ 1;
        ReasoningEnded(payload::ReasoningEnded) = "session.next.reasoning.ended" @ 1;
        ToolInputStarted(payload::ToolInputStarted) = "session.next.tool.input.started" @ 1;
        ToolInputEnded(payload::ToolInputEnded) = "session.next.tool.input.ended" @ 1;
        ToolCalled(payload::ToolCalled) = "session.next.tool.called" @ 2,
            legacy [1 => legacy::ToolCalledV1];
        ToolSuccess(payload::ToolSuccess) = "session.next.tool.success" @ 2,
            legacy [1 => legacy::ToolSuccessV1];
        ToolFailed(payload::ToolFailed) = "session.next.tool.failed" @ 1;
        PermissionRequested(payload::PermissionRequested) = "session.next.permission.requested" @ 2,
            legacy [1 => legacy::PermissionRequestedV1];
        PermissionReplied(payload::PermissionReplied) = "session.next.permission.replied" @ 1;
        QuestionAsked(payload::QuestionAsked) = "session.next.question.asked" @ 1;
        QuestionAnswered(payload::QuestionAnswered) = "session.next.question.answered" @ 1;
        QuestionDismissed(payload::QuestionDismissed) = "session.next.question.dismissed" @ 1;
        RetryScheduled(payload::RetryScheduled) = "session.next.retry.scheduled" @ 1;
        StepEnded(payload::StepEnded) = "session.next.step.ended" @ 2,
            legacy [1 => legacy::StepEndedV1];
        StepFailed(payload::StepFailed) = "session.next.step.failed" @ 1;
        StepAwaiting(payload::StepAwaiting) = "session.next.step.awaiting" @ 1;
        StepInterrupted(payload::StepInterrupted) = "session.next.step.interrupted" @ 1;
        StepRecovered(payload::StepRecovered) = "session.next.step.recovered" @ 2,
            legacy [1 => legacy::StepRecoveredV1];
        CompactionStarted(payload::CompactionStarted) = "session.next.compaction.started" @ 1;
        CompactionEnded(payload::CompactionEnded) = "session.next.compaction.ended" @ 1;
        CompactionFailed(payload::CompactionFailed) = "session.next.compaction.failed" @ 1;
        ContextEpochStarted(payload::ContextEpochStarted) = "session.next.context.epoch_started" @ 1;
        ContextSystemUpdated(payload::ContextSystemUpdated) = "session.next.context.system_updated" @ 1;
    }
}

events! {
    /// An ephemeral event: live only, never stored.
    pub enum EphemeralEvent: Ephemeral, entries EPHEMERAL_ENTRIES {
        TextDelta(payload::TextDelta) = "session.next.text.delta" @ 1;
        ReasoningDelta(payload::ReasoningDelta) = "session.next.reasoning.delta" @ 1;
        ToolInputDelta(payload::ToolInputDelta) = "session.next.tool.input.delta" @ 1;
        ToolProgress(payload::ToolProgress) = "session.next.tool.progress" @ 1;
        CompactionDelta(payload::CompactionDelta) = "session.next.compaction.delta" @ 1;
    }
}

/// A durable event as stored and sent, with its payload still as JSON of any version.
///
/// This is the shape of a row of the event log and of each `data:` line of the log stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEvent {
    pub id: EventId,
    pub session_id: SessionId,
    pub seq: u64,
    #[serde(rename = "type")]
    pub type_name: String,
    pub version: u32,
    /// Milliseconds since the Unix epoch.
    pub time: i64,
    pub data: Value,
}

impl RawEvent {
    /// Decodes the payload into the latest shape.
    pub fn decode(self) -> Result<Envelope, DecodeError> {
        let event = DurableEvent::decode(&self.type_name, self.version, self.data)?;
        Ok(Envelope {
            id: self.id,
            session_id: self.session_id,
            seq: self.seq,
            time: self.time,
            event,
        })
    }
}

/// A durable event with its envelope, decoded to the latest shape.
///
/// On the wire: `{"id", "session_id", "seq", "type", "version", "time", "data"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub id: EventId,
    pub session_id: SessionId,
    /// Position in the session's log: 1, 2, 3 … without gaps.
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time: i64,
    pub event: DurableEvent,
}

impl Envelope {
    /// The stored form, at the latest version.
    pub fn to_raw(&self) -> Result<RawEvent, serde_json::Error> {
        Ok(RawEvent {
            id: self.id,
            session_id: self.session_id,
            seq: self.seq,
            type_name: self.event.type_name().to_owned(),
            version: self.event.version(),
            time: self.time,
            data: self.event.data()?,
        })
    }
}

impl Serialize for Envelope {
    /// The shape of [`RawEvent`], written straight from the payload: envelopes are
    /// serialized for every stream and every stored event, so no [`Value`] is built.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        /// Field for field the order of [`RawEvent`].
        #[derive(Serialize)]
        struct Wire<'a> {
            id: EventId,
            session_id: SessionId,
            seq: u64,
            #[serde(rename = "type")]
            type_name: &'static str,
            version: u32,
            time: i64,
            data: Data<'a, DurableEvent>,
        }

        Wire {
            id: self.id,
            session_id: self.session_id,
            seq: self.seq,
            type_name: self.event.type_name(),
            version: self.event.version(),
            time: self.time,
            data: Data(&self.event),
        }
        .serialize(serializer)
    }
}

/// An event's payload, serialized in place (the envelopes' `data`).
struct Data<'a, E>(&'a E);

impl Serialize for Data<'_, DurableEvent> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize_data(serializer)
    }
}

impl Serialize for Data<'_, EphemeralEvent> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize_data(serializer)
    }
}

impl<'de> Deserialize<'de> for Envelope {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        RawEvent::deserialize(deserializer)?
            .decode()
            .map_err(serde::de::Error::custom)
    }
}

/// `oneOf` the envelope of each type at its latest version, discriminated by `type`.
fn envelope_schema(
    description: &str,
    common: Value,
    common_required: &[&str],
    variants: Vec<(&'static str, u32, Schema)>,
) -> Schema {
    let one_of: Vec<Value> = variants
        .into_iter()
        .map(|(type_name, version, data)| {
            let mut properties = common.clone();
            let map = properties
                .as_object_mut()
                .expect("envelope properties are a JSON object literal");
            map.insert("type".into(), serde_json::json!({"const": type_name}));
            map.insert("version".into(), serde_json::json!({"const": version}));
            map.insert("data".into(), data.to_value());
            let mut required: Vec<&str> = common_required.to_vec();
            required.extend(["type", "version", "data"]);
            serde_json::json!({
                "type": "object",
                "title": type_name,
                "properties": properties,
                "required": required,
                "additionalProperties": false,
            })
        })
        .collect();
    json_schema!({ "description": description, "oneOf": one_of })
}

impl JsonSchema for Envelope {
    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("Envelope")
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let common = serde_json::json!({
            "id": generator.subschema_for::<EventId>(),
            "session_id": generator.subschema_for::<SessionId>(),
            "seq": {"type": "integer", "minimum": 1},
            "time": {"type": "integer", "description": "Milliseconds since the Unix epoch."},
        });
        let variants = DurableEvent::latest_schemas(generator);
        envelope_schema(
            "A durable event: its envelope and payload at the latest version of its type.",
            common,
            &["id", "session_id", "seq", "time"],
            variants,
        )
    }
}

/// An ephemeral event with its envelope. It has no id and no `seq`.
///
/// On the wire: `{"session_id", "type", "version", "time", "data"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct EphemeralEnvelope {
    pub session_id: SessionId,
    /// Milliseconds since the Unix epoch.
    pub time: i64,
    pub event: EphemeralEvent,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEphemeral {
    session_id: SessionId,
    #[serde(rename = "type")]
    type_name: String,
    version: u32,
    time: i64,
    data: Value,
}

impl Serialize for EphemeralEnvelope {
    /// The shape of [`RawEphemeral`], written straight from the payload (every token
    /// delta goes through here).
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        /// Field for field the order of [`RawEphemeral`].
        #[derive(Serialize)]
        struct Wire<'a> {
            session_id: SessionId,
            #[serde(rename = "type")]
            type_name: &'static str,
            version: u32,
            time: i64,
            data: Data<'a, EphemeralEvent>,
        }

        Wire {
            session_id: self.session_id,
            type_name: self.event.type_name(),
            version: self.event.version(),
            time: self.time,
            data: Data(&self.event),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for EphemeralEnvelope {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = RawEphemeral::deserialize(deserializer)?;
        let event = EphemeralEvent::decode(&raw.type_name, raw.version, raw.data)
            .map_err(serde::de::Error::custom)?;
        Ok(Self {
            session_id: raw.session_id,
            time: raw.time,
            event,
        })
    }
}

impl JsonSchema for EphemeralEnvelope {
    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("EphemeralEnvelope")
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let common = serde_json::json!({
            "session_id": generator.subschema_for::<SessionId>(),
            "time": {"type": "integer", "description": "Milliseconds since the Unix epoch."},
        });
        let variants = EphemeralEvent::latest_schemas(generator);
        envelope_schema(
            "An ephemeral event (live only, never stored, no seq).",
            common,
            &["session_id", "time"],
            variants,
        )
    }
}

#[cfg(test)]
mod tests;
