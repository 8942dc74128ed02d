//! Store benchmarks: durable events per second, and the raw driver's ceiling.
//!
//! Run through `cargo xtask bench`, which collects the `BENCH {json}` lines this prints.
//! Each figure is the median of several runs; the raw figures use the same driver and the
//! same durability settings in the same process, so Keel's figures can be read as a share
//! of them.

mod common;

use std::time::Instant;

use common::{Backend, Database, flags, median, option, report, runtime};
use diesel::backend::Backend as DieselBackend;
use diesel::connection::SimpleConnection;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Text};
use diesel::{Connection, PgConnection, QueryResult, RunQueryDsl, SqliteConnection};
use keel_core::store::{DbUrl, Synchronous};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::SessionId;
use keel_schema::types::ModelRef;
use serde_json::json;

struct Plan {
    runs: usize,
    single_events: usize,
    group_sessions: usize,
    group_events_per_session: usize,
}

fn created() -> DurableEvent {
    DurableEvent::Created(payload::Created {
        title: None,
        directory: "/bench".into(),
        agent: "build".into(),
        model: ModelRef {
            provider: "scripted".into(),
            id: "demo".into(),
        },
        metadata: None,
    })
}

fn renamed(n: usize) -> DurableEvent {
    DurableEvent::Renamed(payload::Renamed {
        title: format!("title {n}"),
    })
}

/// Events per second appending one event at a time, each awaited (one commit each).
async fn single(plan: &Plan, backend: Backend) -> f64 {
    let database = Database::new(backend);
    let store = database.open().await;
    let session = SessionId::new();
    store.append(session, vec![created()]).await.unwrap();
    let start = Instant::now();
    for n in 0..plan.single_events {
        store.append(session, vec![renamed(n)]).await.unwrap();
    }
    plan.single_events as f64 / start.elapsed().as_secs_f64()
}

/// Events per second with one task per session appending one event at a time, all at once:
/// the writer commits what is waiting together. Also returns the writes per transaction.
async fn group(plan: &Plan, backend: Backend) -> (f64, f64) {
    group_on_nodes(plan, backend, 1).await
}

/// [`group`] with the sessions shared round-robin among `nodes` stores opened on the same
/// database, each with its own writer and connection, as that many nodes have.
async fn group_on_nodes(plan: &Plan, backend: Backend, nodes: usize) -> (f64, f64) {
    let database = Database::new(backend);
    let mut stores = Vec::new();
    for _ in 0..nodes {
        stores.push(database.open().await);
    }
    let mut sessions = Vec::new();
    for n in 0..plan.group_sessions {
        let session = SessionId::new();
        let store = stores[n % nodes].clone();
        store.append(session, vec![created()]).await.unwrap();
        sessions.push((session, store));
    }
    let stats = |stores: &[keel_core::store::Store]| {
        stores
            .iter()
            .map(keel_core::store::Store::stats)
            .fold((0, 0), |(b, w), (sb, sw)| (b + sb, w + sw))
    };
    let (batches_before, writes_before) = stats(&stores);
    let per_session = plan.group_events_per_session;
    let start = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|(session, store)| {
            tokio::spawn(async move {
                for n in 0..per_session {
                    store.append(session, vec![renamed(n)]).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (batches, writes) = stats(&stores);
    let per_batch = (writes - writes_before) as f64 / (batches - batches_before) as f64;
    (
        (plan.group_sessions * per_session) as f64 / elapsed,
        per_batch,
    )
}

/// One row of the raw ceiling's log, as a query type that says its SQL never changes, so
/// the driver prepares it once per connection (as Keel's own statements are; diesel's
/// `sql_query` would be prepared again for every row).
struct RawInsert<'a> {
    session_id: &'a str,
    seq: i64,
    id: &'a str,
    data: &'a str,
}

impl QueryId for RawInsert<'_> {
    type QueryId = RawInsert<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<DB> QueryFragment<DB> for RawInsert<'_>
where
    DB: DieselBackend + HasSqlType<BigInt> + HasSqlType<Text>,
    i64: ToSql<BigInt, DB>,
    str: ToSql<Text, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql(RAW_INSERT);
        push_row(&mut out, (self.session_id, &self.seq, self.id), self.data)
    }
}

impl<C> RunQueryDsl<C> for RawInsert<'_> {}

/// The raw ceiling's insert, before its rows.
const RAW_INSERT: &str =
    "INSERT INTO event (session_id, seq, id, type, version, data, time) VALUES ";

/// Several rows of the raw ceiling's log in one statement (`INSERT … VALUES (…), (…)`):
/// the fewest statements, and on PostgreSQL the fewest round trips, the driver allows
/// for rows whose values it binds. Its SQL depends on the row count, so diesel caches
/// it by its text.
struct RawRows<'a> {
    rows: &'a [(String, i64, String)],
    data: &'a str,
}

impl QueryId for RawRows<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<DB> QueryFragment<DB> for RawRows<'_>
where
    DB: DieselBackend + HasSqlType<BigInt> + HasSqlType<Text>,
    i64: ToSql<BigInt, DB>,
    str: ToSql<Text, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql(RAW_INSERT);
        for (n, (session_id, seq, id)) in self.rows.iter().enumerate() {
            if n > 0 {
                out.push_sql(", ");
            }
            push_row(&mut out, (session_id, seq, id), self.data)?;
        }
        Ok(())
    }
}

/// One row's `(…)` of the raw ceiling's insert.
fn push_row<'b, DB>(
    out: &mut AstPass<'_, 'b, DB>,
    (session_id, seq, id): (&'b str, &'b i64, &'b str),
    data: &'b str,
) -> QueryResult<()>
where
    DB: DieselBackend + HasSqlType<BigInt> + HasSqlType<Text>,
    i64: ToSql<BigInt, DB>,
    str: ToSql<Text, DB>,
{
    out.push_sql("(");
    out.push_bind_param::<Text, _>(session_id)?;
    out.push_sql(", ");
    out.push_bind_param::<BigInt, _>(seq)?;
    out.push_sql(", ");
    out.push_bind_param::<Text, _>(id)?;
    out.push_sql(", 'session.next.renamed', 1, ");
    out.push_bind_param::<Text, _>(data)?;
    out.push_sql(", 0)");
    Ok(())
}

impl<C> RunQueryDsl<C> for RawRows<'_> {}

/// Inserts `$total` rows, `$per_commit` per transaction begun by `$begin` and
/// `$per_statement` per statement, the rows going round-robin to `$sessions` sessions'
/// logs, and returns rows per second. A macro, not a function: the two connection types
/// share no trait with both transaction methods.
macro_rules! insert_loop {
    ($connection:expr, $per_commit:expr, $per_statement:expr, $total:expr, $sessions:expr, $begin:ident) => {{
        let data = json!({"title": "title 1"}).to_string();
        let sessions: Vec<String> = (0..$sessions).map(|n| format!("ses_bench_{n:03}")).collect();
        let row_of = |row: usize| {
            (
                sessions[row % sessions.len()].clone(),
                i64::try_from(row / sessions.len() + 1).unwrap(),
                format!("evt_{row}"),
            )
        };
        let start = Instant::now();
        let mut row = 0usize;
        while row < $total {
            $connection
                .$begin::<_, diesel::result::Error, _>(|c| {
                    let end = (row + $per_commit).min($total);
                    while row < end {
                        let next = (row + $per_statement).min(end);
                        if next - row == 1 {
                            let (session_id, seq, id) = row_of(row);
                            RawInsert {
                                session_id: &session_id,
                                seq,
                                id: &id,
                                data: &data,
                            }
                            .execute(c)?;
                        } else {
                            let rows: Vec<_> = (row..next).map(row_of).collect();
                            RawRows { rows: &rows, data: &data }.execute(c)?;
                        }
                        row = next;
                    }
                    Ok(())
                })
                .unwrap();
        }
        $total as f64 / start.elapsed().as_secs_f64()
    }};
}

const RAW_TABLE: &str = "CREATE TABLE event (session_id TEXT NOT NULL, seq BIGINT NOT NULL, \
    id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, version INTEGER NOT NULL, data TEXT NOT NULL, \
    time BIGINT NOT NULL, PRIMARY KEY (session_id, seq));";

/// Rows per second inserted through the same diesel driver with Keel's settings and an
/// event-sized row, `per_commit` rows per transaction, spread over `sessions` sessions:
/// the ceiling for the same durability.
fn raw(
    backend: Backend,
    (per_commit, per_statement): (usize, usize),
    total: usize,
    sessions: usize,
) -> f64 {
    let database = Database::new(backend);
    match (&database.url, backend) {
        (DbUrl::Sqlite(path), Backend::Sqlite(synchronous)) => {
            let mut connection = SqliteConnection::establish(path.to_str().unwrap()).unwrap();
            let sync = match synchronous {
                Synchronous::Normal => "NORMAL",
                Synchronous::Full => "FULL",
            };
            connection
                .batch_execute(&format!(
                    "PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; \
                     PRAGMA busy_timeout = 5000; {RAW_TABLE}"
                ))
                .unwrap();
            insert_loop!(
                connection,
                per_commit,
                per_statement,
                total,
                sessions,
                immediate_transaction
            )
        }
        (DbUrl::Postgres(url), _) => {
            let mut connection = PgConnection::establish(url).unwrap();
            connection.batch_execute(RAW_TABLE).unwrap();
            insert_loop!(
                connection,
                per_commit,
                per_statement,
                total,
                sessions,
                transaction
            )
        }
        _ => unreachable!("a database is made for its own backend"),
    }
}

fn main() {
    let (quick, postgres) = flags();
    let plan = if quick {
        Plan {
            runs: 3,
            single_events: 200,
            group_sessions: 64,
            group_events_per_session: 20,
        }
    } else {
        Plan {
            runs: 5,
            single_events: 1_000,
            group_sessions: 64,
            group_events_per_session: 50,
        }
    };
    let runtime = runtime();
    let group_total = plan.group_sessions * plan.group_events_per_session;
    let runs = plan.runs;
    // `--only group` measures group commit alone, for profiling it.
    let group_only = match option("--only").as_deref() {
        None => false,
        Some("group") => true,
        Some(other) => panic!("--only takes group, not `{other}`"),
    };
    for backend in Backend::chosen(postgres) {
        if group_only {
            let rates: Vec<f64> = (0..runs)
                .map(|_| runtime.block_on(group(&plan, backend)).0)
                .collect();
            let sessions = plan.group_sessions;
            report(
                &format!("append, group commit across {sessions} sessions"),
                median(&rates),
                "events/s",
                backend,
                runs,
                "",
            );
            continue;
        }
        let singles: Vec<f64> = (0..runs)
            .map(|_| runtime.block_on(single(&plan, backend)))
            .collect();
        let single_rate = median(&singles);
        report(
            "append, one event per commit",
            single_rate,
            "events/s",
            backend,
            runs,
            "",
        );

        let groups: Vec<(f64, f64)> = (0..runs)
            .map(|_| runtime.block_on(group(&plan, backend)))
            .collect();
        let group_rate = median(&groups.iter().map(|g| g.0).collect::<Vec<_>>());
        let per_batch = median(&groups.iter().map(|g| g.1).collect::<Vec<_>>());
        let sessions = plan.group_sessions;
        report(
            &format!("append, group commit across {sessions} sessions"),
            group_rate,
            "events/s",
            backend,
            runs,
            "",
        );
        report(
            "group commit, writes per transaction",
            per_batch,
            "writes",
            backend,
            runs,
            "",
        );

        let raw_single = median(
            &(0..runs)
                .map(|_| raw(backend, (1, 1), plan.single_events, 1))
                .collect::<Vec<_>>(),
        );
        report(
            "raw insert, one per commit",
            raw_single,
            "rows/s",
            backend,
            runs,
            "",
        );
        // The ceiling for group commit writes what it writes: rows of 64 sessions' logs,
        // each insert into its own session's part of the key. Rows of one session (all at
        // the key's end, so a commit touches a few pages) are measured too, as the easier
        // ceiling the figures were first compared with.
        let raw_group = median(
            &(0..runs)
                .map(|_| raw(backend, (sessions, 1), group_total, sessions))
                .collect::<Vec<_>>(),
        );
        report(
            &format!("raw insert, {sessions} per commit, {sessions} sessions' logs"),
            raw_group,
            "rows/s",
            backend,
            runs,
            "",
        );
        let raw_one_log = median(
            &(0..runs)
                .map(|_| raw(backend, (sessions, 1), group_total, 1))
                .collect::<Vec<_>>(),
        );
        report(
            &format!("raw insert, {sessions} per commit, one session's log"),
            raw_one_log,
            "rows/s",
            backend,
            runs,
            "",
        );
        report(
            "single append / raw one-per-commit ceiling",
            100.0 * single_rate / raw_single,
            "%",
            backend,
            runs,
            "",
        );
        report(
            "group commit / raw batched ceiling",
            100.0 * group_rate / raw_group,
            "%",
            backend,
            runs,
            "",
        );
        report(
            "group commit / raw batched, one session's log",
            100.0 * group_rate / raw_one_log,
            "%",
            backend,
            runs,
            "",
        );
        // The same rows, a commit's worth in one statement: the ceiling for a store that
        // would batch its statements (on PostgreSQL, one round trip instead of 64).
        let raw_rows = median(
            &(0..runs)
                .map(|_| raw(backend, (sessions, sessions), group_total, sessions))
                .collect::<Vec<_>>(),
        );
        report(
            &format!(
                "raw insert, {sessions} per commit in one statement, {sessions} sessions' logs"
            ),
            raw_rows,
            "rows/s",
            backend,
            runs,
            "",
        );
        report(
            "group commit / raw multi-row ceiling",
            100.0 * group_rate / raw_rows,
            "%",
            backend,
            runs,
            "",
        );
        // Several nodes share a PostgreSQL database: each has its writer and connection.
        if backend == Backend::Postgres {
            for nodes in [2, 3] {
                let rates: Vec<f64> = (0..runs)
                    .map(|_| runtime.block_on(group_on_nodes(&plan, backend, nodes)).0)
                    .collect();
                report(
                    &format!("append, group commit across {sessions} sessions, {nodes} nodes"),
                    median(&rates),
                    "events/s",
                    backend,
                    runs,
                    "",
                );
            }
        }
    }
}
