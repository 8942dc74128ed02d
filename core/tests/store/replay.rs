//! Replay: a session's log rebuilds its projections exactly.

use diesel::prelude::*;
use keel_core::event::replay;
use keel_core::store::Error;
use keel_core::store::schema::session_input;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::InputId;
use keel_schema::types::{Delivery, InputKind, InputSource, Part};

use crate::backend_tests;
use crate::lifecycle::{self, rows};
use crate::support::{TestDb, new_session};

backend_tests!(
    replaying_a_full_prompt_lifecycle_into_a_fresh_database_reproduces_every_row,
    an_admission_recorded_without_execution_intent_replays_as_admit_only,
);

async fn replaying_a_full_prompt_lifecycle_into_a_fresh_database_reproduces_every_row(db: TestDb) {
    let source = db.open().await;
    let session = lifecycle::write(&source).await;
    // The target is always a fresh SQLite file: replay crosses backends too.
    let target_db = TestDb::sqlite();
    let target = target_db.open().await;

    let replayed = replay::session(&source, &target, session).await.unwrap();
    assert_eq!(Some(replayed), source.last_seq(session).await.unwrap());

    let original = source
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    let rebuilt = target
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    assert!(!original.messages.is_empty() && !original.tools.is_empty());
    // The refused write's request, settled with its call.
    assert_eq!(original.requests.len(), 1);
    assert_eq!(original.requests[0].5, "settled");
    // Epoch 1, its prompt changed once.
    assert_eq!(original.epoch.len(), 1);
    assert_ne!(original.epoch[0].2, original.epoch[0].3);
    assert!(original.messages.iter().any(|m| m.2 == "system"));
    assert_eq!(rebuilt, original);
    assert_eq!(
        target.read_log(session, 0, 1000).await.unwrap(),
        source.read_log(session, 0, 1000).await.unwrap()
    );

    // Replaying into a database that already has the session is refused.
    let err = replay::session(&source, &target, session)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::SessionExists(_)), "{err}");
}

/// `prompt.admitted` for a queued prompt `text` with id `id`.
fn admitted(id: InputId, text: &str, request_execution: bool) -> DurableEvent {
    DurableEvent::PromptAdmitted(payload::PromptAdmitted {
        input_id: id,
        kind: InputKind::Prompt,
        delivery: Delivery::Queue,
        parts: vec![Part::Text { text: text.into() }],
        source: InputSource::User,
        request_execution,
    })
}

async fn an_admission_recorded_without_execution_intent_replays_as_admit_only(db: TestDb) {
    let source = db.open().await;
    let session = new_session(&source).await;
    // A log as history left it: one admission recorded without execution intent, and one
    // with its intent (`prompt.execution_requested`).
    let (quiet, asked) = (InputId::new(), InputId::new());
    source
        .append(
            session,
            vec![
                admitted(quiet, "a note", false),
                admitted(asked, "a question", true),
                DurableEvent::PromptExecutionRequested(payload::PromptExecutionRequested {
                    input_id: asked,
                }),
            ],
        )
        .await
        .unwrap();
    let target_db = TestDb::sqlite();
    let target = target_db.open().await;
    replay::session(&source, &target, session).await.unwrap();

    // Both wait to be promoted; only the second asks for execution, so only it is ever
    // redriven (recovery wakes sessions by `execution_requested`).
    let flags = |store: keel_core::store::Store| async move {
        store
            .read(move |c| {
                session_input::table
                    .filter(session_input::session_id.eq(session.to_string()))
                    .filter(session_input::promoted_seq.is_null())
                    .order(session_input::admitted_seq.asc())
                    .select((
                        session_input::id,
                        session_input::request_execution,
                        session_input::execution_requested,
                    ))
                    .load::<(String, bool, bool)>(c)
                    .map_err(Error::from)
            })
            .await
            .unwrap()
    };
    let expected = vec![
        (quiet.to_string(), false, false),
        (asked.to_string(), true, true),
    ];
    assert_eq!(flags(source.clone()).await, expected);
    assert_eq!(flags(target.clone()).await, expected);
}
