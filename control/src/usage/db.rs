//! The seam between the usage logic and its two engines: SQL with `?N` placeholders and
//! a handful of value types, run in one transaction on SQLite (one connection) or on
//! PostgreSQL (a bounded pool of its own, `?N` written `$N`).
//!
//! The usage logic (intake, queries, reconcile, quotas) is written once against [`Sql`];
//! what differs between the engines is the schema (`store.rs`, `pg.rs`), advisory locks
//! (PostgreSQL runs batches side by side; SQLite runs one at a time), and how a failure
//! is told apart: a total that would pass `i64::MAX` is [`DbError::Overflow`] on both.

use std::collections::HashMap;
use std::error::Error as StdError;

use bytes::BytesMut;
use postgres::error::SqlState;
use postgres::types::{FromSql, IsNull, ToSql, Type};
use rusqlite::types::{ToSqlOutput, ValueRef};

/// A value bound to a placeholder or read from a column.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    /// SQL NULL.
    Null,
    /// A 64-bit integer (counts, times, flags as 0 and 1).
    Int(i64),
    /// Text.
    Text(String),
    /// Bytes.
    Blob(Vec<u8>),
    /// A float: only read, from a SQLite column an old version let overflow.
    Real(f64),
}

impl From<i64> for Val {
    fn from(n: i64) -> Val {
        Val::Int(n)
    }
}
impl From<u32> for Val {
    fn from(n: u32) -> Val {
        Val::Int(i64::from(n))
    }
}
impl From<bool> for Val {
    fn from(b: bool) -> Val {
        Val::Int(i64::from(b))
    }
}
impl From<&str> for Val {
    fn from(s: &str) -> Val {
        Val::Text(s.to_owned())
    }
}
impl From<&String> for Val {
    fn from(s: &String) -> Val {
        Val::Text(s.clone())
    }
}
impl From<String> for Val {
    fn from(s: String) -> Val {
        Val::Text(s)
    }
}
impl From<Vec<u8>> for Val {
    fn from(b: Vec<u8>) -> Val {
        Val::Blob(b)
    }
}
impl<T: Into<Val>> From<Option<T>> for Val {
    fn from(v: Option<T>) -> Val {
        v.map_or(Val::Null, Into::into)
    }
}

/// `n` as a column value: counts and times above `i64::MAX` are refused, never clamped.
pub(crate) fn int(n: u64) -> Result<Val, DbError> {
    i64::try_from(n).map(Val::Int).map_err(|_| DbError::Overflow)
}

/// `n` as SQL integer, refused above `i64::MAX`.
pub(crate) fn i64_of(n: u64) -> Result<i64, DbError> {
    i64::try_from(n).map_err(|_| DbError::Overflow)
}

/// Placeholder values: `params![a, b]` is `[Val::from(a), Val::from(b)]`.
macro_rules! vals {
    ($($v:expr),* $(,)?) => { [$($crate::usage::db::Val::from($v)),*] };
}
pub(crate) use vals;

/// One row read.
#[derive(Debug, Clone)]
pub(crate) struct DbRow(pub(crate) Vec<Val>);

impl DbRow {
    fn at(&self, i: usize) -> Result<&Val, DbError> {
        self.0.get(i).ok_or_else(|| DbError::Other(format!("no column {i}")))
    }

    /// Column `i`, an integer (NULL is an error).
    pub(crate) fn int(&self, i: usize) -> Result<i64, DbError> {
        self.opt_int(i)?.ok_or_else(|| DbError::Other(format!("column {i} is NULL")))
    }

    /// Column `i`, an integer or NULL.
    pub(crate) fn opt_int(&self, i: usize) -> Result<Option<i64>, DbError> {
        match self.at(i)? {
            Val::Int(n) => Ok(Some(*n)),
            Val::Null => Ok(None),
            v => Err(DbError::Other(format!("column {i} is not an integer: {v:?}"))),
        }
    }

    /// Column `i`, a count: an integer, negative ones read as 0.
    pub(crate) fn count(&self, i: usize) -> Result<u64, DbError> {
        Ok(self.int(i)?.max(0) as u64)
    }

    /// Column `i`, text.
    pub(crate) fn text(&self, i: usize) -> Result<String, DbError> {
        match self.at(i)? {
            Val::Text(s) => Ok(s.clone()),
            v => Err(DbError::Other(format!("column {i} is not text: {v:?}"))),
        }
    }

    /// Column `i`, text or NULL.
    pub(crate) fn opt_text(&self, i: usize) -> Result<Option<String>, DbError> {
        match self.at(i)? {
            Val::Null => Ok(None),
            _ => self.text(i).map(Some),
        }
    }

    /// Column `i`, bytes.
    pub(crate) fn blob(&self, i: usize) -> Result<Vec<u8>, DbError> {
        match self.at(i)? {
            Val::Blob(b) => Ok(b.clone()),
            v => Err(DbError::Other(format!("column {i} is not bytes: {v:?}"))),
        }
    }
}

/// A usage store failure.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLite failed.
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL failed.
    #[error("{}", pg_message(.0))]
    Postgres(#[from] postgres::Error),
    /// A count, time or total would pass `i64::MAX`: refused, never clamped or wrapped.
    #[error("a total would pass {}: refused (never clamped or wrapped)", i64::MAX)]
    Overflow,
    /// Something else: a connection not free in time, a column of the wrong type.
    #[error("{0}")]
    Other(String),
}

fn pg_message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("postgres: {} ({})", db.message(), db.code().code()),
        None => format!("postgres: {e}"),
    }
}

impl DbError {
    /// Whether the transaction may simply run again: PostgreSQL aborted it for a
    /// serialization failure or a deadlock (SQLSTATE 40001, 40P01).
    pub(crate) fn retryable(&self) -> bool {
        match self {
            DbError::Postgres(e) => {
                matches!(e.code(), Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED)
            }
            _ => false,
        }
    }

    fn of_sqlite(e: rusqlite::Error) -> DbError {
        // An upsert's sum past i64::MAX is written NULL (`add`), which the column refuses.
        match &e {
            rusqlite::Error::SqliteFailure(f, _) if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_NOTNULL => {
                DbError::Overflow
            }
            _ => DbError::Sqlite(e),
        }
    }

    fn of_postgres(e: postgres::Error) -> DbError {
        match e.code() {
            Some(c) if *c == SqlState::NOT_NULL_VIOLATION || *c == SqlState::NUMERIC_VALUE_OUT_OF_RANGE => {
                DbError::Overflow
            }
            _ => DbError::Postgres(e),
        }
    }
}

/// An error a transaction's body returns: made from a [`DbError`], and telling whether
/// the transaction may run again.
pub(crate) trait TxError: From<DbError> {
    fn retryable(&self) -> bool;
}

impl TxError for DbError {
    fn retryable(&self) -> bool {
        DbError::retryable(self)
    }
}

/// `col = table.col + excluded.col` in an upsert, checked: a sum past `i64::MAX` is
/// NULL, which the NOT NULL column refuses ([`DbError::Overflow`]) on both engines.
/// (SQLite would make it a float; PostgreSQL would fail with another code.)
pub(crate) fn add(table: &str, col: &str) -> String {
    format!(
        "{col} = CASE WHEN excluded.{col} <= 0 THEN {table}.{col} + excluded.{col} \
         WHEN {table}.{col} <= 9223372036854775807 - excluded.{col} THEN {table}.{col} + excluded.{col} END"
    )
}

/// Which engine runs the SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    Sqlite,
    Postgres,
}

/// An advisory lock held to the end of the transaction (PostgreSQL; SQLite runs one
/// transaction at a time and needs none).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lock<'a> {
    /// Applying windows (shared with other batches) against reconciling or storing a
    /// node's counters (exclusive): a reconcile sees every batch whole or not at all,
    /// and a window applied after it reopens the period.
    Periods { exclusive: bool },
    /// One node's windows: its checks of time order and numbering read what no other
    /// batch of the node is writing.
    Node(&'a str),
}

/// SQL run inside one transaction, on either engine.
pub(crate) trait Sql {
    /// The engine.
    fn engine(&self) -> Engine;
    /// Runs a statement; the rows it changed.
    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64, DbError>;
    /// Runs a query; its rows.
    fn rows(&mut self, sql: &str, params: &[Val]) -> Result<Vec<DbRow>, DbError>;
    /// Takes an advisory lock until the transaction ends.
    fn lock(&mut self, lock: Lock<'_>) -> Result<(), DbError>;

    /// The first row of a query, if any.
    fn row(&mut self, sql: &str, params: &[Val]) -> Result<Option<DbRow>, DbError> {
        Ok(self.rows(sql, params)?.into_iter().next())
    }
}

// ---- SQLite ----

impl rusqlite::ToSql for Val {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Val::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Val::Int(n) => ToSqlOutput::Borrowed(ValueRef::Integer(*n)),
            Val::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Val::Blob(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            Val::Real(f) => ToSqlOutput::Borrowed(ValueRef::Real(*f)),
        })
    }
}

fn sqlite_row(r: &rusqlite::Row<'_>, n: usize) -> rusqlite::Result<DbRow> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(match r.get_ref(i)? {
            ValueRef::Null => Val::Null,
            ValueRef::Integer(n) => Val::Int(n),
            ValueRef::Real(f) => Val::Real(f),
            ValueRef::Text(t) => Val::Text(String::from_utf8_lossy(t).into_owned()),
            ValueRef::Blob(b) => Val::Blob(b.to_vec()),
        });
    }
    Ok(DbRow(out))
}

/// A SQLite transaction.
pub(crate) struct SqliteTx<'a>(pub(crate) &'a rusqlite::Connection);

impl Sql for SqliteTx<'_> {
    fn engine(&self) -> Engine {
        Engine::Sqlite
    }

    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64, DbError> {
        let mut stmt = self.0.prepare_cached(sql).map_err(DbError::of_sqlite)?;
        let n = stmt.execute(rusqlite::params_from_iter(params.iter())).map_err(DbError::of_sqlite)?;
        Ok(n as u64)
    }

    fn rows(&mut self, sql: &str, params: &[Val]) -> Result<Vec<DbRow>, DbError> {
        let mut stmt = self.0.prepare_cached(sql).map_err(DbError::of_sqlite)?;
        let n = stmt.column_count();
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params.iter()), |r| sqlite_row(r, n))
            .map_err(DbError::of_sqlite)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().map_err(DbError::of_sqlite)
    }

    fn lock(&mut self, _: Lock<'_>) -> Result<(), DbError> {
        Ok(())
    }
}

// ---- PostgreSQL ----

type BoxError = Box<dyn StdError + Sync + Send>;

impl ToSql for Val {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
        match self {
            Val::Null => Ok(IsNull::Yes),
            Val::Int(n) if *ty == Type::INT8 => n.to_sql(ty, out),
            Val::Int(n) if *ty == Type::INT4 => i32::try_from(*n)?.to_sql(ty, out),
            Val::Int(n) if *ty == Type::INT2 => i16::try_from(*n)?.to_sql(ty, out),
            Val::Int(n) if *ty == Type::BOOL => (*n != 0).to_sql(ty, out),
            Val::Text(s) => s.as_str().to_sql(ty, out),
            Val::Blob(b) => b.as_slice().to_sql(ty, out),
            Val::Real(f) => f.to_sql(ty, out),
            Val::Int(_) => Err(format!("an integer bound to a parameter of type {ty}").into()),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    fn to_sql_checked(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
        self.to_sql(ty, out)
    }
}

impl<'a> FromSql<'a> for Val {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Val, BoxError> {
        if *ty == Type::INT8 {
            Ok(Val::Int(i64::from_sql(ty, raw)?))
        } else if *ty == Type::INT4 {
            Ok(Val::Int(i64::from(i32::from_sql(ty, raw)?)))
        } else if *ty == Type::INT2 {
            Ok(Val::Int(i64::from(i16::from_sql(ty, raw)?)))
        } else if *ty == Type::BOOL {
            Ok(Val::Int(i64::from(bool::from_sql(ty, raw)?)))
        } else if *ty == Type::BYTEA {
            Ok(Val::Blob(Vec::<u8>::from_sql(ty, raw)?))
        } else if <String as FromSql>::accepts(ty) {
            Ok(Val::Text(String::from_sql(ty, raw)?))
        } else {
            Err(format!("a column of type {ty} (cast it to BIGINT or TEXT)").into())
        }
    }

    fn from_sql_null(_: &Type) -> Result<Val, BoxError> {
        Ok(Val::Null)
    }

    fn accepts(_: &Type) -> bool {
        true
    }
}

/// `?N` placeholders written `$N`.
pub(crate) fn dollar(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

/// Prepared statements a connection keeps at most (they are by SQL text; a batch's
/// multi-row upserts come in a few sizes).
const STATEMENTS: usize = 256;

/// A PostgreSQL transaction with its connection's prepared statements.
pub(crate) struct PgTx<'a> {
    pub(crate) tx: postgres::Transaction<'a>,
    pub(crate) stmts: &'a mut HashMap<String, postgres::Statement>,
}

impl PgTx<'_> {
    fn statement(&mut self, sql: &str) -> Result<postgres::Statement, DbError> {
        if let Some(s) = self.stmts.get(sql) {
            return Ok(s.clone());
        }
        let s = self.tx.prepare(&dollar(sql)).map_err(DbError::of_postgres)?;
        if self.stmts.len() >= STATEMENTS {
            self.stmts.clear();
        }
        self.stmts.insert(sql.to_owned(), s.clone());
        Ok(s)
    }
}

fn pg_params(params: &[Val]) -> Vec<&(dyn ToSql + Sync)> {
    params.iter().map(|v| v as &(dyn ToSql + Sync)).collect()
}

impl Sql for PgTx<'_> {
    fn engine(&self) -> Engine {
        Engine::Postgres
    }

    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64, DbError> {
        let stmt = self.statement(sql)?;
        self.tx.execute(&stmt, &pg_params(params)).map_err(DbError::of_postgres)
    }

    fn rows(&mut self, sql: &str, params: &[Val]) -> Result<Vec<DbRow>, DbError> {
        let stmt = self.statement(sql)?;
        let rows = self.tx.query(&stmt, &pg_params(params)).map_err(DbError::of_postgres)?;
        rows.iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| r.try_get::<_, Val>(i).map_err(DbError::of_postgres))
                    .collect::<Result<Vec<_>, _>>()
                    .map(DbRow)
            })
            .collect()
    }

    fn lock(&mut self, lock: Lock<'_>) -> Result<(), DbError> {
        // Two-key advisory locks: class 0x7573 ("us") for the periods, 0x7574 for nodes.
        match lock {
            Lock::Periods { exclusive: true } => self.exec("SELECT pg_advisory_xact_lock(29043, 0)", &[]),
            Lock::Periods { exclusive: false } => self.exec("SELECT pg_advisory_xact_lock_shared(29043, 0)", &[]),
            Lock::Node(node) => self.exec("SELECT pg_advisory_xact_lock(29044, hashtext(?1))", &vals![node]),
        }
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_for_postgres() {
        assert_eq!(dollar("SELECT a FROM t WHERE b = ?1 AND c = ?12"), "SELECT a FROM t WHERE b = $1 AND c = $12");
        assert_eq!(dollar("SELECT '?' || ?2"), "SELECT '?' || $2");
    }

    #[test]
    fn a_count_past_i64_max_is_refused_not_clamped() {
        assert_eq!(int(7).ok(), Some(Val::Int(7)));
        assert!(matches!(int(u64::MAX), Err(DbError::Overflow)));
        assert!(matches!(i64_of(1 << 63), Err(DbError::Overflow)));
    }
}
