//! The drain and step loop.

use keel_core::provider::ToolChoice;
use keel_core::provider::scripted::Item;
use keel_core::runner::Agent;
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::types::{Delivery, Finish, ModelRef};
use serde_json::json;

use crate::support::{Harness, Setup, call, script, text};

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
            ..Agent::default()
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
