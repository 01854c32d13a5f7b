//! The usage database: one SQLite file in WAL mode or a PostgreSQL database, its tables,
//! the migrations of SQLite stores made by older versions, and the transaction every
//! reader and writer runs in.

use std::path::Path;
use std::sync::Mutex;

use postern_model::usage::{LATENCY_BUCKETS, Window};
use rusqlite::{Connection, params};

use super::db::{DbError, Sql, SqliteTx, TxError};
use super::pg::Pool;

/// The usage database of a control plane.
#[derive(Debug)]
pub struct UsageStore {
    engine: Engine,
    location: String,
    workers: Workers,
}

/// Work the store runs on its own threads.
type Job = Box<dyn FnOnce() + Send>;

/// The store's own blocking workers: the intake, queries and reconciles wait for these
/// and never take tokio's blocking pool, which publish and key revocation use. As many as
/// the engine runs side by side; the queue is bounded.
#[derive(Debug)]
struct Workers {
    queue: std::sync::mpsc::SyncSender<Job>,
}

/// Jobs waiting for a worker at most; past that the store answers busy.
const QUEUE: usize = 1024;

impl Workers {
    fn start(n: usize) -> anyhow::Result<Workers> {
        let (queue, rx) = std::sync::mpsc::sync_channel::<Job>(QUEUE);
        let rx = std::sync::Arc::new(Mutex::new(rx));
        for i in 0..n {
            let rx = rx.clone();
            std::thread::Builder::new().name(format!("usage-store-{i}")).spawn(move || {
                loop {
                    let job = {
                        let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
                        rx.recv()
                    };
                    // The store is gone once its queue is.
                    let Ok(job) = job else { break };
                    // A job that panics drops its answer (the caller sees the store fail);
                    // the worker stays.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })?;
        }
        Ok(Workers { queue })
    }
}

/// The store's workers did not take or finish a job.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Every worker is busy and the queue is full.
    #[error("usage store busy: {QUEUE} jobs waiting")]
    Busy,
    /// The job failed without an answer.
    #[error("usage store: a job failed without an answer")]
    Lost,
}

#[derive(Debug)]
enum Engine {
    /// One connection that writes, one transaction at a time, and one that reads beside
    /// it (WAL: a reader sees the last commit and waits for no writer).
    Sqlite { write: Box<Mutex<Connection>>, read: Box<Mutex<Connection>> },
    /// Bounded pools: batches and reconciles side by side, and reads on their own.
    Postgres { write: Box<Pool>, read: Box<Pool> },
}

/// The applied parts of windows: (node, seq, part) is applied once; `raw` is the part as
/// it was applied, to tell a re-send (the same bytes) from a renumbering node.
const APPLIED: &str = "CREATE TABLE IF NOT EXISTS applied (
    node TEXT NOT NULL, seq INTEGER NOT NULL, part INTEGER NOT NULL, parts INTEGER NOT NULL,
    start INTEGER NOT NULL, recovered INTEGER NOT NULL, calls INTEGER NOT NULL, received INTEGER NOT NULL,
    raw BLOB NOT NULL, PRIMARY KEY (node, seq, part)) WITHOUT ROWID;";

/// Rewrites a whole-window `applied` table as parts ([`Window::split`]).
fn migrate_applied(conn: &Connection) -> anyhow::Result<()> {
    let tx = conn.unchecked_transaction()?;
    tx.execute_batch(&format!("ALTER TABLE applied RENAME TO applied_by_window; {APPLIED}"))?;
    {
        let mut read = tx.prepare("SELECT raw, received FROM applied_by_window")?;
        let mut insert = tx.prepare(
            "INSERT INTO applied (node, seq, part, parts, start, recovered, calls, received, raw)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let raw: Vec<u8> = r.get(0)?;
            let received: i64 = r.get(1)?;
            let w: Window = serde_json::from_slice(&raw)?;
            for p in w.split() {
                let calls: u64 = p.rows.iter().map(|r| r.calls()).sum();
                insert.execute(params![
                    p.node,
                    i64::try_from(p.seq)?,
                    p.part,
                    p.parts,
                    i64::try_from(p.start)?,
                    p.recovered,
                    i64::try_from(calls)?,
                    received,
                    serde_json::to_vec(&p)?
                ])?;
            }
        }
    }
    tx.execute_batch("DROP TABLE applied_by_window")?;
    tx.commit()?;
    Ok(())
}

pub(crate) fn hist_cols(prefix: &str) -> String {
    (0..LATENCY_BUCKETS).map(|i| format!("{prefix}h{i}")).collect::<Vec<_>>().join(", ")
}

impl UsageStore {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> anyhow::Result<UsageStore> {
        let conn = Connection::open(path).map_err(|e| anyhow::anyhow!("usage store {}: {e}", path.display()))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // A store made before windows were applied by part has `applied` keyed by
        // (node, seq): its windows are split into their parts once, in one transaction.
        let by_window = conn.prepare("SELECT seq FROM applied LIMIT 0").is_ok()
            && conn.prepare("SELECT part FROM applied LIMIT 0").is_err();
        if by_window {
            migrate_applied(&conn)?;
        }
        let hist_decl = (0..LATENCY_BUCKETS).map(|i| format!("h{i} INTEGER NOT NULL")).collect::<Vec<_>>().join(", ");
        conn.execute_batch(&format!(
            "{APPLIED}
             CREATE TABLE IF NOT EXISTS totals (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, period TEXT NOT NULL,
                billable INTEGER NOT NULL, s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL,
                s4 INTEGER NOT NULL, s5 INTEGER NOT NULL, overshoot INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (caller, kind, product, period)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS minutes (
                caller TEXT NOT NULL, kind TEXT NOT NULL, route TEXT NOT NULL, product TEXT NOT NULL,
                minute INTEGER NOT NULL,
                s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL, s4 INTEGER NOT NULL,
                s5 INTEGER NOT NULL, latency_us INTEGER NOT NULL, {hist_decl},
                PRIMARY KEY (caller, kind, route, product, minute)) WITHOUT ROWID;
             CREATE INDEX IF NOT EXISTS minutes_by_time ON minutes (minute);
             CREATE TABLE IF NOT EXISTS contiguous (
                node TEXT NOT NULL PRIMARY KEY, seq INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS periods (
                period TEXT NOT NULL PRIMARY KEY, final_at INTEGER, late INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS duplicates (
                node TEXT NOT NULL PRIMARY KEY, windows INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS quota_use (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start INTEGER NOT NULL, period_end INTEGER NOT NULL, used INTEGER NOT NULL,
                PRIMARY KEY (caller, kind, product, period_start)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS quota_events (
                id INTEGER PRIMARY KEY AUTOINCREMENT, at INTEGER NOT NULL,
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start INTEGER NOT NULL, period_end INTEGER NOT NULL, percent INTEGER NOT NULL,
                used INTEGER NOT NULL, quota INTEGER NOT NULL, mode TEXT NOT NULL,
                delivered INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0,
                next_try INTEGER NOT NULL DEFAULT 0,
                UNIQUE (caller, kind, product, period_start, percent));
             CREATE TABLE IF NOT EXISTS over_quota (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, until INTEGER NOT NULL,
                quota INTEGER NOT NULL, period_s INTEGER NOT NULL, since INTEGER NOT NULL,
                PRIMARY KEY (caller, kind, product, until)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS node_counters (
                node TEXT NOT NULL, period TEXT NOT NULL, through INTEGER NOT NULL, calls INTEGER NOT NULL,
                received INTEGER NOT NULL, raw BLOB NOT NULL, PRIMARY KEY (node, period)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS corrections (
                node TEXT NOT NULL, period TEXT NOT NULL, caller TEXT NOT NULL, kind TEXT NOT NULL,
                product TEXT NOT NULL, s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL,
                s4 INTEGER NOT NULL, s5 INTEGER NOT NULL,
                PRIMARY KEY (node, period, caller, kind, product)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS refusals (
                node TEXT NOT NULL, rule TEXT NOT NULL, count INTEGER NOT NULL, last_at INTEGER NOT NULL,
                last_seq INTEGER NOT NULL, last_why TEXT NOT NULL, PRIMARY KEY (node, rule)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS retired (
                node TEXT NOT NULL PRIMARY KEY, after_seq INTEGER NOT NULL, at INTEGER NOT NULL,
                by TEXT NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS held (
                node TEXT NOT NULL, seq INTEGER NOT NULL, part INTEGER NOT NULL, period TEXT NOT NULL,
                calls INTEGER NOT NULL, received INTEGER NOT NULL, raw BLOB NOT NULL, state TEXT NOT NULL,
                decided_by TEXT, decided_at INTEGER, PRIMARY KEY (node, seq, part)) WITHOUT ROWID;
             CREATE INDEX IF NOT EXISTS held_by_period ON held (period, state);
             CREATE TABLE IF NOT EXISTS held_counters (
                node TEXT NOT NULL, period TEXT NOT NULL, through INTEGER NOT NULL, calls INTEGER NOT NULL,
                received INTEGER NOT NULL, raw BLOB NOT NULL, state TEXT NOT NULL, decided_by TEXT,
                decided_at INTEGER, PRIMARY KEY (node, period)) WITHOUT ROWID;"
        ))?;
        // `overshoot` came with quotas: a store made before them gains the column.
        let has_overshoot = conn.prepare("SELECT overshoot FROM totals LIMIT 0").is_ok();
        if !has_overshoot {
            conn.execute_batch("ALTER TABLE totals ADD COLUMN overshoot INTEGER NOT NULL DEFAULT 0")?;
        }
        Ok(UsageStore {
            engine: Engine::Sqlite {
                write: Box::new(Mutex::new(conn)),
                read: Box::new(Mutex::new(Connection::open_with_flags(
                    path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?)),
            },
            location: path.display().to_string(),
            workers: Workers::start(SQLITE_WORKERS)?,
        })
    }

    /// Opens the usage store in PostgreSQL database `url` (`postgres://…`), creating its
    /// tables if missing and dropping per-minute rows older than the months kept.
    pub fn open_postgres(url: &str) -> anyhow::Result<UsageStore> {
        let pool = Pool::new(url, super::pg::POOL_SIZE)?;
        pool.migrate(postern_model::disk::unix_now())?;
        let read = Pool::new(url, super::pg::READ_POOL_SIZE)?;
        let location = without_password(url);
        Ok(UsageStore {
            engine: Engine::Postgres { write: Box::new(pool), read: Box::new(read) },
            location,
            workers: Workers::start(super::pg::POOL_SIZE)?,
        })
    }

    /// Opens `spec`: a `postgres://` or `postgresql://` URL, or a SQLite file's path.
    pub fn open_spec(spec: &str) -> anyhow::Result<UsageStore> {
        if crate::store::is_postgres(spec) { Self::open_postgres(spec) } else { Self::open(Path::new(spec)) }
    }

    /// Runs `f` on the store's own workers (off the async workers and off tokio's
    /// blocking pool) and waits for its answer.
    pub async fn run<T: Send + 'static>(
        self: &std::sync::Arc<Self>,
        f: impl FnOnce(&UsageStore) -> T + Send + 'static,
    ) -> Result<T, WorkerError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let store = self.clone();
        let job: Job = Box::new(move || {
            let _ = tx.send(f(&store));
        });
        self.workers.queue.try_send(job).map_err(|_| WorkerError::Busy)?;
        rx.await.map_err(|_| WorkerError::Lost)
    }

    /// Where the database is: a file, or a PostgreSQL URL (without its password).
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Runs `f` in one transaction, committed if it returns `Ok` and rolled back
    /// otherwise; on PostgreSQL, run again when aborted for a serialization failure or a
    /// deadlock.
    pub(crate) fn tx<T, E: TxError>(&self, f: impl FnMut(&mut dyn Sql) -> Result<T, E>) -> Result<T, E> {
        match &self.engine {
            Engine::Sqlite { write, .. } => sqlite_tx(write, f),
            Engine::Postgres { write, .. } => write.tx(f),
        }
    }

    /// Runs `f`, which only reads, in one transaction on a connection kept for reading.
    pub(crate) fn read<T, E: TxError>(&self, f: impl FnMut(&mut dyn Sql) -> Result<T, E>) -> Result<T, E> {
        match &self.engine {
            Engine::Sqlite { read, .. } => sqlite_tx(read, f),
            Engine::Postgres { read, .. } => read.tx(f),
        }
    }

    /// The PostgreSQL pool, if the store is on PostgreSQL.
    pub(crate) fn pool(&self) -> Option<&Pool> {
        match &self.engine {
            Engine::Postgres { write, .. } => Some(write),
            Engine::Sqlite { .. } => None,
        }
    }
}

fn sqlite_tx<T, E: TxError>(conn: &Mutex<Connection>, mut f: impl FnMut(&mut dyn Sql) -> Result<T, E>) -> Result<T, E> {
    let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
    let tx = conn.transaction().map_err(DbError::from)?;
    let v = f(&mut SqliteTx(&tx))?;
    tx.commit().map_err(DbError::from)?;
    Ok(v)
}

/// Workers of a SQLite store: its one connection runs one transaction at a time; a second
/// worker prepares the next job's arguments meanwhile.
const SQLITE_WORKERS: usize = 2;

/// `url` with its password (if any) left out, to print.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}@{host}")
        }
        None => url.to_owned(),
    }
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
