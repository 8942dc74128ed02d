//! Compaction: manual through a control input, automatic at the model's limit, and the
//! recovery of a context overflow (one forced compaction and retry per step, a second
//! overflow persisted, a failing summary publishing the original overflow, never after
//! output, interruptible). The summary keeps the transcript valid.

use std::collections::HashMap;

use keel_core::coordinator::RunError;
use keel_core::inbox::{self, Admission};
use keel_core::provider::{self, AssistantItem, Event, Turn};
use keel_core::recovery::Recovery;
use keel_core::runner::{Error, Live, ModelLimits};
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, EphemeralEvent};
use keel_schema::id::SessionId;
use keel_schema::types::{CompactionReason, Delivery, Finish, InputKind, Phase, Usage};
use serde_json::json;
use tokio::sync::mpsc::UnboundedSender;

use crate::support::{Harness, Hold, LEASE, Setup};

type Sender = UnboundedSender<Result<Event, provider::Error>>;

fn overflow(message: &str) -> provider::Error {
    provider::Error::ContextOverflow(message.into())
}

/// Sends a whole text answer (or summary) and its finish.
fn say(stream: &Sender, text: &str) {
    for event in [
        Event::TextStart,
        Event::TextDelta(text.into()),
        Event::TextEnd,
        Event::Finish {
            finish: Finish::Stop,
            usage: Usage {
                input: 10,
                output: 5,
                ..Usage::default()
            },
        },
    ] {
        stream.send(Ok(event)).unwrap();
    }
}

/// Queues a response that says `text`.
pub(crate) fn answer(h: &Harness, text: &str) {
    say(&h.driven.queue(), text);
}

/// Queues a response that fails at once with `error`.
pub(crate) fn failing(h: &Harness, error: provider::Error) {
    h.driven.queue().send(Err(error)).unwrap();
}

/// Queues a response that calls `read` on `path`.
fn read_call(h: &Harness, id: &str, path: &str) {
    let stream = h.driven.queue();
    let input = json!({ "path": path }).to_string();
    for event in [
        Event::ToolInputStart {
            id: id.into(),
            name: "read".into(),
        },
        Event::ToolInputEnd { id: id.into() },
        Event::ToolCall {
            id: id.into(),
            name: "read".into(),
            input,
            provider_executed: false,
        },
        Event::Finish {
            finish: Finish::ToolCalls,
            usage: Usage::default(),
        },
    ] {
        stream.send(Ok(event)).unwrap();
    }
}

pub(crate) async fn driven_prompt(h: &Harness, session: SessionId, text: &str) {
    h.admit(session, text, Delivery::Queue).await;
}

/// What the `n`th request to the driven provider sent.
pub(crate) fn request(h: &Harness, n: usize) -> provider::Request {
    h.driven.requests.lock().unwrap()[n].clone()
}

/// The text of a user turn.
pub(crate) fn user_text(turn: &Turn) -> String {
    match turn {
        Turn::User { parts } => format!("{parts:?}"),
        other => panic!("not a user turn: {other:?}"),
    }
}

/// Each tool call of the request has exactly one result, in the turn right after it.
fn assert_valid(request: &provider::Request) {
    for (i, turn) in request.turns.iter().enumerate() {
        let Turn::Assistant { items } = turn else {
            continue;
        };
        let calls: Vec<&String> = items
            .iter()
            .filter_map(|item| match item {
                AssistantItem::ToolCall { id, .. } => Some(id),
                _ => None,
            })
            .collect();
        if calls.is_empty() {
            continue;
        }
        let Some(Turn::ToolResults { results }) = request.turns.get(i + 1) else {
            panic!("the calls of turn {i} have no results: {:?}", request.turns);
        };
        let answered: Vec<&String> = results.iter().map(|r| &r.id).collect();
        assert_eq!(answered, calls, "turn {i}");
    }
}

fn compactions(log: &[keel_schema::event::Envelope]) -> Vec<&'static str> {
    log.iter()
        .filter_map(|e| match &e.event {
            DurableEvent::CompactionStarted(_) => Some("started"),
            DurableEvent::CompactionEnded(_) => Some("ended"),
            DurableEvent::CompactionFailed(_) => Some("failed"),
            _ => None,
        })
        .collect()
}

/// A session that has answered once (a `read` call, then text), so its history holds a
/// tool call and its result.
/// Admits a manual compaction, without running it.
pub(crate) async fn request_compaction(h: &Harness, session: SessionId) {
    let clock = h.store.clock().clone();
    h.store
        .write(move |c| {
            let compact = Admission {
                kind: InputKind::Compact,
                parts: Vec::new(),
                ..Admission::prompt(Vec::new())
            };
            inbox::admit(c, clock.now_ms(), session, compact)
        })
        .await
        .unwrap();
}

pub(crate) async fn with_history(h: &Harness) -> SessionId {
    std::fs::write(h.workspace.path().join("a.txt"), "alpha\n").unwrap();
    let session = h.session_on("driven").await;
    driven_prompt(h, session, "Read a.txt.").await;
    read_call(h, "call_1", "a.txt");
    answer(h, "It says alpha.");
    h.runner.run(session).await.unwrap();
    session
}

#[tokio::test]
async fn an_overflow_before_output_is_recovered_by_one_compaction_and_a_retry() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "And now?").await;
    failing(&h, overflow("prompt is too long"));
    answer(&h, "The user read a.txt, which says alpha.");
    answer(&h, "Nothing else to do.");
    h.runner.run(session).await.unwrap();

    let kinds = h.kinds(session).await;
    let from = kinds.iter().rposition(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "compaction.started",
            "compaction.ended",
            "context.epoch_started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let log = h.log(session).await;
    let (boundary, step_seq) = (
        log.iter()
            .find_map(|e| match &e.event {
                DurableEvent::CompactionEnded(c) => Some(c.boundary_seq),
                _ => None,
            })
            .unwrap(),
        log.iter()
            .rev()
            .find(|e| matches!(e.event, DurableEvent::StepStarted(_)))
            .unwrap()
            .seq,
    );
    assert_eq!(
        boundary, step_seq,
        "the open step is kept, everything before it summarised"
    );
    assert!(log.iter().any(|e| matches!(
        &e.event,
        DurableEvent::CompactionStarted(c) if c.reason == CompactionReason::Overflow
    )));

    // Requests: 2 earlier, then the overflowed one, the summary, the retry.
    let summary_request = request(&h, 3);
    assert!(user_text(summary_request.turns.last().unwrap()).contains("Summarise"));
    assert_valid(&summary_request);
    let retry = request(&h, 4);
    assert_eq!(retry.turns.len(), 1, "{:?}", retry.turns);
    assert!(user_text(&retry.turns[0]).contains("which says alpha"));

    // Later turns keep the step that went on after the compaction.
    driven_prompt(&h, session, "Thanks.").await;
    answer(&h, "You're welcome.");
    h.runner.run(session).await.unwrap();
    let later = request(&h, 5);
    assert_valid(&later);
    assert!(format!("{:?}", later.turns).contains("Nothing else to do."));
}

#[tokio::test]
async fn a_second_overflow_is_persisted_as_the_step_error() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "And now?").await;
    failing(&h, overflow("first"));
    answer(&h, "A summary.");
    failing(&h, overflow("second"));
    let result = h.runner.run(session).await;
    assert!(
        matches!(&result, Err(RunError::Failed(Error::StepFailed(e)))
            if e.kind == "provider.context_overflow" && e.message.contains("second")),
        "{result:?}"
    );
    assert_eq!(compactions(&h.log(session).await), ["started", "ended"]);
    assert_eq!(h.driven.requests.lock().unwrap().len(), 5);
}

#[tokio::test]
async fn a_failing_summary_publishes_the_original_overflow() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "And now?").await;
    failing(&h, overflow("the original overflow"));
    failing(
        &h,
        provider::Error::BadRequest("the summary was refused".into()),
    );
    let result = h.runner.run(session).await;
    assert!(
        matches!(&result, Err(RunError::Failed(Error::StepFailed(e)))
            if e.kind == "provider.context_overflow" && e.message.contains("the original overflow")),
        "{result:?}"
    );
    let log = h.log(session).await;
    assert_eq!(compactions(&log), ["started", "failed"]);
    let failed = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::CompactionFailed(f) => Some(f.error.kind.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(failed, "provider.bad_request");
}

#[tokio::test]
async fn an_overflow_after_output_is_not_recovered() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "And now?").await;
    let stream = h.driven.queue();
    stream.send(Ok(Event::TextStart)).unwrap();
    stream.send(Ok(Event::TextDelta("Part".into()))).unwrap();
    stream.send(Err(overflow("too long"))).unwrap();
    let result = h.runner.run(session).await;
    assert!(
        matches!(&result, Err(RunError::Failed(Error::StepFailed(e))) if e.kind == "provider.context_overflow"),
        "{result:?}"
    );
    assert!(compactions(&h.log(session).await).is_empty());
}

#[tokio::test]
async fn interrupting_the_summary_stops_it_and_the_step() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "And now?").await;
    failing(&h, overflow("too long"));
    // The summary starts and then waits.
    let summary = h.driven.queue();
    summary.send(Ok(Event::TextStart)).unwrap();
    let mut live = h.runner.subscribe();
    let run = h.spawn_run(session);
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::CompactionStarted(_))
        {
            break;
        }
    }
    assert!(h.runner.interrupt(session).await);
    assert_outcome!(
        run.await.unwrap(),
        Err(RunError::Failed(Error::Interrupted))
    );
    let kinds = h.kinds(session).await;
    let from = kinds
        .iter()
        .position(|k| k == "compaction.started")
        .unwrap();
    assert_eq!(
        kinds[from..],
        [
            "compaction.started",
            "compaction.failed",
            "step.interrupted",
            "execution.settled"
        ]
    );
    drop(summary);
    assert_eq!(h.driven.requests.lock().unwrap().len(), 4);
}

#[tokio::test]
async fn a_manual_compaction_summarises_the_history_for_later_turns() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    request_compaction(&h, session).await;
    answer(&h, "Read a.txt: alpha.");
    h.runner.run(session).await.unwrap();
    let log = h.log(session).await;
    assert_eq!(compactions(&log), ["started", "ended"]);
    assert!(log.iter().any(|e| matches!(
        &e.event,
        DurableEvent::CompactionStarted(c) if c.reason == CompactionReason::Manual && c.input_id.is_some()
    )));
    // No continuation after a manual compaction: the session is idle.
    assert!(
        !log.iter()
            .any(|e| matches!(e.event, DurableEvent::Synthetic(_)))
    );
    let messages = h
        .store
        .read(move |c| keel_core::event::view::messages(c, session))
        .await
        .unwrap();
    assert!(matches!(messages.last(), Some(Message::Summary { .. })));

    driven_prompt(&h, session, "What did it say?").await;
    answer(&h, "Alpha.");
    h.runner.run(session).await.unwrap();
    let next = request(&h, 3);
    assert_eq!(next.turns.len(), 2, "{:?}", next.turns);
    assert!(user_text(&next.turns[0]).contains("Read a.txt: alpha."));
    assert!(user_text(&next.turns[1]).contains("What did it say?"));
}

#[tokio::test]
async fn the_context_is_compacted_automatically_at_the_model_limit() {
    let models = HashMap::from([(
        "driven/test".to_owned(),
        ModelLimits {
            context: 400,
            output: 100,
        },
    )]);
    let h = Harness::new(Setup {
        models,
        ..Setup::default()
    })
    .await;
    let session = with_history(&h).await;
    // Enough text to pass 300 estimated tokens.
    driven_prompt(&h, session, &"Please consider this. ".repeat(80)).await;
    answer(&h, "The user read a.txt (alpha) and asked a long question.");
    answer(&h, "Done.");
    h.runner.run(session).await.unwrap();

    let kinds = h.kinds(session).await;
    let from = kinds.iter().rposition(|k| k == "prompted").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "prompted",
            "compaction.started",
            "compaction.ended",
            "context.epoch_started",
            "synthetic",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let step = request(&h, 3);
    assert_eq!(step.max_output_tokens, Some(100));
    assert_eq!(step.turns.len(), 2, "{:?}", step.turns);
    assert!(user_text(&step.turns[1]).contains("Continue the task from the summary"));
}

/// Model limits under which [`with_history`] fits (about 1,200 estimated tokens, most of
/// them the tool definitions) and [`long_prompt`] after it does not: a request of 3,000
/// estimated tokens or more is compacted first.
fn tight_limits() -> HashMap<String, ModelLimits> {
    HashMap::from([(
        "driven/test".to_owned(),
        ModelLimits {
            context: 4_000,
            output: 1_000,
        },
    )])
}

/// A prompt of about 2,200 estimated tokens.
fn long_prompt() -> String {
    "Please consider this. ".repeat(400)
}

#[tokio::test]
async fn an_automatic_compaction_cut_off_by_a_crash_changes_nothing_and_is_done_again() {
    let h = Harness::new(Setup {
        models: tight_limits(),
        ..Setup::default()
    })
    .await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, &long_prompt()).await;
    // The summary starts streaming, and the process dies before it ends.
    let summary = h.driven.queue();
    summary.send(Ok(Event::TextStart)).unwrap();
    summary
        .send(Ok(Event::TextDelta("The user read".into())))
        .unwrap();
    let mut live = h.runner.subscribe();
    let first = h.spawn_run(session);
    loop {
        if let Live::Ephemeral(e) = live.recv().await.unwrap()
            && matches!(e.event, EphemeralEvent::CompactionDelta(_))
        {
            break;
        }
    }
    let claim = h
        .store
        .read(move |c| keel_core::execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claim.phase, Phase::Compacting);

    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    answer(&h, "The user read a.txt (alpha) and asked a long question.");
    answer(&h, "Done.");
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    other.run(session).await.unwrap();

    // The cut-off compaction left no summary: the new owner compacted again, once, and
    // answered from that summary.
    let log = h.log(session).await;
    assert_eq!(compactions(&log), ["started", "started", "ended"]);
    assert!(
        !log.iter()
            .any(|e| matches!(e.event, DurableEvent::StepRecovered(_)))
    );
    let step = request(&h, 4);
    assert_eq!(step.turns.len(), 2, "{:?}", step.turns);
    assert!(user_text(&step.turns[0]).contains("alpha) and asked a long question"));

    // The dead owner's summary ends now; it can write nothing.
    let before = h.kinds(session).await;
    say(&summary, " a.txt.");
    drop(summary);
    assert_outcome!(first.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, before);
}

#[tokio::test]
async fn a_crash_after_compaction_ended_recovers_its_continuation() {
    let (mut hold, failpoint) = Hold::new();
    let h = Harness::new(Setup {
        models: tight_limits(),
        failpoint: Some(failpoint),
        ..Setup::default()
    })
    .await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, &long_prompt()).await;
    let summary = h.driven.queue();
    summary.send(Ok(Event::TextStart)).unwrap();
    let mut live = h.runner.subscribe();
    let first = h.spawn_run(session);
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::CompactionStarted(_))
        {
            break;
        }
    }
    // The summary ends; its commit (`compaction.ended` with the continuation) goes
    // through, and the process stops for good before the next one, the step's start.
    hold.at(h.store.stats().0 + 1);
    say(
        &summary,
        "The user read a.txt (alpha) and asked a long question.",
    );
    drop(summary);
    hold.reached().await;
    let kinds = h.kinds(session).await;
    let from = kinds.iter().rposition(|k| k == "prompted").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "prompted",
            "compaction.started",
            "compaction.ended",
            "context.epoch_started",
            "synthetic",
        ]
    );

    h.clock.advance(LEASE + 1);
    let other = h.another_process().await;
    answer(&h, "Continuing from the summary.");
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    other.run(session).await.unwrap();

    let kinds = h.kinds(session).await;
    assert_eq!(
        kinds[from..],
        [
            "prompted",
            "compaction.started",
            "compaction.ended",
            "context.epoch_started",
            "synthetic",
            "execution.settled",
            "execution.started",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    // The continuation was answered from the summary, without compacting again.
    // Requests: 2 earlier, the summary, the recovered step.
    let step = request(&h, 3);
    assert_eq!(step.turns.len(), 2, "{:?}", step.turns);
    assert!(user_text(&step.turns[0]).contains("alpha) and asked a long question"));
    assert!(user_text(&step.turns[1]).contains("Continue the task from the summary"));

    // The dead owner's held commit finds its claim gone and writes nothing.
    hold.release();
    assert_outcome!(first.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
    assert_eq!(h.kinds(session).await, kinds);
}

#[tokio::test]
async fn a_step_cut_off_by_a_crash_is_summarised_whole_with_every_call_answered() {
    let h = Harness::new(Setup::default()).await;
    let session = with_history(&h).await;
    driven_prompt(&h, session, "Read b.txt.").await;
    // The step says half a sentence and starts a call whose input never completes.
    let stream = h.driven.queue();
    let mut live = h.runner.subscribe();
    let first = h.spawn_run(session);
    for event in [
        Event::TextStart,
        Event::TextDelta("Let me rea".into()),
        Event::ToolInputStart {
            id: "call_2".into(),
            name: "read".into(),
        },
        Event::ToolInputDelta {
            id: "call_2".into(),
            delta: "{\"pa".into(),
        },
    ] {
        stream.send(Ok(event)).unwrap();
    }
    loop {
        if let Live::Durable(e) = live.recv().await.unwrap()
            && matches!(e.event, DurableEvent::ToolInputStarted(_))
        {
            break;
        }
    }
    h.clock.advance(LEASE + 1);
    let other = h.other_runner();
    answer(&h, "b.txt could not be read; stopping here.");
    let report = Recovery::default().pass(&other).await.unwrap();
    assert_eq!(report.recovered, vec![session]);
    other.run(session).await.unwrap();

    request_compaction(&h, session).await;
    answer(&h, "Read a.txt (alpha); reading b.txt was cut off.");
    other.run(session).await.unwrap();
    assert_eq!(compactions(&h.log(session).await), ["started", "ended"]);

    // Requests: 2 earlier, the step cut off, the continuation, the summary.
    let summary_request = request(&h, 4);
    assert!(user_text(summary_request.turns.last().unwrap()).contains("Summarise"));
    assert_valid(&summary_request);
    let items: Vec<&AssistantItem> = summary_request
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::Assistant { items } => Some(items),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(
        items
            .iter()
            .all(|i| !matches!(i, AssistantItem::Text(t) if t.is_empty())),
        "{items:?}"
    );
    let cut_off = summary_request
        .turns
        .iter()
        .filter_map(|t| match t {
            Turn::ToolResults { results } => Some(results),
            _ => None,
        })
        .flatten()
        .find(|r| r.output.is_err())
        .expect("the cut-off call is answered");
    assert!(
        matches!(&cut_off.output, Err(e) if e.kind == "tool.interrupted-by-crash"),
        "{cut_off:?}"
    );

    drop(stream);
    assert_outcome!(first.await.unwrap(), Err(RunError::Failed(Error::OwnershipLost(id))) if id == session);
}
