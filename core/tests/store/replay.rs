//! Replay: a session's log rebuilds its projections exactly.

use keel_core::event::replay;
use keel_core::store::Error;

use crate::backend_tests;
use crate::lifecycle::{self, rows};
use crate::support::TestDb;

backend_tests!(replaying_a_full_prompt_lifecycle_into_a_fresh_database_reproduces_every_row);

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
