//! Inserting the log's rows: one statement per event, or gathered for the store's writer.
//!
//! An append's event insert is a statement of its own, and a statement costs SQLite and
//! diesel a good share of an append, and PostgreSQL a round trip. While the writer runs
//! a batch ([`gather`]), the rows its writes append wait here, on the writer's thread,
//! and go in together before the batch commits ([`flush`]): on PostgreSQL one statement
//! of arrays, on SQLite a statement per 500 rows.
//!
//! The rows are not in the table until then, so every read of `event` on a connection
//! that may be the writer's calls [`flush`] first ([`crate::event::log`]'s reads and
//! recovery's); a read elsewhere sees only committed rows anyway. The writer gathers
//! only when it runs a batch plainly: if the flush fails (a row the database refuses),
//! it rolls the batch back and runs it again inserting each row at once, so that the
//! write whose row is refused fails alone ([`crate::store`]'s writer).
//!
//! A write's own savepoint (a nested transaction) may be rolled back while the batch goes
//! on, which undoes what was inserted in it but not what waits here: a row appended
//! inside one goes in at once, and should gathered rows be flushed inside one (a read of
//! the log there), the batch cannot commit ([`doubt_gathered`]): the writer rolls it back
//! and runs it again gathering nothing.

use std::cell::RefCell;

use diesel::backend::Backend;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{Array, BigInt, HasSqlType, Integer, Text};
use diesel::{QueryResult, RunQueryDsl};

use crate::store::fixed::fixed_query;
use crate::store::{Conn, doubt_gathered, is_in_savepoint};

/// One row of `event`.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub session_id: String,
    pub seq: i64,
    pub id: String,
    pub type_name: &'static str,
    pub version: i32,
    pub data: String,
    pub time: i64,
}

/// The most rows one statement inserts: 3,500 binds, within both databases' limits.
const CHUNK: usize = 500;

thread_local! {
    /// The rows gathered on this thread, while it gathers.
    static GATHERED: RefCell<Option<Vec<Row>>> = const { RefCell::new(None) };
}

/// Until [`stop`], rows inserted on this thread wait for [`flush`]; drops any rows
/// gathered before (a batch rolled back and run again starts afresh).
pub(crate) fn gather() {
    GATHERED.with(|gathered| *gathered.borrow_mut() = Some(Vec::new()));
}

/// Whether this thread gathers rows: it runs a plain batch of the writer's, where only a
/// write's own savepoint or a rollback of the whole batch undoes a write.
pub(crate) fn gathering() -> bool {
    GATHERED.with(|gathered| gathered.borrow().is_some())
}

/// Inserts rows at once again on this thread, dropping any not flushed.
pub(crate) fn stop() {
    GATHERED.with(|gathered| *gathered.borrow_mut() = None);
}

/// Inserts `row`, or keeps it for [`flush`] while this thread gathers. A row appended
/// inside a savepoint goes in at once, so that rolling the savepoint back undoes it.
pub(crate) fn insert(connection: &mut Conn, row: Row) -> QueryResult<()> {
    if gathering() && !is_in_savepoint(connection)? {
        GATHERED.with(|gathered| {
            if let Some(rows) = gathered.borrow_mut().as_mut() {
                rows.push(row);
            }
        });
        return Ok(());
    }
    insert_one(connection, &row)
}

/// Inserts the rows gathered so far (nothing when this thread does not gather); this
/// thread goes on gathering.
pub(crate) fn flush(connection: &mut Conn) -> QueryResult<()> {
    flush_with(connection, insert_all)
}

/// [`flush`], the rows (none when this thread does not gather) inserted by `insert`.
pub(crate) fn flush_with(
    connection: &mut Conn,
    insert: impl FnOnce(&mut Conn, &[Row]) -> QueryResult<()>,
) -> QueryResult<()> {
    let rows = GATHERED.with(|gathered| gathered.borrow_mut().as_mut().map(std::mem::take));
    let rows = rows.unwrap_or_default();
    if !rows.is_empty() && is_in_savepoint(connection)? {
        // Rolling the savepoint back would undo these rows, and nothing here would know.
        doubt_gathered();
    }
    let inserted = insert(connection, &rows);
    if inserted.is_err() {
        // The rows are no longer kept here: should the write swallow the error (SQLite's
        // transaction goes on after a failed statement), the batch must not commit.
        doubt_gathered();
    }
    inserted
}

/// Inserts `rows`: on PostgreSQL by one statement of arrays, on SQLite a statement per
/// [`CHUNK`].
pub(crate) fn insert_all(connection: &mut Conn, rows: &[Row]) -> QueryResult<()> {
    if let Conn::Pg(c) = connection
        && rows.len() > 1
    {
        RowArrays::of(rows).execute(c)?;
        return Ok(());
    }
    for chunk in rows.chunks(CHUNK) {
        match chunk {
            [] => {}
            // One row goes through the fixed statement, prepared once and found by type.
            [row] => insert_one(connection, row)?,
            rows => {
                let insert = InsertRows { rows };
                match connection {
                    Conn::Sqlite(c) => insert.execute(c)?,
                    Conn::Pg(c) => insert.execute(c)?,
                };
            }
        }
    }
    Ok(())
}

fn insert_one(connection: &mut Conn, row: &Row) -> QueryResult<()> {
    InsertEvent {
        session_id: &row.session_id,
        seq: row.seq,
        id: &row.id,
        type_name: row.type_name,
        version: row.version,
        data: &row.data,
        time: row.time,
    }
    .execute(connection)?;
    Ok(())
}

fixed_query! {
    /// Inserts one row of the log.
    struct InsertEvent<'a> {
        session_id: &'a str,
        seq: i64,
        id: &'a str,
        type_name: &'a str,
        version: i32,
        data: &'a str,
        time: i64,
    }
    sql r#"INSERT INTO "event" ("session_id", "seq", "id", "type", "version", "data", "time") VALUES ("#
        {session_id: Text} ", " {seq: BigInt} ", " {id: Text} ", " {type_name: Text} ", "
        {version: Integer} ", " {data: Text} ", " {time: BigInt} ")"
}

/// Inserts several rows of the log in one statement (on SQLite). Its text depends on how
/// many, so diesel finds its prepared statement by the text.
struct InsertRows<'a> {
    rows: &'a [Row],
}

impl QueryId for InsertRows<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<DB> QueryFragment<DB> for InsertRows<'_>
where
    DB: Backend + HasSqlType<BigInt> + HasSqlType<Integer> + HasSqlType<Text>,
    i64: ToSql<BigInt, DB>,
    i32: ToSql<Integer, DB>,
    str: ToSql<Text, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql(
            r#"INSERT INTO "event" ("session_id", "seq", "id", "type", "version", "data", "time") VALUES "#,
        );
        for (n, row) in self.rows.iter().enumerate() {
            out.push_sql(if n == 0 { "(" } else { ", (" });
            out.push_bind_param::<Text, _>(row.session_id.as_str())?;
            out.push_sql(", ");
            out.push_bind_param::<BigInt, _>(&row.seq)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(row.id.as_str())?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(row.type_name)?;
            out.push_sql(", ");
            out.push_bind_param::<Integer, _>(&row.version)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(row.data.as_str())?;
            out.push_sql(", ");
            out.push_bind_param::<BigInt, _>(&row.time)?;
            out.push_sql(")");
        }
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for InsertRows<'_> {}

/// Rows of the log as a column of values each, which PostgreSQL inserts by `UNNEST`: one
/// statement whatever the number of rows, prepared once per connection, where a
/// multi-row `VALUES` is a statement of its own for every row count, parsed and planned
/// again at every use (diesel caches no statement whose text varies).
#[derive(Debug, Default)]
pub(crate) struct RowArrays<'a> {
    session_ids: Vec<&'a str>,
    seqs: Vec<i64>,
    ids: Vec<&'a str>,
    type_names: Vec<&'static str>,
    versions: Vec<i32>,
    data: Vec<&'a str>,
    times: Vec<i64>,
}

impl<'a> RowArrays<'a> {
    pub(crate) fn of(rows: &'a [Row]) -> Self {
        let mut arrays = Self::default();
        for row in rows {
            arrays.session_ids.push(&row.session_id);
            arrays.seqs.push(row.seq);
            arrays.ids.push(&row.id);
            arrays.type_names.push(row.type_name);
            arrays.versions.push(row.version);
            arrays.data.push(&row.data);
            arrays.times.push(row.time);
        }
        arrays
    }
}

impl QueryId for RowArrays<'_> {
    type QueryId = RowArrays<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl QueryFragment<Pg> for RowArrays<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            r#"INSERT INTO "event" ("session_id", "seq", "id", "type", "version", "data", "time") SELECT * FROM UNNEST("#,
        );
        out.push_bind_param::<Array<Text>, _>(&self.session_ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.seqs)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.ids)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.type_names)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Integer>, _>(&self.versions)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Text>, _>(&self.data)?;
        out.push_sql(", ");
        out.push_bind_param::<Array<BigInt>, _>(&self.times)?;
        out.push_sql(")");
        Ok(())
    }
}

impl<C> RunQueryDsl<C> for RowArrays<'_> {}
