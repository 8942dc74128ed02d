use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use super::payload::sample;
use super::*;
use crate::types::{Finish, ToolContent, Usage};

fn envelope(event: DurableEvent) -> Envelope {
    Envelope {
        id: sample::event(),
        session_id: sample::session(),
        seq: 17,
        time: 1_764_690_000_000,
        event,
    }
}

#[test]
fn every_catalog_example_decodes_and_round_trips_through_the_wire_form() {
    for entry in catalog() {
        let example = (entry.example)();
        match entry.durability {
            Durability::Durable => {
                let event = DurableEvent::decode(entry.type_name, entry.version, example)
                    .unwrap_or_else(|e| panic!("{}: {e}", entry.key()));
                assert_eq!(event.type_name(), entry.type_name);
                let original = envelope(event);
                let wire = serde_json::to_string(&original).unwrap();
                let back: Envelope = serde_json::from_str(&wire).unwrap();
                assert_eq!(back, original, "{}", entry.key());
            }
            Durability::Ephemeral => {
                let event = EphemeralEvent::decode(entry.type_name, entry.version, example)
                    .unwrap_or_else(|e| panic!("{}: {e}", entry.key()));
                let original = EphemeralEnvelope {
                    session_id: sample::session(),
                    time: 1_764_690_000_000,
                    event,
                };
                let wire = serde_json::to_string(&original).unwrap();
                let back: EphemeralEnvelope = serde_json::from_str(&wire).unwrap();
                assert_eq!(back, original, "{}", entry.key());
            }
        }
    }
}

#[test]
fn latest_examples_encode_back_to_exactly_the_example() {
    for entry in catalog().filter(|e| e.latest && e.durability == Durability::Durable) {
        let example = (entry.example)();
        let event = DurableEvent::decode(entry.type_name, entry.version, example.clone()).unwrap();
        assert_eq!(event.version(), entry.version, "{}", entry.key());
        assert_eq!(event.data().unwrap(), example, "{}", entry.key());
    }
}

#[test]
fn direct_serialization_writes_the_same_text_as_the_stored_form() {
    for entry in catalog().filter(|e| e.latest && e.durability == Durability::Durable) {
        let event =
            DurableEvent::decode(entry.type_name, entry.version, (entry.example)()).unwrap();
        assert_eq!(
            event.data_json().unwrap(),
            event.data().unwrap().to_string(),
            "{}",
            entry.key()
        );
        let original = envelope(event);
        assert_eq!(
            serde_json::to_string(&original).unwrap(),
            serde_json::to_string(&original.to_raw().unwrap()).unwrap(),
            "{}",
            entry.key()
        );
    }
    for entry in catalog().filter(|e| e.latest && e.durability == Durability::Ephemeral) {
        let event =
            EphemeralEvent::decode(entry.type_name, entry.version, (entry.example)()).unwrap();
        let expected = json!({
            "session_id": sample::session(),
            "type": entry.type_name,
            "version": entry.version,
            "time": 1,
            "data": event.data().unwrap(),
        });
        let original = EphemeralEnvelope {
            session_id: sample::session(),
            time: 1,
            event,
        };
        assert_eq!(
            serde_json::to_string(&original).unwrap(),
            expected.to_string(),
            "{}",
            entry.key()
        );
    }
}

#[test]
fn catalog_versions_count_up_from_one_and_the_highest_is_the_one_written() {
    let mut versions: BTreeMap<&str, Vec<(u32, bool)>> = BTreeMap::new();
    for entry in catalog() {
        versions
            .entry(entry.type_name)
            .or_default()
            .push((entry.version, entry.latest));
    }
    for (type_name, list) in versions {
        let numbers: Vec<u32> = list.iter().map(|(v, _)| *v).collect();
        let expected: Vec<u32> = (1..=numbers.len() as u32).collect();
        assert_eq!(numbers, expected, "{type_name}");
        let latest: Vec<u32> = list.iter().filter(|(_, l)| *l).map(|(v, _)| *v).collect();
        assert_eq!(latest, vec![numbers.len() as u32], "{type_name}");
    }
}

#[test]
fn type_names_are_unique_across_durable_and_ephemeral_events() {
    let durable: BTreeSet<&str> = catalog()
        .filter(|e| e.durability == Durability::Durable)
        .map(|e| e.type_name)
        .collect();
    let ephemeral: BTreeSet<&str> = catalog()
        .filter(|e| e.durability == Durability::Ephemeral)
        .map(|e| e.type_name)
        .collect();
    assert!(durable.is_disjoint(&ephemeral));
    assert!(catalog().all(|e| e.type_name.starts_with("session.next.")));
}

#[test]
fn envelope_wire_form_is_the_documented_one() {
    let event = envelope(DurableEvent::StepInterrupted(payload::StepInterrupted {
        assistant_message_id: sample::assistant(),
        reason: crate::types::InterruptReason::User,
    }));
    assert_eq!(
        serde_json::to_value(&event).unwrap(),
        json!({
            "id": "evt_01KBFVGY400000000000000009",
            "session_id": "ses_01KBFVGY400000000000000001",
            "seq": 17,
            "type": "session.next.step.interrupted",
            "version": 1,
            "time": 1_764_690_000_000_i64,
            "data": {
                "assistant_message_id": "msg_01KBFVGY400000000000000004",
                "reason": "user",
            },
        })
    );
}

#[test]
fn legacy_tool_success_that_carried_result_decodes_into_the_latest_shape() {
    let stored = RawEvent {
        id: sample::event(),
        session_id: sample::session(),
        seq: 9,
        type_name: "session.next.tool.success".into(),
        version: 1,
        time: 1_764_690_000_000,
        data: json!({
            "call_id": "call_01KBFVGY400000000000000007",
            "output": "3 files",
            "result": {"files": ["a.rs", "b.rs", "c.rs"]},
        }),
    };
    let decoded = stored.decode().unwrap();
    assert_eq!(
        decoded.event,
        DurableEvent::ToolSuccess(payload::ToolSuccess {
            call_id: sample::call(),
            structured: json!({"files": ["a.rs", "b.rs", "c.rs"]}),
            content: vec![ToolContent::Text {
                text: "3 files".into()
            }],
            result: None,
        })
    );
    // Re-encoding writes the latest version.
    let raw = decoded.to_raw().unwrap();
    assert_eq!(
        (raw.type_name.as_str(), raw.version),
        ("session.next.tool.success", 2)
    );
}

#[test]
fn legacy_step_ended_decodes_with_zero_for_what_it_did_not_record() {
    let event = DurableEvent::decode(
        "session.next.step.ended",
        1,
        json!({
            "assistant_message_id": "msg_01KBFVGY400000000000000004",
            "finish": "tool_calls",
            "tokens": {"input": 900, "output": 40},
        }),
    )
    .unwrap();
    assert_eq!(
        event,
        DurableEvent::StepEnded(payload::StepEnded {
            assistant_message_id: sample::assistant(),
            finish: Finish::ToolCalls,
            usage: Usage {
                input: 900,
                output: 40,
                ..Usage::default()
            },
            cost: 0.0,
        })
    );
}

#[test]
fn legacy_execution_settled_decodes_with_the_same_outcome() {
    let event = DurableEvent::decode(
        "session.next.execution.settled",
        1,
        json!({"execution_id": "exe_01KBFVGY400000000000000005", "outcome": "recovered"}),
    )
    .unwrap();
    let DurableEvent::ExecutionSettled(settled) = &event else {
        panic!("{event:?}");
    };
    assert_eq!(settled.outcome, crate::types::Outcome::Recovered);
    assert_eq!(event.version(), 2);
    // Version 1 never knew `awaiting`.
    assert!(
        DurableEvent::decode(
            "session.next.execution.settled",
            1,
            json!({"execution_id": "exe_01KBFVGY400000000000000005", "outcome": "awaiting"}),
        )
        .is_err()
    );
}

#[test]
fn an_unknown_type_or_version_is_refused_naming_it() {
    let err = DurableEvent::decode("session.next.step.ended", 3, json!({})).unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown Durable event `session.next.step.ended.3`: not in this build's catalog \
         (written by a newer keel?)"
    );
    // Ephemeral events are not durable events.
    assert!(matches!(
        DurableEvent::decode("session.next.text.delta", 1, json!({})),
        Err(DecodeError::Unknown { .. })
    ));
}

#[test]
fn a_payload_that_does_not_match_its_version_is_refused() {
    let err = DurableEvent::decode(
        "session.next.tool.success",
        2,
        json!({"call_id": "call_01KBFVGY400000000000000007", "output": "x", "result": 1}),
    )
    .unwrap_err();
    assert!(
        matches!(err, DecodeError::Invalid { version: 2, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("session.next.tool.success.2"),
        "{err}"
    );
}
