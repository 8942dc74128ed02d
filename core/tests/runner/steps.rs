//! The drain and step loop.

use std::collections::HashMap;
use std::time::Duration;

use keel_core::coordinator::RunError;
use keel_core::provider::scripted::Item;
use keel_core::provider::{self, Event, ToolChoice, Turn};
use keel_core::recovery::Recovery;
use keel_core::runner::{Agent, Error, Live, ModelLimits};
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::types::{Delivery, Finish, ModelRef, Outcome, ToolContent, Usage};
use serde_json::json;

use crate::compaction::answer;
use crate::support::{Harness, Hold, LEASE, Setup, call, kind, script, text};

#[tokio::test]
async fn a_prompt_produces_the_documented_event_order() {
    let h = Harness::new(Setup::default()).await;
    let session = h.prompted("Hello?").await;
    h.runner.run(session).await.unwrap();
    assert_eq!(
        h.kinds(session).await,
        vec![
            "created",
            "prompt.admitted",
            "prompt.execution_requested",
            "execution.started",
            "prompted",
            "context.epoch_started",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    assert!(!h.claim_exists(session).await);
    let log = h.log(session).await;
    let DurableEvent::TextEnded(ended) = &log[8].event else {
        panic!("{:?}", log[8])
    };
    assert_eq!(ended.text, "Hello.");
}

#[tokio::test]
async fn local_tools_start_only_after_tool_called_commits_and_finish_before_the_step_settles() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.session().await;
    *h.probe.session.lock().unwrap() = Some(session);
    h.admit(session, "probe it", Delivery::Queue).await;
    h.runner.run(session).await.unwrap();
    assert_eq!(*h.probe.called_before_start.lock().unwrap(), vec![true]);
    let kinds = h.kinds(session).await;
    let success = kinds.iter().position(|k| k == "tool.success").unwrap();
    let first_end = kinds.iter().position(|k| k == "step.ended").unwrap();
    assert!(success < first_end, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "step.started").count(), 2);
}

#[tokio::test]
async fn a_tool_driven_continuation_sends_the_results_back_to_the_model() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("probe", json!({}))],
            vec![text("Done.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    h.runner.run(session).await.unwrap();
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let last = format!("{:?}", requests[1].turns.last().unwrap());
    assert!(
        last.contains("ToolResults") && last.contains("probed"),
        "{last}"
    );
    let messages = h
        .store
        .read(move |c| keel_core::event::view::messages(c, session))
        .await
        .unwrap();
    assert!(matches!(messages.last(), Some(Message::Assistant { .. })));
}

#[tokio::test]
async fn steering_inputs_admitted_during_a_step_coalesce_into_one_continuation_turn() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Both seen.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("start").await;
    let run = h.run_to_gate(session).await;
    let first = h.admit(session, "steer one", Delivery::Steer).await;
    let second = h.admit(session, "steer two", Delivery::Steer).await;
    h.release.notify_one();
    run.await.unwrap().unwrap();

    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.success")
        .collect();
    assert_eq!(
        &tail[..6],
        &[
            "tool.success",
            "step.ended",
            "prompted",
            "prompted",
            "step.started",
            "text.started"
        ]
    );
    let log = h.log(session).await;
    let promoted: Vec<_> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::Prompted(p) => Some(p.input_id),
            _ => None,
        })
        .collect();
    assert_eq!(&promoted[1..], &[first, second]);
    // One continuation request carried both steers.
    assert_eq!(h.recording.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_queued_input_is_promoted_only_after_the_continuation_ends() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("First answer.")],
            vec![text("Second answer.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("start").await;
    let run = h.run_to_gate(session).await;
    h.admit(session, "later", Delivery::Queue).await;
    h.release.notify_one();
    run.await.unwrap().unwrap();
    let kinds = h.kinds(session).await;
    let steps: Vec<usize> = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| *k == "step.ended")
        .map(|(i, _)| i)
        .collect();
    let prompted: Vec<usize> = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| *k == "prompted")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(steps.len(), 3);
    assert_eq!(prompted.len(), 2);
    // The queued prompt waited for the end of the tool-driven continuation (step 2).
    assert!(prompted[1] > steps[1], "{kinds:?}");
    assert_eq!(kinds.last().unwrap(), "execution.settled");
}

#[tokio::test]
async fn a_model_switch_is_reloaded_before_a_tool_driven_continuation() {
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("On the new model.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("start").await;
    let run = h.run_to_gate(session).await;
    let switched = ModelRef {
        provider: "other".into(),
        id: "bigger".into(),
    };
    h.store
        .append(
            session,
            vec![DurableEvent::ModelSwitched(payload::ModelSwitched {
                model: switched.clone(),
            })],
        )
        .await
        .unwrap();
    h.release.notify_one();
    run.await.unwrap().unwrap();
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests[0].model.id, "test");
    assert_eq!(requests[1].model, switched);
}

#[tokio::test]
async fn the_last_allowed_step_disables_tool_use_but_keeps_the_definitions() {
    let h = Harness::new(Setup {
        script: Some(script(vec![vec![call("probe", json!({}))]])),
        agent: Some(Agent {
            max_steps: 2,
            ..crate::support::trusting()
        }),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("loop forever").await;
    h.runner.run(session).await.unwrap();
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].tool_choice, ToolChoice::Auto);
    assert_eq!(requests[1].tool_choice, ToolChoice::None);
    assert!(!requests[1].tools.is_empty());
    assert_eq!(h.probe.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    let log = h.log(session).await;
    let refused = log.iter().any(
        |e| matches!(&e.event, DurableEvent::ToolFailed(f) if f.error.kind == "tool.max-steps"),
    );
    assert!(refused);
}

#[tokio::test]
async fn malformed_tool_input_fails_the_call_and_is_never_run() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![Item::ToolCall {
                name: "probe".into(),
                input: json!(null),
                raw: Some("{\"path\": ".into()),
                id: None,
            }],
            vec![text("Sorry.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    h.runner.run(session).await.unwrap();
    assert_eq!(h.probe.runs.load(std::sync::atomic::Ordering::SeqCst), 0);
    let log = h.log(session).await;
    let failed: Vec<&str> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ToolFailed(f) => Some(f.error.kind.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec!["tool.input-json"]);
}

#[tokio::test]
async fn a_hosted_tool_left_unresolved_fails_before_the_step_ends() {
    let h = Harness::new(Setup {
        script: Some(script(vec![vec![
            Item::HostedTool {
                name: "web_search".into(),
                input: json!({"q": "keel"}),
                result: None,
                id: None,
            },
            Item::Finish {
                reason: Finish::Stop,
                usage: None,
            },
        ]])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("search").await;
    h.runner.run(session).await.unwrap();
    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .collect();
    assert_eq!(
        tail,
        vec![
            "tool.called",
            "tool.failed",
            "step.ended",
            "execution.settled"
        ]
    );
    let log = h.log(session).await;
    let message = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolFailed(f) => Some(f.error.message.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        message.starts_with("Provider Step ended without settlement"),
        "{message}"
    );
}

#[tokio::test]
async fn a_hosted_tool_result_is_recorded_with_its_raw_result() {
    let h = Harness::new(Setup {
        script: Some(script(vec![vec![
            Item::HostedTool {
                name: "web_search".into(),
                input: json!({"q": "keel"}),
                result: Some(json!({"hits": 3})),
                id: None,
            },
            text("Found three."),
        ]])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("search").await;
    h.runner.run(session).await.unwrap();
    let log = h.log(session).await;
    let success = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolSuccess(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(success.result, Some(json!({"hits": 3})));
}

/// A 1×1 transparent PNG.
const PIXEL_PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0A, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0x00, 0x01, 0x00, 0x00,
    0x05, 0x00, 0x01, 0x0D, 0x0A, 0x2D, 0xB4, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4E, 0x44, 0xAE,
    0x42, 0x60, 0x82,
];

#[tokio::test]
async fn an_image_read_by_a_tool_is_stored_once_in_the_event_log() {
    use base64::Engine as _;

    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("read", json!({"path": "pixel.png"}))],
            vec![text("A pixel.")],
        ])),
        ..Setup::default()
    })
    .await;
    std::fs::write(h.workspace.path().join("pixel.png"), PIXEL_PNG).unwrap();
    let session = h.prompted("look").await;
    h.runner.run(session).await.unwrap();
    let encoded = base64::engine::general_purpose::STANDARD.encode(PIXEL_PNG);
    let stored: String = h
        .store
        .read(move |c| keel_core::event::log::read_raw(c, session, 0, u32::MAX))
        .await
        .unwrap()
        .iter()
        .map(|e| e.data.to_string())
        .collect();
    assert_eq!(stored.matches(&encoded).count(), 1);
}

/// Writes committed while a prompt runs to the end with `responses` as the model's
/// answers, and the number of durable events they carried.
async fn writes_and_events(responses: Vec<Vec<Item>>) -> (u64, usize) {
    let h = Harness::new(Setup {
        script: Some(script(responses)),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let before = h.store.stats().1;
    h.runner.run(session).await.unwrap();
    (h.store.stats().1 - before, h.log(session).await.len())
}

#[tokio::test]
async fn what_the_model_stream_has_ready_commits_in_one_write() {
    // The scripted model has each answer ready at once: however many fragments it holds,
    // a burst costs one write, so both runs commit the same number of writes while the
    // second logs more events.
    let short = writes_and_events(vec![
        vec![text("Looking."), call("probe", json!({}))],
        vec![text("Done.")],
    ])
    .await;
    let long = writes_and_events(vec![
        vec![
            text("Looking."),
            text("Still looking."),
            text("One more look."),
            call("probe", json!({})),
        ],
        vec![text("Done."), text("Really done.")],
    ])
    .await;
    assert!(long.1 >= short.1 + 6, "{short:?} {long:?}");
    assert_eq!(long.0, short.0, "{short:?} {long:?}");
}

#[tokio::test]
async fn a_hosted_call_left_unresolved_fails_before_the_tool_driven_continuation_starts() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![
                Item::HostedTool {
                    name: "web_search".into(),
                    input: json!({"q": "keel"}),
                    result: None,
                    id: None,
                },
                call("probe", json!({})),
            ],
            vec![text("Done.")],
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("search, then probe").await;
    h.runner.run(session).await.unwrap();

    let kinds = h.kinds(session).await;
    let unsettled = kinds.iter().position(|k| k == "tool.failed").unwrap();
    let first_end = kinds.iter().position(|k| k == "step.ended").unwrap();
    let continuation = kinds.iter().rposition(|k| k == "step.started").unwrap();
    assert!(
        unsettled < first_end && first_end < continuation,
        "{kinds:?}"
    );
    let log = h.log(session).await;
    let failed: Vec<&str> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ToolFailed(f) => Some(f.error.kind.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec!["provider.unsettled"]);
    // The continuation's request carries a result for both calls.
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let Some(Turn::ToolResults { results }) = requests[1].turns.last() else {
        panic!("{:?}", requests[1].turns)
    };
    let outcomes: Vec<(&str, bool)> = results
        .iter()
        .map(|r| (r.name.as_str(), r.output.is_ok()))
        .collect();
    assert_eq!(outcomes, vec![("web_search", false), ("probe", true)]);
}

#[tokio::test]
async fn a_recorded_local_call_starts_while_the_stream_is_still_open() {
    let mut h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let run = h.spawn_run(session);
    stream
        .send(Ok(Event::ToolCall {
            id: "c1".into(),
            name: "gate".into(),
            input: "{}".into(),
            provider_executed: false,
        }))
        .unwrap();
    // Nothing more comes from the model yet: a call that waited for the end of the
    // stream would never start. (A bound on the wait, not a measure of speed.)
    tokio::time::timeout(Duration::from_secs(60), h.gate_started.recv())
        .await
        .expect("the call did not start while the stream was open")
        .unwrap();
    assert!(!stream.is_closed(), "the step stopped reading the stream");
    let kinds = h.kinds(session).await;
    assert_eq!(kinds.last().unwrap(), "tool.called", "{kinds:?}");

    stream
        .send(Ok(Event::Finish {
            finish: Finish::ToolCalls,
            usage: Usage::default(),
        }))
        .unwrap();
    drop(stream);
    answer(&h, "Done.");
    h.release.notify_one();
    run.await.unwrap().unwrap();
    let kinds = h.kinds(session).await;
    let success = kinds.iter().position(|k| k == "tool.success").unwrap();
    let first_end = kinds.iter().position(|k| k == "step.ended").unwrap();
    assert!(success < first_end, "{kinds:?}");
}

#[tokio::test]
async fn a_provider_failure_beside_a_running_call_waits_for_it_and_records_its_result_first() {
    let mut h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let run = h.spawn_run(session);
    stream
        .send(Ok(Event::ToolCall {
            id: "c1".into(),
            name: "gate".into(),
            input: "{}".into(),
            provider_executed: false,
        }))
        .unwrap();
    h.gate_started.recv().await.unwrap();
    stream
        .send(Err(provider::Error::TransportAfterSend(
            "the connection dropped".into(),
        )))
        .unwrap();
    // The step has taken the failure (it dropped the stream) while the call still runs.
    stream.closed().await;
    let kinds = h.kinds(session).await;
    assert_eq!(kinds.last().unwrap(), "tool.called", "{kinds:?}");

    h.release.notify_one();
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::StepFailed(ref e))) if e.kind == "provider.transport_after_send"
    );
    let kinds = h.kinds(session).await;
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "tool.called")
        .collect();
    assert_eq!(
        tail,
        vec![
            "tool.called",
            "tool.success",
            "step.failed",
            "execution.settled"
        ]
    );
}

#[tokio::test]
async fn a_local_tool_success_stores_no_result_and_is_sent_back_from_its_content() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("read", json!({"path": "pixel.png"}))],
            vec![text("A pixel.")],
        ])),
        ..Setup::default()
    })
    .await;
    std::fs::write(h.workspace.path().join("pixel.png"), PIXEL_PNG).unwrap();
    let session = h.prompted("look").await;
    h.runner.run(session).await.unwrap();

    let raw = h
        .store
        .read(move |c| keel_core::event::log::read_raw(c, session, 0, u32::MAX))
        .await
        .unwrap();
    let stored = raw
        .iter()
        .find(|e| e.type_name == "session.next.tool.success")
        .unwrap();
    let mut fields: Vec<&str> = stored
        .data
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(fields, vec!["call_id", "content", "structured"]);
    let log = h.log(session).await;
    let success = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::ToolSuccess(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        success
            .content
            .iter()
            .any(|c| matches!(c, ToolContent::Media { .. }))
    );
    let requests = h.recording.requests.lock().unwrap().clone();
    let Some(Turn::ToolResults { results }) = requests[1].turns.last() else {
        panic!("{:?}", requests[1].turns)
    };
    assert_eq!(results[0].output, Ok(success.content));
    assert_eq!(results[0].provider_result, None);
}

#[tokio::test]
async fn reading_a_binary_file_fails_the_call_and_records_no_success() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("read", json!({"path": "blob.bin"}))],
            vec![text("It is binary.")],
        ])),
        ..Setup::default()
    })
    .await;
    std::fs::write(h.workspace.path().join("blob.bin"), [0u8, 1, 2, 3, 0, 255]).unwrap();
    let session = h.prompted("read blob.bin").await;
    h.runner.run(session).await.unwrap();
    let log = h.log(session).await;
    assert!(
        !log.iter()
            .any(|e| matches!(e.event, DurableEvent::ToolSuccess(_)))
    );
    let failed: Vec<String> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ToolFailed(f) => Some(f.error.message.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].contains("is a binary file"), "{failed:?}");
}

#[tokio::test]
async fn a_queued_input_is_promoted_only_after_a_steering_continuation_ends() {
    let h = Harness::new(Setup::default()).await;
    let session = h.session_on("driven").await;
    h.admit(session, "start", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    stream.send(Ok(Event::TextStart)).unwrap();
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::TextStarted(_))
        {
            break;
        }
    }
    // Admitted while the first step streams, the queued input first.
    let queued = h.admit(session, "queued", Delivery::Queue).await;
    let steer = h.admit(session, "steer", Delivery::Steer).await;
    for event in [
        Event::TextDelta("Working.".into()),
        Event::TextEnd,
        Event::Finish {
            finish: Finish::Stop,
            usage: Usage::default(),
        },
    ] {
        stream.send(Ok(event)).unwrap();
    }
    drop(stream);
    answer(&h, "Steered.");
    answer(&h, "Queued.");
    run.await.unwrap().unwrap();

    let log = h.log(session).await;
    let order: Vec<String> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::Prompted(p) if p.input_id == steer => Some("prompted steer".into()),
            DurableEvent::Prompted(p) if p.input_id == queued => Some("prompted queued".into()),
            DurableEvent::StepEnded(_) => Some("step.ended".into()),
            _ => None,
        })
        .collect();
    assert_eq!(
        order,
        vec![
            "step.ended",
            "prompted steer",
            "step.ended",
            "prompted queued",
            "step.ended"
        ]
    );
    let requests = h.driven.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 3);
    let steered = format!("{:?}", requests[1].turns);
    assert!(
        steered.contains("steer") && !steered.contains("queued"),
        "{steered}"
    );
}

#[tokio::test]
async fn a_crash_between_a_settled_tool_step_and_the_next_recovers_the_continuation() {
    let (mut hold, failpoint) = Hold::new();
    let mut h = Harness::new(Setup {
        script: Some(script(vec![
            vec![call("gate", json!({}))],
            vec![text("Continued.")],
        ])),
        failpoint: Some(failpoint),
        // Limits no request comes near: the next step's start is then a commit of its
        // own, after the boundary that ends the tool step.
        models: HashMap::from([(
            "scripted/test".to_owned(),
            ModelLimits {
                context: 1_000_000,
                output: 1_000,
            },
        )]),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let first = h.run_to_gate(session).await;
    // The commits left: the boundary with the tool step's end, then the next step's
    // start, which is held: the process stops for good between the two.
    hold.at(h.store.stats().0 + 1);
    h.release.notify_one();
    hold.reached().await;
    let settled_step = vec!["tool.called", "tool.success", "step.ended"];
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "tool.called").unwrap();
    assert_eq!(kinds[from..], settled_step);

    h.clock.advance(LEASE + 1);
    let other = h.another_process().await;
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    other.run(session).await.unwrap();

    // The step was settled, so nothing is recovered in it and nothing runs again: the
    // new owner goes on with the tool-driven continuation.
    let kinds = h.kinds(session).await;
    assert_eq!(
        kinds[from..],
        [
            "tool.called",
            "tool.success",
            "step.ended",
            "execution.settled",
            "execution.started",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let settled: Vec<Outcome> = h
        .log(session)
        .await
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ExecutionSettled(s) => Some(s.outcome),
            _ => None,
        })
        .collect();
    assert_eq!(settled, [Outcome::Recovered, Outcome::Succeeded]);
    assert!(h.gate_started.try_recv().is_err(), "the tool ran again");
    let requests = h.recording.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let Some(Turn::ToolResults { results }) = requests[1].turns.last() else {
        panic!("{:?}", requests[1].turns)
    };
    assert_eq!(
        results[0].output,
        Ok(vec![ToolContent::Text {
            text: "released".into()
        }])
    );

    // The dead owner's held commit finds its claim gone and writes nothing.
    hold.release();
    assert_outcome!(first.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, kinds);
}

#[tokio::test]
async fn a_steps_cost_comes_from_its_usage_and_the_models_prices_and_adds_up_per_session() {
    let h = Harness::new(Setup {
        prices: HashMap::from([(
            "driven/test".to_owned(),
            keel_core::runner::Prices {
                input: 3.0,
                output: 15.0,
                cache_read: 0.3,
                cache_write: 3.75,
            },
        )]),
        ..Setup::default()
    })
    .await;
    let session = h.session_on("driven").await;
    for text in ["one", "two"] {
        h.admit(session, text, Delivery::Queue).await;
        // `answer` reports 10 input and 5 output tokens.
        answer(&h, "Done.");
        h.runner.run(session).await.unwrap();
    }
    let costs: Vec<f64> = h
        .log(session)
        .await
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::StepEnded(s) => Some(s.cost),
            _ => None,
        })
        .collect();
    let one = (10.0 * 3.0 + 5.0 * 15.0) / 1_000_000.0;
    assert_eq!(costs.len(), 2);
    assert!(costs.iter().all(|c| (c - one).abs() < 1e-15), "{costs:?}");
    let total = h
        .store
        .read(move |c| keel_core::event::view::session(c, session))
        .await
        .unwrap()
        .unwrap()
        .cost;
    assert!((total - 2.0 * one).abs() < 1e-12, "{total}");
}

/// The next live event that is a text delta or a durable text event, as "delta:…",
/// "started" or "ended:…"; fails when none comes within 10 s.
async fn next_text(live: &mut tokio::sync::broadcast::Receiver<Live>) -> String {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(10), live.recv())
            .await
            .expect("no text event within 10 s")
            .unwrap();
        match item {
            Live::Ephemeral(e) => {
                if let keel_schema::event::EphemeralEvent::TextDelta(d) = e.event {
                    return format!("delta:{}", d.delta);
                }
            }
            Live::Durable(e) => match e.event {
                DurableEvent::TextStarted(_) => return "started".into(),
                DurableEvent::TextEnded(t) => return format!("ended:{}", t.text),
                _ => {}
            },
            Live::Remote(_) => {}
        }
    }
}

#[tokio::test]
async fn deltas_go_live_while_their_fragment_s_start_waits_for_the_writer() {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::StepStarted(_))
        {
            break;
        }
    }
    // The next commit carries `text.started`: the writer is held before it.
    hold.at(h.store.stats().0);
    stream.send(Ok(Event::TextStart)).unwrap();
    stream.send(Ok(Event::TextDelta("Hel".into()))).unwrap();
    hold.reached().await;
    assert_eq!(next_text(&mut live).await, "delta:Hel");
    // The step goes on reading while the commit waits; what it reads meanwhile waits for
    // the next commit.
    stream.send(Ok(Event::TextDelta("lo".into()))).unwrap();
    assert_eq!(next_text(&mut live).await, "delta:lo");
    stream.send(Ok(Event::TextEnd)).unwrap();
    stream
        .send(Ok(Event::Finish {
            finish: Finish::Stop,
            usage: Usage::default(),
        }))
        .unwrap();
    drop(stream);
    hold.release();
    run.await.unwrap().unwrap();

    assert_eq!(next_text(&mut live).await, "started");
    assert_eq!(next_text(&mut live).await, "ended:Hello");
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled"
        ]
    );
}

/// A step boundary after tool calls commits without waiting for the disk and is published
/// once there; the next step's deltas, published as they are read, must not overtake it:
/// a client would show the next answer before the results it answers.
#[tokio::test]
async fn the_next_step_s_deltas_wait_behind_a_boundary_not_yet_on_disk() {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        failpoint: Some(failpoint),
        // The boundary reaches the disk only with the next step's first commit.
        flush_delay: Some(Duration::from_secs(600)),
        ..Setup::default()
    })
    .await;
    let session = h.session_on("driven").await;
    h.admit(session, "go", Delivery::Queue).await;
    let first = h.driven.queue();
    let second = h.driven.queue();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    first
        .send(Ok(Event::ToolCall {
            id: "c1".into(),
            name: "probe".into(),
            input: "{}".into(),
            provider_executed: false,
        }))
        .unwrap();
    first
        .send(Ok(Event::Finish {
            finish: Finish::ToolCalls,
            usage: Usage::default(),
        }))
        .unwrap();
    drop(first);
    // The second request is made once the boundary committed; the next commit is the
    // second step's first, which carries the boundary to the disk: the writer is held
    // before it.
    tokio::time::timeout(Duration::from_secs(60), async {
        while h.driven.requests.lock().unwrap().len() < 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the second step made no request");
    hold.at(h.store.stats().0);
    second.send(Ok(Event::TextStart)).unwrap();
    second.send(Ok(Event::TextDelta("Done".into()))).unwrap();
    hold.reached().await;
    second.send(Ok(Event::TextEnd)).unwrap();
    second
        .send(Ok(Event::Finish {
            finish: Finish::Stop,
            usage: Usage::default(),
        }))
        .unwrap();
    drop(second);
    hold.release();
    run.await.unwrap().unwrap();

    let mut order = Vec::new();
    while let Ok(item) = live.try_recv() {
        order.push(match item {
            Live::Durable(e) => kind(&e.event).to_owned(),
            Live::Ephemeral(_) => "delta".to_owned(),
            Live::Remote(_) => continue,
        });
    }
    let delta = order.iter().position(|k| k == "delta").expect("{order:?}");
    let success = order
        .iter()
        .position(|k| k == "tool.success")
        .expect("{order:?}");
    let second_start = order
        .iter()
        .rposition(|k| k == "step.started")
        .expect("{order:?}");
    assert!(success < delta && second_start < delta, "{order:?}");
}
