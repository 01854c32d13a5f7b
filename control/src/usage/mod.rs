//! The usage store: nodes' closed windows applied exactly once, and what billing and the
//! usage API read from them.
//!
//! One SQLite database (`usage.db` beside a directory store) in WAL mode with
//! `synchronous=FULL`: a commit is on disk before the intake acknowledges. A batch of
//! windows is one transaction that records each window's (node, seq) in `applied` — a
//! window already there is a duplicate and adds nothing — and adds its rows to `totals`
//! (per caller, product and billing period) and `minutes` (per caller, route, product
//! and minute, with the latency histogram). A failed write rolls the whole batch back
//! and the node sends it again: a window is never "seen but not added".
//!
//! SQLite is the embedded store because it gives exactly that transaction on one file
//! with no server to run; the directory store gives atomic renames of whole files, not
//! a counter and its dedupe key in one commit.
//!
//! ```text
//! store.rs      the database: its tables, opening and migrating it
//! intake.rs     nodes' windows applied once, and the numbers still missing
//! queries.rs    what the usage API reads: rows by minute, day or route; totals; nodes
//! reconcile.rs  a period compared with the nodes' own counts, corrected and made final
//! quota.rs      who is on which quota, its use, its events and over-quota flags
//! params.rs     the API's parameters: times and percent-encoded query values
//! render.rs     `posternctl usage`: the answer as a table or a chart
//! ```

mod intake;
mod params;
mod queries;
mod quota;
mod reconcile;
mod render;
mod store;
#[cfg(test)]
mod tests;

pub use self::intake::{ApplyError, CLOCK_ALLOWANCE_S, MAX_SEQ_GAP, Refusal};
pub use self::params::{parse_time, query_escape, query_unescape, rfc3339};
pub use self::queries::{By, LatencySummary, MAX_ROWS, NodeWindows, Query, StatusClasses, Total, UsageRow};
pub use self::quota::{QuotaEvent, Quotas};
pub use self::reconcile::{CLOSE_GRACE_S, PeriodNode, Reconciled};
pub use self::render::{CHART_WIDTH, chart, parse_last, table};
pub use self::store::UsageStore;
