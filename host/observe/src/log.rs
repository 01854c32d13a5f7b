//! JSON access logs: one line per observed request, written off the request path.
//!
//! Which requests: every server error, every client error of an authenticated caller,
//! the first client errors of each second of callers who are not (so that an anonymous
//! client sending bad requests cannot roll the log away; the rest are counted), and a
//! share of the rest, decided from the request's random id so that the same requests are
//! the sampled ones for logs and traces. What a line holds: the request id, trace id, route, caller (the
//! key's id or the app's `client_id`, never a credential: neither the key, the token
//! nor an `Authorization` or `x-api-key` value ever reaches a record), status, sizes,
//! durations (total, gateway-added, upstream), the snapshot version and the filters'
//! outcomes.
//!
//! The request side is [`AccessLog::wants`] and [`AccessLog::submit`]: a push into a
//! bounded lock-free queue, or a counted drop when it is full. The `access-log` thread
//! drains the queue every 50 ms, writes the lines through one buffer, rotates the file
//! by size (`path` → `path.1` → … → `path.<keep>`), and hands each line to the
//! [`LineSink`] if there is one.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::drain::{Drain, sampled};

/// Where and how much to log.
#[derive(Debug, Clone)]
pub struct LogSettings {
    /// The log file; rotated copies are `<path>.1` (newest) to `<path>.<keep>`.
    pub path: PathBuf,
    /// A file is rotated once it would grow past this many bytes.
    pub max_bytes: u64,
    /// Rotated files kept.
    pub keep: u32,
    /// Successes logged, in parts per 10,000 (100: 1 %); errors are always logged.
    pub success_per_10k: u32,
    /// Records the queue holds; past it, records are dropped and counted.
    pub capacity: usize,
    /// Client errors (4xx) of callers who did not authenticate logged per second, the
    /// first ones of each second; the rest are counted, not logged. Server errors and
    /// an authenticated caller's errors are always logged.
    pub anonymous_errors_per_s: u32,
}

impl LogSettings {
    /// A log at `path`: 100 MiB files, 5 kept, 1 % of successes, 16,384 queued records,
    /// 20 anonymous client errors a second.
    pub fn new(path: PathBuf) -> LogSettings {
        LogSettings {
            path,
            max_bytes: 100 << 20,
            keep: 5,
            success_per_10k: 100,
            capacity: 16_384,
            anonymous_errors_per_s: 20,
        }
    }

    /// The success rate as a fraction (`0.01`) in parts per 10,000, or an error.
    pub fn rate(fraction: f64) -> Result<u32, FractionError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(FractionError(fraction));
        }
        Ok((fraction * 10_000.0).round() as u32)
    }
}

/// A sampling rate that is not a fraction from 0 to 1.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("{0} is not a fraction from 0 to 1")]
pub struct FractionError(pub f64);

/// Why a [`LineSink`] did not take a line (its own queue full, or failed).
#[derive(Debug, thiserror::Error)]
#[error("the line was not taken: {0}")]
pub struct LineRefused(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Counters of the log, for metrics.
#[derive(Debug, Default)]
pub struct LogStats {
    /// Lines written to the file.
    pub written: AtomicU64,
    /// Records dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Lines lost to a failed write (a full or failing disk).
    pub failed: AtomicU64,
    /// Files rotated.
    pub rotations: AtomicU64,
    /// Lines the sink took.
    pub sent: AtomicU64,
    /// Lines the sink refused (its own queue full, or failed).
    pub sink_failed: AtomicU64,
    /// Lines the sink took but could not deliver.
    pub undelivered: AtomicU64,
    /// Client errors of anonymous callers not logged: past the second's budget.
    pub anonymous_sampled_out: AtomicU64,
}

/// Where lines go besides the file (a Kafka topic): called on the log's thread only.
pub trait LineSink: Send {
    /// Hands one line over, keyed by the caller (or the request id): must not block.
    fn send(&mut self, key: &str, line: &[u8]) -> Result<(), LineRefused>;
    /// Serves the sink's own callbacks; called after every batch and while idle.
    fn poll(&mut self);
    /// Waits up to `timeout` for lines handed over to leave, at shutdown.
    fn flush(&mut self, timeout: Duration);
    /// Lines taken so far that could not be delivered.
    fn undelivered(&self) -> u64;
}

/// How a caller authenticated, as logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CallerKind {
    /// An API key: the caller is its id.
    Key,
    /// An OAuth app: the caller is its `client_id`.
    App,
}

/// One Wasm or built-in filter's outcome on a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FilterOutcome {
    /// The filter's name on its route.
    pub name: String,
    /// `continue`, `answered` (it made the response) or `failed`.
    pub outcome: &'static str,
}

/// One observed request. Made only for a request that is logged, on its way out.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// When the request arrived.
    pub at: Option<SystemTime>,
    /// The `x-request-id` returned to the client.
    pub request_id: String,
    /// The W3C trace id the request was forwarded with (32 hex digits).
    pub trace_id: String,
    /// The listener's pool.
    pub pool: &'static str,
    /// The method.
    pub method: String,
    /// The path as received, without its query (a query may carry a credential).
    pub path: String,
    /// The route's id, once one matched.
    pub route: Option<String>,
    /// How the caller authenticated, and its key id or `client_id`.
    pub caller: Option<(CallerKind, String)>,
    /// The caller's plan.
    pub plan: Option<String>,
    /// The status sent.
    pub status: u16,
    /// The problem code, on an answer the gateway made itself.
    pub code: Option<&'static str>,
    /// Who made the answer: `gateway` (the gateway or a filter) or `upstream`.
    pub origin: &'static str,
    /// The request body's declared size.
    pub bytes_in: Option<u64>,
    /// Response body bytes sent.
    pub bytes_out: u64,
    /// From arrival to the response head.
    pub head: Duration,
    /// From arrival to the end of the response body (or its end by error or the
    /// client's leaving).
    pub total: Duration,
    /// Waiting for the backend's response head.
    pub upstream: Duration,
    /// The snapshot version that served it.
    pub snapshot: u64,
    /// The route's filters, in order, with what each did.
    pub filters: Vec<FilterOutcome>,
    /// How the response body ended: `complete`, `error` or `client_gone`.
    pub body: &'static str,
}

/// A record as one JSON line.
#[derive(Serialize)]
struct Line<'a> {
    ts: &'a str,
    request_id: &'a str,
    trace_id: &'a str,
    pool: &'a str,
    method: &'a str,
    path: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    route: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    caller_kind: Option<CallerKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    caller: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<&'a str>,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'a str>,
    origin: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_in: Option<u64>,
    bytes_out: u64,
    duration_ms: f64,
    head_ms: f64,
    upstream_ms: f64,
    gateway_ms: f64,
    snapshot: u64,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    filters: &'a [FilterOutcome],
    body: &'a str,
}

/// Milliseconds, to the microsecond.
fn ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

impl Record {
    /// The record as one JSON line, newline included.
    pub fn write_line(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let ts = self.at.map(|t| humantime::format_rfc3339_millis(t).to_string()).unwrap_or_default();
        let line = Line {
            ts: &ts,
            request_id: &self.request_id,
            trace_id: &self.trace_id,
            pool: self.pool,
            method: &self.method,
            path: &self.path,
            route: self.route.as_deref(),
            caller_kind: self.caller.as_ref().map(|c| c.0),
            caller: self.caller.as_ref().map(|c| c.1.as_str()),
            plan: self.plan.as_deref(),
            status: self.status,
            code: self.code,
            origin: self.origin,
            bytes_in: self.bytes_in,
            bytes_out: self.bytes_out,
            duration_ms: ms(self.total),
            head_ms: ms(self.head),
            upstream_ms: ms(self.upstream),
            gateway_ms: ms(self.head.saturating_sub(self.upstream)),
            snapshot: self.snapshot,
            filters: &self.filters,
            body: self.body,
        };
        serde_json::to_writer(&mut *out, &line)?;
        out.push(b'\n');
        Ok(())
    }

    /// The stream key: the caller, else the request id.
    fn key(&self) -> &str {
        self.caller.as_ref().map_or(self.request_id.as_str(), |c| c.1.as_str())
    }
}

/// The access log: a bounded queue in front of its own writer thread.
pub struct AccessLog {
    queue: Drain<Record>,
    success_per_10k: u32,
    /// The budget of anonymous client errors a second.
    anonymous_per_s: u32,
    /// The second (since `epoch`) in the upper 32 bits, the anonymous client errors
    /// logged in it in the lower 32.
    anonymous_window: AtomicU64,
    epoch: Instant,
    /// Counters, for metrics.
    pub stats: LogStats,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog").field("queued", &self.queue.len()).finish_non_exhaustive()
    }
}

impl AccessLog {
    /// Opens the file (appending to what is there) and starts the writer thread.
    pub fn start(settings: LogSettings, sink: Option<Box<dyn LineSink>>) -> io::Result<Arc<AccessLog>> {
        let file = Writer::open(&settings)?;
        let log = Arc::new(AccessLog {
            queue: Drain::new(settings.capacity),
            success_per_10k: settings.success_per_10k.min(10_000),
            anonymous_per_s: settings.anonymous_errors_per_s,
            anonymous_window: AtomicU64::new(0),
            epoch: Instant::now(),
            stats: LogStats::default(),
        });
        let worker = log.clone();
        log.queue.spawn("access-log", move || worker.run(file, sink))?;
        Ok(log)
    }

    /// Whether a request that ended with `status` is logged; `sample` is the request's
    /// random id (the same requests are sampled for traces). Every server error, every
    /// client error of an authenticated caller, the first client errors of each second
    /// of callers who are not (`anonymous`: anyone can send those as fast as the node
    /// answers), and a share of the rest.
    pub fn wants(&self, status: u16, sample: u128, anonymous: bool) -> bool {
        match status {
            500.. => true,
            400..500 if !anonymous => true,
            400..500 => {
                let second = u32::try_from(self.epoch.elapsed().as_secs()).unwrap_or(u32::MAX);
                self.anonymous_error_at(second)
            }
            _ => sampled(sample, self.success_per_10k),
        }
    }

    /// Whether an anonymous client error in `second` (since the log started) is within
    /// that second's budget; counts it when it is not.
    fn anonymous_error_at(&self, second: u32) -> bool {
        let budget = self.anonymous_per_s;
        let taken = self.anonymous_window.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
            let (at, n) = ((w >> 32) as u32, w as u32);
            if second > at {
                (budget > 0).then_some((u64::from(second) << 32) | 1)
            } else {
                (n < budget).then_some(w + 1)
            }
        });
        if taken.is_err() {
            self.stats.anonymous_sampled_out.fetch_add(1, Ordering::Relaxed);
        }
        taken.is_ok()
    }

    /// Queues a record; a full queue drops it and counts the drop. Never blocks.
    pub fn submit(&self, record: Box<Record>) {
        if !self.queue.push(record) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes what is queued and stops the thread (at shutdown, after the drain).
    pub fn shutdown(&self) {
        self.queue.shutdown();
    }

    fn run(&self, mut file: Writer, mut sink: Option<Box<dyn LineSink>>) {
        let mut line = Vec::with_capacity(1024);
        loop {
            let stopping = self.queue.stopping();
            let mut n = 0;
            while let Some(r) = self.queue.pop() {
                line.clear();
                if r.write_line(&mut line).is_err() {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                match file.write(&line) {
                    Ok(rotated) => {
                        self.stats.written.fetch_add(1, Ordering::Relaxed);
                        if rotated {
                            self.stats.rotations.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if let Some(s) = sink.as_mut() {
                    let body = line.strip_suffix(b"\n").unwrap_or(&line);
                    match s.send(r.key(), body) {
                        Ok(()) => self.stats.sent.fetch_add(1, Ordering::Relaxed),
                        Err(_) => self.stats.sink_failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
                n += 1;
                if n % 4096 == 0
                    && let Some(s) = sink.as_mut()
                {
                    s.poll();
                }
            }
            if n > 0 && file.flush().is_err() {
                self.stats.failed.fetch_add(n, Ordering::Relaxed);
            }
            if let Some(s) = sink.as_mut() {
                s.poll();
                self.stats.undelivered.store(s.undelivered(), Ordering::Relaxed);
            }
            if stopping {
                if let Some(s) = sink.as_mut() {
                    s.flush(Duration::from_secs(5));
                }
                return;
            }
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
}

/// The log file and its rotation.
struct Writer {
    path: PathBuf,
    max_bytes: u64,
    keep: u32,
    out: Option<BufWriter<File>>,
    size: u64,
}

impl Writer {
    fn open(settings: &LogSettings) -> io::Result<Writer> {
        let mut w = Writer {
            path: settings.path.clone(),
            max_bytes: settings.max_bytes.max(1),
            keep: settings.keep,
            out: None,
            size: 0,
        };
        w.reopen()?;
        Ok(w)
    }

    fn reopen(&mut self) -> io::Result<()> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let f = OpenOptions::new().create(true).append(true).open(&self.path)?;
        self.size = f.metadata()?.len();
        self.out = Some(BufWriter::with_capacity(64 * 1024, f));
        Ok(())
    }

    /// Appends a line, rotating first if it would pass the cap; whether it rotated. A
    /// failed file is opened again on the next line.
    fn write(&mut self, line: &[u8]) -> io::Result<bool> {
        let mut rotated = false;
        if self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.rotate()?;
            rotated = true;
        }
        if self.out.is_none() {
            self.reopen()?;
        }
        let Some(out) = self.out.as_mut() else { return Err(io::Error::other("the log is not open")) };
        match out.write_all(line) {
            Ok(()) => {
                self.size += line.len() as u64;
                Ok(rotated)
            }
            Err(e) => {
                self.out = None;
                Err(e)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self.out.as_mut().map(BufWriter::flush) {
            Some(Err(e)) => {
                self.out = None;
                Err(e)
            }
            _ => Ok(()),
        }
    }

    fn rotate(&mut self) -> io::Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush()?;
        }
        if self.keep == 0 {
            std::fs::remove_file(&self.path)?;
        } else {
            for i in (1..self.keep).rev() {
                let from = numbered(&self.path, i);
                if from.exists() {
                    std::fs::rename(&from, numbered(&self.path, i + 1))?;
                }
            }
            std::fs::rename(&self.path, numbered(&self.path, 1))?;
        }
        self.reopen()
    }
}

/// `path.<n>`.
fn numbered(path: &Path, n: u32) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::sync::Mutex;

    fn record(status: u16) -> Box<Record> {
        Box::new(Record {
            at: Some(SystemTime::UNIX_EPOCH + Duration::from_millis(1_765_000_000_123)),
            request_id: "0af7651916cd43dd8448eb211c80319c".into(),
            trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
            pool: "public",
            method: "GET".into(),
            path: "/v1/search".into(),
            route: Some("search/query".into()),
            caller: Some((CallerKind::Key, "key-0001".into())),
            plan: Some("gold".into()),
            status,
            code: (status == 429).then_some("rate_limited"),
            origin: if status == 429 { "gateway" } else { "upstream" },
            bytes_in: None,
            bytes_out: 120,
            head: Duration::from_micros(1500),
            total: Duration::from_micros(2250),
            upstream: Duration::from_micros(1200),
            snapshot: 7,
            filters: vec![FilterOutcome { name: "auth".into(), outcome: "continue" }],
            body: "complete",
        })
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field() {
        let mut out = Vec::new();
        record(429).write_line(&mut out).unwrap();
        assert_eq!(out.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["ts"], "2025-12-06T05:46:40.123Z");
        assert_eq!(v["route"], "search/query");
        assert_eq!(v["caller_kind"], "key");
        assert_eq!(v["caller"], "key-0001");
        assert_eq!(v["status"], 429);
        assert_eq!(v["code"], "rate_limited");
        assert_eq!(v["origin"], "gateway");
        assert_eq!(v["duration_ms"], 2.25);
        assert_eq!(v["head_ms"], 1.5);
        assert_eq!(v["upstream_ms"], 1.2);
        assert_eq!(v["gateway_ms"], 0.3);
        assert_eq!(v["filters"][0]["outcome"], "continue");
        assert!(v.get("bytes_in").is_none());
    }

    #[test]
    fn errors_are_always_wanted_and_successes_by_rate() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = LogSettings::new(dir.path().join("access.log"));
        s.success_per_10k = LogSettings::rate(0.01).unwrap();
        let log = AccessLog::start(s, None).unwrap();
        assert!(log.wants(500, 9_999, true) && log.wants(401, 5_000, false));
        let sampled = (0..100_000u128).filter(|i| log.wants(200, i * 7_919, false)).count();
        assert!((900..=1100).contains(&sampled), "{sampled}");
        assert!(LogSettings::rate(1.5).is_err());
        log.shutdown();
    }

    #[test]
    fn anonymous_client_errors_are_logged_up_to_a_budget_a_second() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = LogSettings::new(dir.path().join("access.log"));
        s.anonymous_errors_per_s = 3;
        let log = AccessLog::start(s, None).unwrap();
        let logged = |second| (0..10).filter(|_| log.anonymous_error_at(second)).count();
        assert_eq!(logged(0), 3, "the first three of a second");
        assert_eq!(logged(0), 0, "none more in the same second");
        assert_eq!(logged(1), 3, "the next second has its own budget");
        assert_eq!(logged(0), 0, "a late caller in a past second takes from the current one");
        assert_eq!(log.stats.anonymous_sampled_out.load(Ordering::Relaxed), 7 + 10 + 7 + 10);
        // Server errors and an authenticated caller's errors are never sampled out.
        assert!((0..1_000).all(|i| log.wants(503, i, true)));
        assert!((0..1_000).all(|i| log.wants(429, i, false)));
        assert_eq!(log.stats.anonymous_sampled_out.load(Ordering::Relaxed), 34);
        // A budget of 0 logs no anonymous client error.
        let mut s = LogSettings::new(dir.path().join("none.log"));
        s.anonymous_errors_per_s = 0;
        let none = AccessLog::start(s, None).unwrap();
        assert!(!none.anonymous_error_at(0) && !none.anonymous_error_at(5));
        log.shutdown();
        none.shutdown();
    }

    #[test]
    fn lines_reach_the_file_and_rotate_by_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/access.log");
        let mut s = LogSettings::new(path.clone());
        s.max_bytes = 2_000;
        s.keep = 2;
        let log = AccessLog::start(s, None).unwrap();
        for _ in 0..30 {
            log.submit(record(503));
        }
        log.shutdown();
        assert_eq!(log.stats.written.load(Ordering::Relaxed), 30);
        assert!(log.stats.rotations.load(Ordering::Relaxed) >= 2);
        let mut lines = 0;
        for p in [path.clone(), numbered(&path, 1), numbered(&path, 2)] {
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.len() <= 2_000, "{} holds {} bytes", p.display(), text.len());
            for l in text.lines() {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert_eq!(v["status"], 503);
                lines += 1;
            }
        }
        assert!(!numbered(&path, 3).exists(), "only two rotated files are kept");
        assert!(lines < 30 && lines > 0, "{lines}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = LogSettings::new(dir.path().join("access.log"));
        s.capacity = 8;
        let log = AccessLog::start(s, None).unwrap();
        // Filled faster than the thread's 50 ms round drains it.
        let started = std::time::Instant::now();
        for _ in 0..10_000 {
            log.submit(record(500));
        }
        let took = started.elapsed();
        log.shutdown();
        let (written, dropped) = (log.stats.written.load(Ordering::Relaxed), log.stats.dropped.load(Ordering::Relaxed));
        assert_eq!(written + dropped, 10_000);
        assert!(dropped > 0, "a queue of 8 took 10,000 records");
        assert!(took < Duration::from_secs(5), "submitting never waits: {took:?}");
    }

    struct Collect(Arc<Mutex<Vec<(String, String)>>>);

    impl LineSink for Collect {
        fn send(&mut self, key: &str, line: &[u8]) -> Result<(), LineRefused> {
            self.0.lock().unwrap().push((key.to_owned(), String::from_utf8_lossy(line).into_owned()));
            Ok(())
        }
        fn poll(&mut self) {}
        fn flush(&mut self, _: Duration) {}
        fn undelivered(&self) -> u64 {
            0
        }
    }

    #[test]
    fn a_sink_gets_each_line_keyed_by_caller() {
        let dir = tempfile::tempdir().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let log =
            AccessLog::start(LogSettings::new(dir.path().join("a.log")), Some(Box::new(Collect(got.clone())))).unwrap();
        log.submit(record(404));
        log.shutdown();
        let got = got.lock().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "key-0001");
        assert!(got[0].1.starts_with('{') && !got[0].1.ends_with('\n'));
        assert_eq!(log.stats.sent.load(Ordering::Relaxed), 1);
    }
}
