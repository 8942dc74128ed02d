//! Deferred commits (`Store::write_deferred`): visible at once, held back from the log's
//! readers until on disk, and on disk with the next synced commit that writes or after
//! the flush delay.

use std::time::Duration;

use keel_core::event::log;
use keel_core::store::{Durable, Error, Options, Store, Synchronous};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::SessionId;

use crate::backend_tests;
use crate::support::{TestDb, new_session};

/// Long enough that nothing in a test is synced by the flush delay.
const NEVER: Duration = Duration::from_secs(3600);

fn renamed(title: &str) -> DurableEvent {
    DurableEvent::Renamed(payload::Renamed {
        title: title.into(),
    })
}

async fn open(db: &TestDb, flush_delay: Duration, synchronous: Synchronous) -> Store {
    let options = Options {
        flush_delay,
        synchronous,
        ..db.options()
    };
    Store::open(db.url.clone(), options)
        .await
        .unwrap_or_else(|e| panic!("opening {}: {e}", db.url))
}

/// Appends `events` to `session` in a deferred write.
async fn append_deferred(
    store: &Store,
    session: SessionId,
    events: Vec<DurableEvent>,
) -> Result<(Vec<Envelope>, Durable), Error> {
    let clock = store.clock().clone();
    store
        .write_deferred(session, move |c| {
            log::append(c, clock.now_ms(), session, events.clone())
        })
        .await
}

async fn shown(store: &Store, session: SessionId) -> Vec<u64> {
    let events = store.read_log(session, 0, 100).await.unwrap();
    events.iter().map(|e| e.seq).collect()
}

async fn on_disk(durable: Durable) {
    tokio::time::timeout(Duration::from_secs(30), durable.wait())
        .await
        .expect("the deferred commit reached the disk")
        .expect("its sync succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_commit_is_held_back_from_readers_until_a_synced_commit_takes_it_to_disk() {
    let db = TestDb::sqlite();
    let store = open(&db, NEVER, Synchronous::Full).await;
    let session = new_session(&store).await;
    let other = new_session(&store).await;
    let syncs = store.syncs();

    let (written, mut durable) = append_deferred(&store, session, vec![renamed("a"), renamed("b")])
        .await
        .unwrap();
    assert_eq!(written.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    assert!(!durable.is_durable());
    assert_eq!(
        store.syncs(),
        syncs,
        "the deferred commit did not wait for the disk"
    );
    // Committed (the session's counter moved) but not shown to the log's readers.
    assert_eq!(store.last_seq(session).await.unwrap(), Some(3));
    assert_eq!(shown(&store, session).await, [1]);
    // Another deferred commit of the same session keeps the first hold.
    let (_, later) = append_deferred(&store, session, vec![renamed("c")])
        .await
        .unwrap();
    assert_eq!(shown(&store, session).await, [1]);

    // A synced commit of any session syncs the log, and every commit before it with it.
    store.append(other, vec![renamed("x")]).await.unwrap();
    assert!(durable.is_durable());
    on_disk(later).await;
    assert_eq!(store.syncs(), syncs + 1);
    assert_eq!(shown(&store, session).await, [1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_commit_nothing_follows_is_synced_after_the_flush_delay() {
    let db = TestDb::sqlite();
    let store = open(&db, Duration::from_millis(20), Synchronous::Full).await;
    let session = new_session(&store).await;
    let syncs = store.syncs();

    let (_, durable) = append_deferred(&store, session, vec![renamed("a")])
        .await
        .unwrap();
    on_disk(durable).await;
    assert_eq!(
        store.syncs(),
        syncs + 1,
        "one sync of the log, by the writer"
    );
    assert_eq!(shown(&store, session).await, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synced_commit_that_writes_nothing_does_not_stand_for_a_sync() {
    let db = TestDb::sqlite();
    let store = open(&db, NEVER, Synchronous::Full).await;
    let session = new_session(&store).await;

    let (_, mut durable) = append_deferred(&store, session, vec![renamed("a")])
        .await
        .unwrap();
    // A write that only reads commits without writing to the log, so SQLite syncs
    // nothing: the deferred commit is still not on disk.
    let last = store
        .write(move |c| log::last_seq(c, session))
        .await
        .unwrap();
    assert_eq!(last, Some(2));
    assert!(!durable.is_durable());
    assert_eq!(shown(&store, session).await, [1]);

    store.append(session, vec![renamed("b")]).await.unwrap();
    assert!(durable.is_durable());
    assert_eq!(shown(&store, session).await, [1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_deferred_write_leaves_nothing_and_hides_nothing_committed_after_it() {
    let db = TestDb::sqlite();
    let store = open(&db, NEVER, Synchronous::Full).await;
    let session = new_session(&store).await;

    // A write refused after it appended: its transaction is rolled back.
    let clock = store.clock().clone();
    let refused = store
        .write_deferred(session, move |c| {
            log::append(c, clock.now_ms(), session, vec![renamed("a")])?;
            Err::<(), _>(Error::Corrupt("refused after writing".into()))
        })
        .await;
    assert!(matches!(refused, Err(Error::Corrupt(_))), "{refused:?}");
    assert_eq!(store.last_seq(session).await.unwrap(), Some(1));
    assert_eq!(shown(&store, session).await, [1]);

    // The hold its batch took goes with the next synced commit.
    store.append(session, vec![renamed("b")]).await.unwrap();
    assert_eq!(shown(&store, session).await, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_normal_a_deferred_write_is_an_ordinary_one() {
    let db = TestDb::sqlite();
    let store = open(&db, NEVER, Synchronous::Normal).await;
    let session = new_session(&store).await;
    let (_, mut durable) = append_deferred(&store, session, vec![renamed("a")])
        .await
        .unwrap();
    assert!(durable.is_durable());
    assert_eq!(shown(&store, session).await, [1, 2]);
}

backend_tests!(a_deferred_write_answers_with_what_it_wrote);

/// On both backends a deferred write is a write: its result, its events in the log once
/// durable (at once on PostgreSQL, whose readers on other nodes cannot be held back).
async fn a_deferred_write_answers_with_what_it_wrote(db: TestDb) {
    let store = open(&db, Duration::from_millis(20), Synchronous::Full).await;
    let session = new_session(&store).await;
    let (written, mut durable) = append_deferred(&store, session, vec![renamed("a")])
        .await
        .unwrap();
    assert_eq!(written[0].seq, 2);
    if matches!(db.url, keel_core::store::DbUrl::Postgres(_)) {
        assert!(durable.is_durable());
    }
    on_disk(durable).await;
    assert_eq!(shown(&store, session).await, [1, 2]);
}
