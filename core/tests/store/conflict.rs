//! Conflicts between nodes' transactions on PostgreSQL: the database aborts one of two
//! deadlocked batches, and the writer runs that batch again instead of failing its writes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};

use keel_core::event::log;
use keel_core::store::{Error, Store};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::SessionId;

use crate::support::{TestDb, new_session};

fn renamed(title: &str) -> DurableEvent {
    DurableEvent::Renamed(payload::Renamed {
        title: title.into(),
    })
}

/// On `store`, one write that appends to `first`, waits at `barrier` (on its first run
/// only, so both writes hold one session's row lock), then appends to `second`. Returns
/// how many times the write ran.
async fn crosswise(
    store: &Store,
    first: SessionId,
    second: SessionId,
    barrier: Arc<Barrier>,
) -> (Result<(), Error>, u32) {
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let result = store
        .write(move |c| {
            let now = 0;
            log::append(c, now, first, vec![renamed("first")])?;
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                barrier.wait();
            }
            log::append(c, now, second, vec![renamed("second")])?;
            Ok(())
        })
        .await;
    (result, runs.load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_two_nodes_batches_is_retried_and_each_write_commits_once() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    // Two stores are two nodes: each has its own writer connection.
    let (a, b) = (db.open().await, db.open().await);
    let (x, y) = (new_session(&a).await, new_session(&a).await);
    let barrier = Arc::new(Barrier::new(2));
    // Node a locks x then y, node b y then x: the database finds the deadlock and aborts
    // one transaction.
    let ((a_result, a_runs), (b_result, b_runs)) = tokio::join!(
        crosswise(&a, x, y, barrier.clone()),
        crosswise(&b, y, x, barrier),
    );
    a_result.unwrap();
    b_result.unwrap();
    // Exactly one of the two ran again; neither was turned into a failure.
    let mut runs = [a_runs, b_runs];
    runs.sort_unstable();
    assert_eq!(
        runs,
        [1, 2],
        "one batch is the deadlock's victim and runs again"
    );
    // Each session holds its creation and one event from each write: nothing from the
    // aborted attempt, nothing twice.
    for session in [x, y] {
        let events = a.read_log(session, 0, 100).await.unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        let mut titles: Vec<String> = events[1..]
            .iter()
            .map(|e| match &e.event {
                DurableEvent::Renamed(renamed) => renamed.title.clone(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        titles.sort();
        assert_eq!(titles, ["first", "second"]);
    }
}
