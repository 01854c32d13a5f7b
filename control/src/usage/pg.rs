//! The usage store on PostgreSQL: its schema, a bounded pool of connections of its own,
//! and the monthly partitions of per-minute rows (13 months kept).
//!
//! The pool is a few lines over `postgres::Client` rather than `r2d2_postgres`: the store
//! needs a fixed bound, a wait bounded in time, and a broken connection replaced — not
//! r2d2's background thread pool and its extra dependencies.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use postern_model::usage::{LATENCY_BUCKETS, month_period, parse_month};

use super::db::{DbError, PgTx, Sql, vals};

/// Connections the store opens at most for writing: intake batches and reconciles run
/// side by side up to this many.
pub(crate) const POOL_SIZE: usize = 8;

/// Connections kept for reading (the usage API's queries, totals, flags), so a read never
/// waits behind a full pool of intake batches.
pub(crate) const READ_POOL_SIZE: usize = 2;

/// How long a caller waits for a free connection before the store answers unavailable.
const POOL_WAIT: Duration = Duration::from_secs(30);

/// Months of per-minute rows kept: the current month and the 12 before it.
pub const MINUTE_MONTHS: u64 = 13;

/// A connection and its prepared statements.
pub(crate) struct PgConn {
    client: postgres::Client,
    stmts: HashMap<String, postgres::Statement>,
}

struct PoolState {
    idle: Vec<PgConn>,
    open: usize,
}

/// A bounded pool of connections.
pub(crate) struct Pool {
    config: postgres::Config,
    size: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
    /// The months whose partition of `minutes` exists.
    months: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").finish_non_exhaustive()
    }
}

/// A connection taken from the pool, given back when dropped.
pub(crate) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<PgConn>,
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        let mut st = self.pool.state.lock().unwrap_or_else(|p| p.into_inner());
        match self.conn.take() {
            Some(c) if !c.client.is_closed() => st.idle.push(c),
            _ => st.open = st.open.saturating_sub(1),
        }
        self.pool.freed.notify_one();
    }
}

impl Pool {
    /// A pool for `url`, checked by opening one connection.
    pub(crate) fn new(url: &str, size: usize) -> anyhow::Result<Pool> {
        let mut config: postgres::Config = url.parse().map_err(|e| anyhow::anyhow!("usage store {url}: {e}"))?;
        config.connect_timeout(Duration::from_secs(10));
        let pool = Pool {
            config,
            size,
            state: Mutex::new(PoolState { idle: Vec::new(), open: 0 }),
            freed: Condvar::new(),
            months: Mutex::new(BTreeSet::new()),
        };
        drop(pool.get().map_err(|e| anyhow::anyhow!("usage store: {e}"))?);
        Ok(pool)
    }

    fn connect(&self) -> Result<PgConn, DbError> {
        let mut client = self.config.connect(postgres::NoTls)?;
        // Bounded in time: no statement holds a connection (and its locks) for long.
        client.batch_execute("SET statement_timeout = '60s'; SET lock_timeout = '30s'")?;
        Ok(PgConn { client, stmts: HashMap::new() })
    }

    /// A free connection, waiting at most [`POOL_WAIT`] for one.
    pub(crate) fn get(&self) -> Result<Pooled<'_>, DbError> {
        let deadline = Instant::now() + POOL_WAIT;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(c) = st.idle.pop() {
                if c.client.is_closed() {
                    st.open = st.open.saturating_sub(1);
                    continue;
                }
                return Ok(Pooled { pool: self, conn: Some(c) });
            }
            if st.open < self.size {
                st.open += 1;
                drop(st);
                return match self.connect() {
                    Ok(c) => Ok(Pooled { pool: self, conn: Some(c) }),
                    Err(e) => {
                        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                        st.open = st.open.saturating_sub(1);
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DbError::Other(format!(
                    "no PostgreSQL connection free within {} s ({} in use)",
                    POOL_WAIT.as_secs(),
                    self.size
                )));
            }
            st = self.freed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Runs `f` in one transaction, committed if it returns `Ok`; a transaction
    /// PostgreSQL aborted for a serialization failure or deadlock runs again (a few
    /// times).
    pub(crate) fn tx<T, E: super::db::TxError>(&self, mut f: impl FnMut(&mut dyn Sql) -> Result<T, E>) -> Result<T, E> {
        const ATTEMPTS: usize = 5;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut pooled = self.get()?;
            let Some(PgConn { client, stmts }) = pooled.conn.as_mut() else {
                return Err(DbError::Other("a pooled connection without its client".into()).into());
            };
            let tx = client.transaction().map_err(DbError::from)?;
            let mut pg = PgTx { tx, stmts };
            let result = f(&mut pg);
            let result = match result {
                Ok(v) => pg.tx.commit().map_err(|e| E::from(DbError::from(e))).map(|()| v),
                Err(e) => Err(e),
            };
            match result {
                Err(e) if e.retryable() && attempt < ATTEMPTS => {
                    std::thread::sleep(Duration::from_millis(5 * attempt as u64));
                }
                r => return r,
            }
        }
    }

    /// Runs statements outside a transaction (the schema, partitions).
    fn batch(&self, sql: &str) -> Result<(), DbError> {
        let mut pooled = self.get()?;
        let Some(c) = pooled.conn.as_mut() else { return Err(DbError::Other("no client".into())) };
        c.client.batch_execute(sql)?;
        Ok(())
    }

    /// Creates the schema (if missing) and drops partitions of per-minute rows older than
    /// [`MINUTE_MONTHS`] at `now`.
    pub(crate) fn migrate(&self, now: u64) -> anyhow::Result<()> {
        let hist_decl = (0..LATENCY_BUCKETS).map(|i| format!("h{i} BIGINT NOT NULL")).collect::<Vec<_>>().join(", ");
        let schema = format!(
            "CREATE TABLE IF NOT EXISTS applied (
                node TEXT NOT NULL, seq BIGINT NOT NULL, part BIGINT NOT NULL, parts BIGINT NOT NULL,
                start BIGINT NOT NULL, recovered BIGINT NOT NULL, calls BIGINT NOT NULL, received BIGINT NOT NULL,
                raw BYTEA NOT NULL, PRIMARY KEY (node, seq, part));
             CREATE INDEX IF NOT EXISTS applied_by_start ON applied (start, node);
             CREATE TABLE IF NOT EXISTS totals (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, period TEXT NOT NULL,
                billable BIGINT NOT NULL, s1 BIGINT NOT NULL, s2 BIGINT NOT NULL, s3 BIGINT NOT NULL,
                s4 BIGINT NOT NULL, s5 BIGINT NOT NULL, overshoot BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (caller, kind, product, period));
             CREATE INDEX IF NOT EXISTS totals_by_period ON totals (period);
             CREATE TABLE IF NOT EXISTS minutes (
                caller TEXT NOT NULL, kind TEXT NOT NULL, route TEXT NOT NULL, product TEXT NOT NULL,
                minute BIGINT NOT NULL,
                s1 BIGINT NOT NULL, s2 BIGINT NOT NULL, s3 BIGINT NOT NULL, s4 BIGINT NOT NULL,
                s5 BIGINT NOT NULL, latency_us BIGINT NOT NULL, {hist_decl},
                PRIMARY KEY (caller, kind, route, product, minute)) PARTITION BY RANGE (minute);
             CREATE INDEX IF NOT EXISTS minutes_by_time ON minutes (minute, route);
             CREATE TABLE IF NOT EXISTS contiguous (node TEXT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS periods (period TEXT NOT NULL PRIMARY KEY, final_at BIGINT, late BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS duplicates (node TEXT NOT NULL PRIMARY KEY, windows BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS quota_use (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start BIGINT NOT NULL, period_end BIGINT NOT NULL, used BIGINT NOT NULL,
                PRIMARY KEY (caller, kind, product, period_start));
             CREATE TABLE IF NOT EXISTS quota_events (
                id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, at BIGINT NOT NULL,
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start BIGINT NOT NULL, period_end BIGINT NOT NULL, percent BIGINT NOT NULL,
                used BIGINT NOT NULL, quota BIGINT NOT NULL, mode TEXT NOT NULL,
                delivered BIGINT NOT NULL DEFAULT 0, attempts BIGINT NOT NULL DEFAULT 0,
                next_try BIGINT NOT NULL DEFAULT 0,
                UNIQUE (caller, kind, product, period_start, percent));
             CREATE TABLE IF NOT EXISTS over_quota (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, until BIGINT NOT NULL,
                quota BIGINT NOT NULL, period_s BIGINT NOT NULL, since BIGINT NOT NULL,
                PRIMARY KEY (caller, kind, product, until));
             CREATE TABLE IF NOT EXISTS node_counters (
                node TEXT NOT NULL, period TEXT NOT NULL, through BIGINT NOT NULL, calls BIGINT NOT NULL,
                received BIGINT NOT NULL, raw BYTEA NOT NULL, PRIMARY KEY (node, period));
             CREATE TABLE IF NOT EXISTS corrections (
                node TEXT NOT NULL, period TEXT NOT NULL, caller TEXT NOT NULL, kind TEXT NOT NULL,
                product TEXT NOT NULL, s1 BIGINT NOT NULL, s2 BIGINT NOT NULL, s3 BIGINT NOT NULL,
                s4 BIGINT NOT NULL, s5 BIGINT NOT NULL,
                PRIMARY KEY (node, period, caller, kind, product));
             CREATE TABLE IF NOT EXISTS refusals (
                node TEXT NOT NULL, rule TEXT NOT NULL, count BIGINT NOT NULL, last_at BIGINT NOT NULL,
                last_seq BIGINT NOT NULL, last_why TEXT NOT NULL, PRIMARY KEY (node, rule));
             CREATE TABLE IF NOT EXISTS retired (
                node TEXT NOT NULL PRIMARY KEY, after_seq BIGINT NOT NULL, at BIGINT NOT NULL, by TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS held (
                node TEXT NOT NULL, seq BIGINT NOT NULL, part BIGINT NOT NULL, period TEXT NOT NULL,
                calls BIGINT NOT NULL, received BIGINT NOT NULL, raw BYTEA NOT NULL, state TEXT NOT NULL,
                decided_by TEXT, decided_at BIGINT, PRIMARY KEY (node, seq, part));
             CREATE INDEX IF NOT EXISTS held_by_period ON held (period, state);
             CREATE TABLE IF NOT EXISTS held_counters (
                node TEXT NOT NULL, period TEXT NOT NULL, through BIGINT NOT NULL, calls BIGINT NOT NULL,
                received BIGINT NOT NULL, raw BYTEA NOT NULL, state TEXT NOT NULL, decided_by TEXT,
                decided_at BIGINT, PRIMARY KEY (node, period));"
        );
        // Two control planes starting at once may race on CREATE ... IF NOT EXISTS: the
        // loser sees a unique violation in the catalog and tries again.
        let mut tries = 0;
        loop {
            tries += 1;
            match self.batch(&schema) {
                Ok(()) => break,
                Err(_) if tries < 3 => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => anyhow::bail!("usage store schema: {e}"),
            }
        }
        self.prune(now)?;
        Ok(())
    }

    /// The first month whose per-minute rows are kept at `now` (start, Unix seconds).
    pub(crate) fn first_kept(now: u64) -> u64 {
        let (_, mut start, _) = month_period(now);
        for _ in 1..MINUTE_MONTHS {
            start = month_period(start.saturating_sub(1)).1;
        }
        start
    }

    /// Makes sure the partition of the month starting at `month_start` exists; a month
    /// new to this process (a month's turn) also drops the months no longer kept at `now`.
    pub(crate) fn ensure_month(&self, month_start: u64, now: u64) -> Result<(), DbError> {
        let (name, start, end) = month_period(month_start);
        let months = self.months.lock().unwrap_or_else(|p| p.into_inner());
        if months.contains(&name) {
            return Ok(());
        }
        drop(months);
        let table = format!("minutes_{}", name.replace('-', "_"));
        let sql =
            format!("CREATE TABLE IF NOT EXISTS {table} PARTITION OF minutes FOR VALUES FROM ({start}) TO ({end})");
        let mut tries = 0;
        loop {
            tries += 1;
            match self.batch(&sql) {
                Ok(()) => break,
                // Another batch made it at the same moment.
                Err(_) if tries < 3 => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(e),
            }
        }
        self.months.lock().unwrap_or_else(|p| p.into_inner()).insert(name);
        self.prune(now)?;
        Ok(())
    }

    /// Drops the partitions of per-minute rows of months before [`Pool::first_kept`].
    pub(crate) fn prune(&self, now: u64) -> Result<Vec<String>, DbError> {
        let first = Self::first_kept(now);
        let names = self.tx(|sql| -> Result<Vec<String>, DbError> {
            let rows = sql.rows(
                "SELECT CAST(c.relname AS TEXT) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                 JOIN pg_class p ON p.oid = i.inhparent
                 WHERE p.relname = 'minutes' AND p.relnamespace = c.relnamespace
                   AND p.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())",
                &vals![],
            )?;
            rows.iter().map(|r| r.text(0)).collect()
        })?;
        let mut dropped = Vec::new();
        for table in names {
            let Some(month) = table.strip_prefix("minutes_").map(|m| m.replace('_', "-")) else { continue };
            let Some((start, _)) = parse_month(&month) else { continue };
            if start < first {
                self.batch(&format!("DROP TABLE IF EXISTS {table}"))?;
                self.months.lock().unwrap_or_else(|p| p.into_inner()).remove(&month);
                dropped.push(month);
            }
        }
        Ok(dropped)
    }
}
