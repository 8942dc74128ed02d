//! The event log: gapless seq, atomic appends, typed refusals that change nothing.

use std::collections::HashMap;

use diesel::RunQueryDsl;
use keel_core::store::{Error, Store};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{EventId, MessageId, SessionId};

use crate::backend_tests;
use crate::lifecycle::{Rows, rows};
use crate::support::{T0, TestDb, created, new_session, new_sessions};

/// Step 1's start, its assistant message `message`.
pub(crate) fn started(message: MessageId) -> DurableEvent {
    DurableEvent::StepStarted(payload::StepStarted {
        assistant_message_id: message,
        step: 1,
        agent: "build".into(),
        model: keel_schema::types::ModelRef {
            provider: "scripted".into(),
            id: "demo".into(),
        },
    })
}

/// A step's end, `input` tokens and the rest of its usage 2, 3, 4 and 5, at `cost`.
fn ended(message: MessageId, input: u64, cost: f64) -> DurableEvent {
    DurableEvent::StepEnded(payload::StepEnded {
        assistant_message_id: message,
        finish: keel_schema::types::Finish::Stop,
        usage: keel_schema::types::Usage {
            input,
            output: 2,
            reasoning: 3,
            cache_read: 4,
            cache_write: 5,
        },
        cost,
    })
}

fn renamed(title: &str) -> DurableEvent {
    DurableEvent::Renamed(payload::Renamed {
        title: title.into(),
    })
}

async fn snapshot(store: &Store, session: SessionId) -> (Option<u64>, Rows) {
    let last = store.last_seq(session).await.unwrap();
    let rows = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    (last, rows)
}

backend_tests!(
    appends_number_each_session_from_one_without_gaps,
    events_appended_together_commit_together_and_a_projector_error_rolls_all_back,
    an_event_for_a_session_that_does_not_exist_is_refused_and_writes_nothing,
    creating_a_session_twice_is_refused,
    a_deleted_session_takes_no_more_events,
    a_duplicate_event_id_is_refused_and_writes_nothing,
    a_stored_payload_that_does_not_decode_is_a_typed_error_naming_its_seq,
    reads_return_events_after_a_seq_up_to_a_limit,
    concurrent_appends_to_many_sessions_are_group_committed_in_order,
    each_sessions_writes_commit_in_submission_order_across_several_writers,
    a_write_reading_the_log_sees_what_earlier_writes_of_its_batch_appended,
    a_failing_write_in_a_shared_transaction_undoes_only_itself,
    the_count_of_sessions_not_deleted_follows_creations_and_deletions,
    a_batch_of_writes_for_several_sessions_numbers_each_and_reads_what_it_numbered,
    a_write_s_savepoint_rolled_back_in_a_batch_leaves_every_log_and_counter_right,
    a_batch_whose_gathered_rows_were_refused_to_a_read_does_not_commit_without_them,
    a_row_refused_at_a_batch_s_end_fails_its_write_alone_and_the_counters_stay_right,
    a_write_going_on_past_a_failed_statement_loses_no_other_write,
    a_batch_s_changes_to_its_sessions_rows_equal_a_replay_and_are_read_back_in_the_batch,
    a_batch_of_one_session_s_writes_keeps_its_counter_from_its_first_append,
    an_import_in_a_batch_for_several_sessions_projects_every_change_to_its_session,
);

/// `session_count`, which `GET /metrics` reads instead of counting the sessions, is kept
/// by the projector and always equals the count; a refused creation changes it not.
async fn the_count_of_sessions_not_deleted_follows_creations_and_deletions(db: TestDb) {
    use keel_core::store::schema::{session, session_count};

    let store = db.open().await;
    let counts = |store: &Store| {
        let store = store.clone();
        async move {
            store
                .read(|c| {
                    use diesel::prelude::*;
                    let kept: i64 = session_count::table
                        .select(session_count::live)
                        .get_result(c)?;
                    let counted: i64 = session::table
                        .filter(session::deleted_at.is_null())
                        .count()
                        .get_result(c)?;
                    Ok::<_, Error>((kept, counted))
                })
                .await
                .unwrap()
        }
    };
    assert_eq!(counts(&store).await, (0, 0));
    let sessions = new_sessions(&store, 3).await;
    assert_eq!(counts(&store).await, (3, 3));
    store
        .append(
            sessions[1],
            vec![DurableEvent::Deleted(payload::Deleted {})],
        )
        .await
        .unwrap();
    let again = store.append(sessions[0], vec![created("again")]).await;
    assert!(matches!(again, Err(Error::SessionExists(_))), "{again:?}");
    let deleted_again = store
        .append(
            sessions[1],
            vec![DurableEvent::Deleted(payload::Deleted {})],
        )
        .await;
    assert!(
        matches!(deleted_again, Err(Error::SessionDeleted(_))),
        "{deleted_again:?}"
    );
    assert_eq!(counts(&store).await, (2, 2));
}

async fn appends_number_each_session_from_one_without_gaps(db: TestDb) {
    let store = db.open().await;
    let a = SessionId::new();
    let b = SessionId::new();
    let first = store
        .append(a, vec![created("a"), renamed("a1")])
        .await
        .unwrap();
    store.append(b, vec![created("b")]).await.unwrap();
    db.clock.advance(5);
    let second = store.append(a, vec![renamed("a2")]).await.unwrap();

    let seqs: Vec<u64> = first.iter().chain(&second).map(|e| e.seq).collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    assert_eq!(first[0].time, T0);
    assert_eq!(second[0].time, T0 + 5);
    assert_eq!(store.last_seq(a).await.unwrap(), Some(3));
    assert_eq!(store.last_seq(b).await.unwrap(), Some(1));
    assert_eq!(store.last_seq(SessionId::new()).await.unwrap(), None);

    let log = store.read_log(a, 0, 100).await.unwrap();
    let expected: Vec<Envelope> = first.into_iter().chain(second).collect();
    assert_eq!(log, expected);
}

async fn events_appended_together_commit_together_and_a_projector_error_rolls_all_back(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let before = snapshot(&store, session).await;
    let ghost = MessageId::new();
    let err = store
        .append(
            session,
            vec![
                renamed("should not stick"),
                DurableEvent::TextEnded(payload::TextEnded {
                    assistant_message_id: ghost,
                    ordinal: 0,
                    text: "orphan".into(),
                }),
            ],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "event session.next.text.ended.1 cannot be applied to session {session}: no \
             message {ghost}"
        )
    );
    assert_eq!(snapshot(&store, session).await, before);
    assert_eq!(store.read_log(session, 0, 100).await.unwrap().len(), 1);
}

async fn an_event_for_a_session_that_does_not_exist_is_refused_and_writes_nothing(db: TestDb) {
    let store = db.open().await;
    let ghost = SessionId::new();
    let err = store.append(ghost, vec![renamed("x")]).await.unwrap_err();
    assert!(
        matches!(err, Error::SessionNotFound(id) if id == ghost),
        "{err}"
    );
    assert_eq!(snapshot(&store, ghost).await.0, None);
    assert_eq!(store.read_log(ghost, 0, 10).await.unwrap(), vec![]);
}

async fn creating_a_session_twice_is_refused(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let before = snapshot(&store, session).await;
    let err = store
        .append(session, vec![created("again")])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::SessionExists(id) if id == session),
        "{err}"
    );
    // `created` anywhere but first is refused too.
    let err = store
        .append(session, vec![renamed("x"), created("again")])
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Projection { .. } | Error::Database(_)),
        "{err}"
    );
    assert_eq!(snapshot(&store, session).await, before);
}

async fn a_deleted_session_takes_no_more_events(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    store
        .append(session, vec![DurableEvent::Deleted(payload::Deleted {})])
        .await
        .unwrap();
    let before = snapshot(&store, session).await;
    let err = store.append(session, vec![renamed("x")]).await.unwrap_err();
    assert!(
        matches!(err, Error::SessionDeleted(id) if id == session),
        "{err}"
    );
    assert_eq!(snapshot(&store, session).await, before);
}

async fn a_duplicate_event_id_is_refused_and_writes_nothing(db: TestDb) {
    let store = db.open().await;
    let a = new_session(&store).await;
    let b = new_session(&store).await;
    let existing = store.read_log(a, 0, 1).await.unwrap()[0].id;
    let before = snapshot(&store, b).await;
    let copy = Envelope {
        id: existing,
        session_id: b,
        seq: 2,
        time: T0,
        event: renamed("copied"),
    };
    let err = store
        .write(move |c| keel_core::event::log::import(c, std::slice::from_ref(&copy)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::DuplicateEventId(id) if id == existing),
        "{err}"
    );
    assert_eq!(snapshot(&store, b).await, before);
}

async fn a_stored_payload_that_does_not_decode_is_a_typed_error_naming_its_seq(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let id = EventId::new();
    store
        .write(move |c| {
            diesel::sql_query(format!(
                "INSERT INTO event (session_id, seq, id, type, version, data, time) \
                 VALUES ('{session}', 2, '{id}', 'session.next.renamed', 1, \
                 '{{\"name\": \"not a title\"}}', 0)"
            ))
            .execute(c)
            .map(|_| ())
            .map_err(Error::from)
        })
        .await
        .unwrap();
    let err = store.read_log(session, 0, 10).await.unwrap_err();
    assert!(matches!(err, Error::Decode { seq: 2, .. }), "{err}");
    assert!(err.to_string().contains("session.next.renamed.1"), "{err}");
    // Reading before the bad event still works.
    assert_eq!(store.read_log(session, 0, 1).await.unwrap().len(), 1);
}

async fn reads_return_events_after_a_seq_up_to_a_limit(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    let titles: Vec<DurableEvent> = (0..9).map(|i| renamed(&format!("t{i}"))).collect();
    store.append(session, titles).await.unwrap();
    let page: Vec<u64> = store
        .read_log(session, 3, 4)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(page, vec![4, 5, 6, 7]);
    assert_eq!(store.read_log(session, 10, 4).await.unwrap(), vec![]);
}

async fn concurrent_appends_to_many_sessions_are_group_committed_in_order(db: TestDb) {
    let store = db.open().await;
    let sessions = new_sessions(&store, 64).await;
    let (batches_before, writes_before) = store.stats();
    let mut tasks = Vec::new();
    for (n, &session) in sessions.iter().enumerate() {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                store
                    .append(session, vec![renamed(&format!("{n}:{i}"))])
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (batches, writes) = store.stats();
    assert_eq!(writes - writes_before, 640);
    // Waiting writes share transactions: fewer commits than writes.
    assert!(
        batches - batches_before < 640,
        "{} batches",
        batches - batches_before
    );

    let mut titles = HashMap::new();
    for (n, &session) in sessions.iter().enumerate() {
        let log = store.read_log(session, 0, 100).await.unwrap();
        let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=11).collect::<Vec<u64>>());
        let order: Vec<String> = log[1..]
            .iter()
            .map(|e| match &e.event {
                DurableEvent::Renamed(r) => r.title.clone(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        let expected: Vec<String> = (0..10).map(|i| format!("{n}:{i}")).collect();
        assert_eq!(order, expected);
        titles.insert(session, order);
    }
    assert_eq!(titles.len(), 64);
}

async fn a_failing_write_in_a_shared_transaction_undoes_only_itself(db: TestDb) {
    let store = db.open().await;
    let sessions = new_sessions(&store, 48).await;
    let (batches_before, writes_before) = store.stats();
    let mut tasks = Vec::new();
    for (n, &session) in sessions.iter().enumerate() {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .write(move |c| {
                    let appended =
                        keel_core::event::log::append(c, T0, session, vec![renamed("kept?")])?;
                    match n % 3 {
                        // Fails after writing: its event must be undone.
                        0 => Err(Error::Corrupt(format!("refused {n}"))),
                        // Fails in the database (a duplicate key; PostgreSQL then refuses
                        // every statement until the savepoint is rolled back).
                        1 => diesel::sql_query(format!(
                            "INSERT INTO event (session_id, seq, id, type, version, data, time) \
                             VALUES ('{session}', {}, 'evt_dup_{n}', 'x', 1, '{{}}', 0)",
                            appended[0].seq
                        ))
                        .execute(c)
                        .map(|_| ())
                        .map_err(Error::from),
                        _ => Ok(()),
                    }
                })
                .await
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    let (batches, writes) = store.stats();
    assert_eq!(writes - writes_before, 48);
    assert!(
        batches - batches_before < 48,
        "the writes shared transactions"
    );
    for (n, (&session, outcome)) in sessions.iter().zip(outcomes).enumerate() {
        let log = store.read_log(session, 0, 10).await.unwrap();
        if n % 3 == 2 {
            assert!(outcome.is_ok(), "{n}: {outcome:?}");
            assert_eq!(log.len(), 2, "{n}: its event committed");
        } else {
            assert!(outcome.is_err(), "{n} must fail");
            assert_eq!(log.len(), 1, "{n}: its event was undone");
            assert_eq!(store.last_seq(session).await.unwrap(), Some(1));
        }
    }
}

/// On PostgreSQL a store commits on several writers at once; a session's writes all go to
/// one of them, so appends submitted together (none awaited before the next is
/// submitted) are numbered in the order they were submitted.
async fn each_sessions_writes_commit_in_submission_order_across_several_writers(db: TestDb) {
    let store = Store::open(
        db.url.clone(),
        keel_core::store::Options {
            pg_writers: 4,
            ..db.options()
        },
    )
    .await
    .unwrap();
    let expected_writers = match db.url {
        keel_core::store::DbUrl::Sqlite(_) => 1,
        keel_core::store::DbUrl::Postgres(_) => 4,
    };
    assert_eq!(store.writers(), expected_writers);
    let sessions = new_sessions(&store, 12).await;
    let mut appends = Vec::new();
    for round in 0..10 {
        for &session in &sessions {
            let store = store.clone();
            appends.push(async move {
                let title = format!("{session} {round}");
                let appended = store.append(session, vec![renamed(&title)]).await.unwrap();
                (session, round, appended[0].seq)
            });
        }
    }
    for (session, round, seq) in futures::future::join_all(appends).await {
        assert_eq!(seq, round + 2, "{session}: append {round} got seq {seq}");
    }
}

/// The writer gathers a batch's event rows and inserts them together before the commit;
/// a write that reads the log in the same batch still sees the rows appended before it.
async fn a_write_reading_the_log_sees_what_earlier_writes_of_its_batch_appended(db: TestDb) {
    let store = db.open().await;
    let session = new_session(&store).await;
    // The first write holds the writer while the next two queue, so they share a batch.
    let hold = store.write_for(session, |_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        Ok::<_, Error>(())
    });
    let append = store.append(session, vec![renamed("seen")]);
    let read = store.write_for(session, move |c| {
        keel_core::event::log::read(c, session, 0, 100)
    });
    let (held, appended, read) = tokio::join!(hold, append, read);
    held.unwrap();
    let appended = appended.unwrap();
    let read = read.unwrap();
    assert_eq!(
        read.last().map(|e| e.seq),
        Some(appended[0].seq),
        "the read saw the append before it"
    );
    let (batches, writes) = store.stats();
    assert!(writes > batches, "the append and the read shared a batch");
}

/// One batch of writes for several sessions, as a busy node's writer runs them (on
/// PostgreSQL the batch keeps the sessions' counters in memory and writes them back at
/// its end): every append is numbered after the one before it in its session, whether its
/// write named the session or not; a read inside the batch sees the counter its writes
/// moved; a session deleted in the batch takes no more events; a session created in the
/// batch is counted too; and the table's counters and update times are right after.
async fn a_batch_of_writes_for_several_sessions_numbers_each_and_reads_what_it_numbered(
    db: TestDb,
) {
    use keel_core::event::{log, view};
    let store = one_writer(&db).await;
    let [a, b, c]: [SessionId; 3] = new_sessions(&store, 3).await.try_into().unwrap();
    let d = SessionId::new();
    db.clock.advance(7);
    let now = T0 + 7;
    let before = store.stats();

    let append = |session: SessionId, events: Vec<DurableEvent>| {
        move |c: &mut keel_core::store::Conn| log::append(c, now, session, events.clone())
    };
    let seqs = |events: Vec<Envelope>| events.iter().map(|e| e.seq).collect::<Vec<u64>>();
    let (a12, a3, b123, a4, c_deleted, c_refused, d_created, d1, a5) =
        in_one_batch(&store, async {
            tokio::join!(
                // Named for `a`, twice.
                store.write_for(a, append(a, vec![renamed("a1"), renamed("a2")])),
                store.write_for(a, append(a, vec![renamed("a3")])),
                // Appends to `b`, reading its counter back after each append, each read
                // the first thing after it that could write the counters back.
                store.write_for(b, move |c| {
                    let b1 = log::append(c, now, b, vec![renamed("b1")])?;
                    let shown = view::session(c, b)?.map(|s| (s.last_seq, s.time_updated));
                    let b2 = log::append(c, now, b, vec![renamed("b2")])?;
                    let listed = view::sessions(c, None, 100)?
                        .into_iter()
                        .find(|s| s.id == b)
                        .map(|s| s.last_seq);
                    let b3 = log::append(c, now, b, vec![renamed("b3")])?;
                    let counted = log::last_seq(c, b)?;
                    let read = log::read(c, b, 0, 100)?.last().map(|e| e.seq);
                    let appended = [b1, b2, b3].concat();
                    Ok::<_, Error>((appended, shown, listed, counted, read))
                }),
                // Not named for `a`: numbered after the writes above that were.
                store.write(append(a, vec![renamed("a4")])),
                // `c` deleted, then refused.
                store.write_for(
                    c,
                    append(c, vec![DurableEvent::Deleted(payload::Deleted {})])
                ),
                store.write_for(c, {
                    let append = append(c, vec![renamed("too late")]);
                    move |conn| Ok::<_, Error>(append(conn).map_err(|e| e.to_string()))
                }),
                // `d` created in the batch, then appended to by a write named for it.
                store.write(append(d, vec![created("d")])),
                store.write_for(d, append(d, vec![renamed("d1")])),
                // `a` again, moved in memory after every read above: written back at commit.
                store.write_for(a, append(a, vec![renamed("a5")])),
            )
        })
        .await;
    one_batch(&store, before, 9);

    assert_eq!(seqs(a12.unwrap()), vec![2, 3]);
    assert_eq!(seqs(a3.unwrap()), vec![4]);
    assert_eq!(seqs(a4.unwrap()), vec![5]);
    let (b123, shown, listed, counted, read) = b123.unwrap();
    assert_eq!(seqs(b123), vec![2, 3, 4]);
    assert_eq!(shown, Some((2, now)), "the session view in the batch");
    assert_eq!(listed, Some(3), "the session list in the batch");
    assert_eq!(counted, Some(4), "log::last_seq in the batch");
    assert_eq!(read, Some(4), "the log read in the batch");
    assert_eq!(seqs(c_deleted.unwrap()), vec![2]);
    let refused = c_refused.unwrap().unwrap_err();
    assert_eq!(refused, Error::SessionDeleted(c).to_string());
    assert_eq!(seqs(d_created.unwrap()), vec![1]);
    assert_eq!(seqs(d1.unwrap()), vec![2]);
    assert_eq!(seqs(a5.unwrap()), vec![6]);

    // Committed: the logs and the table's counters agree.
    for (session, last) in [(a, 6), (b, 4), (c, 2), (d, 2)] {
        let log = store.read_log(session, 0, 100).await.unwrap();
        assert_eq!(seqs(log), (1..=last).collect::<Vec<u64>>(), "{session}");
        assert_eq!(store.last_seq(session).await.unwrap(), Some(last));
    }
    for session in [a, b, d] {
        let shown = store
            .read(move |c| view::session(c, session))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(shown.time_updated, now, "{session}");
    }
    // The next batch goes on from the counters the last one wrote back.
    let next = store.append(a, vec![renamed("a6")]).await.unwrap();
    assert_eq!(seqs(next), vec![7]);
}

/// Writes that append or read inside a savepoint of their own (as an admission does,
/// falling back to what another node admitted when its append fails), in a batch of
/// writes for several sessions: whatever the savepoint rolls back, every session's log
/// holds exactly the events that were not rolled back, its counter is its last seq at
/// the commit, and the next appends go on from it. This is where what the batch gathers
/// for its end (event rows, see `event::rows`; on PostgreSQL counters, see
/// `event::counters`) must not outlive a rolled back savepoint: the first append of the
/// batch in one, an append in one to a session the batch had appended to already, a read
/// of the log in one after appends the batch had gathered.
async fn a_write_s_savepoint_rolled_back_in_a_batch_leaves_every_log_and_counter_right(db: TestDb) {
    use keel_core::event::log;
    use keel_core::store::Conn;

    let store = one_writer(&db).await;
    let [a, b, c]: [SessionId; 3] = new_sessions(&store, 3).await.try_into().unwrap();

    // Appends in a savepoint, rolled back (its write goes on) unless `keep`.
    let in_savepoint = |session: SessionId, title: &'static str, keep: bool| {
        move |c: &mut Conn| {
            let appended = diesel::Connection::transaction::<_, Error, _>(c, |c| {
                let appended = log::append(c, T0, session, vec![renamed(title)])?;
                if keep {
                    Ok(appended)
                } else {
                    Err(diesel::result::Error::RollbackTransaction.into())
                }
            });
            Ok::<_, Error>(appended.ok().map(|events| events[0].seq))
        }
    };
    let plain = |session: SessionId, title: &'static str| {
        move |c: &mut Conn| {
            let appended = log::append(c, T0, session, vec![renamed(title)])?;
            Ok::<_, Error>(Some(appended[0].seq))
        }
    };
    let logs = || async {
        let mut logs = Vec::new();
        for session in [a, b, c] {
            let log = store.read_log(session, 0, 100).await.unwrap();
            let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
            let counted = store.last_seq(session).await.unwrap().unwrap();
            logs.push((seqs, counted));
        }
        logs
    };
    let upto = |last: u64| ((1..=last).collect::<Vec<u64>>(), last);

    // The batch's first append, in a savepoint rolled back; then another session's.
    let before = store.stats();
    let (b_undone, a1) = in_one_batch(&store, async {
        tokio::join!(
            store.write_for(b, in_savepoint(b, "b undone", false)),
            store.write_for(a, plain(a, "a1")),
        )
    })
    .await;
    one_batch(&store, before, 2);
    assert_eq!((b_undone.unwrap(), a1.unwrap()), (None, Some(2)));
    assert_eq!(logs().await, vec![upto(2), upto(1), upto(1)]);

    // A session appended to by the batch, then appended to in a savepoint rolled back.
    let before = store.stats();
    let (a2, a_undone, nothing) = in_one_batch(&store, async {
        tokio::join!(
            store.write_for(a, plain(a, "a2")),
            store.write_for(a, in_savepoint(a, "a undone", false)),
            // Names a second session, so that the batch keeps counters.
            store.write_for(b, |_: &mut Conn| Ok::<Option<u64>, Error>(None)),
        )
    })
    .await;
    one_batch(&store, before, 3);
    assert_eq!((a2.unwrap(), a_undone.unwrap()), (Some(3), None));
    assert_eq!(nothing.unwrap(), None);
    assert_eq!(logs().await, vec![upto(3), upto(1), upto(1)]);

    // A savepoint kept, appending to a session the batch has not appended to: the batch
    // runs once (what it kept of other sessions stays kept).
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let before = store.stats();
    let (a3, c1) = in_one_batch(&store, async {
        let runs = runs.clone();
        let a3 = plain(a, "a3");
        tokio::join!(
            store.write_for(a, move |conn: &mut Conn| {
                runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                a3(conn)
            }),
            store.write_for(c, in_savepoint(c, "c1", true)),
        )
    })
    .await;
    one_batch(&store, before, 2);
    assert_eq!((a3.unwrap(), c1.unwrap()), (Some(4), Some(2)));
    assert_eq!(runs.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(logs().await, vec![upto(4), upto(1), upto(2)]);

    // A read of the log in a savepoint rolled back, after the batch appended.
    let before = store.stats();
    let (c2, c_read, a4) = in_one_batch(&store, async {
        tokio::join!(
            store.write_for(c, plain(c, "c2")),
            store.write_for(c, move |conn: &mut Conn| {
                let read = diesel::Connection::transaction::<(), Error, _>(conn, |conn| {
                    let read = log::read(conn, c, 0, 100)?;
                    let seqs: Vec<u64> = read.iter().map(|e| e.seq).collect();
                    Err(Error::Corrupt(format!("read {seqs:?}")))
                });
                Ok::<_, Error>(read.unwrap_err().to_string())
            }),
            store.write_for(a, plain(a, "a4")),
        )
    })
    .await;
    one_batch(&store, before, 3);
    assert_eq!((c2.unwrap(), a4.unwrap()), (Some(3), Some(5)));
    assert!(c_read.unwrap().contains("read [1, 2, 3]"));
    assert_eq!(logs().await, vec![upto(5), upto(1), upto(3)]);

    // The next appends go on from the counters.
    for (session, last) in [(a, 5), (b, 1), (c, 3)] {
        let next = store.append(session, vec![renamed("next")]).await.unwrap();
        assert_eq!(next[0].seq, last + 1, "{session}");
    }
}

/// A read of the log inserts the rows its batch gathered; should the database refuse
/// them there and the reading write go on regardless (as SQLite lets it), the batch must
/// not commit without them: it runs again, each row inserted as it is appended, and the
/// write that broke the log fails alone.
async fn a_batch_whose_gathered_rows_were_refused_to_a_read_does_not_commit_without_them(
    db: TestDb,
) {
    use keel_core::event::log;
    use keel_core::store::Conn;

    let store = one_writer(&db).await;
    let session = new_session(&store).await;
    let before = store.stats();
    let (appended, taking) = in_one_batch(&store, async {
        tokio::join!(
            store.append(session, vec![renamed("appended")]),
            // Takes the appended event's seq with a row of its own, then reads the log
            // (inserting the gathered row, refused) and ignores the refusal.
            store.write_for(session, move |c: &mut Conn| {
                take_seq(c, session, 2)?;
                let read = log::read(c, session, 0, 100).map(|events| events.len());
                Ok::<_, Error>(read.is_err())
            }),
        )
    })
    .await;
    one_batch(&store, before, 2);
    assert_eq!(appended.unwrap()[0].seq, 2);
    assert!(
        taking.is_err(),
        "the write taking the seq fails: {taking:?}"
    );
    let titles: Vec<String> = store
        .read_log(session, 0, 100)
        .await
        .unwrap()
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::Renamed(r) => Some(r.title.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(titles, vec!["appended".to_owned()]);
    assert_eq!(store.last_seq(session).await.unwrap(), Some(2));
}

/// A batch's gathered rows go in at its end, on PostgreSQL by the statement that also
/// writes the kept counters back (`event::counters::flush_with_rows`). When the database
/// refuses one of the rows there, the batch runs again row by row: the write whose row
/// it is fails alone, and the others commit, their counters at their logs' last seqs.
async fn a_row_refused_at_a_batch_s_end_fails_its_write_alone_and_the_counters_stay_right(
    db: TestDb,
) {
    use keel_core::store::Conn;

    let store = one_writer(&db).await;
    let sessions = new_sessions(&store, 3).await;
    let [a, b, c] = [sessions[0], sessions[1], sessions[2]];
    let before = store.stats();
    let (first, taking, second) = in_one_batch(&store, async {
        tokio::join!(
            store.append(a, vec![renamed("first")]),
            // Takes the seq `c`'s append below numbers its first event with, by a row of
            // its own inserted at once: `c`'s row is refused only at the batch's end.
            store.write_for(b, move |conn: &mut Conn| {
                take_seq(conn, c, 2)?;
                Ok::<_, Error>(())
            }),
            store.append(c, vec![renamed("second"), renamed("third")]),
        )
    })
    .await;
    one_batch(&store, before, 3);
    assert_eq!(first.unwrap()[0].seq, 2);
    taking.unwrap();
    assert!(second.is_err(), "{second:?}");
    let log = store.read_log(a, 0, 100).await.unwrap();
    assert_eq!(log.len(), 2);
    assert!(matches!(&log[1].event, DurableEvent::Renamed(r) if r.title == "first"));
    assert_eq!(store.last_seq(a).await.unwrap(), Some(2));
    assert_eq!(store.last_seq(c).await.unwrap(), Some(1), "not moved");
    // `a`'s next append goes on from its counter.
    assert_eq!(
        store.append(a, vec![renamed("next")]).await.unwrap()[0].seq,
        3
    );
}

/// Inserts a row of `session`'s log at `seq` at once, past the log's own numbering and
/// without moving its counter.
fn take_seq(
    connection: &mut keel_core::store::Conn,
    session: SessionId,
    seq: u64,
) -> diesel::QueryResult<usize> {
    diesel::sql_query(format!(
        "INSERT INTO event (session_id, seq, id, type, version, data, time) \
         VALUES ('{session}', {seq}, 'evt_taken', 'session.next.renamed', 1, \
         '{{\"title\": \"taken\"}}', 0)"
    ))
    .execute(connection)
}

/// A write that goes on past a statement the database refused, outside any savepoint of
/// its own (which the style forbids, but a write may do): on PostgreSQL that statement
/// ended the transaction, whose `COMMIT` then rolls back without an error. The other
/// writes of its batch are not lost for it: what each was told committed is in the log.
async fn a_write_going_on_past_a_failed_statement_loses_no_other_write(db: TestDb) {
    use keel_core::store::Conn;

    let store = one_writer(&db).await;
    let [a, b]: [SessionId; 2] = new_sessions(&store, 2).await.try_into().unwrap();
    let before = store.stats();
    let (a1, b1, going_on) = in_one_batch(&store, async {
        tokio::join!(
            store.append(a, vec![renamed("a1")]),
            // Reads the log and the counter, so that nothing gathered or kept is left to
            // write at the end (its refusal would have told).
            store.write_for(b, move |c: &mut Conn| {
                let appended = keel_core::event::log::append(c, T0, b, vec![renamed("b1")])?;
                keel_core::event::log::read(c, b, 0, 100)?;
                keel_core::event::log::last_seq(c, b)?;
                Ok::<_, Error>(appended)
            }),
            // Last, so that no later write meets the ended transaction.
            store.write_for(b, |c: &mut Conn| {
                let refused = diesel::sql_query("SELECT * FROM no_such_table").execute(c);
                Ok::<_, Error>(refused.is_err())
            }),
        )
    })
    .await;
    one_batch(&store, before, 3);
    // On PostgreSQL the write that went on fails (its savepoint cannot be released);
    // on SQLite the refused statement ended nothing, and it commits.
    if let Ok(refused) = going_on {
        assert!(refused);
    }
    for (session, appended) in [(a, a1), (b, b1)] {
        let appended = appended.unwrap();
        let log = store.read_log(session, 0, 100).await.unwrap();
        assert_eq!(log.last(), appended.last(), "{session}");
        assert_eq!(store.last_seq(session).await.unwrap(), Some(2));
    }
}

/// What a batch of writes for several sessions projects onto their own rows (a rename, a
/// switch of agent or model, a step's usage and cost; on PostgreSQL kept with the
/// counters until the write-back, see `event::counters`) is what a replay of their logs
/// projects, exactly: two steps' costs in one batch are added to the total one after the
/// other, as the replay adds them, and a change made in a savepoint rolled back is gone.
/// A read of the session's row in the batch sees what its writes changed, and the batch
/// runs once.
#[allow(clippy::float_cmp)] // The costs must be equal to the bit.
async fn a_batch_s_changes_to_its_sessions_rows_equal_a_replay_and_are_read_back_in_the_batch(
    db: TestDb,
) {
    use keel_core::event::{log, view};
    use keel_core::store::Conn;
    use keel_schema::types::ModelRef;

    let store = one_writer(&db).await;
    let [a, b, c]: [SessionId; 3] = new_sessions(&store, 3).await.try_into().unwrap();
    let switched_agent = |agent: &str| {
        DurableEvent::AgentSwitched(payload::AgentSwitched {
            agent: agent.into(),
        })
    };
    let switched_model = |id: &str| {
        DurableEvent::ModelSwitched(payload::ModelSwitched {
            model: ModelRef {
                provider: "other".into(),
                id: id.into(),
            },
        })
    };
    // `a` has cost 0.1 before the batch: 0.1 + 0.2 + 0.3 added in turn is not
    // 0.1 + (0.2 + 0.3).
    let [first, second, third, fourth] = [(); 4].map(|()| MessageId::new());
    store
        .append(a, vec![started(first), ended(first, 1, 0.1)])
        .await
        .unwrap();
    store.append(b, vec![started(second)]).await.unwrap();

    let append = |session: SessionId, events: Vec<DurableEvent>| {
        move |c: &mut Conn| log::append(c, T0, session, events.clone())
    };
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let before = store.stats();
    let (renamed_a, steps_a, read_b, kept_c) = in_one_batch(&store, async {
        let runs = runs.clone();
        let renames = append(
            a,
            vec![renamed("a1"), switched_agent("plan"), switched_model("m1")],
        );
        tokio::join!(
            store.write_for(a, move |conn: &mut Conn| {
                runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                renames(conn)
            }),
            store.write_for(
                a,
                append(
                    a,
                    vec![
                        started(third),
                        ended(third, 10, 0.2),
                        started(fourth),
                        ended(fourth, 100, 0.3),
                        renamed("a2"),
                    ]
                )
            ),
            // `b`'s step ends, and its row is read back in the same write.
            store.write_for(b, move |c: &mut Conn| {
                log::append(
                    c,
                    T0,
                    b,
                    vec![ended(second, 20, 0.3), switched_agent("review")],
                )?;
                let info = view::session_info(c, b)?.map(|info| info.agent);
                log::append(c, T0, b, vec![renamed("b1"), switched_model("m2")])?;
                let shown =
                    view::session(c, b)?.map(|s| (s.title, s.model.id, s.usage.input, s.cost));
                Ok::<_, Error>((info, shown))
            }),
            // `c` renamed in a savepoint rolled back, then outside it.
            store.write_for(c, move |c_conn: &mut Conn| {
                let undone = diesel::Connection::transaction::<(), Error, _>(c_conn, |conn| {
                    log::append(conn, T0, c, vec![renamed("undone")])?;
                    Err(diesel::result::Error::RollbackTransaction.into())
                });
                assert!(undone.is_err());
                log::append(c_conn, T0, c, vec![renamed("c1")])
            }),
        )
    })
    .await;
    one_batch(&store, before, 4);
    // Nothing made the batch run again (on PostgreSQL, with nothing kept).
    assert_eq!(runs.load(std::sync::atomic::Ordering::Relaxed), 1);
    renamed_a.unwrap();
    steps_a.unwrap();
    kept_c.unwrap();
    let (info, shown) = read_b.unwrap();
    assert_eq!(info.as_deref(), Some("review"), "session_info in the batch");
    assert_eq!(
        shown,
        Some((Some("b1".to_owned()), "m2".to_owned(), 20, 0.3)),
        "the session view in the batch"
    );

    let shown = |session: SessionId| {
        let store = store.clone();
        async move {
            store
                .read(move |c| view::session(c, session))
                .await
                .unwrap()
                .unwrap()
        }
    };
    let a_shown = shown(a).await;
    assert_eq!(
        (a_shown.title.as_deref(), a_shown.agent.as_str()),
        (Some("a2"), "plan")
    );
    assert_eq!(a_shown.model.id, "m1");
    assert_eq!(a_shown.usage.input, 111);
    assert_eq!(a_shown.cost, 0.1 + 0.2 + 0.3, "costs added in turn");
    assert_ne!(a_shown.cost, 0.1 + (0.2 + 0.3));
    assert_eq!(shown(c).await.title.as_deref(), Some("c1"));

    // Every row is what a replay of the log projects, to the last bit of the costs.
    for session in [a, b, c] {
        crate::lifecycle::assert_replay_projects_the_same_rows(&store, session).await;
    }
}

/// An import numbers its events in the table, not in what a batch keeps for several
/// sessions (see `event::counters`): a page imported in such a batch, after another
/// session's append there, projects each of its events onto the session's row as a
/// replay does.
async fn an_import_in_a_batch_for_several_sessions_projects_every_change_to_its_session(
    db: TestDb,
) {
    use keel_core::event::log;

    let source_db = TestDb::sqlite();
    let source = source_db.open().await;
    let imported = new_session(&source).await;
    source
        .append(imported, vec![renamed("imported")])
        .await
        .unwrap();
    let log = source.read_log(imported, 0, 100).await.unwrap();
    let (first, rest) = (log[..1].to_vec(), log[1..].to_vec());

    let store = one_writer(&db).await;
    let other = new_session(&store).await;
    store
        .write_for(imported, move |c| log::import(c, &first))
        .await
        .unwrap();
    let before = store.stats();
    let (appended, page) = in_one_batch(&store, async {
        tokio::join!(
            store.write_for(other, move |c| {
                log::append(c, T0, other, vec![renamed("other")])
            }),
            store.write_for(imported, move |c| log::import(c, &rest)),
        )
    })
    .await;
    one_batch(&store, before, 2);
    appended.unwrap();
    page.unwrap();
    assert_eq!(
        snapshot(&store, imported).await,
        snapshot(&source, imported).await
    );
}

/// Checks that the `writes` writes since `before` (the stats then, before the writer was
/// held) all ran in one batch, after the holding write's.
fn one_batch(store: &Store, before: (u64, u64), writes: u64) {
    let (batches, written) = store.stats();
    assert_eq!((batches - before.0, written - before.1), (2, writes + 1));
}

/// A store with one writer, so that every write goes to the same one.
pub(crate) async fn one_writer(db: &TestDb) -> Store {
    let options = keel_core::store::Options {
        pg_writers: 1,
        ..db.options()
    };
    Store::open(db.url.clone(), options).await.unwrap()
}

/// Runs `writes`, a future that submits its writes when first polled, as one batch of
/// `store`'s only writer: a write holds the writer until all of them are queued.
pub(crate) async fn in_one_batch<F: Future>(store: &Store, writes: F) -> F::Output {
    use std::sync::mpsc;
    use std::time::Duration;

    let (started, running) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let mut hold = std::pin::pin!(store.write(move |_| {
        let _ = started.send(());
        let _ = released
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(10));
        Ok::<_, Error>(())
    }));
    assert!(futures::poll!(&mut hold).is_pending());
    tokio::task::spawn_blocking(move || running.recv_timeout(Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("the holding write runs");
    let mut writes = std::pin::pin!(writes);
    assert!(futures::poll!(&mut writes).is_pending());
    release.send(()).unwrap();
    hold.await.unwrap();
    writes.await
}

/// A batch of one session's writes moves the session's counter in the table at its first
/// append and keeps it from there on PostgreSQL (`event::counters::adopt`): later appends
/// and the steps' usage wait for the batch's end, what reads the session's row in the
/// batch sees them, and the row committed is what a replay projects, update time
/// included. A savepoint's append before the first keeps nothing and runs nothing again.
async fn a_batch_of_one_session_s_writes_keeps_its_counter_from_its_first_append(db: TestDb) {
    use diesel::prelude::*;
    use keel_core::event::{log, view};
    use keel_core::store::Conn;
    use keel_core::store::schema::session;

    let store = db.open().await;
    let id = new_session(&store).await;
    // 0.1 + 0.2 + 0.3 added in turn is not 0.1 + (0.2 + 0.3).
    let first = MessageId::new();
    store
        .append(id, vec![started(first), ended(first, 1, 0.1)])
        .await
        .unwrap();
    let created_at = store.last_seq(id).await.unwrap().unwrap();
    let (second, third) = (MessageId::new(), MessageId::new());
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let (in_table, shown) = store
        .write_for(id, move |c: &mut Conn| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let raw = |c: &mut Conn| {
                session::table
                    .find(id.to_string())
                    .select((
                        session::last_seq,
                        session::usage_input,
                        session::time_updated,
                    ))
                    .get_result::<(i64, i64, i64)>(c)
                    .unwrap()
            };
            let undone = diesel::Connection::transaction::<(), Error, _>(c, |c| {
                log::append(c, T0 + 1, id, vec![renamed("undone")])?;
                Err(diesel::result::Error::RollbackTransaction.into())
            });
            assert!(undone.is_err());
            let mut in_table = Vec::new();
            // The first append: the counter moves in the table, its step's usage waits.
            log::append(c, T0 + 2, id, vec![started(second), ended(second, 10, 0.2)])?;
            in_table.push(raw(c));
            // What the step's boundary reads next needs nothing of that written.
            assert_eq!(view::session_info(c, id)?.unwrap().agent, "build");
            assert_eq!(raw(c), in_table[0], "the session's settings read alone");
            let read = view::session(c, id)?.map(|s| s.usage.input);
            assert_eq!(read, Some(11), "the session view in the batch");
            in_table.push(raw(c));
            log::append(c, T0 + 3, id, vec![renamed("x")])?;
            in_table.push(raw(c));
            log::append(c, T0 + 4, id, vec![started(third), ended(third, 100, 0.3)])?;
            in_table.push(raw(c));
            // An admission (its prompt and its request to run) appends in a savepoint of
            // its own: the kept counter is written back before it, and the batch need not
            // run again.
            let admission =
                keel_core::inbox::Admission::prompt(vec![keel_schema::types::Part::Text {
                    text: "steer".into(),
                }]);
            keel_core::inbox::admit(c, T0 + 5, id, admission).unwrap();
            in_table.push(raw(c));
            let shown = view::session(c, id)?.map(|s| (s.title, s.usage.input, s.cost));
            Ok::<_, Error>((in_table, shown))
        })
        .await
        .unwrap();
    assert_eq!(runs.load(std::sync::atomic::Ordering::Relaxed), 1);
    let seq = i64::try_from(created_at).unwrap();
    if matches!(db.url, keel_core::store::DbUrl::Postgres(_)) {
        assert_eq!(
            in_table,
            [
                (seq + 2, 1, T0 + 2),
                // Written back for the view at the time the table had.
                (seq + 2, 11, T0 + 2),
                (seq + 2, 11, T0 + 2),
                (seq + 2, 11, T0 + 2),
                (seq + 7, 111, T0 + 5),
            ],
            "kept from the first append"
        );
    } else {
        assert_eq!(
            in_table,
            [
                (seq + 2, 11, T0 + 2),
                (seq + 2, 11, T0 + 2),
                (seq + 3, 11, T0 + 3),
                (seq + 5, 111, T0 + 4),
                (seq + 7, 111, T0 + 5),
            ],
            "SQLite keeps nothing"
        );
    }
    assert_eq!(
        shown,
        Some((Some("x".to_owned()), 111, 0.1 + 0.2 + 0.3)),
        "the session view in the batch"
    );
    let row = store
        .read(move |c| {
            Ok::<_, Error>(
                session::table
                    .find(id.to_string())
                    .select((session::last_seq, session::time_updated, session::cost))
                    .get_result::<(i64, i64, f64)>(c)
                    .unwrap(),
            )
        })
        .await
        .unwrap();
    assert_eq!(row, (seq + 7, T0 + 5, 0.1 + 0.2 + 0.3));
    crate::lifecycle::assert_replay_projects_the_same_rows(&store, id).await;
}
