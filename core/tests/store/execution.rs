//! Claims: one winner, never replaced, renewed while run, fenced, released with settlement.

use diesel::RunQueryDsl;
use keel_core::execution::{self, Claim, Error};
use keel_core::store::{self, Store};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{ExecutionId, MessageId, OwnerId, SessionId};
use keel_schema::types::{Outcome, Phase};

use crate::backend_tests;
use crate::support::{T0, TestDb, new_session};

const LEASE: i64 = 30_000;

async fn acquire(store: &Store, session: SessionId, owner: OwnerId) -> Option<Claim> {
    let clock = store.clock().clone();
    store
        .write(move |c| execution::acquire(c, clock.now_ms(), LEASE, session, owner))
        .await
        .unwrap()
        .map(|(claim, _)| claim)
}

async fn fenced_rename(store: &Store, claim: Claim, title: &str) -> Result<(), Error> {
    let clock = store.clock().clone();
    let title = title.to_owned();
    store
        .write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                keel_core::event::log::append(
                    c,
                    now,
                    claim.session_id,
                    vec![DurableEvent::Renamed(payload::Renamed {
                        title: title.clone(),
                    })],
                )
                .map(|_| ())
                .map_err(Error::from)
            })
        })
        .await
}

backend_tests!(
    exactly_one_owner_wins_a_session,
    acquisition_never_replaces_an_expired_claim,
    the_fence_requires_the_exact_claim_and_an_unexpired_lease,
    a_fenced_write_after_ownership_is_lost_rolls_back_entirely,
    a_failed_write_behind_the_fence_rolls_back_the_renewal,
    renewal_extends_only_the_named_live_leases_of_an_owner,
    a_cancelling_claim_stays_cancelling_when_a_step_starts_or_a_compaction_ends,
    release_deletes_the_claim_together_with_execution_settled,
    the_phase_column_refuses_unknown_phases,
);

async fn exactly_one_owner_wins_a_session(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let (a, b) = (OwnerId::new(), OwnerId::new());
    let (first, second) = tokio::join!(acquire(&store, session, a), acquire(&store, session, b));
    assert_eq!(
        [first.is_some(), second.is_some()]
            .iter()
            .filter(|w| **w)
            .count(),
        1
    );
    let winner = first.or(second).unwrap();
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.claim, winner);
    assert_eq!(row.phase, Phase::Claimed);
    assert_eq!((row.time_created, row.expires_at), (T0, T0 + LEASE));
    let log = store.read_log(session, 1, 10).await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(
        log[0].event,
        DurableEvent::ExecutionStarted(payload::ExecutionStarted {
            execution_id: winner.id,
            owner_id: winner.owner_id,
        })
    );
}

async fn acquisition_never_replaces_an_expired_claim(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    db.clock.advance(LEASE * 10);
    assert_eq!(acquire(&store, session, OwnerId::new()).await, None);
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.claim, claim);
}

async fn the_fence_requires_the_exact_claim_and_an_unexpired_lease(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    fenced_rename(&store, claim, "owner writes").await.unwrap();
    for impostor in [
        Claim {
            owner_id: OwnerId::new(),
            ..claim
        },
        Claim {
            id: ExecutionId::new(),
            ..claim
        },
        Claim {
            session_id: new_session(&store).await,
            ..claim
        },
    ] {
        let err = fenced_rename(&store, impostor, "impostor")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");
    }
    // The fenced write renewed the lease to T0 + LEASE; at that instant it has expired.
    db.clock.advance(LEASE);
    let err = fenced_rename(&store, claim, "too late").await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::OwnershipLost { execution_id, session_id }
                if execution_id == claim.id && session_id == session
        ),
        "{err}"
    );
}

async fn a_fenced_write_after_ownership_is_lost_rolls_back_entirely(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    let before = store.last_seq(session).await.unwrap();
    db.clock.advance(LEASE + 1);
    fenced_rename(&store, claim, "late").await.unwrap_err();
    assert_eq!(store.last_seq(session).await.unwrap(), before);
    let clock = store.clock().clone();
    let err = store
        .write(move |c| {
            execution::release(c, clock.now_ms(), LEASE, &claim, Outcome::Succeeded, None)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");
    assert_eq!(store.last_seq(session).await.unwrap(), before);
    assert!(
        store
            .read(move |c| execution::get(c, session))
            .await
            .unwrap()
            .is_some()
    );
}

async fn a_failed_write_behind_the_fence_rolls_back_the_renewal(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    let before = store.last_seq(session).await.unwrap();
    db.clock.advance(10_000);
    let clock = store.clock().clone();
    let err = store
        .write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                keel_core::event::log::append(
                    c,
                    now,
                    claim.session_id,
                    vec![DurableEvent::Renamed(payload::Renamed {
                        title: "half done".into(),
                    })],
                )
                .map_err(Error::from)?;
                Err::<(), _>(Error::Store(keel_core::store::Error::Corrupt(
                    "the write behind the fence failed".into(),
                )))
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert_eq!(store.last_seq(session).await.unwrap(), before);
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        row.expires_at,
        T0 + LEASE,
        "the renewal was rolled back too"
    );
}

async fn renewal_extends_only_the_named_live_leases_of_an_owner(db: TestDb) {
    let store = db.open().await;
    let owner = OwnerId::new();
    let mut running = Vec::new();
    for _ in 0..3 {
        let session = new_session(&store).await;
        let claim = acquire(&store, session, owner).await.unwrap();
        running.push((session, claim.id));
    }
    // The owner's fourth claim is one it no longer runs (its release failed, say).
    let stranded = new_session(&store).await;
    acquire(&store, stranded, owner).await.unwrap();
    let other = new_session(&store).await;
    let foreign = acquire(&store, other, OwnerId::new()).await.unwrap();
    db.clock.advance(10_000);
    let mut named: Vec<ExecutionId> = running.iter().map(|(_, id)| *id).collect();
    // Another owner's claim named by mistake is not renewed either.
    named.push(foreign.id);
    let renew = |named: Vec<ExecutionId>| {
        let clock = store.clock().clone();
        store.write(move |c| execution::renew(c, clock.now_ms(), LEASE, owner, &named))
    };
    assert_eq!(renew(named.clone()).await.unwrap(), 3);
    for (session, _) in &running {
        let session = *session;
        let row = store
            .read(move |c| execution::get(c, session))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.expires_at, T0 + 10_000 + LEASE);
    }
    for session in [stranded, other] {
        let row = store
            .read(move |c| execution::get(c, session))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.expires_at, T0 + LEASE, "not renewed");
    }
    // An expired lease is not renewed: it belongs to recovery.
    db.clock.advance(LEASE * 2);
    assert_eq!(renew(named).await.unwrap(), 0);
}

async fn a_cancelling_claim_stays_cancelling_when_a_step_starts_or_a_compaction_ends(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    let assistant = MessageId::new();
    let set = |phase: Phase, assistant: Option<(MessageId, u64)>| {
        let clock = store.clock().clone();
        store.write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                execution::set_phase(c, &claim, phase, assistant)
            })
        })
    };
    set(Phase::Cancelling, None).await.unwrap();
    // A step's start that raced the interrupt records its assistant, not its phase.
    set(Phase::Running, Some((assistant, 7))).await.unwrap();
    // The end of a compaction puts the phase of the work that goes on back, but not over
    // a cancellation.
    set(Phase::Claimed, None).await.unwrap();
    set(Phase::Compacting, Some((assistant, 7))).await.unwrap();
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.phase, Phase::Cancelling);
    assert_eq!(row.assistant_message_id, Some(assistant));
    assert_eq!(row.assistant_seq, Some(7));
}

async fn release_deletes_the_claim_together_with_execution_settled(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = acquire(&store, session, OwnerId::new()).await.unwrap();
    let clock = store.clock().clone();
    let assistant = MessageId::new();
    store
        .write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                execution::set_phase(c, &claim, Phase::Running, Some((assistant, 5)))
            })
        })
        .await
        .unwrap();
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.phase, row.assistant_message_id, row.assistant_seq),
        (Phase::Running, Some(assistant), Some(5))
    );
    let clock = store.clock().clone();
    let settled = store
        .write(move |c| {
            execution::release(c, clock.now_ms(), LEASE, &claim, Outcome::Succeeded, None)
        })
        .await
        .unwrap();
    assert_eq!(
        settled.event,
        DurableEvent::ExecutionSettled(payload::ExecutionSettled {
            execution_id: claim.id,
            outcome: Outcome::Succeeded,
            error: None,
        })
    );
    assert_eq!(
        store
            .read(move |c| execution::get(c, session))
            .await
            .unwrap(),
        None
    );
}

async fn the_phase_column_refuses_unknown_phases(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let err = store
        .write(move |c| {
            diesel::sql_query(format!(
                "INSERT INTO session_execution (id, session_id, owner_id, phase, time_created, \
                 expires_at) VALUES ('{}', '{session}', '{}', 'sleeping', 0, 1)",
                ExecutionId::new(),
                OwnerId::new()
            ))
            .execute(c)
            .map(|_| ())
            .map_err(store::Error::from)
        })
        .await
        .unwrap_err();
    assert!(err.to_string().to_lowercase().contains("check"), "{err}");
}
