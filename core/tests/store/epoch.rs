//! Context epochs: started and advanced only behind the fence, refused out of order, and
//! rolled back with everything else of their transaction.

use keel_core::epoch::{self, Epoch};
use keel_core::event::view;
use keel_core::execution::{self, Claim, Error};
use keel_core::inbox::{self, Boundary, Promotion};
use keel_core::recovery;
use keel_core::store::{self, Store};
use keel_schema::api::InputStatus;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{OwnerId, SessionId};
use keel_schema::types::Delivery;

use crate::backend_tests;
use crate::lifecycle::admit;
use crate::support::{T0, TestDb, new_session};

backend_tests!(
    the_first_step_starts_epoch_one_and_a_changed_prompt_is_appended_once,
    promotion_and_the_epoch_start_roll_back_together_after_ownership_loss,
    the_epoch_never_advances_after_ownership_changes,
    a_failed_epoch_advance_rolls_back_the_claim_renewal,
);

const LEASE: i64 = 30_000;

async fn claimed(store: &Store, session: SessionId) -> Claim {
    let clock = store.clock().clone();
    store
        .write(move |c| execution::acquire(c, clock.now_ms(), LEASE, session, OwnerId::new()))
        .await
        .unwrap()
        .expect("the session is free")
        .0
}

async fn current(store: &Store, session: SessionId) -> Option<Epoch> {
    store
        .read(move |c| epoch::current(c, session))
        .await
        .unwrap()
}

/// What a boundary does before a step: promotes the pending input and brings the epoch in
/// line with `system`, behind the fence of `claim`.
async fn boundary(store: &Store, claim: Claim, system: &'static str) -> Result<String, Error> {
    let clock = store.clock().clone();
    store
        .write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                let mut written = Vec::new();
                let promotion =
                    inbox::promote_into(c, now, claim.session_id, Boundary::Idle, &mut written)
                        .map_err(|e| match e {
                            inbox::Error::Store(e) => Error::Store(e),
                            other => panic!("{other}"),
                        })?;
                assert!(matches!(promotion, Promotion::Prompts(_)), "{promotion:?}");
                // As the runner reads it: with the session's row, in one statement.
                let (info, current) = epoch::with_session(c, claim.session_id)?.unwrap();
                assert_eq!(current, epoch::current(c, claim.session_id)?);
                assert_eq!(Some(info), view::session_info(c, claim.session_id)?);
                let (system, _) = epoch::establish(c, now, claim.session_id, current, system)?;
                Ok(system)
            })
        })
        .await
}

/// What a completed compaction does: the summary and the next epoch, behind the fence.
async fn compacted(store: &Store, claim: Claim, baseline_seq: u64) -> Result<(), Error> {
    let clock = store.clock().clone();
    store
        .write(move |c| {
            let now = clock.now_ms();
            execution::fenced(c, now, LEASE, &claim, |c| {
                let (next, _) = epoch::advance(c, claim.session_id, baseline_seq, "unused")?;
                let ended = DurableEvent::CompactionEnded(payload::CompactionEnded {
                    summary: "So far: nothing.".into(),
                    boundary_seq: baseline_seq,
                    usage: Default::default(),
                });
                keel_core::event::log::append(c, now, claim.session_id, vec![ended, next])?;
                Ok(())
            })
        })
        .await
}

async fn the_first_step_starts_epoch_one_and_a_changed_prompt_is_appended_once(db: TestDb) {
    let store = db.open().await;
    // Another session's epoch, which nothing of this session's reads.
    let other = new_session(&store).await;
    let other_claim = claimed(&store, other).await;
    admit(&store, other, "elsewhere", Delivery::Queue).await;
    assert_eq!(boundary(&store, other_claim, "Z").await.unwrap(), "Z");
    let session = new_session(&store).await;
    let claim = claimed(&store, session).await;
    admit(&store, session, "one", Delivery::Queue).await;
    assert_eq!(boundary(&store, claim, "A").await.unwrap(), "A");
    let first = current(&store, session).await.unwrap();
    assert_eq!((first.epoch, first.system.as_str()), (1, "A"));

    // The same prompt: nothing is written.
    let before = store.last_seq(session).await.unwrap();
    admit(&store, session, "two", Delivery::Queue).await;
    let after_admit = store.last_seq(session).await.unwrap();
    assert_eq!(boundary(&store, claim, "A").await.unwrap(), "A");
    assert!(after_admit > before);
    let promoted_only = store.last_seq(session).await.unwrap().unwrap();

    // A changed prompt: the epoch's stays, the new one is a message, written once.
    admit(&store, session, "three", Delivery::Queue).await;
    assert_eq!(boundary(&store, claim, "B").await.unwrap(), "A");
    admit(&store, session, "four", Delivery::Queue).await;
    assert_eq!(boundary(&store, claim, "B").await.unwrap(), "A");
    let log = store.read_log(session, promoted_only, 1000).await.unwrap();
    let updates: Vec<&str> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ContextSystemUpdated(u) => Some(u.system.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(updates, ["B"]);
    let now = current(&store, session).await.unwrap();
    assert_eq!(
        (
            now.epoch,
            now.system.as_str(),
            now.effective_system.as_str()
        ),
        (1, "A", "B")
    );

    // A compaction starts epoch 2 from the effective prompt.
    compacted(&store, claim, 3).await.unwrap();
    let next = current(&store, session).await.unwrap();
    assert_eq!(
        (next.epoch, next.baseline_seq, next.system.as_str()),
        (2, 3, "B")
    );
}

async fn promotion_and_the_epoch_start_roll_back_together_after_ownership_loss(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = claimed(&store, session).await;
    let input = admit(&store, session, "one", Delivery::Queue).await;
    let before = store.last_seq(session).await.unwrap();
    // Another owner's claim, then this one's lease running out: both fence it out.
    let impostor = Claim {
        owner_id: OwnerId::new(),
        ..claim
    };
    let err = boundary(&store, impostor, "A").await.unwrap_err();
    assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");
    db.clock.advance(LEASE + 1);
    let err = boundary(&store, claim, "A").await.unwrap_err();
    assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");

    assert_eq!(store.last_seq(session).await.unwrap(), before);
    assert_eq!(current(&store, session).await, None);
    let pending = store
        .read(move |c| inbox::pending(c, session))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].id, input);
    assert_eq!(pending[0].status, InputStatus::Pending);
}

async fn the_epoch_never_advances_after_ownership_changes(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = claimed(&store, session).await;
    admit(&store, session, "one", Delivery::Queue).await;
    boundary(&store, claim, "A").await.unwrap();
    let before = store.last_seq(session).await.unwrap().unwrap();

    // The owner stalls past its lease; whoever comes next owns the session now.
    db.clock.advance(LEASE + 1);
    let err = compacted(&store, claim, before).await.unwrap_err();
    assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");
    // Recovery settles the abandoned execution and another owner claims the session.
    let report = recovery::settle_abandoned(&store, |_| {}).await.unwrap();
    assert_eq!(report.recovered, [session]);
    let next = claimed(&store, session).await;
    assert_ne!(next.owner_id, claim.owner_id);
    let settled = store.last_seq(session).await.unwrap().unwrap();
    let err = compacted(&store, claim, before).await.unwrap_err();
    assert!(matches!(err, Error::OwnershipLost { .. }), "{err}");

    assert_eq!(store.last_seq(session).await.unwrap().unwrap(), settled);
    let epoch = current(&store, session).await.unwrap();
    assert_eq!((epoch.epoch, epoch.baseline_seq), (1, 0));
}

async fn a_failed_epoch_advance_rolls_back_the_claim_renewal(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let claim = claimed(&store, session).await;
    admit(&store, session, "one", Delivery::Queue).await;
    boundary(&store, claim, "A").await.unwrap();
    let renewed = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap()
        .expires_at;
    assert_eq!(renewed, T0 + LEASE);
    let before = store.last_seq(session).await.unwrap();

    // An advance computed from a stale view (epoch 1 again) is refused by the
    // projection, and the renewal of its transaction goes with it.
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
                    vec![DurableEvent::ContextEpochStarted(
                        payload::ContextEpochStarted {
                            epoch: 1,
                            system: "stale".into(),
                            baseline_seq: 2,
                        },
                    )],
                )?;
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Store(store::Error::Projection { reason, .. })
            if reason.contains("does not follow")),
        "{err}"
    );
    assert_eq!(store.last_seq(session).await.unwrap(), before);
    let row = store
        .read(move |c| execution::get(c, session))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.expires_at, renewed, "the renewal rolled back");
    let epoch = current(&store, session).await.unwrap();
    assert_eq!((epoch.epoch, epoch.system.as_str()), (1, "A"));
}
