//! Fleet-wide rate limits: a background sync through Redis.
//!
//! Buckets are decided in memory on every request ([`Limiter`]); each holds this node's
//! share of its limit. Every `interval` (500 ms) this task, on its own thread and runtime
//! so it never competes with the request path, makes one pipelined call to Redis: one
//! Lua script per shard of keys, atomic, that for each key this node used since its last
//! report
//!
//! - refills the key's fleet-wide token bucket by the time since its last update and
//!   takes what this node admitted (the bucket may go into debt, at most one burst);
//! - replaces this node's entry in the key's traffic rate (the sum over nodes of each
//!   node's latest rate of tokens asked for, fading out over `TAU_S` so a node that died
//!   stops counting);
//!
//! and returns the bucket's tokens and the fleet's rate. This node's share is then its
//! own rate over the fleet's, and its bucket is set to hold that share of the fleet's
//! tokens. A key new to a node (or idle on it since) starts with an even share of the
//! live nodes, which every node registers in a sorted set on each sync.
//!
//! Keys are spread over `SHARDS` hashes, each its own hash tag (`<prefix>{NNN}`), so one
//! script call touches one Redis Cluster slot and the same code works against one Redis or a cluster
//! (one pipeline on a single server; one call per shard, pipelined per connection, on a
//! cluster).
//!
//! When Redis is unreachable or slow, nothing waits: buckets keep their last shares
//! (bounded fail-open), consumption accumulates for the next report, and after
//! `LOST_AFTER` missed intervals the limiter is marked lost so plans that fail closed
//! refuse their callers. The sync retries every interval and recovers by itself.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use postern_builtin_filters::ratelimit::{Limiter, SHARE_ONE, Touched};
use redis::aio::ConnectionLike;
use redis::{Cmd, Value};

/// Shards of the key space; one script call per shard with traffic.
const SHARDS: u64 = 1024;
/// How fast a node's reported rate fades out of a key's fleet rate when it stops
/// reporting, in seconds.
const TAU_S: f64 = 10.0;
/// How often a key far below its limit is reported.
const QUIET_REFRESH: Duration = Duration::from_secs(5);
/// Most keys reported in one sync (about 100 ms of Redis CPU).
const MAX_KEYS_PER_SYNC: usize = 25_000;
/// Reports a key needs before it may go quiet.
const QUIET_AFTER: u32 = 4;
/// Missed intervals after which the sync counts as lost.
const LOST_AFTER: u32 = 4;
/// A node not seen for this long no longer counts for even shares, in seconds.
const NODE_TTL_S: u64 = 5;

/// One shard's keys in one call. The shard is a hash of fields named by the 8-byte key,
/// each `<ddd>` (tokens, last update, fleet rate); lines come packed (`LINE` bytes
/// each: key, admitted, rate, old rate, rps, window, burst) and answers go back packed (`<ff>`:
/// tokens, fleet rate, per key). Per key: refill, take what this node admitted, swap its
/// rate into the fleet's. Each call also sweeps a few fields and drops stale ones.
const KEYS_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tau, horizon, stale, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local blob = ARGV[5]
local n = math.floor(#blob / 32)
local names = {}
for i = 1, n do
  local at = (i - 1) * 32 + 1
  names[i] = string.sub(blob, at, at + 7)
end
local cur = redis.call('HMGET', KEYS[1], unpack(names))
local set, out = {}, {}
for i = 1, n do
  local used, rnew, old, rps, win, burst = struct.unpack('<I4ffffI4', blob, (i - 1) * 32 + 9)
  local tokens, ts, rate = burst, now, 0
  local v = cur[i]
  if v and #v == 24 then
    tokens, ts, rate = struct.unpack('<ddd', v)
    if now - ts > stale then tokens, ts, rate = burst, now, 0 end
  end
  local el = math.max(0, now - ts)
  tokens = math.min(burst + rps * math.max(horizon, win), tokens + el * rps) - used
  if tokens < -burst then tokens = -burst end
  rate = math.max(0, rate * math.exp(-el / tau) - old) + rnew
  set[2 * i - 1] = names[i]
  set[2 * i] = struct.pack('<ddd', tokens, now, rate)
  out[i] = struct.pack('<ff', tokens, rate)
end
redis.call('HSET', KEYS[1], unpack(set))
redis.call('PEXPIRE', KEYS[1], ttl)
local cursor = redis.call('HGET', KEYS[1], '~') or '0'
local scan = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 16)
local fields = scan[2]
for j = 1, #fields, 2 do
  local f, v = fields[j], fields[j + 1]
  if #f == 8 and #v == 24 then
    local _, ts = struct.unpack('<dd', v)
    if now - ts > stale then redis.call('HDEL', KEYS[1], f) end
  end
end
redis.call('HSET', KEYS[1], '~', scan[1])
return table.concat(out)
";

/// Bytes of one packed line.
const LINE: usize = 32;
/// Most keys in one script call (Lua's `unpack` has a stack limit).
const MAX_PER_CALL: usize = 2000;

/// Registers this node and answers how many nodes synced lately.
const NODES_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], 60000)
return redis.call('ZCARD', KEYS[1])
";

/// Where and how to sync.
#[derive(Debug, Clone)]
pub struct SyncSettings {
    /// Redis URLs: one server, or seed nodes of a cluster.
    pub urls: Vec<String>,
    /// The URLs are a Redis Cluster.
    pub cluster: bool,
    /// Prefix of every key this fleet writes.
    pub prefix: String,
    /// How often to sync.
    pub interval: Duration,
    /// This node's name in the fleet.
    pub node_id: String,
}

impl SyncSettings {
    /// The settings the command line gives for the node `node_id`; `None` without Redis
    /// (each node then enforces whole limits on its own).
    pub fn from_args(args: &crate::node::args::Args, node_id: &str) -> Option<SyncSettings> {
        if args.ratelimit_redis.is_empty() {
            return None;
        }
        Some(SyncSettings {
            urls: args.ratelimit_redis.clone(),
            cluster: args.ratelimit_cluster,
            prefix: args.ratelimit_prefix.clone(),
            interval: Duration::from_millis(args.ratelimit_sync_ms.max(50)),
            node_id: node_id.to_owned(),
        })
    }

    /// Gives `builder` a fleet-mode limiter and starts syncing it.
    pub fn start(self, builder: &mut crate::snapshot::Builder) -> anyhow::Result<Arc<RateSync>> {
        let limiter = Arc::new(Limiter::fleet(crate::snapshot::RATE_BUCKETS));
        builder.use_limiter(limiter.clone());
        let shown: Vec<String> = self.urls.iter().map(|u| postern_model::redact_url(u)).collect();
        tracing::info!(redis = ?shown, cluster = self.cluster, node = %self.node_id, "fleet-wide rate limits");
        start(limiter, self).context("cannot start the rate sync")
    }
}

/// The sync's state, for `/metrics` and `/readyz`.
#[derive(Debug)]
pub struct RateSync {
    /// The node's limiter.
    pub limiter: Arc<Limiter>,
    /// Sync interval.
    pub interval: Duration,
    /// Successful syncs.
    pub ok: AtomicU64,
    /// Failed syncs (unreachable, slow or refused).
    pub failed: AtomicU64,
    /// Keys reported by the last successful sync.
    pub keys: AtomicU64,
    /// Bytes of requests sent, in total.
    pub bytes_sent: AtomicU64,
    /// Live nodes seen by the last successful sync.
    pub nodes: AtomicU64,
    /// When the last sync succeeded (unix ms; 0: never).
    pub last_ok_ms: AtomicU64,
    /// How long the last successful sync took, in µs.
    pub last_us: AtomicU64,
    /// Syncs that had more keys to report than one sync takes.
    pub deferred: AtomicU64,
}

impl RateSync {
    /// `synced`, `lost` or `starting`.
    pub fn state(&self) -> &'static str {
        match self.limiter.fleet_state() {
            Some(f) if f.lost() => "lost",
            _ if self.last_ok_ms.load(Ordering::Relaxed) == 0 => "starting",
            _ => "synced",
        }
    }

    /// Milliseconds since the last successful sync.
    pub fn since_ok_ms(&self) -> Option<u64> {
        let last = self.last_ok_ms.load(Ordering::Relaxed);
        (last > 0).then(|| unix_ms().saturating_sub(last))
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(0)).unwrap_or(0)
}

/// A key this node reports.
struct Active {
    bucket: Arc<postern_builtin_filters::ratelimit::Bucket>,
    interval_ns: u64,
    burst: u64,
    /// The rate (tokens asked for a second) last reported, and when (limiter ns).
    rate: f64,
    reported_at: u64,
    /// Counts not yet reported.
    asked: u64,
    admitted: u64,
    /// The key's fleet-wide rate at the last report.
    fleet_rate: f64,
    /// Reports answered since the key became active here.
    reports: u32,
}

/// One key's line in a report.
struct Line {
    key: u64,
    admitted: u64,
    rate: f64,
    /// This node's previous rate as the fleet's sum holds it now (faded since).
    old: f64,
    /// Seconds the counts cover.
    window: f64,
    /// How much the report matters: refusals first, then use of its share.
    urgency: f64,
}

enum Conn {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// Starts the sync on its own thread. Returns its state.
pub fn start(limiter: Arc<Limiter>, settings: SyncSettings) -> anyhow::Result<Arc<RateSync>> {
    if limiter.fleet_state().is_none() {
        anyhow::bail!("the rate limiter is not in fleet mode");
    }
    let state = Arc::new(RateSync {
        limiter,
        interval: settings.interval,
        ok: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        keys: AtomicU64::new(0),
        bytes_sent: AtomicU64::new(0),
        nodes: AtomicU64::new(0),
        last_ok_ms: AtomicU64::new(0),
        last_us: AtomicU64::new(0),
        deferred: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let s = state.clone();
    std::thread::Builder::new().name("postern-ratesync".into()).spawn(move || rt.block_on(run(s, settings)))?;
    Ok(state)
}

async fn connect(settings: &SyncSettings, timeout: Duration) -> redis::RedisResult<Conn> {
    if settings.cluster {
        let client = redis::cluster::ClusterClient::builder(settings.urls.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(0)
            .build()?;
        Ok(Conn::Cluster(client.get_async_connection().await?))
    } else {
        let url = settings.urls.first().map(String::as_str).unwrap_or("redis://127.0.0.1:6379");
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(0);
        Ok(Conn::Single(redis::aio::ConnectionManager::new_with_config(client, config).await?))
    }
}

async fn run(state: Arc<RateSync>, settings: SyncSettings) {
    let Some(fleet) = state.limiter.fleet_state() else { return };
    let keys_script = redis::Script::new(KEYS_SCRIPT);
    let nodes_script = redis::Script::new(NODES_SCRIPT);
    let budget = settings.interval.mul_f64(0.8);
    let mut active: HashMap<u64, Active, foldhash::fast::RandomState> = HashMap::default();
    let mut touched = Vec::new();
    let mut conn: Option<Conn> = None;
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut last_ok = started;
    loop {
        ticker.tick().await;
        touched.clear();
        fleet.drain(&mut touched);
        collect(&mut active, &touched);
        let now = state.limiter.now();
        let mut lines = report(&mut active, now, settings.interval, fleet.even_share());
        if lines.len() > MAX_KEYS_PER_SYNC {
            // More than Redis should take in one interval: the most urgent now, the rest
            // keep their counts for the next sync.
            lines.select_nth_unstable_by(MAX_KEYS_PER_SYNC, |a, b| b.urgency.total_cmp(&a.urgency));
            lines.truncate(MAX_KEYS_PER_SYNC);
            state.deferred.fetch_add(1, Ordering::Relaxed);
        }

        let t0 = Instant::now();
        if conn.is_none() {
            match tokio::time::timeout(budget, connect(&settings, budget)).await {
                Ok(Ok(c)) => conn = Some(c),
                Ok(Err(e)) => tracing::debug!(error = %e, "rate sync: cannot connect"),
                Err(_) => tracing::debug!("rate sync: connect timed out"),
            }
        }
        let result = match conn.as_mut() {
            None => Err("not connected".to_owned()),
            Some(c) => {
                let call = sync(c, &keys_script, &nodes_script, &settings, &active, &lines, &state);
                match tokio::time::timeout(budget, call).await {
                    Ok(r) => r,
                    Err(_) => Err("timed out".to_owned()),
                }
            }
        };
        match result {
            Ok((answers, nodes)) => {
                let now = state.limiter.now();
                fleet.set_nodes(nodes);
                apply(&mut active, &lines, &answers, now, fleet.even_share());
                last_ok = Instant::now();
                state.nodes.store(nodes, Ordering::Relaxed);
                state.keys.store(lines.len() as u64, Ordering::Relaxed);
                state.last_us.store(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
                state.last_ok_ms.store(unix_ms(), Ordering::Relaxed);
                state.ok.fetch_add(1, Ordering::Relaxed);
                if fleet.lost() {
                    tracing::info!(nodes, "rate sync back");
                }
                fleet.set_lost(false);
            }
            Err(why) => {
                state.failed.fetch_add(1, Ordering::Relaxed);
                // A broken connection is made again next time; the manager would retry
                // on its own, but with our timeouts a fresh one is simpler to reason about.
                conn = None;
                if last_ok.elapsed() >= settings.interval * LOST_AFTER && !fleet.lost() {
                    tracing::warn!(error = %why, "rate sync lost: nodes keep their last shares");
                    fleet.set_lost(true);
                }
            }
        }
    }
}

/// Adds buckets checked since the last sync to the reported set.
fn collect(active: &mut HashMap<u64, Active, foldhash::fast::RandomState>, touched: &[Touched]) {
    for t in touched {
        let a = active.entry(t.key).or_insert_with(|| Active {
            bucket: t.bucket.clone(),
            interval_ns: t.interval_ns,
            burst: t.burst,
            rate: 0.0,
            reported_at: 0,
            asked: 0,
            admitted: 0,
            fleet_rate: 0.0,
            reports: 0,
        });
        if !Arc::ptr_eq(&a.bucket, &t.bucket) {
            // The bucket was evicted and made again: report for the live one.
            a.bucket = t.bucket.clone();
        }
        a.interval_ns = t.interval_ns;
        a.burst = t.burst;
    }
}

/// Takes every active bucket's counts and makes this sync's lines; drops keys idle on
/// this node since their last report of zero, giving their buckets an even share again.
fn report(
    active: &mut HashMap<u64, Active, foldhash::fast::RandomState>,
    now: u64,
    interval: Duration,
    even: u32,
) -> Vec<Line> {
    let mut lines = Vec::with_capacity(active.len());
    active.retain(|&key, a| {
        let (asked, admitted) = a.bucket.take_counts();
        a.asked += asked;
        a.admitted += admitted;
        if a.asked == 0 && a.rate == 0.0 {
            a.bucket.set_share(even);
            return false;
        }
        let window = if a.reported_at == 0 {
            interval.as_secs_f64()
        } else {
            (now.saturating_sub(a.reported_at) as f64 / 1e9).max(0.001)
        };
        let rate = a.asked as f64 / window;
        // A key far below its limit everywhere (the fleet's rate and this node's both
        // under half of what they may use) needs no coordination every interval: it is
        // reported every `QUIET_REFRESH` instead, its counts kept until then.
        let limit = 1e9 / a.interval_ns.max(1) as f64;
        let own_limit = limit * f64::from(a.bucket.share()) / f64::from(SHARE_ONE);
        // Only once the fleet's rate is known: a first answer may hold this node's
        // rate alone.
        let quiet = a.reports >= QUIET_AFTER
            && a.asked == a.admitted
            && a.asked > 0
            && a.fleet_rate * 2.0 < limit
            && rate * 2.0 < own_limit
            && window < QUIET_REFRESH.as_secs_f64();
        if !quiet {
            let old = a.rate * (-window / TAU_S).exp();
            let refused = if a.asked > a.admitted { 1e9 } else { 0.0 };
            let urgency = refused + rate / own_limit.max(1e-9) + a.fleet_rate / limit.max(1e-9);
            lines.push(Line { key, admitted: a.admitted, rate, old, window, urgency });
        }
        true
    });
    lines
}

/// The shard's hash: `<prefix>{NNN}`, one Redis Cluster slot per hash tag.
fn shard_name(prefix: &str, shard: u64) -> String {
    let mut s = String::with_capacity(prefix.len() + 8);
    let _ = write!(s, "{prefix}{{{shard:03x}}}");
    s
}

/// Appends one key's packed line.
fn pack_line(out: &mut Vec<u8>, l: &Line, a: &Active) {
    let rps = 1e9 / a.interval_ns.max(1) as f64;
    out.extend_from_slice(&l.key.to_le_bytes());
    out.extend_from_slice(&u32::try_from(l.admitted).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&(l.rate as f32).to_le_bytes());
    out.extend_from_slice(&(l.old as f32).to_le_bytes());
    out.extend_from_slice(&(rps as f32).to_le_bytes());
    out.extend_from_slice(&(l.window as f32).to_le_bytes());
    out.extend_from_slice(&u32::try_from(a.burst).unwrap_or(u32::MAX).to_le_bytes());
}

/// Builds the script calls, one per shard, and runs them; returns each line's answer
/// (fleet tokens, fleet rate) in line order, and the live node count.
async fn sync(
    conn: &mut Conn,
    keys_script: &redis::Script,
    nodes_script: &redis::Script,
    settings: &SyncSettings,
    active: &HashMap<u64, Active, foldhash::fast::RandomState>,
    lines: &[Line],
    state: &RateSync,
) -> Result<(Vec<(f64, f64)>, u64), String> {
    // Lines grouped by shard, keeping each line's index.
    let mut by_shard: HashMap<u64, Vec<usize>, foldhash::fast::RandomState> = HashMap::default();
    for (i, l) in lines.iter().enumerate() {
        by_shard.entry(l.key % SHARDS).or_default().push(i);
    }
    let horizon = settings.interval.as_secs_f64();
    let mut calls: Vec<(Cmd, Vec<usize>)> = Vec::with_capacity(by_shard.len());
    for (shard, idx) in by_shard {
        for chunk in idx.chunks(MAX_PER_CALL) {
            let mut blob = Vec::with_capacity(chunk.len() * LINE);
            // Keep a key's state at least as long as its bucket takes to fill.
            let mut ttl_ms = 30_000u64;
            for &i in chunk {
                if let Some(a) = active.get(&lines[i].key) {
                    pack_line(&mut blob, &lines[i], a);
                    ttl_ms = ttl_ms.max(a.burst.saturating_mul(a.interval_ns) / 1_000_000 * 2);
                }
            }
            if blob.len() != chunk.len() * LINE {
                return Err("a reported key left the active set".to_owned());
            }
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(keys_script.get_hash()).arg(1).arg(shard_name(&settings.prefix, shard));
            cmd.arg(TAU_S).arg(horizon).arg(ttl_ms as f64 / 1000.0).arg(ttl_ms).arg(blob);
            calls.push((cmd, chunk.to_vec()));
        }
    }
    let mut nodes_cmd = redis::cmd("EVALSHA");
    nodes_cmd.arg(nodes_script.get_hash()).arg(1).arg(format!("{}nodes", settings.prefix));
    nodes_cmd.arg(&settings.node_id).arg(NODE_TTL_S);

    let bytes: usize =
        calls.iter().map(|(c, _)| c.get_packed_command().len()).sum::<usize>() + nodes_cmd.get_packed_command().len();
    state.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);

    let replies = match conn {
        Conn::Single(c) => {
            let mut pipe = redis::pipe();
            pipe.add_command(nodes_cmd.clone());
            for (cmd, _) in &calls {
                pipe.add_command(cmd.clone());
            }
            let first: redis::RedisResult<Vec<Value>> = pipe.query_async(c).await;
            match first {
                Err(e) if is_noscript(&e) => {
                    load(c, &[keys_script, nodes_script]).await.map_err(|e| e.to_string())?;
                    pipe.query_async(c).await.map_err(|e| e.to_string())?
                }
                other => other.map_err(|e| e.to_string())?,
            }
        }
        Conn::Cluster(c) => {
            let mut out = Vec::with_capacity(calls.len() + 1);
            for attempt in 0..2 {
                let all = std::iter::once(&nodes_cmd).chain(calls.iter().map(|(cmd, _)| cmd));
                let futs = all.map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<Value>(&mut c).await }
                });
                let results = futures_util::future::join_all(futs).await;
                if attempt == 0 && results.iter().any(|r| matches!(r, Err(e) if is_noscript(e))) {
                    load(c, &[keys_script, nodes_script]).await.map_err(|e| e.to_string())?;
                    continue;
                }
                out = results.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
                break;
            }
            out
        }
    };
    let mut it = replies.into_iter();
    let nodes = match it.next() {
        Some(Value::Int(n)) => u64::try_from(n).unwrap_or(1),
        other => return Err(format!("unexpected node count {other:?}")),
    };
    let mut answers = vec![(0.0, 0.0); lines.len()];
    for ((_, idx), reply) in calls.iter().zip(it) {
        let packed = match reply {
            Value::BulkString(b) => b,
            Value::SimpleString(s) => s.into_bytes(),
            other => return Err(format!("unexpected reply {other:?}")),
        };
        if packed.len() != idx.len() * 8 {
            return Err("short reply".to_owned());
        }
        for (k, &i) in idx.iter().enumerate() {
            let f = |at: usize| {
                let mut b = [0u8; 4];
                b.copy_from_slice(&packed[at..at + 4]);
                f64::from(f32::from_le_bytes(b))
            };
            answers[i] = (f(8 * k), f(8 * k + 4));
        }
    }
    Ok((answers, nodes))
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

async fn load(c: &mut impl ConnectionLike, scripts: &[&redis::Script]) -> Result<(), redis::RedisError> {
    for s in scripts {
        s.prepare_invoke().load_async(c).await?;
    }
    Ok(())
}

/// Sets each reported bucket's share and level from the fleet's answer.
fn apply(
    active: &mut HashMap<u64, Active, foldhash::fast::RandomState>,
    lines: &[Line],
    answers: &[(f64, f64)],
    now: u64,
    even: u32,
) {
    for (l, &(tokens, fleet_rate)) in lines.iter().zip(answers) {
        let Some(a) = active.get_mut(&l.key) else { continue };
        let share = if l.rate > 0.0 && fleet_rate > 0.0 {
            let s = (l.rate / fleet_rate).min(1.0) * f64::from(SHARE_ONE);
            s as u32
        } else {
            even
        };
        a.bucket.apply(now, share, tokens, a.interval_ns, a.burst);
        a.fleet_rate = fleet_rate;
        a.reports = a.reports.saturating_add(1);
        a.rate = l.rate;
        a.reported_at = now;
        a.asked = 0;
        a.admitted = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use postern_builtin_filters::ratelimit::Limit;
    use postern_model::Rate;

    fn setup() -> (Limiter, Limit, HashMap<u64, Active, foldhash::fast::RandomState>) {
        let limiter = Limiter::fleet(1024);
        let limit = Limit::from_rate("c", &Rate { rps: 100, burst: 10 }).unwrap_or_else(|e| panic!("{e}"));
        (limiter, limit, HashMap::default())
    }

    fn drain(limiter: &Limiter, active: &mut HashMap<u64, Active, foldhash::fast::RandomState>) {
        let mut touched = Vec::new();
        if let Some(f) = limiter.fleet_state() {
            f.drain(&mut touched);
        }
        collect(active, &touched);
    }

    #[test]
    fn a_report_carries_rates_and_a_share_follows_the_fleet_rate() {
        let (limiter, limit, mut active) = setup();
        let now = limiter.now() + 1_000_000_000;
        for _ in 0..50 {
            let _ = limiter.take(1, &limit, 1, now);
        }
        drain(&limiter, &mut active);
        let lines = report(&mut active, now, Duration::from_millis(500), SHARE_ONE / 2);
        assert_eq!(lines.len(), 1);
        // 50 asked in a first window of 500 ms: 100/s; the even share was the whole
        // burst of 10 (a node alone before its first sync).
        assert_eq!((lines[0].admitted, lines[0].rate, lines[0].old), (10, 100.0, 0.0));
        // The fleet asks for 400/s in all: this node holds a quarter.
        apply(&mut active, &lines, &[(0.0, 400.0)], now, SHARE_ONE / 2);
        assert_eq!(active[&1].bucket.share(), SHARE_ONE / 4);
        assert_eq!(active[&1].rate, 100.0);
        // Nothing asked since: one more report of zero, then the key leaves and its
        // bucket goes back to an even share.
        let later = now + 500_000_000;
        let lines = report(&mut active, later, Duration::from_millis(500), SHARE_ONE / 3);
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].rate, 0.0);
        assert!((lines[0].old - 100.0 * (-0.5f64 / TAU_S).exp()).abs() < 1e-9);
        apply(&mut active, &lines, &[(10.0, 300.0)], later, SHARE_ONE / 3);
        let bucket = active[&1].bucket.clone();
        assert!(report(&mut active, later + 500_000_000, Duration::from_millis(500), SHARE_ONE / 3).is_empty());
        assert!(active.is_empty());
        assert_eq!(bucket.share(), SHARE_ONE / 3);
    }

    #[test]
    fn counts_from_failed_syncs_are_reported_next_time() {
        let (limiter, limit, mut active) = setup();
        let now = limiter.now() + 1_000_000_000;
        let _ = limiter.take(5, &limit, 3, now);
        drain(&limiter, &mut active);
        let _ = report(&mut active, now, Duration::from_millis(500), SHARE_ONE);
        // No apply (the sync failed); more traffic; the next report holds both.
        let _ = limiter.take(5, &limit, 2, now);
        drain(&limiter, &mut active);
        let lines = report(&mut active, now + 500_000_000, Duration::from_millis(500), SHARE_ONE);
        assert_eq!(lines[0].admitted, 5);
    }

    #[test]
    fn a_shard_is_one_hash_tag_and_lines_pack_to_their_size() {
        assert_eq!(shard_name("p:", 0x2f0), "p:{2f0}");
        let (limiter, limit, mut active) = setup();
        let _ = limiter.take(9, &limit, 1, limiter.now());
        drain(&limiter, &mut active);
        let lines = report(&mut active, limiter.now(), Duration::from_millis(500), SHARE_ONE);
        let mut blob = Vec::new();
        pack_line(&mut blob, &lines[0], &active[&9]);
        assert_eq!(blob.len(), LINE);
        assert_eq!(&blob[..8], &9u64.to_le_bytes());
        assert_eq!(&blob[28..], &10u32.to_le_bytes(), "the burst");
    }
}
