//! Migrations: run once under a lock, refuse a newer schema, report bad locations clearly.

use diesel::prelude::*;
use keel_core::store::{DbUrl, Error, Options, Store};
use keel_schema::id::OwnerId;

use crate::backend_tests;
use crate::lifecycle::{self, rows};
use crate::support::TestDb;

backend_tests!(
    concurrent_first_opens_migrate_once,
    a_populated_database_keeps_every_row_across_the_context_epoch_migration,
    a_database_from_a_newer_keel_is_refused_with_a_message_that_says_so,
    schema_rs_matches_the_migrated_database,
    a_populated_database_migrated_from_the_initial_schema_keeps_its_rows_and_its_constraints,
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

/// The context epoch migration rebuilds `session_message` on SQLite (a CHECK cannot change in
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

/// A table as `core/src/store/schema.rs` declares it, or as a database has it: its
/// primary key and its columns (name, type as diesel names it, nullable), sorted by name.
#[derive(Debug, PartialEq, Eq)]
struct Table {
    name: String,
    key: Vec<String>,
    columns: Vec<(String, String, bool)>,
}

/// The tables `schema.rs` declares, read from its `diesel::table!` blocks.
fn declared() -> Vec<Table> {
    let source = include_str!("../../src/store/schema.rs");
    let mut tables = Vec::new();
    for block in source.split("diesel::table! {").skip(1) {
        let mut lines = block.lines().map(str::trim).filter(|l| !l.is_empty());
        let head = lines.next().expect("a table name");
        let (name, rest) = head.split_once(' ').expect("`name (key) {`");
        let key = rest
            .trim_start_matches('(')
            .split_once(')')
            .expect("a primary key")
            .0
            .split(',')
            .map(|k| k.trim().to_owned())
            .collect();
        let mut columns = Vec::new();
        let mut sql_name = None;
        for line in lines {
            if line == "}" {
                break;
            }
            if let Some(named) = line.strip_prefix("#[sql_name = \"") {
                sql_name = Some(named.trim_end_matches("\"]").to_owned());
                continue;
            }
            let (column, ty) = line.split_once(" -> ").expect("`column -> Type,`");
            let ty = ty.trim_end_matches(',');
            let (ty, nullable) = match ty.strip_prefix("Nullable<") {
                Some(inner) => (inner.trim_end_matches('>'), true),
                None => (ty, false),
            };
            let column = sql_name.take().unwrap_or_else(|| column.to_owned());
            columns.push((column, ty.to_owned(), nullable));
        }
        columns.sort();
        tables.push(Table {
            name: name.to_owned(),
            key,
            columns,
        });
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    tables
}

/// The tables of the migrated database (without diesel's own), in the terms of
/// [`declared`]: a column type the declarations have no name for stays as the database
/// spells it, so it differs.
async fn migrated(store: &keel_core::store::Store, url: &DbUrl) -> Vec<Table> {
    use diesel::sql_types::{BigInt, Bool, Text};

    #[derive(diesel::QueryableByName)]
    struct Column {
        #[diesel(sql_type = Text)]
        table_name: String,
        #[diesel(sql_type = Text)]
        column_name: String,
        #[diesel(sql_type = Text)]
        data_type: String,
        #[diesel(sql_type = Bool)]
        nullable: bool,
        /// The column's place in the primary key from 1, or 0.
        #[diesel(sql_type = BigInt)]
        key: i64,
    }

    let query = match url {
        DbUrl::Sqlite(_) => {
            "SELECT m.name AS table_name, c.name AS column_name, c.type AS data_type, \
                    c.\"notnull\" = 0 AS nullable, c.pk AS key \
             FROM sqlite_master m, pragma_table_info(m.name) c \
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite\\_%' ESCAPE '\\' \
               AND m.name <> '__diesel_schema_migrations'"
        }
        DbUrl::Postgres(_) => {
            "SELECT c.table_name::text AS table_name, c.column_name::text AS column_name, \
                    c.data_type::text AS data_type, c.is_nullable = 'YES' AS nullable, \
                    COALESCE(k.ordinal_position, 0)::bigint AS key \
             FROM information_schema.columns c \
             LEFT JOIN information_schema.table_constraints t \
               ON t.table_schema = c.table_schema AND t.table_name = c.table_name \
              AND t.constraint_type = 'PRIMARY KEY' \
             LEFT JOIN information_schema.key_column_usage k \
               ON k.constraint_name = t.constraint_name AND k.table_schema = c.table_schema \
              AND k.table_name = c.table_name AND k.column_name = c.column_name \
             WHERE c.table_schema = 'public' AND c.table_name <> '__diesel_schema_migrations'"
        }
    };
    let rows = store
        .read(move |c| {
            diesel::sql_query(query)
                .load::<Column>(c)
                .map_err(Error::from)
        })
        .await
        .unwrap();
    let mut tables: Vec<Table> = Vec::new();
    let mut keys: Vec<(String, i64, String)> = Vec::new();
    for row in rows {
        let ty = match row.data_type.to_lowercase().as_str() {
            "text" => "Text",
            "bigint" => "BigInt",
            "integer" => "Integer",
            "boolean" => "Bool",
            "double precision" => "Double",
            _ => row.data_type.as_str(),
        }
        .to_owned();
        if row.key > 0 {
            keys.push((row.table_name.clone(), row.key, row.column_name.clone()));
        }
        let column = (row.column_name, ty, row.nullable);
        match tables.iter_mut().find(|t| t.name == row.table_name) {
            Some(table) => table.columns.push(column),
            None => tables.push(Table {
                name: row.table_name,
                key: Vec::new(),
                columns: vec![column],
            }),
        }
    }
    keys.sort();
    for (table, _, column) in keys {
        if let Some(table) = tables.iter_mut().find(|t| t.name == table) {
            table.key.push(column);
        }
    }
    for table in &mut tables {
        table.columns.sort();
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    tables
}

/// Every table, column, column type, nullability and primary key that `schema.rs`
/// declares is what the migrations built, and the migrations built nothing more.
async fn schema_rs_matches_the_migrated_database(db: TestDb) {
    let store = db.open().await;
    let declared = declared();
    assert!(declared.len() >= 9, "{declared:?}");
    assert_eq!(migrated(&store, &db.url).await, declared);
}

/// A database populated at the level of the initial migration (a whole session, a claim
/// and a node, written by Keel and then with every later migration taken back) is brought
/// up to date on open: every row is kept (what the later migrations add is filled in),
/// and the result has every NOT NULL, primary key and column `schema.rs` declares, the
/// phase CHECK, and unique keys.
async fn a_populated_database_migrated_from_the_initial_schema_keeps_its_rows_and_its_constraints(
    db: TestDb,
) {
    use keel_core::execution;
    use keel_core::store::schema::session_message;

    // Newest first: the order they are taken back in.
    const LATER: [&str; 6] = [
        "2026-12-05-000001_session_count",
        "2026-12-04-000003_tool_rerun",
        "2026-12-04-000002_permission_rule",
        "2026-12-04-000001_context_epoch_system",
        "2026-12-03-000002_session_request",
        "2026-12-03-000001_message_updated_seq",
    ];
    let backend = match db.url {
        DbUrl::Sqlite(_) => "sqlite",
        DbUrl::Postgres(_) => "postgres",
    };
    let store = db.open().await;
    let session = lifecycle::write(&store).await;
    let claimed = crate::support::new_session(&store).await;
    let clock = store.clock().clone();
    store
        .write(move |c| {
            execution::acquire(c, clock.now_ms(), 30_000, claimed, OwnerId::new())?;
            diesel::sql_query(
                "INSERT INTO node (owner_id, host, pid, started_at, heartbeat_at) \
                 VALUES ('own_1', 'host-a', 42, 1, 2)",
            )
            .execute(c)?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    let snapshot = |store: &Store| {
        let store = store.clone();
        async move {
            store
                .read(move |c| {
                    let claim = execution::get(c, claimed)?;
                    Ok::<_, Error>((rows(c, session), claim))
                })
                .await
                .unwrap()
        }
    };
    let (before, claim) = snapshot(&store).await;
    let log = store.read_log(session, 0, u32::MAX).await.unwrap();
    assert!(claim.is_some() && !before.requests.is_empty() && !before.epoch.is_empty());

    let migrations = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(backend);
    for name in LATER {
        let down = std::fs::read_to_string(migrations.join(name).join("down.sql")).unwrap();
        let version: String = name
            .split('_')
            .next()
            .unwrap()
            .chars()
            .filter(char::is_ascii_digit)
            .collect();
        store
            .write(move |c| {
                use diesel::connection::SimpleConnection;
                c.batch_execute(&down)?;
                let taken = diesel::sql_query(format!(
                    "DELETE FROM __diesel_schema_migrations WHERE version = '{version}'"
                ))
                .execute(c)?;
                assert_eq!(taken, 1, "{version} was applied");
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
    }
    drop(store);

    let store = Store::open(db.url.clone(), db.options()).await.unwrap();
    let (after, claim_after) = snapshot(&store).await;
    // The count of sessions not deleted starts from the sessions already there.
    let live = store
        .read(|c| {
            use keel_core::store::schema::session_count;
            session_count::table
                .select(session_count::live)
                .get_result::<i64>(c)
                .map_err(Error::from)
        })
        .await
        .unwrap();
    assert_eq!(live, 2);
    assert_eq!(store.read_log(session, 0, u32::MAX).await.unwrap(), log);
    assert_eq!(claim_after, claim);
    assert_eq!(after.session, before.session);
    assert_eq!(after.tools, before.tools);
    assert_eq!(after.inputs, before.inputs);
    // Messages other than the epoch's system prompt (which only the newest migration can
    // hold) are kept, each marked as written by the session's latest event.
    let kept: Vec<_> = before
        .messages
        .iter()
        .filter(|m| m.2 != "system")
        .cloned()
        .collect();
    assert_eq!(after.messages, kept);
    let last_seq = before.session[0].8;
    let updated: Vec<i64> = store
        .read(move |c| {
            session_message::table
                .filter(session_message::session_id.eq(session.to_string()))
                .select(session_message::updated_seq)
                .load(c)
                .map_err(Error::from)
        })
        .await
        .unwrap();
    assert_eq!(updated, vec![last_seq; kept.len()]);
    // Requests are rebuilt from the log, settled, without the reply they had; a
    // permission keeps its pattern, and an `always` answered before rules allowed the
    // whole tool, as it did then.
    let settled: Vec<_> = before
        .requests
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.5 = "settled".into();
            r.6 = None;
            if r.2 == "permission" {
                r.9 = Some("*".into());
            }
            r
        })
        .collect();
    assert_eq!(after.requests, settled);
    // The epoch is kept; its prompts were not known before, so they are empty.
    let epochs: Vec<_> = before
        .epoch
        .iter()
        .map(|&(epoch, baseline, _, _)| (epoch, baseline, String::new(), String::new()))
        .collect();
    assert_eq!(after.epoch, epochs);
    let nodes = store
        .read(|c| {
            #[derive(diesel::QueryableByName, Debug, PartialEq)]
            struct Node {
                #[diesel(sql_type = diesel::sql_types::Text)]
                owner_id: String,
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                pid: i64,
            }
            diesel::sql_query("SELECT owner_id, pid FROM node")
                .load::<Node>(c)
                .map(|nodes| {
                    nodes
                        .into_iter()
                        .map(|n| (n.owner_id, n.pid))
                        .collect::<Vec<_>>()
                })
                .map_err(Error::from)
        })
        .await
        .unwrap();
    assert_eq!(nodes, [("own_1".to_owned(), 42)]);

    // Every column, NOT NULL and primary key as declared.
    assert_eq!(migrated(&store, &db.url).await, declared());
    // The phase CHECK, a primary key and a NOT NULL still refuse what they must.
    let other = crate::support::new_session(&store).await;
    let refused = [
        format!(
            "INSERT INTO session_execution (id, session_id, owner_id, phase, time_created, \
             expires_at) VALUES ('exe_x', '{other}', 'own_x', 'dancing', 0, 1)"
        ),
        format!(
            "INSERT INTO event (session_id, seq, id, type, version, data, time) \
             VALUES ('{session}', 1, 'evt_again', 'session.next.created', 1, '{{}}', 0)"
        ),
        format!(
            "INSERT INTO session_message (id, session_id, seq, role, data, updated_seq) \
             VALUES ('msg_x', '{session}', 999, 'user', NULL, 0)"
        ),
    ];
    for statement in refused {
        let shown = statement.clone();
        let result = store
            .write(move |c| {
                diesel::sql_query(&statement)
                    .execute(c)
                    .map_err(Error::from)
            })
            .await;
        assert!(result.is_err(), "accepted: {shown}");
    }
}
