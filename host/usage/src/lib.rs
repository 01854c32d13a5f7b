//! Usage metering on a node: every answered call of an authenticated caller is counted
//! in memory ([`meter`]); closed 10 s windows are numbered and written to a crash-safe
//! disk [`spool`]; a shipper thread sends them on to the usage stream and frees them
//! only once it acknowledged them.
//!
//! Threads: the request workers only count (one uncontended lock, no I/O, no
//! allocation for a caller already in the window), in memory and in the counts file
//! ([`durable`]: a memory-mapped file beside the spool, so `kill -9` loses no counted
//! call). `usage-closer` closes windows a quarter second after their end and appends
//! them to the spool. `usage-shipper` sends spooled windows in order through a [`Sink`].
//! Neither ever runs on a request worker.
//!
//! Beside the spool the node keeps its own [`counters`] of each billing period, counted
//! from every window as it is spooled, and reports a period once it is complete, for the
//! reconciler to compare with what the usage store applied.
#![deny(missing_docs)]

pub mod counters;
pub mod durable;
pub mod kafka;
pub mod meter;
pub mod spool;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use postern_model::usage::{NodeCounters, WINDOW_S, Window};
use serde::{Deserialize, Serialize};

pub use counters::Counters;
pub use meter::{Call, Meter};
pub use spool::{Opened, Spool, SpoolError, SpoolLimits};

/// Why a send to the usage stream or the control plane failed; the windows stay in the
/// spool and go again.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The control plane did not answer in time.
    #[error("{url}: no answer in {secs} s")]
    Timeout {
        /// Where it was sent.
        url: String,
        /// How long it waited.
        secs: u64,
    },
    /// The request did not reach the control plane.
    #[error("{url}: {source}")]
    Request {
        /// Where it was sent.
        url: String,
        /// What the client said.
        source: hyper_util::client::legacy::Error,
    },
    /// The control plane answered with an error status.
    #[error("{url}: {status}: {body}")]
    Status {
        /// Where it was sent.
        url: String,
        /// The status.
        status: http::StatusCode,
        /// The body of the answer, trimmed.
        body: String,
    },
    /// The control plane's answer is not what it should be.
    #[error("{url}: the answer: {source}")]
    Answer {
        /// Where it was sent.
        url: String,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// A request could not be built (a bad URL).
    #[error("{0}")]
    Build(#[from] http::Error),
    /// What was to be sent could not be written as JSON.
    #[error("{0}")]
    Encode(#[from] serde_json::Error),
    /// Counters can only go to a control plane, and there is none.
    #[error("no control plane to report usage counters to (--control)")]
    NoControl,
    /// A spooled window does not parse.
    #[error("spooled window {seq}: {source}")]
    Spooled {
        /// Its number.
        seq: u64,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// Kafka refused a part.
    #[error("usage window {id} to Kafka: {source}")]
    Produce {
        /// The part's `ce_id`.
        id: String,
        /// librdkafka's error.
        source: rdkafka::error::KafkaError,
    },
    /// A part was not delivered.
    #[error("Kafka: {0}")]
    Delivery(rdkafka::error::KafkaError),
    /// Not every part was acknowledged in time.
    #[error("Kafka: not every usage window acknowledged in {secs} s")]
    Unacknowledged {
        /// How long it waited.
        secs: u64,
    },
}

impl SinkError {
    /// The far side refused what was sent for good: a window breaks one of its rules
    /// (422, or 400 for its shape) or holds a number it applied with other contents (409).
    /// Sending the same bytes again changes nothing.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            SinkError::Status { status, .. }
                if matches!(
                    *status,
                    http::StatusCode::BAD_REQUEST | http::StatusCode::CONFLICT | http::StatusCode::UNPROCESSABLE_ENTITY
                )
        )
    }
}

/// Why the HTTP sink could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Its runtime could not start.
    #[error(transparent)]
    Runtime(#[from] std::io::Error),
    /// Its TLS client could not be set up.
    #[error(transparent)]
    Tls(#[from] postern_model::tls::TlsError),
}

/// How long after a window's end it is closed: calls answered at its very end are
/// counted in it unless their thread ran this much later.
const GRACE: Duration = Duration::from_millis(250);
/// The longest wait between two tries of a failing send.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Windows sent in one batch at most.
const BATCH: usize = 64;
/// Bytes sent in one batch at most (at least one window).
const BATCH_BYTES: u64 = 4 << 20;
/// Windows kept in the spool's `parked/` folder at most; past it the shipper tries a
/// refused window again, as it does any failed send (nothing is dropped).
const MAX_PARKED: usize = 10_000;
/// How long after a failed counters report it is tried again.
const REPORT_RETRY: Duration = Duration::from_secs(10);

/// Where spooled windows go: the usage stream.
pub trait Sink: Send {
    /// Delivers windows (`(seq, window JSON)`, in order); `Ok` only once every one is
    /// acknowledged (applied or already applied), with the runs of this node's earlier
    /// numbers the far side says it never got (inclusive), for a re-send.
    fn send(&mut self, windows: &[(u64, Vec<u8>)]) -> Result<Vec<(u64, u64)>, SinkError>;

    /// Runs of this node's acknowledged numbers the far side says it lacks, asked for
    /// while there is nothing new to send (a sink decides how often it really asks).
    fn poll_missing(&mut self) -> Vec<(u64, u64)> {
        Vec::new()
    }

    /// Reports the node's own counters of a period complete on it; `Ok` once the control
    /// plane took them.
    fn report(&mut self, counters: &NodeCounters) -> Result<(), SinkError>;
}

/// Counters shown in `/readyz` and `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    /// Windows written to the spool.
    pub spooled: AtomicU64,
    /// Failed spool writes (a full spool or disk).
    pub spool_errors: AtomicU64,
    /// Windows the usage stream acknowledged.
    pub shipped: AtomicU64,
    /// Failed sends.
    pub ship_errors: AtomicU64,
    /// Windows sent again because the usage store never got them.
    pub resent: AtomicU64,
    /// Windows the usage store asked for again that the spool no longer holds.
    pub resend_unavailable: AtomicU64,
    /// Windows the usage stream refused for good, set aside in the spool's `parked/`.
    pub parked: AtomicU64,
    /// Closed windows waiting in memory for the spool.
    pub pending: AtomicU64,
    /// Windows rebuilt after a crash from the counts file (or an older run's checkpoint).
    pub recovered: AtomicU64,
    /// Period counters the control plane took.
    pub reports: AtomicU64,
    /// Failed counters reports.
    pub report_errors: AtomicU64,
    /// The last error writing the counters file, while it is failing.
    pub counters_error: Mutex<Option<String>>,
    /// The last spool error, while the spool is failing.
    pub spool_error: Mutex<Option<String>>,
    /// The last send error, while sending is failing.
    pub ship_error: Mutex<Option<String>>,
}

/// The open windows as an older run checkpointed them (`open.json`): rebuilt into records
/// after its crash. Runs now keep them in the counts file instead ([`durable`]).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Checkpoint {
    /// The spool's next sequence number when it was written.
    next: u64,
    /// Closed windows not yet spooled, then the open ones (`seq` 0: not numbered yet).
    windows: Vec<Window>,
}

/// The spool's size, for metrics.
#[derive(Debug, Clone, Copy)]
pub struct SpoolGauges {
    /// Records not yet acknowledged.
    pub unacked: u64,
    /// Bytes of segments.
    pub bytes: u64,
    /// The size cap.
    pub cap: u64,
}

/// Usage settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The node's id, on every window.
    pub node: String,
    /// The spool's directory.
    pub dir: PathBuf,
    /// The spool's limits.
    pub limits: SpoolLimits,
}

/// The node's metering: counters, spool and the threads that move windows on.
#[derive(Debug)]
pub struct Usage {
    /// The counters the request path increments.
    pub meter: Meter,
    /// The spool (locked by the closer, the shipper and re-sends; never by a request).
    pub spool: Mutex<Spool>,
    /// The node's own per-period counters (locked after the spool, never before it).
    counters: Mutex<Counters>,
    /// Counters.
    pub stats: Stats,
    node: String,
    /// Closed windows the spool could not take yet, oldest first.
    pending: Mutex<VecDeque<Window>>,
    /// Wakes the shipper (a record spooled) and both threads (stop).
    wake: (Mutex<u64>, Condvar),
    /// Stops the closer (after a last close of every window).
    stop: AtomicBool,
    /// Stops the shipper, set once the closer is done (after one last send).
    ship_stop: AtomicBool,
    closer: Mutex<Option<std::thread::JoinHandle<()>>>,
    shipper: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The busiest callers of the last closed window, busiest first.
    top: Mutex<Vec<TopCaller>>,
}

/// Callers [`Usage::top_callers`] keeps: a bounded set of series for live operations.
pub const TOP_CALLERS: usize = 10;

/// One of the busiest callers of a window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopCaller {
    /// Key or app.
    pub kind: postern_model::usage::CallerKind,
    /// Its key id or `client_id`.
    pub caller: String,
    /// Calls in the window, every route.
    pub calls: u64,
    /// Of which 5xx.
    pub errors: u64,
}

/// The [`TOP_CALLERS`] busiest callers of rows, busiest first (ties by name).
pub fn busiest(rows: &[postern_model::usage::Row]) -> Vec<TopCaller> {
    let mut by: std::collections::BTreeMap<(postern_model::usage::CallerKind, &str), (u64, u64)> =
        std::collections::BTreeMap::new();
    for r in rows {
        let e = by.entry((r.kind, r.caller.as_str())).or_default();
        e.0 += r.calls();
        e.1 += r.status[4];
    }
    let mut all: Vec<TopCaller> = by
        .into_iter()
        .map(|((kind, caller), (calls, errors))| TopCaller { kind, caller: caller.to_owned(), calls, errors })
        .collect();
    all.sort_by(|a, b| b.calls.cmp(&a.calls).then_with(|| a.caller.cmp(&b.caller)));
    all.truncate(TOP_CALLERS);
    all
}

impl Usage {
    /// Opens the spool (cutting torn tails), turns what a crashed run left in the counts
    /// file (or an older run's checkpoint) into records, and starts the closer and, with a sink, the shipper.
    pub fn start(settings: Settings, sink: Option<Box<dyn Sink>>) -> Result<Arc<Usage>, SpoolError> {
        let (spool, opened) = Spool::open(&settings.dir, &settings.node, settings.limits)?;
        let mut counters = Counters::load(&settings.dir, &settings.node)
            .map_err(|e| SpoolError::Io { path: settings.dir.join("counters.json"), source: e })?;
        if counters.through() >= spool.next_seq() {
            // Counts past the spool's numbers are another spool's (this one was lost and
            // numbers again): they are kept aside, never mixed with this spool's.
            tracing::error!(
                through = counters.through(),
                next = spool.next_seq(),
                "usage counters count windows this spool never numbered: kept as counters.json.bad, counting again"
            );
            let path = settings.dir.join("counters.json");
            std::fs::rename(&path, path.with_extension("json.bad")).map_err(|e| SpoolError::Io { path, source: e })?;
            counters = Counters::load(&settings.dir, &settings.node)
                .map_err(|e| SpoolError::Io { path: settings.dir.join("counters.json"), source: e })?;
        }
        tracing::info!(
            dir = %settings.dir.display(),
            records = opened.records,
            next = spool.next_seq(),
            acked = spool.acked(),
            "usage spool open"
        );
        let usage = Arc::new(Usage {
            meter: Meter::new(),
            spool: Mutex::new(spool),
            counters: Mutex::new(counters),
            stats: Stats::default(),
            node: settings.node,
            pending: Mutex::new(VecDeque::new()),
            wake: (Mutex::new(0), Condvar::new()),
            stop: AtomicBool::new(false),
            ship_stop: AtomicBool::new(false),
            closer: Mutex::new(None),
            shipper: Mutex::new(None),
            top: Mutex::new(Vec::new()),
        });
        usage.count_spooled()?;
        usage.recover()?;
        usage.recover_counts()?;
        let u = usage.clone();
        *usage.closer.lock().unwrap_or_else(|p| p.into_inner()) = Some(spawn("usage-closer", move || u.close_loop())?);
        if let Some(sink) = sink {
            let u = usage.clone();
            *usage.shipper.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(spawn("usage-shipper", move || u.ship_loop(sink))?);
        }
        Ok(usage)
    }

    fn checkpoint_path(&self) -> PathBuf {
        self.lock_spool().dir().join("open.json")
    }

    fn lock_spool(&self) -> std::sync::MutexGuard<'_, Spool> {
        self.spool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves the counters, noting a failure for `/readyz` (the counts stay in memory and
    /// the next save writes them).
    fn save_counters(&self, counters: &mut Counters) {
        let mut last = self.stats.counters_error.lock().unwrap_or_else(|p| p.into_inner());
        match counters.save() {
            Ok(()) => *last = None,
            Err(e) => {
                let msg = e.to_string();
                if last.as_deref() != Some(&msg) {
                    tracing::error!(error = %msg, "usage counters not written; retried with the next window");
                }
                *last = Some(msg);
            }
        }
    }

    /// Counts the spooled records the counters file does not have yet (written after
    /// its last save, before a crash): the counters are saved before a record can be
    /// shipped and freed, so every such record is still in the spool.
    fn count_spooled(&self) -> Result<(), SpoolError> {
        let spool = self.lock_spool();
        let mut counters = self.lock_counters();
        let mut from = counters.through() + 1;
        let mut counted = 0u64;
        loop {
            let batch = spool.read(from, BATCH, BATCH_BYTES)?;
            let Some(&(last, _)) = batch.last() else { break };
            for (seq, bytes) in &batch {
                match serde_json::from_slice::<Window>(bytes) {
                    Ok(w) => counters.count(&w),
                    Err(e) => tracing::error!(seq, error = %e, "usage spool record unreadable: not counted"),
                }
                counted += 1;
            }
            from = last + 1;
        }
        if counted > 0 {
            tracing::info!(windows = counted, through = counters.through(), "usage counters caught up with the spool");
            self.save_counters(&mut counters);
        }
        Ok(())
    }

    /// Appends the windows of a crashed run's checkpoint that no later record closed.
    fn recover(&self) -> Result<(), SpoolError> {
        let path = self.checkpoint_path();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(SpoolError::Io { path, source: e }),
        };
        let cp: Checkpoint = match serde_json::from_slice(&bytes) {
            Ok(cp) => cp,
            Err(e) => {
                // Written whole and renamed, so this is not a torn write: keep it aside.
                tracing::error!(path = %path.display(), error = %e, "usage checkpoint unreadable, kept as open.json.bad");
                let _ = std::fs::rename(&path, path.with_extension("json.bad"));
                return Ok(());
            }
        };
        let mut spool = self.lock_spool();
        // A window is closed already when a record written after the checkpoint starts
        // at or after it (windows close in order).
        let closed_through = spool.last_start_since(cp.next);
        for mut w in cp.windows {
            if closed_through.is_some_and(|s| s >= w.start) || w.rows.is_empty() {
                continue;
            }
            w.recovered = true;
            w.node.clone_from(&self.node);
            self.spool_recovered(&mut spool, w, "the last checkpoint")?;
        }
        drop(spool);
        std::fs::remove_file(&path).map_err(|e| SpoolError::Io { path, source: e })
    }

    /// Appends the windows a crashed run left in the counts file that the spool did not
    /// take before the crash, then starts the file afresh and counts in it from now on.
    fn recover_counts(&self) -> Result<(), SpoolError> {
        let durable = durable::Durable::in_dir(self.lock_spool().dir());
        let io = |source| SpoolError::Io { path: durable.path().to_owned(), source };
        let found = match durable.read() {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let aside = durable.path().with_extension("counts.bad");
                tracing::error!(path = %durable.path().display(), error = %e, "usage counts file unreadable, kept as open.counts.bad");
                std::fs::rename(durable.path(), &aside).map_err(io)?;
                durable::Found::default()
            }
            Err(e) => return Err(io(e)),
        };
        if found.skipped > 0 {
            tracing::error!(slots = found.skipped, "usage counts file: slots out of shape skipped");
        }
        let mut spool = self.lock_spool();
        // A window is in the spool already when a record written since that run began
        // starts at or after it (windows are spooled in order).
        let closed_through = spool.last_start_since(found.next);
        for (window, rows) in &found.windows {
            let start = window.saturating_mul(WINDOW_S);
            if closed_through.is_some_and(|s| s >= start) {
                continue;
            }
            let w = Window::new(self.node.clone(), 0, start, true, meter::to_rows(rows));
            self.spool_recovered(&mut spool, w, "the counts file")?;
        }
        let slots = durable.create(spool.next_seq()).map_err(io)?;
        drop(spool);
        self.meter.keep_in(slots);
        Ok(())
    }

    /// Appends a window recovered from `source` after a crash, numbered now, and counts it.
    fn spool_recovered(&self, spool: &mut Spool, mut w: Window, source: &str) -> Result<(), SpoolError> {
        spool.append(|seq| {
            w.seq = seq;
            serde_json::to_vec(&w).unwrap_or_default()
        })?;
        let mut counters = self.lock_counters();
        counters.count(&w);
        self.save_counters(&mut counters);
        drop(counters);
        self.stats.recovered.fetch_add(1, Ordering::Relaxed);
        self.stats.spooled.fetch_add(1, Ordering::Relaxed);
        let calls: u64 = w.rows.iter().map(|r| r.calls()).sum();
        tracing::warn!(seq = w.seq, start = w.start, calls, "usage window recovered from {source}");
        Ok(())
    }

    /// Closes windows before `window` into the pending queue.
    fn close_into_pending(&self, window: u64) {
        let closed = self.meter.close_before(window);
        if closed.is_empty() {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut top = None;
        for (w, rows) in closed {
            let window = Window::new(self.node.clone(), 0, w * WINDOW_S, false, meter::to_rows(&rows));
            top = Some(busiest(&window.rows));
            pending.push_back(window);
        }
        if let Some(top) = top {
            *self.top.lock().unwrap_or_else(|p| p.into_inner()) = top;
        }
        self.stats.pending.store(pending.len() as u64, Ordering::Relaxed);
    }

    /// Spools pending windows in order until one fails.
    fn flush_pending(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.is_empty() {
            return;
        }
        let mut spool = self.lock_spool();
        let mut counters = self.lock_counters();
        let mut wrote = false;
        while let Some(w) = pending.front_mut() {
            let appended = spool.append(|seq| {
                w.seq = seq;
                serde_json::to_vec(&*w).unwrap_or_default()
            });
            match appended {
                Ok(_) => {
                    self.meter.spooled(w.start / WINDOW_S);
                    counters.count(w);
                    pending.pop_front();
                    wrote = true;
                    self.stats.spooled.fetch_add(1, Ordering::Relaxed);
                    *self.stats.spool_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                }
                Err(e) => {
                    self.stats.spool_errors.fetch_add(1, Ordering::Relaxed);
                    let msg = e.to_string();
                    let mut last = self.stats.spool_error.lock().unwrap_or_else(|p| p.into_inner());
                    if last.as_deref() != Some(&msg) {
                        tracing::error!(error = %msg, pending = pending.len(), "usage spool: cannot write; windows kept in memory and retried every second");
                    }
                    *last = Some(msg);
                    break;
                }
            }
        }
        self.stats.pending.store(pending.len() as u64, Ordering::Relaxed);
        // Saved before the shipper can read what was appended (it takes the spool's
        // lock): a window is never shipped and freed uncounted.
        if wrote {
            self.save_counters(&mut counters);
        }
        drop(counters);
        drop(spool);
        drop(pending);
        if wrote {
            self.notify();
        }
    }

    fn close_loop(&self) {
        loop {
            let stopping = self.wait(&self.stop, Duration::from_millis(100));
            let now = Instant::now();
            let cutoff = if stopping {
                // Every window, the open one too.
                self.meter.window_of(now) + 1
            } else {
                self.meter.window_of(now.checked_sub(GRACE).unwrap_or(now))
            };
            if cutoff > self.meter.open_from() {
                self.close_into_pending(cutoff);
            }
            self.flush_pending();
            if self.pending.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
                // Every window before the open one is spooled: the periods ended by then
                // are complete on this node.
                let mut counters = self.lock_counters();
                counters.complete_before(self.meter.open_from() * WINDOW_S);
                self.save_counters(&mut counters);
            }
            if stopping {
                // Windows the spool could not take keep their slots in the counts file:
                // the next start recovers them.
                return;
            }
        }
    }

    fn ship_loop(&self, mut sink: Box<dyn Sink>) {
        let mut backoff = Duration::from_millis(250);
        // Runs the store asked for again, and every run asked for in this process (each
        // is sent again once: a run the spool no longer holds is reported, not retried).
        let mut resend: VecDeque<(u64, u64)> = VecDeque::new();
        let mut asked: std::collections::BTreeSet<(u64, u64)> = std::collections::BTreeSet::new();
        let mut next_report = Instant::now();
        // After a batch was refused for good, its windows go one at a time up to its
        // last, so the refused one is found, parked, and the rest shipped.
        let mut one_by_one_through = 0u64;
        loop {
            let stopping = self.ship_stop.load(Ordering::Acquire);
            let again = resend.front().copied();
            let batch = {
                let spool = self.lock_spool();
                let first = again.map_or(spool.acked().saturating_add(1), |(from, _)| from);
                let max = if first <= one_by_one_through { 1 } else { BATCH };
                match again {
                    Some((_, to)) => spool.read(first, max, BATCH_BYTES).map(|mut b| {
                        b.retain(|(seq, _)| *seq <= to);
                        b
                    }),
                    None => spool.read(first, max, BATCH_BYTES),
                }
            };
            let batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "usage spool: cannot read");
                    Vec::new()
                }
            };
            if let Some((from, to)) = again {
                let first = batch.first().map_or(to + 1, |b| b.0);
                if first > from {
                    let gone = first.min(to + 1) - from;
                    self.stats.resend_unavailable.fetch_add(gone, Ordering::Relaxed);
                    tracing::error!(
                        from,
                        to = first.min(to + 1) - 1,
                        "usage windows asked for again are no longer in the spool"
                    );
                    // The node's counters stand for them: the reconciler learns which.
                    let mut counters = self.lock_counters();
                    counters.unavailable(from, first.min(to + 1) - 1);
                    self.save_counters(&mut counters);
                }
                if batch.is_empty() {
                    resend.pop_front();
                    continue;
                }
            }
            let Some(&(last, _)) = batch.last() else {
                if again.is_none() && (stopping || Instant::now() >= next_report) && !self.report(&mut *sink) {
                    next_report = Instant::now() + REPORT_RETRY;
                }
                if stopping {
                    return;
                }
                if again.is_none() {
                    let missing = sink.poll_missing();
                    self.chase(missing, &mut resend, &mut asked);
                }
                self.wait(&self.ship_stop, Duration::from_secs(1));
                continue;
            };
            match sink.send(&batch) {
                Ok(missing) => {
                    backoff = Duration::from_millis(250);
                    *self.stats.ship_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                    match again {
                        Some((_, to)) => {
                            self.stats.resent.fetch_add(batch.len() as u64, Ordering::Relaxed);
                            tracing::info!(
                                from = batch.first().map_or(last, |b| b.0),
                                to = last,
                                "usage windows sent again"
                            );
                            resend.pop_front();
                            if last < to {
                                resend.push_front((last + 1, to));
                            }
                        }
                        None => {
                            self.stats.shipped.fetch_add(batch.len() as u64, Ordering::Relaxed);
                            if let Err(e) = self.lock_spool().ack(last) {
                                tracing::error!(error = %e, "usage spool: cannot record the acknowledgement");
                            }
                        }
                    }
                    self.chase(missing, &mut resend, &mut asked);
                }
                Err(e) if e.is_refusal() && batch.len() > 1 => {
                    self.stats.ship_errors.fetch_add(1, Ordering::Relaxed);
                    one_by_one_through = last;
                }
                Err(e) if e.is_refusal() && self.park(last, &batch[0].1, &e) => {
                    self.stats.ship_errors.fetch_add(1, Ordering::Relaxed);
                    match again {
                        Some((_, to)) => {
                            resend.pop_front();
                            if last < to {
                                resend.push_front((last + 1, to));
                            }
                        }
                        None => {
                            if let Err(e) = self.lock_spool().ack(last) {
                                tracing::error!(error = %e, "usage spool: cannot record the acknowledgement");
                            }
                        }
                    }
                }
                Err(e) => {
                    self.stats.ship_errors.fetch_add(1, Ordering::Relaxed);
                    let e = e.to_string();
                    let mut last = self.stats.ship_error.lock().unwrap_or_else(|p| p.into_inner());
                    if last.as_deref() != Some(&e) {
                        tracing::warn!(error = %e, "usage windows not delivered; retrying (they stay in the spool)");
                    }
                    *last = Some(e);
                    drop(last);
                    if stopping {
                        return;
                    }
                    self.wait(&self.ship_stop, backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Sets window `seq` aside in the spool's `parked/` folder (the far side refused it
    /// for good, `why`), so the shipper goes on with the rest: an alert for the operator,
    /// never an endless retry. Whether it was parked (not past [`MAX_PARKED`], written).
    fn park(&self, seq: u64, window: &[u8], why: &SinkError) -> bool {
        let dir = self.lock_spool().dir().join("parked");
        let full = std::fs::read_dir(&dir).map(|d| d.take(MAX_PARKED).count() >= MAX_PARKED).unwrap_or(false);
        if full {
            tracing::error!(seq, error = %why, max = MAX_PARKED, "usage window refused, and the parked folder is full: trying it again");
            return false;
        }
        let written = std::fs::create_dir_all(&dir).map_err(|e| e.to_string()).and_then(|()| {
            postern_model::disk::write_atomic(&dir.join(format!("{seq:020}.json")), window).map_err(|e| e.to_string())
        });
        if let Err(e) = written {
            tracing::error!(seq, error = %e, "usage window refused, and it cannot be parked: trying it again");
            return false;
        }
        self.stats.parked.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            seq,
            error = %why,
            "usage window refused by the usage stream: parked in the spool's parked/ folder, the rest ships on"
        );
        true
    }

    /// Sends the reports of periods complete on this node that the control plane has not
    /// taken; whether every one was taken.
    fn report(&self, sink: &mut dyn Sink) -> bool {
        let due = self.lock_counters().due();
        for c in &due {
            match sink.report(c) {
                Ok(()) => {
                    self.stats.reports.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(period = %c.period, through = c.through, calls = c.calls(), "usage counters reported");
                    let mut counters = self.lock_counters();
                    counters.reported(c);
                    self.save_counters(&mut counters);
                }
                Err(e) => {
                    self.stats.report_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(period = %c.period, error = %e, "usage counters not reported; retrying");
                    return false;
                }
            }
        }
        true
    }

    /// Queues the runs the usage store lacks for a re-send: only what was acknowledged
    /// can be missing, and each run goes again once.
    fn chase(
        &self,
        missing: Vec<(u64, u64)>,
        resend: &mut VecDeque<(u64, u64)>,
        asked: &mut std::collections::BTreeSet<(u64, u64)>,
    ) {
        if missing.is_empty() {
            return;
        }
        let acked = self.lock_spool().acked();
        for (from, to) in missing {
            let run = (from.max(1), to.min(acked));
            if run.0 <= run.1 && asked.insert(run) {
                tracing::warn!(from = run.0, to = run.1, "the usage store lacks windows: sending them again");
                resend.push_back(run);
            }
        }
    }

    /// Sleeps up to `d` or until woken; whether `stop` is set.
    fn wait(&self, stop: &AtomicBool, d: Duration) -> bool {
        let (lock, cv) = &self.wake;
        let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let seen = *guard;
        if !stop.load(Ordering::Acquire) {
            let _ = cv.wait_timeout_while(guard, d, |n| *n == seen && !stop.load(Ordering::Acquire));
        }
        stop.load(Ordering::Acquire)
    }

    fn notify(&self) {
        let (lock, cv) = &self.wake;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        cv.notify_all();
    }

    /// Closes every window (the open one too) into the spool, gives the shipper one
    /// last try, and stops both threads. Call after requests have drained.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.notify();
        if let Some(t) = self.closer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        self.ship_stop.store(true, Ordering::Release);
        self.notify();
        if let Some(t) = self.shipper.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// Spooled records from `from` to `to` (inclusive), as stored: for re-sends.
    pub fn windows(&self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, SpoolError> {
        let want = usize::try_from(to.saturating_sub(from).saturating_add(1)).unwrap_or(usize::MAX).min(10_000);
        self.lock_spool().read(from, want, 64 << 20)
    }

    /// The spool's size, for metrics.
    pub fn spool_gauges(&self) -> SpoolGauges {
        let spool = self.lock_spool();
        SpoolGauges { unacked: spool.unacked(), bytes: spool.bytes(), cap: spool.cap() }
    }

    /// The busiest callers of the last closed window (at most [`TOP_CALLERS`]).
    pub fn top_callers(&self) -> Vec<TopCaller> {
        self.top.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The spool's state for `/readyz`.
    pub fn state(&self) -> serde_json::Value {
        let spool = self.lock_spool();
        let spool_error = self.stats.spool_error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let ship_error = self.stats.ship_error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let counters_error = self.stats.counters_error.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let counters = self.lock_counters().state();
        serde_json::json!({
            "metered": true,
            "node": self.node,
            "spool": if spool_error.is_some() { "degraded" } else { "ok" },
            "spool_error": spool_error,
            "ship_error": ship_error,
            "next_seq": spool.next_seq(),
            "acked": spool.acked(),
            "unacked": spool.unacked(),
            "spool_bytes": spool.bytes(),
            "pending": self.stats.pending.load(Ordering::Relaxed),
            "shipped": self.stats.shipped.load(Ordering::Relaxed),
            "ship_errors": self.stats.ship_errors.load(Ordering::Relaxed),
            "resent": self.stats.resent.load(Ordering::Relaxed),
            "resend_unavailable": self.stats.resend_unavailable.load(Ordering::Relaxed),
            "parked": self.stats.parked.load(Ordering::Relaxed),
            "counters": counters,
            "counters_error": counters_error,
            "counter_reports": self.stats.reports.load(Ordering::Relaxed),
            "counter_report_errors": self.stats.report_errors.load(Ordering::Relaxed),
        })
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<std::thread::JoinHandle<()>, SpoolError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| SpoolError::Io { path: PathBuf::from(name), source: e })
}

/// Sends windows to a control plane's intake, `POST /v1/usage`, with the node's token.
pub struct HttpSink {
    rt: tokio::runtime::Runtime,
    client: postern_model::tls::ControlClient,
    url: String,
    /// The control plane, `http(s)://host:port`.
    base: String,
    token: String,
    /// The node whose missing windows it asks for.
    node: String,
    /// Signs each batch (`x-postern-usage-signature`), when the node has a key.
    signer: Option<std::sync::Arc<postern_model::sign::Signer>>,
}

impl HttpSink {
    /// A sink to the control plane at `base` (`http(s)://host:port`) for `node`.
    pub fn new(base: &str, token: &str, ca: Option<&std::path::Path>, node: &str) -> Result<HttpSink, SetupError> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let client = {
            let _enter = rt.enter();
            postern_model::tls::client(ca)?
        };
        Ok(HttpSink {
            rt,
            client,
            url: format!("{}{}", base.trim_end_matches('/'), postern_model::protocol::USAGE_PATH),
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            node: node.to_owned(),
            signer: None,
        })
    }

    /// Signs every batch with the node's own key (`--usage-signing-key`).
    pub fn signed(mut self, signer: Option<std::sync::Arc<postern_model::sign::Signer>>) -> HttpSink {
        self.signer = signer;
        self
    }
}

/// The node's signature over `bytes` it sends as `node`'s usage.
pub fn sign_usage(signer: &postern_model::sign::Signer, node: &str, bytes: &[u8]) -> String {
    let hash = postern_model::content_hash(bytes);
    signer.sign(&postern_model::sign::Subject::Usage { node, hash: &hash })
}

impl HttpSink {
    /// Asks the control plane which of this node's numbers the usage store lacks
    /// (`GET /v1/nodes/<node>/usage/missing`).
    pub fn missing(&mut self) -> Result<Vec<(u64, u64)>, SinkError> {
        let url = format!("{}/v1/nodes/{}/usage/missing", self.base, self.node);
        let req = http::Request::get(&url).header(http::header::AUTHORIZATION, format!("Bearer {}", self.token));
        self.exchange(url, req, bytes::Bytes::new())
    }

    /// Reports the node's own counters of a period (`PUT /v1/nodes/<node>/usage/counters`).
    pub fn put_counters(&mut self, counters: &NodeCounters) -> Result<(), SinkError> {
        let url = format!("{}{}", self.base, postern_model::protocol::counters_path(&self.node));
        let body = serde_json::to_vec(counters)?;
        let req = http::Request::put(&url)
            .header(http::header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))?;
        self.send(&url, req).map(|_| ())
    }

    /// Sends `req` (10 s at most); the body of a success, the status and body otherwise.
    fn send(
        &mut self,
        url: &str,
        req: http::Request<http_body_util::Full<bytes::Bytes>>,
    ) -> Result<bytes::Bytes, SinkError> {
        let client = self.client.clone();
        self.rt.block_on(async move {
            let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
                .await
                .map_err(|_| SinkError::Timeout { url: url.to_owned(), secs: 10 })?
                .map_err(|source| SinkError::Request { url: url.to_owned(), source })?;
            let status = resp.status();
            let body =
                http_body_util::BodyExt::collect(resp.into_body()).await.map(|b| b.to_bytes()).unwrap_or_default();
            if !status.is_success() {
                let body = String::from_utf8_lossy(&body).trim().to_owned();
                return Err(SinkError::Status { url: url.to_owned(), status, body });
            }
            Ok(body)
        })
    }

    /// Sends `req` with `body` and reads the [`UsageAck`](postern_model::protocol::UsageAck)
    /// it is answered: the runs it names of this node's numbers.
    fn exchange(
        &mut self,
        url: String,
        req: http::request::Builder,
        body: bytes::Bytes,
    ) -> Result<Vec<(u64, u64)>, SinkError> {
        let req = req.body(http_body_util::Full::new(body))?;
        let body = self.send(&url, req)?;
        let ack: postern_model::protocol::UsageAck =
            serde_json::from_slice(&body).map_err(|source| SinkError::Answer { url, source })?;
        Ok(ack.missing.into_iter().filter(|m| m.node == self.node).map(|m| (m.from, m.to)).collect())
    }
}

/// Spooled windows as one batch, `{"windows": [...]}` ([`postern_model::protocol::UsageBatch`]),
/// their bytes as spooled.
pub fn batch_body(windows: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut body = Vec::with_capacity(windows.iter().map(|w| w.1.len() + 1).sum::<usize>() + 16);
    body.extend_from_slice(b"{\"windows\":[");
    for (i, (_, w)) in windows.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(w);
    }
    body.extend_from_slice(b"]}");
    body
}

impl Sink for HttpSink {
    fn send(&mut self, windows: &[(u64, Vec<u8>)]) -> Result<Vec<(u64, u64)>, SinkError> {
        let body = batch_body(windows);
        let mut req = http::Request::post(&self.url)
            .header(http::header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(signer) = &self.signer {
            req = req.header(postern_model::usage::SIGNATURE_HEADER, sign_usage(signer, &self.node, &body));
        }
        self.exchange(self.url.clone(), req, bytes::Bytes::from(body))
    }

    fn report(&mut self, counters: &NodeCounters) -> Result<(), SinkError> {
        self.put_counters(counters)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use postern_model::usage::{CallerKind, LATENCY_BUCKETS, Row};

    fn row(caller: &str, route: &str, status: [u64; 5]) -> Row {
        Row {
            caller: caller.into(),
            kind: CallerKind::Key,
            product: "p".into(),
            route: route.into(),
            status,
            latency: vec![0; LATENCY_BUCKETS],
            latency_us: 0,
        }
    }

    #[test]
    fn a_start_recovers_what_the_counts_file_holds_that_the_spool_did_not_take() {
        let dir = tempfile::tempdir().unwrap();
        let (w0, w1) = (179_608_320, 179_608_321);
        {
            // A run that began at spool number 1, spooled window w0 (its slots not yet
            // given back at the kill) and counted w1, open.
            let (mut spool, _) = Spool::open(dir.path(), "n", SpoolLimits::default()).unwrap();
            let w = Window::new("n".into(), 1, w0 * WINDOW_S, false, vec![row("k", "t/r", [0, 2, 0, 0, 0])]);
            let file = durable::Durable::in_dir(dir.path());
            let mut shards = file.create(spool.next_seq()).unwrap();
            spool.append(|_| serde_json::to_vec(&w).unwrap()).unwrap();
            let s = &mut shards[3];
            let a = s.take(w0, CallerKind::Key, b"k", "t/r", "p").unwrap();
            s.add(a, 1, 0, 10);
            s.add(a, 1, 0, 10);
            let b = s.take(w1, CallerKind::Key, b"k", "t/r", "p").unwrap();
            for _ in 0..5 {
                s.add(b, 1, 2, 10);
            }
        }
        let settings = Settings { node: "n".into(), dir: dir.path().to_owned(), limits: SpoolLimits::default() };
        let usage = Usage::start(settings.clone(), None).unwrap();
        assert_eq!(usage.stats.recovered.load(Ordering::Relaxed), 1);
        let records = usage.lock_spool().read(1, 10, 1 << 20).unwrap();
        let windows: Vec<Window> = records.iter().map(|(_, b)| serde_json::from_slice(b).unwrap()).collect();
        assert_eq!(windows.len(), 2, "w0 once, w1 recovered");
        assert_eq!(
            (windows[1].start, windows[1].recovered, windows[1].rows[0].status),
            (w1 * WINDOW_S, true, [0, 5, 0, 0, 0])
        );
        usage.stop();
        drop(usage);
        // Recovered once: the file started afresh, and a second start finds nothing.
        let usage = Usage::start(settings, None).unwrap();
        assert_eq!(usage.stats.recovered.load(Ordering::Relaxed), 0);
        usage.stop();
    }

    #[test]
    fn a_refusal_for_good_is_told_from_a_failure_worth_trying_again() {
        let status = |status| SinkError::Status { url: "u".into(), status, body: String::new() };
        assert!(status(http::StatusCode::CONFLICT).is_refusal());
        assert!(status(http::StatusCode::UNPROCESSABLE_ENTITY).is_refusal());
        assert!(status(http::StatusCode::BAD_REQUEST).is_refusal());
        assert!(!status(http::StatusCode::SERVICE_UNAVAILABLE).is_refusal());
        assert!(!status(http::StatusCode::UNAUTHORIZED).is_refusal(), "a token problem is fixed by the operator");
        assert!(!SinkError::NoControl.is_refusal());
    }

    #[test]
    fn the_busiest_callers_are_summed_over_routes_and_bounded() {
        let mut rows =
            vec![row("a", "r1", [0, 5, 0, 0, 1]), row("a", "r2", [0, 5, 0, 0, 0]), row("b", "r1", [0, 7, 0, 0, 3])];
        rows.extend((0..20).map(|i| row(&format!("k{i:02}"), "r1", [0, 1, 0, 0, 0])));
        let top = busiest(&rows);
        assert_eq!(top.len(), TOP_CALLERS);
        assert_eq!((top[0].caller.as_str(), top[0].calls, top[0].errors), ("a", 11, 1));
        assert_eq!((top[1].caller.as_str(), top[1].calls, top[1].errors), ("b", 10, 3));
        assert_eq!(top[2].caller, "k00", "ties by name");
    }
}
