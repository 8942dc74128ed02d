//! Migrations: run once under a lock, refuse a newer schema, report bad locations clearly.

use diesel::RunQueryDsl;
use keel_core::store::{DbUrl, Error, Options, Store};

use crate::backend_tests;
use crate::lifecycle::{self, rows};
use crate::support::TestDb;

backend_tests!(
    concurrent_first_opens_migrate_once,
    a_populated_database_keeps_every_row_across_the_context_epoch_migration,
    a_database_from_a_newer_keel_is_refused_with_a_message_that_says_so,
);

async fn concurrent_first_opens_migrate_once(db: TestDb) {
    let (a, b) = tokio::join!(
        Store::open(db.url.clone(), db.options()),
        Store::open(db.url.clone(), db.options())
    );
    let (a, _b) = (a.unwrap(), b.unwrap());
    let applied: Vec<i64> = a
        .read(|c| {
            #[derive(diesel::QueryableByName)]
            struct Count {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                n: i64,
            }
            diesel::sql_query(
                "SELECT COUNT(*) AS n FROM __diesel_schema_migrations GROUP BY version",
            )
            .load::<Count>(c)
            .map(|rows| rows.into_iter().map(|r| r.n).collect())
            .map_err(Error::from)
        })
        .await
        .unwrap();
    assert!(!applied.is_empty());
    assert!(applied.iter().all(|&n| n == 1), "{applied:?}");
}

async fn a_database_from_a_newer_keel_is_refused_with_a_message_that_says_so(db: TestDb) {
    let store = db.open().await;
    store
        .write(|c| {
            diesel::sql_query(
                "INSERT INTO __diesel_schema_migrations (version) VALUES ('99991231000000')",
            )
            .execute(c)
            .map(|_| ())
            .map_err(Error::from)
        })
        .await
        .unwrap();
    drop(store);
    let err = Store::open(db.url.clone(), db.options()).await.unwrap_err();
    assert!(matches!(err, Error::NewerSchema { .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("migrated by a newer keel"), "{message}");
    assert!(message.contains("99991231000000"), "{message}");
    assert!(message.contains("upgrade keel"), "{message}");
}

/// The newest migration rebuilds `session_message` on SQLite (a CHECK cannot change in
/// place) under the rows `session_tool` references: taken back and run again on a
/// database with a whole session in it, every row is still there and still consistent.
async fn a_populated_database_keeps_every_row_across_the_context_epoch_migration(db: TestDb) {
    const VERSION: &str = "20261204000001";
    let down = match db.url {
        DbUrl::Sqlite(_) => {
            include_str!("../../migrations/sqlite/2026-12-04-000001_context_epoch_system/down.sql")
        }
        DbUrl::Postgres(_) => include_str!(
            "../../migrations/postgres/2026-12-04-000001_context_epoch_system/down.sql"
        ),
    };
    let store = db.open().await;
    let session = lifecycle::write(&store).await;
    let before = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    store
        .write(move |c| {
            use diesel::connection::SimpleConnection;
            c.batch_execute(down)?;
            diesel::sql_query(format!(
                "DELETE FROM __diesel_schema_migrations WHERE version = '{VERSION}'"
            ))
            .execute(c)?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    drop(store);

    let store = Store::open(db.url.clone(), db.options()).await.unwrap();
    let after = store
        .read(move |c| Ok::<_, Error>(rows(c, session)))
        .await
        .unwrap();
    // Taking the migration back drops what only it can hold: the message of role
    // `system` and the epoch's prompts.
    let kept = |rows: &lifecycle::Rows| -> Vec<_> {
        rows.messages
            .iter()
            .filter(|m| m.2 != "system")
            .cloned()
            .collect()
    };
    assert_eq!(kept(&after), kept(&before));
    assert_eq!(after.messages.len() + 1, before.messages.len());
    assert_eq!(after.tools, before.tools);
    assert_eq!(after.inputs, before.inputs);
    assert_eq!(after.requests, before.requests);
    assert_eq!(after.session, before.session);
    if let DbUrl::Sqlite(_) = db.url {
        #[derive(diesel::QueryableByName)]
        struct Violation {
            #[diesel(sql_type = diesel::sql_types::Text)]
            table: String,
        }
        let violations = store
            .read(|c| {
                diesel::sql_query("PRAGMA foreign_key_check")
                    .load::<Violation>(c)
                    .map_err(Error::from)
            })
            .await
            .unwrap();
        let tables: Vec<String> = violations.into_iter().map(|v| v.table).collect();
        assert!(tables.is_empty(), "{tables:?}");
    }
    // The rebuilt table takes the new role.
    store
        .append(
            session,
            vec![keel_schema::event::DurableEvent::ContextSystemUpdated(
                keel_schema::event::payload::ContextSystemUpdated {
                    message_id: keel_schema::id::MessageId::new(),
                    system: "again".into(),
                },
            )],
        )
        .await
        .unwrap();
}

#[test]
fn both_backends_have_the_same_migrations() {
    let names = |backend: &str| -> Vec<String> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(backend);
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert!(!names("sqlite").is_empty());
    assert_eq!(names("sqlite"), names("postgres"));
}

#[tokio::test]
async fn a_sqlite_file_in_a_missing_directory_is_refused_naming_the_path() {
    let url = DbUrl::Sqlite("/nonexistent-keel-dir/keel.db".into());
    let err = Store::open(url, Options::default()).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message
            .starts_with("could not open the database at sqlite:///nonexistent-keel-dir/keel.db"),
        "{message}"
    );
}

#[tokio::test]
async fn an_unreachable_postgres_server_is_refused_with_the_real_cause() {
    let url = DbUrl::Postgres("postgres://keel@127.0.0.1:1/keel".into());
    let err = Store::open(url, Options::default()).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("could not open the database at postgres://keel@127.0.0.1:1/keel"),
        "{message}"
    );
    assert!(message.contains("127.0.0.1"), "{message}");
}
