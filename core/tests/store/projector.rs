//! Projections: the transcript, tools resolved exactly once, usage totals.

use keel_core::event::log;
use keel_core::event::projector::{ToolOutput, crashed_tool_error, interrupted_tool_error};
use keel_core::event::view::{self, Transcript};
use keel_core::store::{Error, Store};
use keel_schema::api::{AssistantPart, Message, StepEnd, ToolStatus};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{CallId, ExecutionId, MessageId, SessionId};
use keel_schema::types::{Effect, ErrorInfo, Finish, InterruptReason, ToolContent};
use serde_json::{Value, json};

use crate::backend_tests;
use crate::lifecycle::{self, rows, usage};
use crate::support::{TestDb, model, new_session};

backend_tests!(
    a_full_prompt_lifecycle_projects_the_transcript_tools_inputs_and_totals,
    step_interrupted_fails_every_unresolved_tool_of_its_step,
    step_recovered_fails_unresolved_tools_with_the_crash_error,
    a_tool_call_is_resolved_exactly_once,
    a_step_does_not_end_while_a_tool_of_it_is_unresolved,
    usage_totals_accumulate_from_step_ended_and_step_failed,
    a_held_transcript_reads_only_what_changed_and_matches_a_full_read,
    a_reply_is_projected_only_onto_a_pending_request_of_its_kind,
    an_edit_rolled_back_leaves_nothing_in_the_next_edit_of_its_message,
    an_edit_made_by_another_node_is_in_the_next_edit_of_its_message_here,
    a_call_that_may_run_again_is_marked_in_its_row_whether_streamed_or_not,
    a_call_its_row_does_not_allow_is_refused_and_changes_nothing,
    a_batch_s_unwritten_edits_are_read_in_it_and_outlast_its_savepoints,
);

fn step_started(id: MessageId) -> DurableEvent {
    DurableEvent::StepStarted(payload::StepStarted {
        assistant_message_id: id,
        step: 1,
        agent: "build".into(),
        model: model(),
    })
}

fn text_started(message: MessageId, ordinal: u32) -> DurableEvent {
    DurableEvent::TextStarted(payload::TextStarted {
        assistant_message_id: message,
        ordinal,
    })
}

fn text_ended(message: MessageId, ordinal: u32, text: &str) -> DurableEvent {
    DurableEvent::TextEnded(payload::TextEnded {
        assistant_message_id: message,
        ordinal,
        text: text.into(),
    })
}

fn reasoning_started(message: MessageId, ordinal: u32) -> DurableEvent {
    DurableEvent::ReasoningStarted(payload::ReasoningStarted {
        assistant_message_id: message,
        ordinal,
        provider_metadata: None,
    })
}

fn called(message: MessageId, call: CallId, name: &str, effect: Effect) -> DurableEvent {
    DurableEvent::ToolCalled(payload::ToolCalled {
        assistant_message_id: message,
        call_id: call,
        name: name.into(),
        input: json!({}),
        provider_executed: false,
        effect,
        provider_call_id: None,
        rerun: false,
    })
}

fn success(call: CallId) -> DurableEvent {
    DurableEvent::ToolSuccess(payload::ToolSuccess {
        call_id: call,
        structured: json!(null),
        content: vec![ToolContent::Text { text: "ok".into() }],
        result: None,
    })
}

/// (call id, status, output) of every tool call of the session, by call id.
async fn tools(store: &Store, session: SessionId) -> Vec<(String, String, Option<Value>)> {
    let mut tools: Vec<(String, String, Option<Value>)> = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap()
        .tools
        .into_iter()
        .map(|t| (t.0, t.4, t.7.map(|o| serde_json::from_str(&o).unwrap())))
        .collect();
    tools.sort_by(|a, b| a.0.cmp(&b.0));
    tools
}

async fn a_full_prompt_lifecycle_projects_the_transcript_tools_inputs_and_totals(db: TestDb) {
    let store = db.open().await;
    let session = lifecycle::write(&store).await;
    let rows = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();

    let (title, last_seq, totals, cost) = (
        rows.session[0].1.clone(),
        rows.session[0].8,
        rows.session[0].9,
        rows.session[0].10,
    );
    assert_eq!(title.as_deref(), Some("Flaky login test"));
    let events = store.read_log(session, 0, 1000).await.unwrap();
    assert_eq!(last_seq, events.len() as i64);
    assert_eq!(totals, (2200, 70, 14, 200, 6));
    assert!((cost - 0.75).abs() < 1e-9);

    let roles: Vec<&str> = rows.messages.iter().map(|m| m.2.as_str()).collect();
    assert_eq!(roles, vec!["user", "assistant", "system", "assistant"]);
    let transcript: Vec<Message> = rows
        .messages
        .iter()
        .map(|m| serde_json::from_value(m.3.clone()).unwrap())
        .collect();
    let Message::User { parts, .. } = &transcript[0] else {
        panic!("{:?}", transcript[0])
    };
    assert_eq!(
        parts,
        &vec![keel_schema::types::Part::Text {
            text: "Why does test_login fail?".into()
        }]
    );
    let Message::Assistant {
        parts,
        end,
        usage: u,
        ..
    } = &transcript[1]
    else {
        panic!("{:?}", transcript[1])
    };
    assert_eq!(
        end,
        &Some(StepEnd::Ended {
            finish: Finish::ToolCalls
        })
    );
    assert_eq!(*u, usage(1000, 50));
    let statuses: Vec<(String, ToolStatus)> = parts
        .iter()
        .filter_map(|p| match p {
            AssistantPart::Tool { name, status, .. } => Some((name.clone(), *status)),
            _ => None,
        })
        .collect();
    assert_eq!(
        statuses,
        vec![
            ("read".into(), ToolStatus::Completed),
            ("write".into(), ToolStatus::Error)
        ]
    );
    let Message::System { system, .. } = &transcript[2] else {
        panic!("{:?}", transcript[2])
    };
    assert_eq!(
        system,
        "You are a careful engineer who explains every change."
    );
    let Message::Assistant { parts, .. } = &transcript[3] else {
        panic!("{:?}", transcript[3])
    };
    assert_eq!(
        parts,
        &vec![
            AssistantPart::Reasoning {
                ordinal: 0,
                text: "The clock is read twice.".into(),
                provider_metadata: Some(json!({"signature": "sig"})),
            },
            AssistantPart::Text {
                ordinal: 0,
                text: "Pin the clock.".into()
            },
        ]
    );

    let statuses: Vec<keel_schema::api::InputStatus> =
        rows.inputs.iter().map(|i| i.status()).collect();
    assert_eq!(
        statuses,
        vec![
            keel_schema::api::InputStatus::Promoted,
            keel_schema::api::InputStatus::Cancelled
        ]
    );
    assert!(rows.inputs.iter().all(|i| i.execution_requested));
    let mut tool_rows: Vec<(String, String)> = rows
        .tools
        .iter()
        .map(|t| (t.2.clone(), t.4.clone()))
        .collect();
    tool_rows.sort();
    assert_eq!(
        tool_rows,
        vec![
            ("read".to_owned(), "completed".to_owned()),
            ("write".to_owned(), "error".to_owned()),
        ]
    );
}

async fn step_interrupted_fails_every_unresolved_tool_of_its_step(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let (done, running, streaming) = (CallId::new(), CallId::new(), CallId::new());
    store
        .append(
            session,
            vec![
                step_started(message),
                called(message, done, "read", Effect::Read),
                called(message, running, "bash", Effect::Write),
                DurableEvent::ToolInputStarted(payload::ToolInputStarted {
                    assistant_message_id: message,
                    call_id: streaming,
                    name: "edit".into(),
                }),
                success(done),
            ],
        )
        .await
        .unwrap();
    store
        .append(
            session,
            vec![DurableEvent::StepInterrupted(payload::StepInterrupted {
                assistant_message_id: message,
                reason: InterruptReason::User,
            })],
        )
        .await
        .unwrap();
    let failure = serde_json::to_value(ToolOutput::Failure {
        error: interrupted_tool_error(InterruptReason::User),
    })
    .unwrap();
    let mut expected = vec![
        (
            done.to_string(),
            "completed".to_owned(),
            Some(json!({
                "structured": null,
                "content": [{"type": "text", "text": "ok"}],
            })),
        ),
        (
            running.to_string(),
            "error".to_owned(),
            Some(failure.clone()),
        ),
        (streaming.to_string(), "error".to_owned(), Some(failure)),
    ];
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(tools(&store, session).await, expected);
    // Once the step is settled, nothing resolves its tools again.
    let err = store
        .append(session, vec![success(running)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already resolved"), "{err}");
}

async fn step_recovered_fails_unresolved_tools_with_the_crash_error(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let write = CallId::new();
    store
        .append(
            session,
            vec![
                step_started(message),
                called(message, write, "write", Effect::Write),
                DurableEvent::StepRecovered(payload::StepRecovered {
                    assistant_message_id: message,
                    execution_id: ExecutionId::new(),
                    rerun: Vec::new(),
                }),
            ],
        )
        .await
        .unwrap();
    let failure = serde_json::to_value(ToolOutput::Failure {
        error: crashed_tool_error(),
    })
    .unwrap();
    assert_eq!(
        tools(&store, session).await,
        vec![(write.to_string(), "error".to_owned(), Some(failure))]
    );
    assert!(
        crashed_tool_error()
            .message
            .contains("did not run it again")
    );
}

async fn a_tool_call_is_resolved_exactly_once(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let call = CallId::new();
    store
        .append(
            session,
            vec![
                step_started(message),
                called(message, call, "read", Effect::Read),
                success(call),
            ],
        )
        .await
        .unwrap();
    let before = tools(&store, session).await;
    for second in [
        success(call),
        DurableEvent::ToolFailed(payload::ToolFailed {
            call_id: call,
            error: ErrorInfo::new("tool.x", "late"),
        }),
    ] {
        let err = store.append(session, vec![second]).await.unwrap_err();
        assert!(err.to_string().contains("already resolved"), "{err}");
    }
    let err = store
        .append(session, vec![called(message, call, "read", Effect::Read)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already called"), "{err}");
    let err = store
        .append(session, vec![success(CallId::new())])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no tool call"), "{err}");
    assert_eq!(tools(&store, session).await, before);
}

async fn a_step_does_not_end_while_a_tool_of_it_is_unresolved(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let call = CallId::new();
    store
        .append(
            session,
            vec![
                step_started(message),
                called(message, call, "read", Effect::Read),
            ],
        )
        .await
        .unwrap();
    for end in [
        DurableEvent::StepEnded(payload::StepEnded {
            assistant_message_id: message,
            finish: Finish::ToolCalls,
            usage: usage(1, 1),
            cost: 0.0,
        }),
        DurableEvent::StepFailed(payload::StepFailed {
            assistant_message_id: message,
            error: ErrorInfo::new("provider.server", "502"),
            usage: None,
        }),
    ] {
        let err = store.append(session, vec![end]).await.unwrap_err();
        assert!(err.to_string().contains("is unresolved"), "{err}");
    }
}

async fn usage_totals_accumulate_from_step_ended_and_step_failed(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let (a, b, c) = (MessageId::new(), MessageId::new(), MessageId::new());
    store
        .append(
            session,
            vec![
                step_started(a),
                DurableEvent::StepEnded(payload::StepEnded {
                    assistant_message_id: a,
                    finish: Finish::Stop,
                    usage: usage(10, 1),
                    cost: 1.0,
                }),
                step_started(b),
                DurableEvent::StepFailed(payload::StepFailed {
                    assistant_message_id: b,
                    error: ErrorInfo::new("provider.server", "502"),
                    usage: Some(usage(5, 0)),
                }),
                step_started(c),
                DurableEvent::StepFailed(payload::StepFailed {
                    assistant_message_id: c,
                    error: ErrorInfo::new("provider.auth", "401"),
                    usage: None,
                }),
            ],
        )
        .await
        .unwrap();
    let rows = store
        .read(move |conn| Ok::<_, Error>(rows(conn, session)))
        .await
        .unwrap();
    assert_eq!(rows.session[0].9, (15, 1, 14, 200, 6));
    assert!((rows.session[0].10 - 1.0).abs() < 1e-9);
}

async fn a_held_transcript_reads_only_what_changed_and_matches_a_full_read(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let (first, second) = (MessageId::new(), MessageId::new());
    let call = CallId::new();
    let ended = |id| {
        DurableEvent::StepEnded(payload::StepEnded {
            assistant_message_id: id,
            finish: Finish::ToolCalls,
            usage: usage(1, 1),
            cost: 0.0,
        })
    };
    // Each round's events, and how many messages the refresh after it reads.
    let rounds: Vec<(Vec<DurableEvent>, usize)> = vec![
        (vec![step_started(first)], 1),
        (vec![called(first, call, "read", Effect::Read)], 1),
        (vec![success(call), ended(first)], 1),
        (vec![step_started(second)], 1),
        (vec![ended(second)], 1),
        (vec![], 0),
    ];
    let mut held = Transcript::default();
    for (events, changed) in rounds {
        if !events.is_empty() {
            store.append(session, events).await.unwrap();
        }
        let ((read, refreshed), full) = store
            .read(move |c| {
                let read = held.refresh(c, session)?;
                let full = view::messages(c, session)?;
                Ok::<_, Error>(((read, held), full))
            })
            .await
            .unwrap();
        held = refreshed;
        assert_eq!(read, changed);
        assert_eq!(held.messages(), full.as_slice());
    }
    assert_eq!(held.messages().len(), 2);
}

async fn a_reply_is_projected_only_onto_a_pending_request_of_its_kind(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let call = CallId::new();
    let request = keel_schema::id::RequestId::new();
    store
        .append(
            session,
            vec![
                step_started(message),
                called(message, call, "write", Effect::Write),
                DurableEvent::PermissionRequested(payload::PermissionRequested {
                    request_id: request,
                    call_id: call,
                    tool: "write".into(),
                    pattern: "a.txt".into(),
                    rule: None,
                }),
            ],
        )
        .await
        .unwrap();
    let before = store.last_seq(session).await.unwrap();
    let answer = |request_id| {
        DurableEvent::QuestionAnswered(payload::QuestionAnswered {
            request_id,
            answer: "yes".into(),
        })
    };
    let once = |request_id| {
        DurableEvent::PermissionReplied(payload::PermissionReplied {
            request_id,
            decision: keel_schema::types::Decision::Once,
        })
    };
    // The wrong kind, and an unknown request: refused, nothing appended.
    for refused in [answer(request), once(keel_schema::id::RequestId::new())] {
        let err = store.append(session, vec![refused]).await.unwrap_err();
        assert!(err.to_string().contains("no pending"), "{err}");
    }
    // Another session's request.
    let other = new_session(&store).await;
    let err = store.append(other, vec![once(request)]).await.unwrap_err();
    assert!(err.to_string().contains("no pending"), "{err}");
    assert_eq!(store.last_seq(session).await.unwrap(), before);
    // The right reply, once; a second one is refused.
    store.append(session, vec![once(request)]).await.unwrap();
    let err = store
        .append(session, vec![once(request)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no pending"), "{err}");
    // The call's result settles the request.
    store.append(session, vec![success(call)]).await.unwrap();
    let open = store
        .read(move |c| keel_core::request::open(c, session))
        .await
        .unwrap();
    assert!(open.is_empty(), "{open:?}");
}

/// The writer keeps each open step's message as it last wrote it, to edit it without
/// decoding it again; an edit rolled back must not come back through that.
async fn an_edit_rolled_back_leaves_nothing_in_the_next_edit_of_its_message(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    store
        .append(
            session,
            vec![step_started(message), text_started(message, 0)],
        )
        .await
        .unwrap();
    // The fragment opens, then the write fails: its transaction is rolled back.
    let failed = store
        .write(move |c| {
            log::append(c, 0, session, vec![text_started(message, 1)])?;
            Err::<(), _>(Error::Corrupt("the write fails after its edit".into()))
        })
        .await;
    assert!(failed.is_err());
    store
        .append(session, vec![text_ended(message, 0, "hello")])
        .await
        .unwrap();
    let messages = store
        .read(move |c| view::messages(c, session))
        .await
        .unwrap();
    let Message::Assistant { parts, .. } = &messages[0] else {
        panic!("{:?}", messages[0])
    };
    assert_eq!(
        parts,
        &vec![AssistantPart::Text {
            ordinal: 0,
            text: "hello".into()
        }],
        "only the committed edits: the rolled-back fragment is not there"
    );
    // The session's log agrees: seq 3 (the failed write's) was never taken.
    let types: Vec<&str> = store
        .read_log(session, 0, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.event.type_name())
        .collect();
    assert_eq!(types.last(), Some(&"session.next.text.ended"));
}

/// A node edits a message from the copy it kept when it last wrote it, without reading
/// the row back (see `projector::assistant::Written`). Another node's edit in between must
/// not be lost: the row moved on, and the edit here reads it. Nor may an edit here that
/// was rolled back be taken for another node's edit at the same seq (the rollback left
/// the seq free, and the other node's row is at that version): whether the rollback was
/// the whole transaction's, a write's own savepoint's, or the savepoint the writer gives a
/// write when it runs a batch again after one of its writes failed.
async fn an_edit_made_by_another_node_is_in_the_next_edit_of_its_message_here(db: TestDb) {
    let here = crate::log::one_writer(&db).await;
    let there = db.open().await;
    let session = new_session(&here).await;
    let message = MessageId::new();
    let parts = |store: Store| async move {
        let messages = store
            .read(move |c| view::messages(c, session))
            .await
            .unwrap();
        let Message::Assistant { parts, .. } = &messages[0] else {
            panic!("{:?}", messages[0])
        };
        parts.clone()
    };
    let reasoning = |ordinal| AssistantPart::Reasoning {
        ordinal,
        text: String::new(),
        provider_metadata: None,
    };

    // Here the step starts and a fragment opens; there another opens; here the first ends.
    here.append(
        session,
        vec![step_started(message), text_started(message, 0)],
    )
    .await
    .unwrap();
    there
        .append(session, vec![reasoning_started(message, 0)])
        .await
        .unwrap();
    here.append(session, vec![text_ended(message, 0, "one")])
        .await
        .unwrap();
    assert_eq!(
        parts(here.clone()).await,
        vec![text(0, "one"), reasoning(0)],
        "the other node's fragment is kept"
    );

    // Here a fragment opens and the write fails; there the seq it left free is taken by
    // another edit; here the next edit must start from that one.
    let failed = here
        .write(move |c| {
            log::append(c, 0, session, vec![text_started(message, 1)])?;
            Err::<(), _>(Error::Corrupt("the write fails after its edit".into()))
        })
        .await;
    assert!(failed.is_err());
    let taken = there
        .append(session, vec![reasoning_started(message, 1)])
        .await
        .unwrap();
    here.append(
        session,
        vec![text_started(message, 2), text_ended(message, 2, "two")],
    )
    .await
    .unwrap();
    assert_eq!(
        parts(here.clone()).await,
        vec![text(0, "one"), reasoning(0), reasoning(1), text(2, "two")],
        "the edit at seq {} is the other node's",
        taken[0].seq
    );

    // The same, the edit here undone by a savepoint of its write's own.
    here.write_for(session, move |c| {
        let undone = diesel::Connection::transaction::<(), Error, _>(c, |c| {
            log::append(c, 0, session, vec![text_started(message, 3)])?;
            Err(diesel::result::Error::RollbackTransaction.into())
        });
        assert!(undone.is_err());
        Ok::<_, Error>(())
    })
    .await
    .unwrap();
    there
        .append(session, vec![reasoning_started(message, 3)])
        .await
        .unwrap();
    here.append(session, vec![text_started(message, 4)])
        .await
        .unwrap();

    // The same, the edit here undone by the savepoint its write runs in when its batch
    // runs again, one write by one, after that write failed.
    let other = new_session(&here).await;
    let (failed, went_on) = crate::log::in_one_batch(&here, async {
        tokio::join!(
            here.write_for(session, move |c| {
                log::append(c, 0, session, vec![text_started(message, 5)])?;
                Err::<(), _>(Error::Corrupt("the write fails after its edit".into()))
            }),
            here.write_for(other, move |c| {
                log::append(
                    c,
                    0,
                    other,
                    vec![DurableEvent::Renamed(payload::Renamed {
                        title: "other".into(),
                    })],
                )
            }),
        )
    })
    .await;
    assert!(failed.is_err());
    went_on.unwrap();
    there
        .append(session, vec![reasoning_started(message, 5)])
        .await
        .unwrap();
    here.append(session, vec![text_started(message, 6)])
        .await
        .unwrap();
    assert_eq!(
        parts(here.clone()).await[4..],
        [reasoning(3), text(4, ""), reasoning(5), text(6, "")]
    );

    // Another node's edit, then here, in one write, an edit from the copy kept here and
    // one only the other node's edit allows: refused on the stale copy, the write runs
    // again from the rows, which allow it. The same for a call whose input started
    // streaming on the other node, called here.
    there
        .append(session, vec![reasoning_started(message, 7)])
        .await
        .unwrap();
    let reasoned = DurableEvent::ReasoningEnded(payload::ReasoningEnded {
        assistant_message_id: message,
        ordinal: 7,
        text: "seven".into(),
        provider_metadata: None,
    });
    here.append(session, vec![text_started(message, 8), reasoned])
        .await
        .unwrap();
    let call = CallId::new();
    there
        .append(session, vec![input_started(message, call)])
        .await
        .unwrap();
    here.append(
        session,
        vec![called(message, call, "read", Effect::Read), success(call)],
    )
    .await
    .unwrap();

    // Another node's edit, then here an edit and the step's end in one write: the edit
    // waits unwritten, started from the copy kept here, and the end finds the row moved
    // on; the write runs again from the rows and succeeds.
    there
        .append(session, vec![reasoning_started(message, 9)])
        .await
        .unwrap();
    here.append(
        session,
        vec![
            text_ended(message, 6, "six"),
            DurableEvent::StepEnded(payload::StepEnded {
                assistant_message_id: message,
                finish: Finish::Stop,
                usage: usage(1, 1),
                cost: 0.0,
            }),
        ],
    )
    .await
    .unwrap();
    let all = parts(here.clone()).await;
    let seven = AssistantPart::Reasoning {
        ordinal: 7,
        text: "seven".into(),
        provider_metadata: None,
    };
    assert_eq!(all[7..10], [text(6, "six"), seven, text(8, "")]);
    assert!(
        matches!(&all[10], AssistantPart::Tool { call_id, status: ToolStatus::Completed, .. } if *call_id == call),
        "{:?}",
        all[10]
    );
    assert_eq!(all[11..], [reasoning(9)]);

    // And the rows are what a replay of the log projects.
    lifecycle::assert_replay_projects_the_same_rows(&here, session).await;
}

/// `tool.called`'s `rerun` marks the call's row (which recovery reads to run it again
/// after a crash), whether its input streamed first (the row exists, pending) or not.
async fn a_call_that_may_run_again_is_marked_in_its_row_whether_streamed_or_not(db: TestDb) {
    use diesel::prelude::*;
    use keel_core::store::schema::session_tool;

    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    let [streamed, plain, once] = [(); 3].map(|()| CallId::new());
    let called = |call, rerun| {
        let DurableEvent::ToolCalled(mut e) = called(message, call, "read", Effect::Read) else {
            unreachable!()
        };
        e.rerun = rerun;
        DurableEvent::ToolCalled(e)
    };
    store
        .append(
            session,
            vec![
                step_started(message),
                DurableEvent::ToolInputStarted(payload::ToolInputStarted {
                    assistant_message_id: message,
                    call_id: streamed,
                    name: "read".into(),
                }),
                called(streamed, true),
                called(plain, true),
                called(once, false),
            ],
        )
        .await
        .unwrap();
    let marked = |call: CallId| {
        let store = store.clone();
        async move {
            store
                .read(move |c| {
                    Ok::<_, Error>(
                        session_tool::table
                            .filter(session_tool::call_id.eq(call.to_string()))
                            .select(session_tool::rerun)
                            .get_result::<bool>(c)
                            .unwrap(),
                    )
                })
                .await
                .unwrap()
        }
    };
    assert!(marked(streamed).await, "streamed, then called to run again");
    assert!(marked(plain).await, "called to run again");
    assert!(!marked(once).await, "called to run once");
}

fn input_started(message: MessageId, call: CallId) -> DurableEvent {
    DurableEvent::ToolInputStarted(payload::ToolInputStarted {
        assistant_message_id: message,
        call_id: call,
        name: "read".into(),
    })
}

/// A call is written without reading its row first: its message says whether its input
/// streamed, and the row's insert or update is conditional. Every event the row does not
/// allow is still refused with its reason, alone or behind edits of its batch, and leaves
/// every row as it was; the message edits after a refusal start from the rows.
async fn a_call_its_row_does_not_allow_is_refused_and_changes_nothing(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let (first, second) = (MessageId::new(), MessageId::new());
    let [streaming, plain, resolved] = [(); 3].map(|()| CallId::new());
    store
        .append(
            session,
            vec![
                step_started(first),
                input_started(first, streaming),
                called(first, plain, "read", Effect::Read),
                called(first, resolved, "read", Effect::Read),
                success(resolved),
            ],
        )
        .await
        .unwrap();
    let before = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    let refused: [(Vec<DurableEvent>, &str); 8] = [
        // Streamed under the first message, called by the second.
        (
            vec![
                step_started(second),
                called(second, streaming, "read", Effect::Read),
            ],
            "started by another message",
        ),
        (
            vec![called(first, plain, "read", Effect::Read)],
            "already called",
        ),
        (
            vec![called(first, resolved, "read", Effect::Read)],
            "already called",
        ),
        // Another message's call, called again here without streaming.
        (
            vec![
                step_started(second),
                called(second, plain, "read", Effect::Read),
            ],
            "already called",
        ),
        (vec![input_started(first, plain)], "already open"),
        (
            vec![step_started(second), input_started(second, streaming)],
            "already exists",
        ),
        // Edits of the message in the same batch, then the refusal.
        (
            vec![
                text_started(first, 7),
                called(first, streaming, "read", Effect::Read),
                success(streaming),
                success(resolved),
            ],
            "already resolved",
        ),
        (
            vec![text_started(first, 7), success(CallId::new())],
            "no tool call",
        ),
    ];
    for (events, reason) in refused {
        let err = store.append(session, events).await.unwrap_err();
        assert!(err.to_string().contains(reason), "{reason}: {err}");
        let after = store
            .read(move |c| Ok::<_, Error>(rows(c, session)))
            .await
            .unwrap();
        assert_eq!(after, before, "{reason}: the refusal changed the rows");
    }

    // What the rows allow goes on from them.
    store
        .append(
            session,
            vec![
                text_started(first, 7),
                called(first, streaming, "read", Effect::Read),
                success(streaming),
                success(plain),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        tools(&store, session)
            .await
            .iter()
            .map(|t| t.1.as_str())
            .collect::<Vec<_>>(),
        ["completed"; 3]
    );
    lifecycle::assert_replay_projects_the_same_rows(&store, session).await;
}

/// The text parts of the session's one assistant message in `messages`.
fn assistant_parts(messages: &[Message]) -> Vec<AssistantPart> {
    match messages {
        [Message::Assistant { parts, .. }] => parts.clone(),
        other => panic!("{other:?}"),
    }
}

fn text(ordinal: u32, text: &str) -> AssistantPart {
    AssistantPart::Text {
        ordinal,
        text: text.into(),
    }
}

/// In a plain batch an edit of an open step's message waits in memory for the batch's
/// end (`projector::assistant::Stored::Unwritten`): what reads the session's messages in
/// the batch sees every edit made before it, an edit or a refusal inside a write's own
/// savepoint that is rolled back loses none of the batch's earlier edits, and the rows
/// committed are what a replay projects.
async fn a_batch_s_unwritten_edits_are_read_in_it_and_outlast_its_savepoints(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let message = MessageId::new();
    store
        .write_for(session, move |c| {
            let events = vec![step_started(message), text_started(message, 0)];
            log::append(c, 0, session, events)?;
            let read = view::messages(c, session)?;
            assert_eq!(assistant_parts(&read), [text(0, "")], "a read in the batch");
            let mut held = Transcript::default();
            held.refresh(c, session)?;
            log::append(c, 0, session, vec![text_ended(message, 0, "a")])?;
            held.refresh(c, session)?;
            assert_eq!(
                assistant_parts(held.messages()),
                [text(0, "a")],
                "a held transcript brought up to date in the batch"
            );
            // An edit not written yet, then one in a savepoint that is rolled back.
            log::append(c, 0, session, vec![text_started(message, 1)])?;
            let undone = diesel::Connection::transaction::<(), Error, _>(c, |c| {
                log::append(c, 0, session, vec![text_started(message, 2)])?;
                Err(diesel::result::Error::RollbackTransaction.into())
            });
            assert!(undone.is_err());
            log::append(c, 0, session, vec![text_ended(message, 1, "b")])?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    store
        .write_for(session, move |c| {
            // An edit not written yet, then one refused in a savepoint.
            log::append(c, 0, session, vec![text_started(message, 3)])?;
            let refused = diesel::Connection::transaction::<(), Error, _>(c, |c| {
                log::append(c, 0, session, vec![text_started(message, 3)])?;
                Ok(())
            });
            assert!(refused.unwrap_err().to_string().contains("already open"));
            log::append(c, 0, session, vec![text_ended(message, 3, "d")])?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    let messages = store
        .read(move |c| view::messages(c, session))
        .await
        .unwrap();
    assert_eq!(
        assistant_parts(&messages),
        [text(0, "a"), text(1, "b"), text(3, "d")]
    );
    lifecycle::assert_replay_projects_the_same_rows(&store, session).await;
}
