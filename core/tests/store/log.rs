//! The event log: gapless seq, atomic appends, typed refusals that change nothing.

use std::collections::HashMap;

use diesel::RunQueryDsl;
use keel_core::store::{Error, Store};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{EventId, MessageId, SessionId};

use crate::backend_tests;
use crate::lifecycle::{Rows, rows};
use crate::support::{T0, TestDb, created, new_session, new_sessions};

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
