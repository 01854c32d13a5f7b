//! Usage windows: what a node counted in one 10-second window, the record its spool
//! keeps and the quota service applies exactly once, keyed by (node, seq).
//!
//! Windows are aligned to UTC (`start` is a multiple of [`WINDOW_S`]). Every billing
//! period starts at a UTC midnight, a multiple of [`WINDOW_S`] too, so a window never
//! straddles two periods: each call lands in exactly one.

use serde::{Deserialize, Serialize};

/// A window's length in seconds.
pub const WINDOW_S: u64 = 10;

/// Upper bounds of the latency histogram's buckets, in milliseconds; the last bucket
/// holds everything slower than the last bound.
pub const LATENCY_BOUNDS_MS: [u32; 23] =
    [1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000];

/// Buckets in a histogram: one per bound and one past the last.
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_MS.len() + 1;

/// Rows a window may hold at most (a node's 10 s of distinct callers × routes).
pub const MAX_ROWS: usize = 1 << 20;

/// Calls one row of a window may count at most: more than a node can answer for one
/// caller on one route in 10 s (~430 M a second). With it, a minute's row of the usage
/// store (6 windows of each node) stays far below `i64::MAX` for any fleet under
/// ~350 M nodes.
pub const MAX_ROW_CALLS: u64 = 1 << 32;

/// The sum of one row's latencies at most, in microseconds (~9 years): with
/// [`MAX_ROW_CALLS`] the figures a minute's row adds up stay below `i64::MAX` for any
/// fleet under ~5,000 nodes (PostgreSQL and SQLite refuse or widen beyond it; the store
/// refuses a total that would overflow).
pub const MAX_ROW_LATENCY_US: u64 = 1 << 48;

/// Sequence numbers end here: a node numbering ten windows a second would need ~900
/// years to reach it, and every sum and run of numbers stays far from `u64::MAX`.
pub const MAX_SEQ: u64 = 1 << 48;

/// The usage stream's Kafka topic unless told otherwise.
pub const KAFKA_TOPIC: &str = "postern.usage";

/// The header of a batch to the intake that carries its node's signature over the body
/// ([`crate::sign::Subject::Usage`]), when the node has a usage key.
pub const SIGNATURE_HEADER: &str = "x-postern-usage-signature";

/// The header of a part on the usage stream that carries its node's signature over the
/// payload, when the node has a usage key.
pub const STREAM_SIGNATURE_HEADER: &str = "postern_signature";

/// A librdkafka setting refused.
#[derive(Debug, thiserror::Error)]
pub enum KafkaOptionError {
    /// Not `key=value`, as given.
    #[error("Kafka setting {0:?}: give key=value")]
    Malformed(String),
    /// A secret (`sasl.password`…) given on the command line.
    #[error(transparent)]
    Secret(#[from] crate::secrets::OnCommandLine),
    /// The settings file cannot be read.
    #[error("Kafka settings file {path}: {error}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

/// The largest Kafka settings file read: 64 KiB.
pub const KAFKA_OPTIONS_FILE_CAP: u64 = 64 << 10;

fn kafka_option(o: &str) -> Result<(String, String), KafkaOptionError> {
    match o.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(KafkaOptionError::Malformed(o.to_owned())),
    }
}

/// Parses `key=value` librdkafka settings given on the command line
/// (`--usage-kafka-option`); a secret among them is refused, since every process of the
/// host can read a command line: it belongs in `--usage-kafka-options-file`.
pub fn kafka_options(options: &[String]) -> Result<Vec<(String, String)>, KafkaOptionError> {
    options
        .iter()
        .map(|o| {
            let (k, v) = kafka_option(o)?;
            if crate::secrets::kafka_setting(&k) {
                return Err(crate::secrets::OnCommandLine {
                    flag: "--usage-kafka-option",
                    what: format!("the secret setting {k:?}"),
                    instead: "--usage-kafka-options-file (key=value lines, readable only by this service)",
                }
                .into());
            }
            Ok((k, v))
        })
        .collect()
}

/// Reads librdkafka settings from a file of `key=value` lines (`#` starts a comment line),
/// where secrets belong: a regular file of at most 64 KiB.
pub fn kafka_options_file(path: &std::path::Path) -> Result<Vec<(String, String)>, KafkaOptionError> {
    let file = |error| KafkaOptionError::File { path: path.to_owned(), error };
    let bytes = crate::disk::read_regular(path, KAFKA_OPTIONS_FILE_CAP).map_err(file)?;
    let text = String::from_utf8(bytes).map_err(|e| file(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| kafka_option(l).map_err(|_| KafkaOptionError::Malformed(format!("{}: a line", path.display()))))
        .collect()
}

/// The bucket of a latency in microseconds.
pub fn latency_bucket(us: u64) -> usize {
    let ms = us / 1000;
    LATENCY_BOUNDS_MS.iter().position(|&b| ms < u64::from(b)).unwrap_or(LATENCY_BOUNDS_MS.len())
}

/// The `q`-quantile (0..=1) of a histogram in milliseconds, interpolated in its bucket
/// (the last bucket answers its lower bound); `None` when it is empty.
pub fn quantile_ms(hist: &[u64], q: f64) -> Option<f64> {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * total as f64).max(1.0);
    let mut seen = 0u64;
    for (i, &n) in hist.iter().enumerate() {
        if n > 0 && (seen + n) as f64 >= rank {
            let lo = if i == 0 { 0.0 } else { f64::from(LATENCY_BOUNDS_MS[i - 1]) };
            let Some(&hi) = LATENCY_BOUNDS_MS.get(i) else { return Some(lo) };
            return Some(lo + (f64::from(hi) - lo) * ((rank - seen as f64) / n as f64));
        }
        seen += n;
    }
    None
}

/// Who a row counts: an API key (by id) or an OAuth app (by `client_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallerKind {
    /// An API key's id.
    Key,
    /// An OAuth app's `client_id` (every user of the app counts against it).
    App,
}

impl CallerKind {
    /// `key` or `app`.
    pub fn as_str(self) -> &'static str {
        match self {
            CallerKind::Key => "key",
            CallerKind::App => "app",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<CallerKind> {
        match s {
            "key" => Some(CallerKind::Key),
            "app" => Some(CallerKind::App),
            _ => None,
        }
    }
}

/// One closed window of one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    /// The node that counted it.
    pub node: String,
    /// The node's sequence number: contiguous from 1, never reused.
    pub seq: u64,
    /// Start, in Unix seconds (a multiple of [`WINDOW_S`]).
    pub start: u64,
    /// The window was rebuilt after a crash from the node's last checkpoint of it: it
    /// holds what was counted up to that checkpoint (at most a second before the crash).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recovered: bool,
    /// Which part of the window this is (from 0), when it travels split by caller
    /// ([`Window::split`]); a whole window is part 0 of 1.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: u32,
    /// How many parts the whole window has (1: this is the whole window).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub parts: u32,
    /// One row per (caller, route) that answered a call in the window.
    pub rows: Vec<Row>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// Calls of one caller on one route within a window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// Key id or `client_id`.
    pub caller: String,
    /// What `caller` names.
    pub kind: CallerKind,
    /// The route's API product.
    pub product: String,
    /// The route, `team/name`.
    pub route: String,
    /// Answers by status class: 1xx, 2xx, 3xx, 4xx, 5xx.
    pub status: [u64; 5],
    /// Latency histogram over [`LATENCY_BOUNDS_MS`] ([`LATENCY_BUCKETS`] counts).
    pub latency: Vec<u64>,
    /// Sum of latencies, in microseconds.
    pub latency_us: u64,
}

impl Row {
    /// All calls.
    pub fn calls(&self) -> u64 {
        self.status.iter().sum()
    }

    /// Billable calls: answered 2xx or 3xx.
    pub fn billable(&self) -> u64 {
        self.status[1] + self.status[2]
    }
}

/// Why a window was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WindowError {
    /// Something in it is out of shape, or more than a node could have counted.
    #[error("usage window {node}/{seq} refused ({rule}): {why}")]
    Invalid {
        /// The node it claims.
        node: String,
        /// Its sequence number.
        seq: u64,
        /// The rule it broke, a stable name (`shape`, `row_calls`, …).
        rule: &'static str,
        /// What is wrong.
        why: String,
    },
}

impl Window {
    /// A whole window, part 0 of 1.
    pub fn new(node: String, seq: u64, start: u64, recovered: bool, rows: Vec<Row>) -> Window {
        Window { node, seq, start, recovered, part: 0, parts: 1, rows }
    }

    /// The window split by caller, the unit the usage store applies once and the usage
    /// stream keys by caller: one part per (kind, caller), in that order, each with the
    /// caller's rows in their order here; a window without rows is one empty part. The
    /// same window always splits into the same parts, so a part sent again is
    /// recognised whichever way it travelled. A part splits into itself.
    pub fn split(&self) -> Vec<Window> {
        if self.parts != 1 {
            return vec![self.clone()];
        }
        // Row indices by (kind, caller), stably: a part keeps its rows' order.
        let key = |i: usize| (self.rows[i].kind.as_str(), self.rows[i].caller.as_str());
        let mut order: Vec<usize> = (0..self.rows.len()).collect();
        order.sort_by(|&a, &b| key(a).cmp(&key(b)));
        let mut groups: Vec<&[usize]> = order.chunk_by(|&a, &b| key(a) == key(b)).collect();
        if groups.len() <= 1 {
            return vec![self.clone()];
        }
        let parts = u32::try_from(groups.len()).unwrap_or(u32::MAX);
        groups
            .drain(..)
            .enumerate()
            .map(|(i, rows)| Window {
                node: self.node.clone(),
                seq: self.seq,
                start: self.start,
                recovered: self.recovered,
                part: u32::try_from(i).unwrap_or(u32::MAX),
                parts,
                rows: rows.iter().map(|&r| self.rows[r].clone()).collect(),
            })
            .collect()
    }

    /// The caller a part is about (`kind:caller`), the usage stream's message key; `None`
    /// for a part without rows.
    pub fn caller_key(&self) -> Option<String> {
        self.rows.first().map(|r| format!("{}:{}", r.kind.as_str(), r.caller))
    }

    /// Checks what JSON cannot: the sequence, alignment, row shapes and sums, and that
    /// no row counts more than a node could ([`MAX_ROW_CALLS`], [`MAX_ROW_LATENCY_US`]).
    /// What depends on the time or on the node's earlier windows is the usage store's
    /// to check.
    pub fn check(&self) -> Result<(), WindowError> {
        let refuse = |rule: &'static str, why: String| WindowError::Invalid {
            node: self.node.clone(),
            seq: self.seq,
            rule,
            why,
        };
        let bad = |why: String| refuse("shape", why);
        if self.node.is_empty() || self.node.len() > 128 {
            return Err(bad("node must be 1 to 128 bytes".into()));
        }
        if self.seq == 0 || self.seq > MAX_SEQ {
            return Err(refuse("seq_range", format!("seq is 1 to {MAX_SEQ}")));
        }
        if self.parts == 0 || self.part >= self.parts || self.parts as usize > MAX_ROWS {
            return Err(bad(format!("part {} of {}: give 0 <= part < parts <= {MAX_ROWS}", self.part, self.parts)));
        }
        if self.parts > 1 && self.rows.iter().any(|r| (r.kind, &r.caller) != (self.rows[0].kind, &self.rows[0].caller))
        {
            return Err(bad("a part holds one caller's rows".into()));
        }
        if !self.start.is_multiple_of(WINDOW_S) {
            return Err(bad(format!("start {} is not on a {WINDOW_S} s boundary", self.start)));
        }
        if self.rows.len() > MAX_ROWS {
            return Err(bad(format!("{} rows, at most {MAX_ROWS}", self.rows.len())));
        }
        for (i, r) in self.rows.iter().enumerate() {
            if r.caller.is_empty() || r.caller.len() > 256 || r.product.len() > 256 || r.route.len() > 256 {
                return Err(bad(format!("row {i}: caller, product and route are 1 to 256 bytes")));
            }
            if r.latency.len() != LATENCY_BUCKETS {
                return Err(bad(format!("row {i}: latency has {} buckets, not {LATENCY_BUCKETS}", r.latency.len())));
            }
            let calls = r.status.iter().try_fold(0u64, |a, &n| a.checked_add(n));
            let timed = r.latency.iter().try_fold(0u64, |a, &n| a.checked_add(n));
            match (calls, timed) {
                (Some(c), Some(t)) if c == t && c > 0 => {}
                _ => return Err(bad(format!("row {i}: the status counts and the latency histogram disagree"))),
            }
            if calls.is_some_and(|c| c > MAX_ROW_CALLS) {
                return Err(refuse("row_calls", format!("row {i}: more than {MAX_ROW_CALLS} calls in one window")));
            }
            if r.latency_us > MAX_ROW_LATENCY_US {
                return Err(refuse("row_latency", format!("row {i}: latencies over {MAX_ROW_LATENCY_US} us in all")));
            }
        }
        Ok(())
    }
}

impl WindowError {
    /// The rule it names.
    pub fn rule(&self) -> &'static str {
        match self {
            WindowError::Invalid { rule, .. } => rule,
        }
    }
}

/// Unavailable runs a node reports at most (the oldest are dropped first).
pub const MAX_UNAVAILABLE: usize = 1024;

/// A node's own count of one billing period (a UTC month), kept beside its spool from
/// every window it spooled and reported once the period is complete on the node: every
/// window of the period is spooled, all numbered at most `through`. The reconciler
/// compares it with what the usage store applied of this node's windows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeCounters {
    /// The node.
    pub node: String,
    /// The period, `YYYY-MM`.
    pub period: String,
    /// The last sequence number the node had spooled when the period was complete:
    /// every window of the period is numbered at most this.
    pub through: u64,
    /// Calls per (kind, caller, product), in that order, each once.
    pub rows: Vec<CounterRow>,
    /// Runs of this node's numbers (inclusive) the usage store asked for again that the
    /// spool no longer held: they will never come, and the counts stand for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unavailable: Vec<(u64, u64)>,
}

/// One caller's calls on one product in a [`NodeCounters`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CounterRow {
    /// What `caller` names.
    pub kind: CallerKind,
    /// Key id or `client_id`.
    pub caller: String,
    /// The API product.
    pub product: String,
    /// Answers by status class: 1xx, 2xx, 3xx, 4xx, 5xx.
    pub status: [u64; 5],
}

/// Why a node's counters of a period were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("counters of node {node:?} for {period:?}: {problem}")]
pub struct CountersError {
    /// The node they claim.
    pub node: String,
    /// The period they claim.
    pub period: String,
    /// What is wrong.
    pub problem: CountersProblem,
}

/// What is wrong with a node's counters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CountersProblem {
    /// The node's name is empty or too long.
    #[error("node must be 1 to 128 bytes")]
    Node,
    /// The period is not a month.
    #[error("period must be YYYY-MM")]
    Period,
    /// `through` is out of range.
    #[error("through is the last number spooled, 1 to {max}", max = MAX_SEQ)]
    Through,
    /// Too many rows.
    #[error("{0} rows, at most {max}", max = MAX_ROWS)]
    Rows(usize),
    /// A row's caller or product is empty or too long.
    #[error("row {0}: caller and product are 1 to 256 bytes")]
    Names(usize),
    /// A row's counts overflow.
    #[error("row {0}: counts overflow")]
    Overflow(usize),
    /// A row is out of order or repeated.
    #[error("row {0}: rows are sorted by kind, caller and product, each once")]
    Order(usize),
    /// Too many unavailable runs.
    #[error("{0} unavailable runs, at most {max}", max = MAX_UNAVAILABLE)]
    Runs(usize),
    /// An unavailable run is out of range.
    #[error("unavailable run {from}..{to}: give 1 <= from <= to <= through")]
    Run {
        /// Its first number.
        from: u64,
        /// Its last number.
        to: u64,
    },
}

impl NodeCounters {
    /// All calls counted.
    pub fn calls(&self) -> u64 {
        self.rows.iter().flat_map(|r| r.status).fold(0u64, u64::saturating_add)
    }

    /// Checks what JSON cannot: the names, the period, the order of rows and runs.
    pub fn check(&self) -> Result<(), CountersError> {
        let refuse = |problem| Err(CountersError { node: self.node.clone(), period: self.period.clone(), problem });
        if self.node.is_empty() || self.node.len() > 128 {
            return refuse(CountersProblem::Node);
        }
        if parse_month(&self.period).is_none() {
            return refuse(CountersProblem::Period);
        }
        if self.through == 0 || self.through > MAX_SEQ {
            return refuse(CountersProblem::Through);
        }
        if self.rows.len() > MAX_ROWS {
            return refuse(CountersProblem::Rows(self.rows.len()));
        }
        for (i, r) in self.rows.iter().enumerate() {
            if r.caller.is_empty() || r.caller.len() > 256 || r.product.len() > 256 {
                return refuse(CountersProblem::Names(i));
            }
            if r.status.iter().try_fold(0u64, |a, &n| a.checked_add(n)).is_none() {
                return refuse(CountersProblem::Overflow(i));
            }
            if i > 0 {
                let p = &self.rows[i - 1];
                if (p.kind, &p.caller, &p.product) >= (r.kind, &r.caller, &r.product) {
                    return refuse(CountersProblem::Order(i));
                }
            }
        }
        if self.unavailable.len() > MAX_UNAVAILABLE {
            return refuse(CountersProblem::Runs(self.unavailable.len()));
        }
        if let Some(&(from, to)) =
            self.unavailable.iter().find(|(from, to)| *from == 0 || from > to || *to > self.through)
        {
            return refuse(CountersProblem::Run { from, to });
        }
        Ok(())
    }

    /// Whether number `seq` is in an unavailable run.
    pub fn is_unavailable(&self, seq: u64) -> bool {
        self.unavailable.iter().any(|&(from, to)| from <= seq && seq <= to)
    }
}

/// The UTC date (year, month, day) of a Unix day number.
pub fn civil(days: i64) -> (i64, u32, u32) {
    // Howard Hinnant's days-from-civil inverse.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The Unix day number of a UTC date.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The billing period holding Unix second `t`: its name (`YYYY-MM`, the UTC calendar
/// month) and its bounds in Unix seconds, `[start, end)`.
pub fn month_period(t: u64) -> (String, u64, u64) {
    let days = (t / 86_400) as i64;
    let (y, m, _) = civil(days);
    let start = days_from_civil(y, m, 1) * 86_400;
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    let end = days_from_civil(ny, nm, 1) * 86_400;
    (format!("{y:04}-{m:02}"), start as u64, end as u64)
}

/// Bounds `[start, end)` of a period named `YYYY-MM`.
pub fn parse_month(name: &str) -> Option<(u64, u64)> {
    let (y, m) = name.split_once('-')?;
    let (y, m): (i64, u32) = (y.parse().ok()?, m.parse().ok()?);
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&m) || name.len() != 7 {
        return None;
    }
    let start = days_from_civil(y, m, 1) * 86_400;
    let (_, _, end) = month_period(start as u64);
    Some((start as u64, end))
}

/// Where a quota's periods start. Every boundary is a multiple of [`WINDOW_S`], so a
/// window lands in exactly one period of any anchor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Anchor {
    /// The UTC calendar month.
    UtcMonth,
    /// A month from day `n` (1 to 28) at UTC midnight: a customer's billing day.
    BillingDay(u8),
    /// Fixed periods of this many seconds from the Unix epoch (a multiple of
    /// [`WINDOW_S`]): trials, and tests that watch a period end.
    EverySeconds(u64),
}

/// Why an anchor was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AnchorError {
    /// A billing day outside 1 to 28.
    #[error("billing day {0}: give 1 to 28")]
    BillingDay(u8),
    /// A period that is not a whole number of windows.
    #[error("period of {0} s: give a multiple of {window} s", window = WINDOW_S)]
    Period(u64),
}

impl Anchor {
    /// Checks the anchor's number.
    pub fn check(self) -> Result<(), AnchorError> {
        match self {
            Anchor::UtcMonth => Ok(()),
            Anchor::BillingDay(d) if (1..=28).contains(&d) => Ok(()),
            Anchor::BillingDay(d) => Err(AnchorError::BillingDay(d)),
            Anchor::EverySeconds(s) if s >= WINDOW_S && s.is_multiple_of(WINDOW_S) => Ok(()),
            Anchor::EverySeconds(s) => Err(AnchorError::Period(s)),
        }
    }

    /// The period holding Unix second `t`: `[start, end)`.
    pub fn period(self, t: u64) -> (u64, u64) {
        match self {
            Anchor::UtcMonth => {
                let (_, start, end) = month_period(t);
                (start, end)
            }
            Anchor::BillingDay(d) => {
                let d = u32::from(d.clamp(1, 28));
                let (y, m, day) = civil((t / 86_400) as i64);
                let (y, m) = if day >= d {
                    (y, m)
                } else if m == 1 {
                    (y - 1, 12)
                } else {
                    (y, m - 1)
                };
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                let start = days_from_civil(y, m, d) * 86_400;
                let end = days_from_civil(ny, nm, d) * 86_400;
                (start.max(0) as u64, end.max(0) as u64)
            }
            Anchor::EverySeconds(s) => {
                let s = s.max(WINDOW_S);
                let start = t - t % s;
                (start, start + s)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: [u64; 5]) -> Row {
        let mut latency = vec![0; LATENCY_BUCKETS];
        latency[3] = status.iter().sum();
        Row {
            caller: "k-1".into(),
            kind: CallerKind::Key,
            product: "search".into(),
            route: "t/r".into(),
            status,
            latency,
            latency_us: 0,
        }
    }

    #[test]
    fn months_are_utc_calendar_months() {
        // 2026-12-01T00:00:00Z = 1796083200.
        assert_eq!(month_period(1_796_083_200), ("2026-12".into(), 1_796_083_200, 1_798_761_600));
        assert_eq!(month_period(1_796_083_199).0, "2026-11");
        assert_eq!(parse_month("2026-12"), Some((1_796_083_200, 1_798_761_600)));
        assert_eq!(parse_month("2024-02").map(|(s, e)| (e - s) / 86_400), Some(29));
        assert_eq!(parse_month("2026-13"), None);
        assert_eq!(parse_month("26-1"), None);
        for d in [-1000i64, 0, 19_000, 20_454, 2_932_896] {
            let (y, m, dd) = civil(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
    }

    #[test]
    fn a_window_is_checked_beyond_its_json() {
        let w = Window::new("n".into(), 1, 20, false, vec![row([0, 3, 0, 1, 0])]);
        assert_eq!(w.check(), Ok(()));
        assert_eq!(w.rows[0].billable(), 3);
        let mut bad = w.clone();
        bad.start = 21;
        assert!(bad.check().is_err());
        let mut bad = w.clone();
        bad.seq = 0;
        assert!(bad.check().is_err());
        let mut bad = w.clone();
        bad.rows[0].status[1] += 1;
        assert!(bad.check().unwrap_err().to_string().contains("disagree"));
        let mut bad = w;
        bad.rows[0].latency.pop();
        assert!(bad.check().is_err());
    }

    #[test]
    fn kafka_settings_are_key_value() {
        assert_eq!(
            kafka_options(&["security.protocol=SSL".into(), "a=b=c".into()]).unwrap(),
            vec![("security.protocol".to_owned(), "SSL".to_owned()), ("a".to_owned(), "b=c".to_owned())]
        );
        assert!(kafka_options(&["novalue".into()]).is_err());
        assert!(kafka_options(&["=x".into()]).is_err());
        // A secret setting belongs in the settings file, not on a command line.
        let e = kafka_options(&["sasl.password=p".into()]).unwrap_err();
        assert!(matches!(e, KafkaOptionError::Secret(_)), "{e}");
        assert!(!e.to_string().contains("=p"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kafka.properties");
        std::fs::write(&file, "# credentials\n\nsasl.password = p=q\n  sasl.username=u\n").unwrap();
        assert_eq!(
            kafka_options_file(&file).unwrap(),
            vec![("sasl.password".to_owned(), " p=q".to_owned()), ("sasl.username".to_owned(), "u".to_owned())]
        );
        std::fs::write(&file, "sasl.password\n").unwrap();
        let e = kafka_options_file(&file).unwrap_err();
        assert!(e.to_string().contains("kafka.properties: a line"), "{e}");
    }

    #[test]
    fn a_window_splits_by_caller_the_same_way_every_time() {
        let mut a = row([0, 2, 0, 0, 0]);
        a.caller = "zed".into();
        let mut b = row([0, 1, 0, 0, 0]);
        b.caller = "amy".into();
        let mut c = row([0, 0, 0, 1, 0]);
        c.caller = "zed".into();
        c.route = "t/other".into();
        let w = Window::new("n".into(), 7, 20, false, vec![a, b, c]);
        let parts = w.split();
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].part, parts[0].parts, parts[0].caller_key().as_deref()), (0, 2, Some("key:amy")));
        assert_eq!((parts[1].part, parts[1].rows.len(), parts[1].caller_key().as_deref()), (1, 2, Some("key:zed")));
        assert!(parts.iter().all(|p| p.check().is_ok() && p.seq == 7));
        assert_eq!(parts, w.split());
        assert_eq!(parts[1].split(), vec![parts[1].clone()]);
        // A part's JSON names its place; a whole window's does not.
        let json = serde_json::to_string(&parts[1]).unwrap_or_default();
        assert!(json.contains("\"part\":1,\"parts\":2"), "{json}");
        assert!(!serde_json::to_string(&w).unwrap_or_default().contains("part"));
        let mut mixed = parts[1].clone();
        mixed.rows.push(parts[0].rows[0].clone());
        assert!(mixed.check().unwrap_err().to_string().contains("one caller"));
        let mut out_of_range = parts[1].clone();
        out_of_range.part = 2;
        assert!(out_of_range.check().is_err());
        let empty = Window::new("n".into(), 8, 20, true, Vec::new());
        assert_eq!(empty.split(), vec![empty.clone()]);
        assert_eq!(empty.caller_key(), None);
    }

    #[test]
    fn node_counters_are_checked_beyond_their_json() {
        let row = |caller: &str, ok: u64| CounterRow {
            kind: CallerKind::Key,
            caller: caller.into(),
            product: "search".into(),
            status: [0, ok, 0, 1, 0],
        };
        let c = NodeCounters {
            node: "n".into(),
            period: "2026-11".into(),
            through: 9,
            rows: vec![row("a", 2), row("b", 3)],
            unavailable: vec![(3, 4)],
        };
        assert_eq!(c.check(), Ok(()));
        assert_eq!(c.calls(), 7);
        assert!(c.is_unavailable(4) && !c.is_unavailable(5));
        let json = serde_json::to_string(&c).unwrap_or_default();
        assert_eq!(serde_json::from_str::<NodeCounters>(&json).ok(), Some(c.clone()));
        let mut bad = c.clone();
        bad.rows.swap(0, 1);
        assert!(bad.check().unwrap_err().to_string().contains("sorted"));
        let mut bad = c.clone();
        bad.rows.push(row("b", 1));
        assert!(bad.check().is_err());
        let mut bad = c.clone();
        bad.period = "2026-13".into();
        assert!(bad.check().unwrap_err().to_string().contains("YYYY-MM"));
        let mut bad = c.clone();
        bad.unavailable = vec![(5, 4)];
        assert!(bad.check().is_err());
        let mut bad = c;
        bad.rows[0].status = [u64::MAX, 1, 0, 0, 0];
        assert!(bad.check().unwrap_err().to_string().contains("overflow"));
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        let mut h = vec![0u64; LATENCY_BUCKETS];
        assert_eq!(quantile_ms(&h, 0.5), None);
        h[latency_bucket(4_000)] = 100; // 3..5 ms
        let p50 = quantile_ms(&h, 0.5).unwrap_or_default();
        assert!((3.0..=5.0).contains(&p50), "{p50}");
        assert_eq!(latency_bucket(999), 0);
        assert_eq!(latency_bucket(60_000_000), LATENCY_BOUNDS_MS.len());
    }

    #[test]
    fn quota_periods_hold_their_instant_and_meet_end_to_start() {
        // 2026-03-15T00:00:00Z and around.
        let mid_march = days_from_civil(2026, 3, 15) as u64 * 86_400;
        for anchor in [Anchor::UtcMonth, Anchor::BillingDay(15), Anchor::BillingDay(28), Anchor::EverySeconds(60)] {
            assert_eq!(anchor.check(), Ok(()));
            for t in [mid_march - 1, mid_march, mid_march + 7 * 86_400 + 5, 0, 1_900_000_000] {
                let (start, end) = anchor.period(t);
                assert!(start <= t && t < end, "{anchor:?} {t}: [{start}, {end})");
                assert!(start.is_multiple_of(WINDOW_S) && end.is_multiple_of(WINDOW_S));
                assert_eq!(anchor.period(end).0, end, "{anchor:?}: the next period starts where this one ends");
            }
        }
        assert_eq!(Anchor::BillingDay(15).period(mid_march), (mid_march, days_from_civil(2026, 4, 15) as u64 * 86_400));
        assert_eq!(
            Anchor::BillingDay(15).period(mid_march - 1),
            (days_from_civil(2026, 2, 15) as u64 * 86_400, mid_march)
        );
        assert!(Anchor::BillingDay(29).check().is_err());
        assert!(Anchor::EverySeconds(15).check().is_err());
    }
}
