//! The inbox: idempotent admission, execution intent, promotion order, cancellation.

use keel_core::inbox::{self, Admission, Admitted, Boundary, Promotion};
use keel_core::store::{self, Store};
use keel_schema::api::InputStatus;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{InputId, SessionId};
use keel_schema::types::{CompactionReason, Delivery, InputKind, InputSource, Part};

use crate::backend_tests;
use crate::lifecycle::admit;
use crate::support::{TestDb, new_session};

fn text(t: &str) -> Vec<Part> {
    vec![Part::Text { text: t.into() }]
}

async fn run_admit(
    store: &Store,
    session: SessionId,
    admission: Admission,
) -> Result<Admitted, inbox::Error> {
    let clock = store.clock().clone();
    store
        .write(move |c| inbox::admit(c, clock.now_ms(), session, admission.clone()))
        .await
}

async fn promote(store: &Store, session: SessionId, boundary: Boundary) -> Promotion {
    let clock = store.clock().clone();
    store
        .write(move |c| inbox::promote(c, clock.now_ms(), session, boundary))
        .await
        .unwrap()
}

fn promoted_ids(promotion: &Promotion) -> Vec<InputId> {
    match promotion {
        Promotion::Prompts(p) => p.iter().map(|(id, _)| *id).collect(),
        other => panic!("expected prompts, got {other:?}"),
    }
}

async fn types(store: &Store, session: SessionId) -> Vec<String> {
    store
        .read_log(session, 0, 1000)
        .await
        .unwrap()
        .iter()
        .map(|e| {
            e.event
                .type_name()
                .trim_start_matches("session.next.")
                .to_owned()
        })
        .collect()
}

backend_tests!(
    admission_writes_the_input_and_its_execution_intent_in_one_transaction,
    an_input_admitted_without_intent_is_admit_only,
    a_retry_with_the_same_id_and_content_returns_the_original_and_writes_nothing,
    a_retry_with_other_content_or_another_session_is_a_conflict_that_never_wakes,
    a_replayed_input_that_was_already_promoted_wakes_nothing,
    steers_promote_together_at_a_step_boundary_and_queued_inputs_one_per_idle_boundary,
    a_control_input_blocks_later_steers_until_its_compaction_promotes_it,
    a_pending_input_can_be_cancelled_once,
    admission_to_an_unknown_session_is_refused,
    an_empty_prompt_is_refused,
);

async fn admission_writes_the_input_and_its_execution_intent_in_one_transaction(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let admitted = run_admit(&store, session, Admission::prompt(text("hi")))
        .await
        .unwrap();
    assert!(!admitted.replayed && admitted.wake);
    assert_eq!(admitted.input.status, InputStatus::Pending);
    assert_eq!(admitted.input.admitted_seq, 2);
    assert_eq!(
        (admitted.input.kind, admitted.input.source),
        (InputKind::Prompt, InputSource::User)
    );
    assert_eq!(
        types(&store, session).await,
        vec!["created", "prompt.admitted", "prompt.execution_requested"]
    );
    let pending = store
        .read(move |c| inbox::pending(c, session))
        .await
        .unwrap();
    assert_eq!(pending, vec![admitted.input]);
}

async fn an_input_admitted_without_intent_is_admit_only(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let admitted = run_admit(
        &store,
        session,
        Admission {
            request_execution: false,
            ..Admission::prompt(text("note"))
        },
    )
    .await
    .unwrap();
    assert!(!admitted.wake);
    assert!(!admitted.input.request_execution);
    assert_eq!(
        types(&store, session).await,
        vec!["created", "prompt.admitted"]
    );
}

async fn a_retry_with_the_same_id_and_content_returns_the_original_and_writes_nothing(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let admission = Admission {
        id: Some(InputId::new()),
        delivery: Delivery::Steer,
        ..Admission::prompt(text("hi"))
    };
    let first = run_admit(&store, session, admission.clone()).await.unwrap();
    let last_seq = store.last_seq(session).await.unwrap();
    let again = run_admit(&store, session, admission).await.unwrap();
    assert_eq!(
        again,
        Admitted {
            replayed: true,
            ..first
        }
    );
    assert_eq!(store.last_seq(session).await.unwrap(), last_seq);
}

async fn a_retry_with_other_content_or_another_session_is_a_conflict_that_never_wakes(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let other = new_session(&store).await;
    let id = InputId::new();
    let admission = Admission {
        id: Some(id),
        ..Admission::prompt(text("hi"))
    };
    run_admit(&store, session, admission.clone()).await.unwrap();
    let seqs = (
        store.last_seq(session).await.unwrap(),
        store.last_seq(other).await.unwrap(),
    );
    let variants = [
        (
            session,
            Admission {
                parts: text("bye"),
                ..admission.clone()
            },
        ),
        (
            session,
            Admission {
                delivery: Delivery::Steer,
                ..admission.clone()
            },
        ),
        (
            session,
            Admission {
                request_execution: false,
                ..admission.clone()
            },
        ),
        (other, admission.clone()),
    ];
    for (target, variant) in variants {
        let err = run_admit(&store, target, variant).await.unwrap_err();
        // An error carries no `wake`: a conflicting retry cannot arm one.
        assert!(
            matches!(err, inbox::Error::Conflict { input_id, .. } if input_id == id),
            "{err}"
        );
    }
    assert_eq!(
        (
            store.last_seq(session).await.unwrap(),
            store.last_seq(other).await.unwrap()
        ),
        seqs
    );
}

async fn a_replayed_input_that_was_already_promoted_wakes_nothing(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let admission = Admission {
        id: Some(InputId::new()),
        ..Admission::prompt(text("hi"))
    };
    run_admit(&store, session, admission.clone()).await.unwrap();
    promote(&store, session, Boundary::Idle).await;
    let again = run_admit(&store, session, admission).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.input.status, InputStatus::Promoted);
    assert!(!again.wake);
}

async fn steers_promote_together_at_a_step_boundary_and_queued_inputs_one_per_idle_boundary(
    db: TestDb,
) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let q1 = admit(&store, session, "q1", Delivery::Queue).await;
    let s1 = admit(&store, session, "s1", Delivery::Steer).await;
    let q2 = admit(&store, session, "q2", Delivery::Queue).await;
    let s2 = admit(&store, session, "s2", Delivery::Steer).await;

    assert_eq!(
        promoted_ids(&promote(&store, session, Boundary::Step).await),
        vec![s1, s2]
    );
    assert_eq!(
        promote(&store, session, Boundary::Step).await,
        Promotion::Nothing
    );
    assert_eq!(
        promoted_ids(&promote(&store, session, Boundary::Idle).await),
        vec![q1]
    );
    assert_eq!(
        promoted_ids(&promote(&store, session, Boundary::Idle).await),
        vec![q2]
    );
    assert_eq!(
        promote(&store, session, Boundary::Idle).await,
        Promotion::Nothing
    );

    let log = store.read_log(session, 0, 1000).await.unwrap();
    let prompted: Vec<InputId> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::Prompted(p) => Some(p.input_id),
            _ => None,
        })
        .collect();
    assert_eq!(prompted, vec![s1, s2, q1, q2]);
}

async fn a_control_input_blocks_later_steers_until_its_compaction_promotes_it(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let s1 = admit(&store, session, "s1", Delivery::Steer).await;
    let compact = run_admit(
        &store,
        session,
        Admission {
            kind: InputKind::Compact,
            parts: vec![],
            ..Admission::prompt(vec![])
        },
    )
    .await
    .unwrap()
    .input
    .id;
    let s2 = admit(&store, session, "s2", Delivery::Steer).await;

    assert_eq!(
        promoted_ids(&promote(&store, session, Boundary::Step).await),
        vec![s1]
    );
    assert_eq!(
        promote(&store, session, Boundary::Step).await,
        Promotion::Nothing
    );
    let Promotion::Control(control) = promote(&store, session, Boundary::Idle).await else {
        panic!("the compaction request is next")
    };
    assert_eq!(control.id, compact);
    // A prompt's promotion cannot take a control input's place.
    let err = store
        .append(
            session,
            vec![DurableEvent::Prompted(payload::Prompted {
                input_id: compact,
                message_id: keel_schema::id::MessageId::new(),
            })],
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("control input"), "{err}");
    store
        .append(
            session,
            vec![DurableEvent::CompactionStarted(
                payload::CompactionStarted {
                    reason: CompactionReason::Manual,
                    input_id: Some(compact),
                },
            )],
        )
        .await
        .unwrap();
    assert_eq!(
        promoted_ids(&promote(&store, session, Boundary::Step).await),
        vec![s2]
    );
}

async fn a_pending_input_can_be_cancelled_once(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let input = admit(&store, session, "hi", Delivery::Queue).await;
    let clock = store.clock().clone();
    let cancelled = store
        .write(move |c| inbox::cancel(c, clock.now_ms(), session, input))
        .await
        .unwrap();
    assert_eq!(cancelled.status, InputStatus::Cancelled);
    assert_eq!(
        promote(&store, session, Boundary::Idle).await,
        Promotion::Nothing
    );
    let clock = store.clock().clone();
    let err = store
        .write(move |c| inbox::cancel(c, clock.now_ms(), session, input))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            inbox::Error::NotPending {
                status: InputStatus::Cancelled,
                ..
            }
        ),
        "{err}"
    );
    let other = new_session(&store).await;
    let clock = store.clock().clone();
    let err = store
        .write(move |c| inbox::cancel(c, clock.now_ms(), other, input))
        .await
        .unwrap_err();
    assert!(matches!(err, inbox::Error::NotFound { .. }), "{err}");
}

async fn admission_to_an_unknown_session_is_refused(db: TestDb) {
    let store = db.open().await;
    let ghost = SessionId::new();
    let err = run_admit(&store, ghost, Admission::prompt(text("hi")))
        .await
        .unwrap_err();
    assert!(
        matches!(err, inbox::Error::Store(store::Error::SessionNotFound(id)) if id == ghost),
        "{err}"
    );
}

async fn an_empty_prompt_is_refused(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let err = run_admit(&store, session, Admission::prompt(vec![]))
        .await
        .unwrap_err();
    assert!(matches!(err, inbox::Error::Invalid(_)), "{err}");
    assert_eq!(store.last_seq(session).await.unwrap(), Some(1));
}
