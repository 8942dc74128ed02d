//! Embedded migrations, run on open under a lock, refusing databases from a newer Keel.

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::{Connection, RunQueryDsl};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use super::{Conn, DbUrl, Error};

const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");
const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// The advisory lock PostgreSQL migrations hold ("keel" in ASCII).
const PG_MIGRATION_LOCK: i64 = 0x6b65_656c;

/// Brings the schema up to date, or refuses a newer one.
///
/// The whole check-and-migrate runs in one transaction that first takes an exclusive lock
/// (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: an advisory transaction lock), so a second
/// process opening the same new database waits, then finds nothing left to do.
pub(super) fn run(connection: &mut Conn, url: &DbUrl) -> Result<(), Error> {
    let failed = |message: String| Error::Migration {
        url: url.to_string(),
        message,
    };
    match connection {
        Conn::Sqlite(c) => AnsiTransactionManager::begin_transaction_sql(c, "BEGIN IMMEDIATE"),
        Conn::Pg(c) => AnsiTransactionManager::begin_transaction(c),
    }
    .map_err(|e| failed(format!("taking the migration lock: {e}")))?;

    let result = migrate_locked(connection, url);
    match result {
        Ok(()) => <Conn as Connection>::TransactionManager::commit_transaction(connection)
            .map_err(|e| failed(format!("committing: {e}"))),
        Err(e) => {
            if let Err(rollback) =
                <Conn as Connection>::TransactionManager::rollback_transaction(connection)
            {
                tracing::error!(%url, %rollback, "rolling back a failed migration failed");
            }
            Err(e)
        }
    }
}

fn migrate_locked(connection: &mut Conn, url: &DbUrl) -> Result<(), Error> {
    let failed = |message: String| Error::Migration {
        url: url.to_string(),
        message,
    };
    let migrations = match connection {
        Conn::Sqlite(_) => SQLITE,
        Conn::Pg(pg) => {
            diesel::sql_query(format!("SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK})"))
                .execute(pg)
                .map_err(|e| failed(format!("taking the migration lock: {e}")))?;
            POSTGRES
        }
    };
    let known: Vec<String> =
        diesel::migration::MigrationSource::<<Conn as Connection>::Backend>::migrations(
            &migrations,
        )
        .map_err(|e| failed(e.to_string()))?
        .iter()
        .map(|m| m.name().version().to_string())
        .collect();
    let applied = connection
        .applied_migrations()
        .map_err(|e| failed(format!("reading applied migrations: {e}")))?;
    if let Some(unknown) = applied
        .iter()
        .map(ToString::to_string)
        .filter(|v| !known.contains(v))
        .max()
    {
        return Err(Error::NewerSchema {
            url: url.to_string(),
            version: unknown,
            newest: known.iter().max().cloned().unwrap_or_default(),
        });
    }
    let ran = connection
        .run_pending_migrations(migrations)
        .map_err(|e| failed(e.to_string()))?;
    for version in ran {
        tracing::info!(%url, %version, "applied migration");
    }
    Ok(())
}
