//! Connections: one type for both backends, opened with Keel's settings.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::r2d2::ManageConnection;
use diesel::{Connection, PgConnection, SqliteConnection};

use super::{DbUrl, Error};

/// A connection to either backend. Queries written against it run on both.
#[derive(diesel::MultiConnection)]
pub enum Conn {
    Sqlite(SqliteConnection),
    Pg(PgConnection),
}

/// SQLite's `synchronous` pragma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    Normal,
    Full,
}

/// Everything needed to open a connection.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub url: DbUrl,
    pub synchronous: Synchronous,
    pub busy_timeout_ms: u32,
}

impl Settings {
    /// Opens a connection, choosing the backend from the URL so the user sees the real
    /// cause of a failure (diesel's generic establish hides it).
    pub fn establish(&self) -> Result<Conn, Error> {
        let failed = |message: String| Error::Connect {
            url: self.url.to_string(),
            message,
        };
        match &self.url {
            DbUrl::Sqlite(path) => {
                let text = path
                    .to_str()
                    .ok_or_else(|| failed("the path is not valid UTF-8".into()))?;
                let mut connection =
                    SqliteConnection::establish(text).map_err(|e| failed(e.to_string()))?;
                let synchronous = match self.synchronous {
                    Synchronous::Normal => "NORMAL",
                    Synchronous::Full => "FULL",
                };
                connection
                    .batch_execute(&format!(
                        "PRAGMA busy_timeout = {}; PRAGMA foreign_keys = ON; \
                         PRAGMA synchronous = {synchronous};",
                        self.busy_timeout_ms
                    ))
                    .map_err(|e| failed(format!("setting connection options: {e}")))?;
                Ok(Conn::Sqlite(connection))
            }
            DbUrl::Postgres(url) => {
                let mut connection = PgConnection::establish(url)
                    .map_err(|e| failed(e.to_string().trim_end().to_owned()))?;
                connection
                    .batch_execute(&format!(
                        "SET idle_in_transaction_session_timeout = '{}ms'",
                        PG_IDLE_IN_TRANSACTION.as_millis()
                    ))
                    .map_err(|e| failed(format!("setting connection options: {e}")))?;
                Ok(Conn::Pg(connection))
            }
        }
    }
}

/// How long PostgreSQL lets a transaction of Keel's sit idle before it ends the
/// connection. Keel's transactions run their statements back to back, so only a stalled
/// process (stopped, swapped out, cut off mid-transaction) leaves one idle; its row locks
/// would otherwise stop every other node's recovery of its sessions until it woke. Well
/// below the default lease, so its sessions can be taken over when the lease runs out.
pub(super) const PG_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// Switches a SQLite database to write-ahead logging (persistent, so once suffices).
///
/// Changing the journal mode needs the database to itself, and SQLite answers "database is
/// locked" at once rather than waiting, so a process opening a database another is opening
/// too retries for up to the busy timeout.
pub(super) fn enable_wal(
    connection: &mut Conn,
    url: &DbUrl,
    busy_timeout_ms: u32,
) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_millis(u64::from(busy_timeout_ms));
    loop {
        match connection.batch_execute("PRAGMA journal_mode = WAL;") {
            Ok(()) => return Ok(()),
            Err(e) if e.to_string().contains("locked") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                return Err(Error::Connect {
                    url: url.to_string(),
                    message: format!("enabling write-ahead logging: {e}"),
                });
            }
        }
    }
}

/// Opens pooled read connections with the same settings as the writer's.
#[derive(Debug)]
pub(super) struct Manager(pub Settings);

impl ManageConnection for Manager {
    type Connection = Conn;
    type Error = Error;

    fn connect(&self) -> Result<Conn, Error> {
        self.0.establish()
    }

    fn is_valid(&self, connection: &mut Conn) -> Result<(), Error> {
        connection.batch_execute("SELECT 1").map_err(Error::from)
    }

    fn has_broken(&self, connection: &mut Conn) -> bool {
        use diesel::connection::TransactionManager;
        <Conn as Connection>::TransactionManager::is_broken_transaction_manager(connection)
    }
}

/// Whether `connection` is inside a savepoint of its transaction (a write's own nested
/// transaction, in the writer's batch): what is done there may be rolled back while the
/// batch goes on, so what the writer's thread gathers for the batch's end must not be
/// done or kept there.
pub(crate) fn is_in_savepoint(connection: &mut Conn) -> diesel::QueryResult<bool> {
    Ok(transaction_depth(connection)?.is_some_and(|depth| depth.get() > 1))
}

/// How deep in transactions diesel's manager counts `connection` (`None`: in none).
pub(super) fn transaction_depth(
    connection: &mut Conn,
) -> diesel::QueryResult<Option<std::num::NonZeroU32>> {
    use diesel::connection::TransactionManager;
    <Conn as Connection>::TransactionManager::transaction_manager_status_mut(connection)
        .transaction_depth()
}

/// Loads at most `at_most` rows of `query`.
///
/// SQLite recompiles a statement at every use once its `LIMIT` is a bound parameter; it
/// steps rows only as they are read, so stopping early costs the same and keeps the
/// statement prepared. PostgreSQL gets the `LIMIT`, so it sends no more rows than asked.
pub(crate) fn load_at_most<'query, Q, U>(
    connection: &mut Conn,
    query: Q,
    at_most: usize,
) -> diesel::QueryResult<Vec<U>>
where
    U: 'static,
    Q: diesel::query_dsl::methods::LimitDsl
        + diesel::query_dsl::LoadQuery<'query, Conn, U>
        + 'query,
    diesel::dsl::Limit<Q>: diesel::query_dsl::LoadQuery<'query, Conn, U>,
{
    use diesel::RunQueryDsl;

    if matches!(connection, Conn::Sqlite(_)) {
        query
            .load_iter::<U, diesel::connection::DefaultLoadingMode>(connection)?
            .take(at_most)
            .collect()
    } else {
        query
            .limit(i64::try_from(at_most).unwrap_or(i64::MAX))
            .load(connection)
    }
}

/// Queries run on the backend's own connection.
///
/// Through [`Conn`] (diesel's `MultiConnection`), every query's SQL text is built again
/// at each run, to find its prepared statement by that text: about 16,000 instructions
/// a query on SQLite, a sixth of the store writer's work in a step. The backend's own
/// connection finds a query whose text never changes (any query without an `IN` list or
/// a boxed part) by its type, building nothing. These methods stand in for
/// [`diesel::RunQueryDsl`]'s on a `Conn`; fixed statements' `execute` does the same
/// ([`super::fixed::Execute`]).
pub(crate) trait Direct<'query>: Sized + 'query {
    /// [`diesel::RunQueryDsl::load`].
    fn load_direct<U>(self, connection: &mut Conn) -> diesel::QueryResult<Vec<U>>
    where
        Self: diesel::query_dsl::LoadQuery<'query, SqliteConnection, U>
            + diesel::query_dsl::LoadQuery<'query, PgConnection, U>,
    {
        use diesel::RunQueryDsl;
        match connection {
            Conn::Sqlite(c) => RunQueryDsl::<SqliteConnection>::load(self, c),
            Conn::Pg(c) => RunQueryDsl::<PgConnection>::load(self, c),
        }
    }

    /// [`diesel::RunQueryDsl::get_result`].
    fn get_direct<U>(self, connection: &mut Conn) -> diesel::QueryResult<U>
    where
        Self: diesel::query_dsl::LoadQuery<'query, SqliteConnection, U>
            + diesel::query_dsl::LoadQuery<'query, PgConnection, U>,
    {
        use diesel::RunQueryDsl;
        match connection {
            Conn::Sqlite(c) => RunQueryDsl::<SqliteConnection>::get_result(self, c),
            Conn::Pg(c) => RunQueryDsl::<PgConnection>::get_result(self, c),
        }
    }
}

impl<'query, T: 'query> Direct<'query> for T {}

/// `$body` with `$c` bound to the backend's own connection inside `$connection`: the
/// same as [`Direct`], for a query whose type names its backend (a selection by
/// `as_select`), which is built once for each.
macro_rules! on_backend {
    ($connection:expr, |$c:ident| $body:expr) => {
        match $connection {
            $crate::store::Conn::Sqlite($c) => $body,
            $crate::store::Conn::Pg($c) => $body,
        }
    };
}

pub(crate) use on_backend;
