use keel_schema::types::{Effect, Finish, Usage};

use super::*;

fn translator() -> Translator {
    Translator::new(
        MessageId::new(),
        HashMap::from([(
            "read".to_owned(),
            Known {
                effect: Effect::Read,
                rerun: true,
            },
        )]),
        false,
    )
}

fn kinds(actions: &Actions) -> Vec<&'static str> {
    actions
        .durable
        .iter()
        .map(DurableEvent::type_name)
        .collect()
}

#[test]
fn a_second_open_text_fragment_is_a_protocol_error() {
    let mut p = translator();
    p.accept(Event::TextStart).unwrap();
    assert!(matches!(
        p.accept(Event::TextStart),
        Err(provider::Error::Protocol(_))
    ));
}

#[test]
fn text_and_reasoning_count_their_ordinals_separately() {
    let mut p = translator();
    let mut ordinals = Vec::new();
    for event in [
        Event::TextStart,
        Event::TextEnd,
        Event::ReasoningStart,
        Event::ReasoningEnd { metadata: None },
        Event::TextStart,
        Event::TextEnd,
    ] {
        for durable in p.accept(event).unwrap().durable {
            match durable {
                DurableEvent::TextStarted(t) => ordinals.push(("text", t.ordinal)),
                DurableEvent::ReasoningStarted(r) => ordinals.push(("reasoning", r.ordinal)),
                _ => {}
            }
        }
    }
    assert_eq!(ordinals, vec![("text", 0), ("reasoning", 0), ("text", 1)]);
}

#[test]
fn deltas_are_ephemeral_and_the_ended_event_carries_the_whole_text() {
    let mut p = translator();
    p.accept(Event::TextStart).unwrap();
    let delta = p.accept(Event::TextDelta("Hel".into())).unwrap();
    assert!(delta.durable.is_empty());
    assert_eq!(delta.ephemeral.len(), 1);
    p.accept(Event::TextDelta("lo".into())).unwrap();
    let ended = p.accept(Event::TextEnd).unwrap();
    assert!(matches!(&ended.durable[..], [DurableEvent::TextEnded(t)] if t.text == "Hello"));
}

#[test]
fn a_duplicate_call_a_result_for_a_local_call_and_a_second_finish_are_protocol_errors() {
    let call = || Event::ToolCall {
        id: "c1".into(),
        name: "read".into(),
        input: "{}".into(),
        provider_executed: false,
    };
    let mut p = translator();
    let first = p.accept(call()).unwrap();
    assert_eq!(kinds(&first), vec!["session.next.tool.called"]);
    assert_eq!(first.launch.len(), 1);
    assert!(matches!(
        p.accept(call()),
        Err(provider::Error::Protocol(_))
    ));
    let result = Event::ToolResult {
        id: "c1".into(),
        result: Value::Null,
        content: vec![],
        error: None,
    };
    assert!(matches!(
        p.accept(result),
        Err(provider::Error::Protocol(_))
    ));
    let finish = || Event::Finish {
        finish: Finish::Stop,
        usage: Usage::default(),
    };
    p.accept(finish()).unwrap();
    assert!(matches!(
        p.accept(finish()),
        Err(provider::Error::Protocol(_))
    ));
}

#[test]
fn calls_the_model_may_not_make_fail_at_once_and_are_not_launched() {
    let mut p = translator();
    let unknown = p
        .accept(Event::ToolCall {
            id: "a".into(),
            name: "rm_rf".into(),
            input: "{}".into(),
            provider_executed: false,
        })
        .unwrap();
    assert_eq!(
        kinds(&unknown),
        vec!["session.next.tool.called", "session.next.tool.failed"]
    );
    assert!(unknown.launch.is_empty());
    let mut last = Translator::new(
        MessageId::new(),
        HashMap::from([(
            "read".to_owned(),
            Known {
                effect: Effect::Read,
                rerun: true,
            },
        )]),
        true,
    );
    let late = last
        .accept(Event::ToolCall {
            id: "b".into(),
            name: "read".into(),
            input: "{}".into(),
            provider_executed: false,
        })
        .unwrap();
    assert!(
        matches!(&late.durable[1], DurableEvent::ToolFailed(f) if f.error.kind == "tool.max-steps")
    );
    assert!(late.launch.is_empty());
}

#[test]
fn closing_ends_open_fragments_in_order_and_fails_unsettled_hosted_calls() {
    let mut p = translator();
    // Opened in the reverse of the closing order: the order is by kind, not by arrival.
    p.accept(Event::ToolInputStart {
        id: "c".into(),
        name: "read".into(),
    })
    .unwrap();
    p.accept(Event::ToolInputDelta {
        id: "c".into(),
        delta: "{\"pa".into(),
    })
    .unwrap();
    p.accept(Event::ReasoningStart).unwrap();
    p.accept(Event::TextStart).unwrap();
    p.accept(Event::ToolCall {
        id: "h".into(),
        name: "web_search".into(),
        input: "{}".into(),
        provider_executed: true,
    })
    .unwrap();
    let closed = p.close();
    let kinds: Vec<&str> = closed.iter().map(DurableEvent::type_name).collect();
    assert_eq!(
        kinds,
        vec![
            "session.next.text.ended",
            "session.next.reasoning.ended",
            "session.next.tool.input.ended",
            "session.next.tool.failed",
            "session.next.tool.failed"
        ]
    );
    assert!(
        matches!(&closed[2], DurableEvent::ToolInputEnded(e) if e.text == "{\"pa"),
        "{closed:?}"
    );
    let failures: Vec<&str> = closed
        .iter()
        .filter_map(|e| match e {
            DurableEvent::ToolFailed(f) => Some(f.error.kind.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(failures, vec!["provider.incomplete", "provider.unsettled"]);
}

#[test]
fn a_finish_is_recorded_without_publishing_step_ended() {
    let mut p = translator();
    let usage = Usage {
        input: 12,
        output: 3,
        ..Usage::default()
    };
    let accepted = p
        .accept(Event::Finish {
            finish: Finish::ToolCalls,
            usage,
        })
        .unwrap();
    assert!(
        accepted.durable.is_empty() && accepted.ephemeral.is_empty() && accepted.launch.is_empty(),
        "{accepted:?}"
    );
    assert_eq!(p.finish, Some((Finish::ToolCalls, usage)));
}

#[test]
fn consecutive_deltas_of_one_fragment_coalesce() {
    let id = MessageId::new();
    let delta = |ordinal, text: &str| {
        EphemeralEvent::TextDelta(payload::TextDelta {
            assistant_message_id: id,
            ordinal,
            delta: text.into(),
        })
    };
    let merged = coalesce(vec![
        (delta(0, "a"), 1),
        (delta(0, "b"), 2),
        (delta(1, "c"), 3),
    ]);
    assert_eq!(merged, vec![(delta(0, "ab"), 1), (delta(1, "c"), 3)]);
}
