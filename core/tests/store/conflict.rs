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

/// A node that stalls in the middle of a transaction (stopped, swapped out) holds its row
/// locks; PostgreSQL ends such a transaction once it has sat idle for a few seconds, so
/// another node can write the session again, and the stalled write fails and leaves
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_left_idle_by_a_stalled_node_is_ended_and_its_locks_released() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let (stalled, other) = (db.open().await, db.open().await);
    let session = new_session(&stalled).await;
    let (locked_tx, locked) = std::sync::mpsc::channel();
    let stalling = stalled.write_for(session, move |c| {
        log::append(c, 0, session, vec![renamed("stalled")])?;
        // On a run after the first, nobody waits any more.
        locked_tx.send(()).ok();
        // Longer than PostgreSQL lets a transaction sit idle.
        std::thread::sleep(std::time::Duration::from_secs(7));
        log::append(c, 0, session, vec![renamed("stalled, later")])?;
        Ok::<_, Error>(())
    });
    let (stalled_result, other_result) = tokio::join!(stalling, async {
        tokio::task::spawn_blocking(move || locked.recv())
            .await
            .unwrap()
            .unwrap();
        // Waits on the session's row lock until the stalled transaction is ended.
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            other.append(session, vec![renamed("other")]),
        )
        .await
    });
    let appended = other_result
        .expect("the other node writes within 30 s")
        .unwrap();
    assert!(stalled_result.is_err(), "the stalled write failed");
    let titles: Vec<String> = other
        .read_log(session, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.event {
            DurableEvent::Renamed(r) => Some(r.title),
            _ => None,
        })
        .collect();
    assert_eq!(titles, ["other"], "the stalled write left nothing");
    assert_eq!(appended[0].seq, 2);
    // The stalled node's writer reconnects and writes again.
    stalled
        .append(session, vec![renamed("after")])
        .await
        .unwrap();
}

/// Three nodes append to the same sessions at once, each with several writers, so that
/// every node's batches lock many of the sessions together and move their counters: the
/// row locks order them, and each session's log is numbered without a gap or a repeat,
/// its counter equal to its last seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_appending_to_the_same_sessions_at_once_number_every_event_once() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let nodes = [db.open().await, db.open().await, db.open().await];
    let sessions = crate::support::new_sessions(&nodes[0], 8).await;
    let per_task = 15;
    let mut tasks = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        for &session in &sessions {
            let node = node.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..per_task {
                    node.append(session, vec![renamed(&format!("{n}:{i}"))])
                        .await
                        .unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let last = 1 + (nodes.len() * per_task) as u64;
    for &session in &sessions {
        let events = nodes[1].read_log(session, 0, 1000).await.unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=last).collect::<Vec<u64>>());
        assert_eq!(nodes[2].last_seq(session).await.unwrap(), Some(last));
        // Each node's appends to a session kept their order.
        for n in 0..nodes.len() {
            let titles: Vec<String> = events
                .iter()
                .filter_map(|e| match &e.event {
                    DurableEvent::Renamed(r) if r.title.starts_with(&format!("{n}:")) => {
                        Some(r.title.clone())
                    }
                    _ => None,
                })
                .collect();
            let expected: Vec<String> = (0..per_task).map(|i| format!("{n}:{i}")).collect();
            assert_eq!(titles, expected);
        }
    }
}

/// A node's writer remembers the counters its batches committed and numbers its next
/// appends from them without reading the table (`event::counters`). Another node's
/// appends move those counters, and its deletion ends the session: the first node's next
/// append to each is numbered after what the other wrote, or refused, and never fails
/// for the stale counter, whichever statement finds it stale: a row whose seq the other
/// node's row took (a message's), the write-back at the batch's end, the write-back for a
/// read of the counter in the batch, or the one a deletion makes. Each is one batch run
/// again, which only a remembered counter causes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_s_remembered_counters_give_way_to_another_node_s_appends_and_deletion() {
    use crate::log::{in_one_batch, one_writer, started};
    use keel_schema::id::MessageId;

    let Some(db) = TestDb::postgres() else {
        return;
    };
    let (a, b) = (one_writer(&db).await, one_writer(&db).await);
    let (s, t) = (new_session(&a).await, new_session(&a).await);
    let seqs = |events: Vec<keel_schema::event::Envelope>| {
        events.iter().map(|e| e.seq).collect::<Vec<u64>>()
    };
    // Each appended by `a`, which then remembers both counters at 2.
    assert_eq!(seqs(a.append(s, vec![renamed("a")]).await.unwrap()), [2]);
    assert_eq!(seqs(a.append(t, vec![renamed("a")]).await.unwrap()), [2]);
    assert_eq!(a.stale_reruns(), 0);
    let on_b = b.append(s, vec![started(MessageId::new())]).await.unwrap();
    assert_eq!(seqs(on_b), [3]);
    let on_b = b.append(t, vec![renamed("b"), renamed("b")]).await.unwrap();
    assert_eq!(seqs(on_b), [3, 4]);

    // A message whose seq `b`'s message took.
    let on_a = a.append(s, vec![started(MessageId::new())]).await.unwrap();
    assert_eq!(seqs(on_a), [4]);
    assert_eq!(a.stale_reruns(), 1);
    // `s` as remembered, `t` moved: the batch's write-back.
    let (on_s, on_t) = in_one_batch(&a, async {
        tokio::join!(
            a.append(s, vec![renamed("a again")]),
            a.append(t, vec![renamed("a again")]),
        )
    })
    .await;
    assert_eq!(seqs(on_s.unwrap()), [5]);
    assert_eq!(seqs(on_t.unwrap()), [5]);
    assert_eq!(a.stale_reruns(), 2);
    // The write-back for a read of the counter inside the batch.
    assert_eq!(seqs(b.append(t, vec![renamed("b")]).await.unwrap()), [6]);
    let (appended, counted) = a
        .write_for(t, move |c| {
            let appended = log::append(c, 0, t, vec![renamed("a, read")])?;
            let counted = log::last_seq(c, t)?;
            Ok::<_, Error>((appended, counted))
        })
        .await
        .unwrap();
    assert_eq!((seqs(appended), counted), (vec![7], Some(7)));
    assert_eq!(a.stale_reruns(), 3);
    // The write-back a deletion makes.
    assert_eq!(seqs(b.append(s, vec![renamed("b")]).await.unwrap()), [6]);
    let deleted = a
        .append(s, vec![DurableEvent::Deleted(payload::Deleted {})])
        .await
        .unwrap();
    assert_eq!(seqs(deleted), [7]);
    assert_eq!(a.stale_reruns(), 4);

    // Deleted by the other node: refused.
    let u = new_session(&a).await;
    assert_eq!(seqs(a.append(u, vec![renamed("a")]).await.unwrap()), [2]);
    let deleted = b
        .append(u, vec![DurableEvent::Deleted(payload::Deleted {})])
        .await
        .unwrap();
    assert_eq!(seqs(deleted), [3]);
    let refused = a.append(u, vec![renamed("too late")]).await.unwrap_err();
    assert!(
        matches!(refused, Error::SessionDeleted(id) if id == u),
        "{refused}"
    );
    assert_eq!(a.stale_reruns(), 5);

    // The process's metric counts them too (other tests' stores may add to it).
    let page = keel_core::metrics::render(keel_core::metrics::Shared::default());
    let reruns: f64 = page
        .lines()
        .find_map(|line| line.strip_prefix("keel_store_stale_reruns_total "))
        .expect("the metric is on the page")
        .parse()
        .unwrap();
    assert!(reruns >= 5.0, "{reruns}");

    for (session, last) in [(s, 7), (t, 7), (u, 3)] {
        let log = a.read_log(session, 0, 100).await.unwrap();
        assert_eq!(seqs(log), (1..=last).collect::<Vec<u64>>());
        assert_eq!(b.last_seq(session).await.unwrap(), Some(last));
    }
}
