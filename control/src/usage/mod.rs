//! The usage store: nodes' closed windows applied exactly once, and what billing and the
//! usage API read from them.
//!
//! One usage logic, two engines. The intake, queries, reconcile and quotas are written
//! once against a small SQL seam (`db.rs`: `?N` placeholders, a handful of value types,
//! one transaction); each engine supplies the schema and the connection:
//!
//! - **SQLite** (the embedded default, `usage.db` beside a directory store, `make demo`):
//!   one file in WAL mode with `synchronous=FULL`, one connection, one transaction at a
//!   time. It gives exactly the transaction the intake needs on one file with no server
//!   to run; the directory store gives atomic renames of whole files, not a counter and
//!   its dedupe key in one commit.
//! - **PostgreSQL** (`posternctl serve --store postgres://…` keeps usage in the same
//!   database, or `--usage-db postgres://…`): a bounded pool of its own (`pg.rs`), batches
//!   applied side by side. Each batch takes a shared advisory lock against reconciles and
//!   one per node (its checks of numbering and time order), writes its rows in key order
//!   (no two batches wait on each other in a circle) and is run again when aborted for a
//!   serialization failure or deadlock. Per-minute rows are partitioned by month; 13
//!   months are kept, older partitions dropped.
//!
//! On both, reads (the usage API, flags, events, the export) take connections of their own
//! (SQLite: a read-only connection beside the writer, which WAL lets read the last commit
//! without waiting; PostgreSQL: a pool of 2), and the work runs on the store's own bounded
//! threads ([`UsageStore::run`]), never tokio's blocking pool that publish and key
//! revocation use. A commit is durable before the intake acknowledges. A batch of windows is
//! one transaction that records each window's parts in `applied` — (node, seq, part)
//! once; a part already there is a duplicate and adds nothing — and adds its rows,
//! summed per key in the batch, to `totals` (per caller, product and billing period) and
//! `minutes` (per caller, route, product and minute, with the latency histogram) in
//! multi-row upserts. A failed write rolls the whole batch back and the node sends it
//! again: a window is never "seen but not added". A sum that would pass `i64::MAX` is
//! refused (rule `total_overflow`), never clamped, wrapped or turned into a float.
//!
//! ```text
//! store.rs      the database: SQLite's tables, opening either engine, the transaction
//! db.rs         the seam: SQL with `?N` placeholders on SQLite or PostgreSQL
//! pg.rs         PostgreSQL: its schema, its pool, the monthly partitions of minutes
//! intake.rs     nodes' windows applied once, and the numbers still missing
//! coalesce.rs   the HTTP intake's group commit: batches arriving together, one transaction
//! decide.rs     the platform's decisions: a node retired, windows and reports held for a final period
//! queries.rs    what the usage API reads: rows by minute, day or route; totals; nodes
//! reconcile.rs  a period compared with the nodes' own counts, corrected and made final
//! quota.rs      who is on which quota, its use, its events and over-quota flags
//! params.rs     the API's parameters: times and percent-encoded query values
//! render.rs     `posternctl usage`: the answer as a table or a chart
//! ```

mod coalesce;
mod db;
mod decide;
mod intake;
mod params;
mod pg;
mod queries;
mod quota;
mod reconcile;
mod render;
mod store;
#[cfg(test)]
mod tests;

pub use self::coalesce::Coalescer;
pub use self::db::DbError;
pub use self::decide::{Decided, Decision, Held, Retired};
pub use self::intake::{ApplyError, CLOCK_ALLOWANCE_S, MAX_SEQ_GAP, Refusal};
pub use self::params::{parse_time, percent_unescape, query_escape, query_unescape, rfc3339};
pub use self::pg::MINUTE_MONTHS;
pub use self::queries::{
    By, LatencySummary, MAX_ROWS, MAX_TEAM_RANGE_S, NodeWindows, Query, RouteLatency, StatusClasses, Total, UsageRow,
};
pub use self::quota::{QuotaEvent, Quotas};
pub use self::reconcile::{CLOSE_GRACE_S, Counted, PeriodNode, Reconciled};
pub use self::render::{CHART_WIDTH, chart, parse_last, table};
pub use self::store::{UsageStore, WorkerError};
