//! What the fleet-wide rate sync costs: 100 k active keys on one node, synced every
//! 500 ms with the Redis at 127.0.0.1:6379 (or `POSTERN_BENCH_REDIS`).
//!
//! `cargo bench -p postern --bench ratesync`
//!
//! Prints, per sync: bytes sent, the sync's duration, and the Redis CPU it used (from
//! `INFO cpu`); and the memory per active key on the node (RSS) and in Redis
//! (`used_memory`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use postern::node::ratesync::{SyncSettings, start};
use postern_builtin_filters::ratelimit::{Limit, Limiter};

const KEYS: u64 = 100_000;
const SYNCS: u64 = 20;

fn redis_info(con: &mut redis::Connection, section: &str, field: &str) -> f64 {
    let text: String = redis::cmd("INFO").arg(section).query(con).expect("INFO");
    text.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

fn redis_cpu(con: &mut redis::Connection) -> f64 {
    redis_info(con, "cpu", "used_cpu_user") + redis_info(con, "cpu", "used_cpu_sys")
}

fn rss_kib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let url = std::env::var("POSTERN_BENCH_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // Every key asks for 2 tokens a second. Under a limit of 3/s every key is near its
    // limit and reported on every sync (the worst case); under 100/s keys are far below
    // it and reported every 5 s (the common case).
    measure(&url, 3, "every key near its limit (3/s)");
    measure(&url, 100, "every key far below its limit (100/s)");
}

fn measure(url: &str, rps: u64, label: &str) {
    let mut con = redis::Client::open(url).unwrap().get_connection().expect("Redis for the bench");
    let limit = Limit::from_rate("bench", &postern_model::Rate { rps, burst: rps }).unwrap();
    let limiter = Arc::new(Limiter::fleet(1 << 20));
    let rss0 = rss_kib();
    let mem0 = redis_info(&mut con, "memory", "used_memory");
    let prefix = format!("postern-bench:{}:{rps}:", std::process::id());
    let settings = SyncSettings {
        urls: vec![url.to_owned()],
        cluster: false,
        prefix,
        interval: Duration::from_millis(500),
        node_id: format!("bench-{rps}"),
    };
    let sync = start(limiter.clone(), settings).unwrap();
    let touch = |limiter: &Limiter| {
        let now = limiter.now();
        for k in 0..KEYS {
            let _ = limiter.take(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), &limit, 1, now);
        }
    };
    // Warm up: every key reported once.
    for _ in 0..3 {
        touch(&limiter);
        std::thread::sleep(Duration::from_millis(500));
    }
    let (ok0, failed0, bytes0, cpu0) = (
        sync.ok.load(Ordering::Relaxed),
        sync.failed.load(Ordering::Relaxed),
        sync.bytes_sent.load(Ordering::Relaxed),
        redis_cpu(&mut con),
    );
    let mut durations = Vec::new();
    let mut keys = Vec::new();
    let t0 = Instant::now();
    for _ in 0..SYNCS {
        touch(&limiter);
        std::thread::sleep(Duration::from_millis(500));
        durations.push(sync.last_us.load(Ordering::Relaxed));
        keys.push(sync.keys.load(Ordering::Relaxed));
    }
    let wall = t0.elapsed().as_secs_f64();
    let ok = sync.ok.load(Ordering::Relaxed) - ok0;
    let failed = sync.failed.load(Ordering::Relaxed) - failed0;
    let attempts = (ok + failed).max(1) as f64;
    let bytes = (sync.bytes_sent.load(Ordering::Relaxed) - bytes0) as f64;
    let cpu = redis_cpu(&mut con) - cpu0;
    let mem1 = redis_info(&mut con, "memory", "used_memory");
    let rss1 = rss_kib();
    durations.sort_unstable();
    let mean_keys = keys.iter().sum::<u64>() as f64 / keys.len() as f64;
    println!("== {KEYS} active keys, {label}");
    println!("syncs                   {ok} ok, {failed} failed in {wall:.1} s");
    println!("keys reported per sync  {mean_keys:.0} (mean)");
    println!(
        "sent per sync           {:.2} MB ({:.1} B per reported key)",
        bytes / attempts / 1e6,
        bytes / attempts / mean_keys.max(1.0)
    );
    println!(
        "sync duration p50/max   {:.1} / {:.1} ms",
        durations[durations.len() / 2] as f64 / 1e3,
        durations[durations.len() - 1] as f64 / 1e3
    );
    println!(
        "Redis CPU per sync      {:.1} ms ({:.0} % of one core for this node)",
        cpu / attempts * 1e3,
        cpu / wall * 100.0
    );
    println!(
        "node memory per key     {:.0} B (RSS: bucket, cache slot, sync state)",
        (rss1 - rss0) * 1024.0 / KEYS as f64
    );
    println!("Redis memory per key    {:.0} B (used_memory)", (mem1 - mem0) / KEYS as f64);
}
