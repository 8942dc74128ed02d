//! Statements whose SQL text never changes, declared as their own query types.
//!
//! diesel caches a prepared statement by its query type only when that type says its SQL
//! is always the same. The `UPDATE`s it builds are never cached (they are prepared again
//! at every use), and the `INSERT`s it builds are cached by their SQL text, which is
//! rebuilt at every use to look the statement up. The hot writes (the seq counter, the
//! event insert, the projections, the fence) are therefore declared with
//! [`fixed_query!`], which makes a query type whose identity is its type: prepared once
//! per connection, looked up without building any text.
//!
//! ```text
//! fixed_query! {
//!     /// `UPDATE session SET title = ? WHERE id = ?`
//!     struct SetTitle<'a> { title: Option<&'a str>, id: &'a str }
//!     sql r#"UPDATE "session" SET "title" = "# {title: Nullable<Text>}
//!         r#" WHERE "id" = "# {id: Text}
//! }
//! ```
//!
//! The SQL is a run of string literals and `{field: SqlType}` binds, in order. Identifiers
//! are quoted, so the same text runs on SQLite and PostgreSQL. A statement that returns
//! rows says `returns SqlType;` before `sql`, and is then a [`diesel::query_builder::Query`]
//! (for `get_result`/`load`); one that does not is run with `execute`.

/// Declares a fixed statement; see the [module documentation](self).
macro_rules! fixed_query {
    // With fields borrowed for `'a`: the type's identity is its `'static` instance.
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident<'a> { $($field:ident : $ty:ty),* $(,)? }
        $(returns $returns:ty;)?
        sql $($piece:tt)+
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        $vis struct $name<'a> { $($vis $field: $ty),* }

        impl diesel::query_builder::QueryId for $name<'_> {
            type QueryId = $name<'static>;
            const HAS_STATIC_QUERY_ID: bool = true;
        }

        $crate::store::fixed::fixed_query!(@fragments [$name<'_>] $($piece)+);
        $crate::store::fixed::fixed_query!(@execute [$name<'_>]);

        $(
            impl diesel::query_builder::Query for $name<'_> {
                type SqlType = $returns;
            }
        )?

        impl<C> diesel::RunQueryDsl<C> for $name<'_> {}
    };
    // Without fields.
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident;
        $(returns $returns:ty;)?
        sql $($piece:literal)+
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        $vis struct $name;

        impl diesel::query_builder::QueryId for $name {
            type QueryId = $name;
            const HAS_STATIC_QUERY_ID: bool = true;
        }

        $crate::store::fixed::fixed_query!(@fragments [$name] $($piece)+);
        $crate::store::fixed::fixed_query!(@execute [$name]);

        $(
            impl diesel::query_builder::Query for $name {
                type SqlType = $returns;
            }
        )?

        impl<C> diesel::RunQueryDsl<C> for $name {}
    };
    // The SQL and binds, for `Conn`'s backend and for each backend's own connection.
    (@fragments [$($target:tt)+] $($piece:tt)+) => {
        $crate::store::fixed::fixed_query!(@fragment
            [<$crate::store::Conn as diesel::Connection>::Backend] [$($target)+] $($piece)+);
        $crate::store::fixed::fixed_query!(@fragment
            [diesel::sqlite::Sqlite] [$($target)+] $($piece)+);
        $crate::store::fixed::fixed_query!(@fragment [diesel::pg::Pg] [$($target)+] $($piece)+);
    };
    (@fragment [$backend:ty] [$($target:tt)+] $($piece:tt)+) => {
        impl diesel::query_builder::QueryFragment<$backend> for $($target)+ {
            fn walk_ast<'b>(
                &'b self,
                mut out: diesel::query_builder::AstPass<'_, 'b, $backend>,
            ) -> diesel::QueryResult<()> {
                $($crate::store::fixed::fixed_query!(@piece self out $piece);)+
                Ok(())
            }
        }
    };
    // `execute` on the backend's own connection: `Conn`'s would walk the binds twice.
    (@execute [$($target:tt)+]) => {
        impl $crate::store::fixed::Execute for $($target)+ {
            fn execute_on(self, connection: &mut $crate::store::Conn) -> diesel::QueryResult<usize> {
                match connection {
                    $crate::store::Conn::Sqlite(c) => diesel::RunQueryDsl::execute(self, c),
                    $crate::store::Conn::Pg(c) => diesel::RunQueryDsl::execute(self, c),
                }
            }
        }

        impl $($target)+ {
            /// Runs the statement; returns how many rows it changed.
            #[allow(dead_code)] // Statements that return rows are loaded instead.
            pub(crate) fn execute(
                self,
                connection: &mut $crate::store::Conn,
            ) -> diesel::QueryResult<usize> {
                $crate::store::fixed::Execute::execute_on(self, connection)
            }
        }
    };
    (@piece $self:ident $out:ident $text:literal) => {
        $out.push_sql($text);
    };
    (@piece $self:ident $out:ident { $field:ident : $sql_type:ty }) => {
        $out.push_bind_param::<$sql_type, _>(&$self.$field)?;
    };
}

pub(crate) use fixed_query;

/// A fixed statement that returns no rows, run on the backend's own connection.
///
/// Through [`Conn`](crate::store::Conn) (diesel's `MultiConnection`), every statement's
/// binds are collected once for the connection type and again for the backend; a fixed
/// statement knows its SQL for each backend, so it goes straight to the backend's
/// connection. Its inherent `execute` calls this, so `statement.execute(connection)`
/// reads as diesel's.
pub(crate) trait Execute {
    fn execute_on(self, connection: &mut crate::store::Conn) -> diesel::QueryResult<usize>;
}
