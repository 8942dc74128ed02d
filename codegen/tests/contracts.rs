//! The generated contracts describe exactly what keel-schema reads and writes.

use keel_codegen::events;
use keel_schema::event::{
    Durability, DurableEvent, Envelope, EphemeralEnvelope, EphemeralEvent, catalog,
};
use keel_schema::id::{EventId, SessionId};
use schemars::SchemaGenerator;
use serde_json::{Value, json};

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::draft202012::new(schema).expect("a generated schema compiles")
}

fn errors(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator
        .iter_errors(instance)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect()
}

#[test]
fn every_generated_schema_is_a_valid_draft_2020_12_schema() {
    for entry in catalog() {
        let schema = events::schema(entry);
        if let Err(e) = jsonschema::meta::validate(&schema) {
            panic!("{}: {e}", entry.key());
        }
    }
}

#[test]
fn every_catalog_example_validates_against_its_generated_schema() {
    for entry in catalog() {
        let validator = validator(&events::schema(entry));
        let example = (entry.example)();
        assert_eq!(
            errors(&validator, &example),
            Vec::<String>::new(),
            "{}",
            entry.key()
        );
    }
}

#[test]
fn generated_schemas_reject_unknown_fields_and_wrong_types() {
    for entry in catalog() {
        let validator = validator(&events::schema(entry));
        let mut extra = (entry.example)();
        extra["not_a_field"] = json!(1);
        assert!(
            !validator.is_valid(&extra),
            "{} accepted an unknown field",
            entry.key()
        );
        assert!(
            !validator.is_valid(&json!([])),
            "{} accepted an array",
            entry.key()
        );
    }
}

#[test]
fn what_a_schema_rejects_the_decoder_rejects_too() {
    // A required field missing: both the schema and the decoder refuse it.
    for entry in catalog() {
        let example = (entry.example)();
        let Some(fields) = example.as_object() else {
            continue;
        };
        let validator = validator(&events::schema(entry));
        for field in fields.keys() {
            let mut without = example.clone();
            without.as_object_mut().unwrap().remove(field);
            let schema_accepts = validator.is_valid(&without);
            let decoder_accepts = match entry.durability {
                Durability::Durable => {
                    DurableEvent::decode(entry.type_name, entry.version, without).is_ok()
                }
                Durability::Ephemeral => {
                    EphemeralEvent::decode(entry.type_name, entry.version, without).is_ok()
                }
            };
            assert_eq!(
                schema_accepts,
                decoder_accepts,
                "{} without `{field}`",
                entry.key()
            );
        }
    }
}

fn envelope_validator<T: schemars::JsonSchema>() -> jsonschema::Validator {
    let schema = SchemaGenerator::default().into_root_schema_for::<T>();
    validator(&schema.to_value())
}

#[test]
fn every_latest_event_in_its_envelope_validates_against_the_envelope_schema() {
    let durable = envelope_validator::<Envelope>();
    let ephemeral = envelope_validator::<EphemeralEnvelope>();
    for entry in catalog().filter(|e| e.latest) {
        let example = (entry.example)();
        let wire = match entry.durability {
            Durability::Durable => {
                let envelope = Envelope {
                    id: EventId::new(),
                    session_id: SessionId::new(),
                    seq: 3,
                    time: 1_764_690_000_000,
                    event: DurableEvent::decode(entry.type_name, entry.version, example).unwrap(),
                };
                let wire = serde_json::to_value(&envelope).unwrap();
                assert_eq!(
                    errors(&durable, &wire),
                    Vec::<String>::new(),
                    "{}",
                    entry.key()
                );
                wire
            }
            Durability::Ephemeral => {
                let envelope = EphemeralEnvelope {
                    session_id: SessionId::new(),
                    time: 1_764_690_000_000,
                    event: EphemeralEvent::decode(entry.type_name, entry.version, example).unwrap(),
                };
                let wire = serde_json::to_value(&envelope).unwrap();
                assert_eq!(
                    errors(&ephemeral, &wire),
                    Vec::<String>::new(),
                    "{}",
                    entry.key()
                );
                wire
            }
        };
        // The envelope schema pins type and version together.
        let mut wrong_version = wire;
        wrong_version["version"] = json!(entry.version + 1);
        let validator = match entry.durability {
            Durability::Durable => &durable,
            Durability::Ephemeral => &ephemeral,
        };
        assert!(!validator.is_valid(&wrong_version), "{}", entry.key());
    }
}

#[test]
fn legacy_versions_are_in_the_catalog_and_their_schemas_describe_the_old_shape() {
    let tool_success_1 = catalog()
        .find(|e| e.key() == "session.next.tool.success.1")
        .expect("tool.success version 1 stays in the catalog");
    assert!(!tool_success_1.latest);
    let validator = validator(&events::schema(tool_success_1));
    let legacy = json!({
        "call_id": "call_01KBFVGY400000000000000007",
        "output": "3 files",
        "result": {"files": ["a.rs", "b.rs", "c.rs"]},
    });
    assert_eq!(errors(&validator, &legacy), Vec::<String>::new());
}
