//! Per-second rate limits with bursts, decided in memory on every request.
//!
//! Each bucket is a GCRA "theoretical arrival time" (the token bucket, expressed as the
//! time at which it will be full again) in one `AtomicU64`: a check is a load, a little
//! arithmetic and one compare-and-swap. Buckets are per (caller, route class) — the
//! caller being the API key, or the app and user of an access token — plus a ceiling per
//! OAuth app (`client_id`) across all its users; rate and burst come from the caller's
//! plan, and a route may cost several tokens. Buckets live in a bounded cache keyed by a
//! 64-bit hash, so millions of distinct keys cannot grow memory without bound: an idle
//! bucket is evicted and comes back full, which is what it would have refilled to.
//!
//! A refused request gets 429 `rate_limited` with `Retry-After`; an admitted one leaves
//! `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers) for its most
//! restrictive bucket in the request's [`Context`], and the proxy stamps them on whatever
//! answers the request: the backend, a later filter, or the gateway itself.
//!
//! Alone (the embedded mode) a node enforces the whole limit. In a fleet
//! ([`Limiter::fleet`]) each bucket enforces this node's *share* of the limit: the same
//! burst time, a token interval divided by the share. Every check also counts the tokens
//! asked for and admitted, and the first check of a bucket in a sync period queues it;
//! a background task (the host's rate sync) drains the queue, reports the counts, and
//! writes back each bucket's share and level ([`Bucket::apply`]). The request path never
//! waits on that task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use postern_filter_contract::{ConfigError, Context, Filter, Flow, Problem, RequestHead};
use postern_model::{Plan, Rate, RouteRate};

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: the state of the tightest bucket.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The whole limit, as a share in millionths.
pub const SHARE_ONE: u32 = 1_000_000;
/// The smallest share a node keeps of a limit it has traffic for.
const SHARE_MIN: u32 = 1_000;

/// One token bucket as GCRA: the instant (ns since the limiter's epoch) at which the
/// bucket will be full again, and, in a fleet, this node's share of the limit and what it
/// took since the last sync.
#[derive(Debug)]
pub struct Bucket {
    tat: AtomicU64,
    /// This node's share of the limit, in millionths ([`SHARE_ONE`] alone).
    share: AtomicU32,
    /// Tokens asked for (high 32 bits) and admitted (low 32 bits) since the last sync.
    counts: AtomicU64,
    /// Queued for the next sync.
    queued: AtomicBool,
}

impl Default for Bucket {
    fn default() -> Self {
        Bucket::with_share(SHARE_ONE)
    }
}

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Admitted.
    pub allowed: bool,
    /// Whole tokens left after this request (0 when refused).
    pub remaining: u64,
    /// Seconds until the bucket is full again (admitted), or until this request's cost
    /// is available (refused), rounded up.
    pub reset_s: u64,
}

impl Bucket {
    /// A full bucket holding `share` millionths of its limit.
    pub fn with_share(share: u32) -> Bucket {
        Bucket {
            tat: AtomicU64::new(0),
            share: AtomicU32::new(share.clamp(SHARE_MIN, SHARE_ONE)),
            counts: AtomicU64::new(0),
            queued: AtomicBool::new(false),
        }
    }

    /// Takes `cost` tokens at `now` (ns) from a bucket refilling one token every
    /// `interval` ns up to `burst` tokens, of which this node holds its share.
    pub fn take(&self, now: u64, cost: u64, interval: u64, burst: u64) -> Verdict {
        // The burst lasts as long whatever the share; a token takes longer to come back.
        let capacity = burst.saturating_mul(interval);
        let per_token = self.per_token(interval);
        let increment = cost.saturating_mul(per_token);
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let start = tat.max(now);
            let next = start.saturating_add(increment);
            if next - now > capacity {
                // Not enough tokens: the cost is available once `next - capacity` passes.
                let wait = next - capacity - now;
                return Verdict { allowed: false, remaining: 0, reset_s: wait.div_ceil(1_000_000_000).max(1) };
            }
            match self.tat.compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    let used = next - now;
                    return Verdict {
                        allowed: true,
                        remaining: (capacity - used) / per_token.max(1),
                        reset_s: used.div_ceil(1_000_000_000),
                    };
                }
                Err(current) => tat = current,
            }
        }
    }

    /// Gives back `cost` tokens taken by a request another bucket then refused.
    pub fn refund(&self, cost: u64, interval: u64) {
        let increment = cost.saturating_mul(self.per_token(interval));
        let _ = self.tat.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t.saturating_sub(increment)));
        let _ = self.counts.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
            let admitted = (c & 0xffff_ffff).saturating_sub(cost);
            Some((c & !0xffff_ffff) | admitted)
        });
    }

    /// Nanoseconds one token takes to come back to this node's share of the bucket
    /// (shares are stored clamped to at least `SHARE_MIN`).
    fn per_token(&self, interval: u64) -> u64 {
        let share = self.share.load(Ordering::Relaxed);
        if share >= SHARE_ONE {
            interval
        } else {
            interval.saturating_mul(u64::from(SHARE_ONE)) / u64::from(share.max(1))
        }
    }

    /// This node's share of the limit, in millionths.
    pub fn share(&self) -> u32 {
        self.share.load(Ordering::Relaxed)
    }

    /// Sets this node's share (millionths), keeping its level as a fraction of the limit.
    pub fn set_share(&self, share: u32) {
        self.share.store(share.clamp(SHARE_MIN, SHARE_ONE), Ordering::Relaxed);
    }

    /// Takes the counts since the last call, `(asked, admitted)` in tokens, and lets the
    /// next check queue the bucket again.
    pub fn take_counts(&self) -> (u64, u64) {
        self.queued.store(false, Ordering::Relaxed);
        let c = self.counts.swap(0, Ordering::Relaxed);
        (c >> 32, c & 0xffff_ffff)
    }

    /// Applies a sync: this node's `share` (millionths) of a limit whose fleet-wide
    /// bucket holds `fleet_tokens` (negative when overdrawn), less what this node admitted
    /// since it took its counts.
    pub fn apply(&self, now: u64, share: u32, fleet_tokens: f64, interval: u64, burst: u64) {
        let share = share.clamp(SHARE_MIN, SHARE_ONE);
        self.share.store(share, Ordering::Relaxed);
        let since = self.counts.load(Ordering::Relaxed) & 0xffff_ffff;
        // This node holds `share` of the fleet's tokens: the bucket is full again after
        // the fleet's missing tokens come back, plus what it took since.
        let missing = (burst as f64 - fleet_tokens).max(0.0);
        let own = since as f64 * f64::from(SHARE_ONE) / f64::from(share);
        let ahead = ((missing + own) * interval as f64).min(u64::MAX as f64 / 4.0);
        self.tat.store(now.saturating_add(ahead as u64), Ordering::Relaxed);
    }
}

/// A bucket checked since the last sync, with the limit it was checked under.
#[derive(Debug, Clone)]
pub struct Touched {
    /// The bucket's key (a hash of the caller or app, and the route class).
    pub key: u64,
    /// The bucket.
    pub bucket: Arc<Bucket>,
    /// One token every this many ns fleet-wide.
    pub interval_ns: u64,
    /// Burst fleet-wide.
    pub burst: u64,
}

/// The fleet side of a limiter: what the sync task reads and writes.
#[derive(Debug)]
pub struct Fleet {
    touched: crossbeam_queue::SegQueue<Touched>,
    even: AtomicU32,
    lost: AtomicBool,
}

impl Fleet {
    /// Moves the buckets checked since the last call into `out`.
    pub fn drain(&self, out: &mut Vec<Touched>) {
        while let Some(t) = self.touched.pop() {
            out.push(t);
        }
    }

    /// The share (millionths) a key new to this node starts with: an even share of the
    /// fleet's live nodes.
    pub fn even_share(&self) -> u32 {
        self.even.load(Ordering::Relaxed)
    }

    /// Sets the even share from the number of live nodes.
    pub fn set_nodes(&self, nodes: u64) {
        let share = u64::from(SHARE_ONE) / nodes.max(1);
        self.even.store(u32::try_from(share).unwrap_or(SHARE_ONE).max(SHARE_MIN), Ordering::Relaxed);
    }

    /// Whether the sync is lost (plans that fail closed refuse their callers).
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// Marks the sync lost or back.
    pub fn set_lost(&self, lost: bool) {
        self.lost.store(lost, Ordering::Relaxed);
    }
}

/// The node's buckets, shared by every route and snapshot.
pub struct Limiter {
    epoch: Instant,
    buckets: quick_cache::sync::Cache<u64, Arc<Bucket>>,
    fleet: Option<Fleet>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").field("buckets", &self.buckets.len()).field("fleet", &self.fleet.is_some()).finish()
    }
}

impl Limiter {
    /// A limiter keeping at most `capacity` buckets (the least recently used idle ones go).
    pub fn new(capacity: usize) -> Limiter {
        Limiter { epoch: Instant::now(), buckets: quick_cache::sync::Cache::new(capacity.max(16)), fleet: None }
    }

    /// A limiter for one node of a fleet: each bucket holds this node's share of its
    /// limit, set by a sync task through [`Limiter::fleet_state`]. Until the first sync,
    /// a node counts itself alone.
    pub fn fleet(capacity: usize) -> Limiter {
        let fleet = Fleet {
            touched: crossbeam_queue::SegQueue::new(),
            even: AtomicU32::new(SHARE_ONE),
            lost: AtomicBool::new(false),
        };
        Limiter { fleet: Some(fleet), ..Limiter::new(capacity) }
    }

    /// The fleet side, when this node is part of one.
    pub fn fleet_state(&self) -> Option<&Fleet> {
        self.fleet.as_ref()
    }

    /// Nanoseconds since the limiter started.
    pub fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Live buckets.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    fn bucket(&self, key: u64) -> Arc<Bucket> {
        if let Some(b) = self.buckets.get(&key) {
            return b;
        }
        let share = self.fleet.as_ref().map_or(SHARE_ONE, Fleet::even_share);
        let b = Arc::new(Bucket::with_share(share));
        // Two first requests may race here; the loser's bucket is dropped after one use.
        self.buckets.insert(key, b.clone());
        b
    }

    /// Takes `cost` tokens from the bucket `key` under `rate` at `now`.
    pub fn take(&self, key: u64, rate: &Limit, cost: u64, now: u64) -> Verdict {
        let bucket = self.bucket(key);
        let v = bucket.take(now, cost, rate.interval_ns, rate.burst);
        if let Some(fleet) = &self.fleet {
            let admitted = if v.allowed { cost } else { 0 };
            bucket.counts.fetch_add((cost << 32) | admitted, Ordering::Relaxed);
            if !bucket.queued.load(Ordering::Relaxed) && !bucket.queued.swap(true, Ordering::Relaxed) {
                fleet.touched.push(Touched { key, bucket, interval_ns: rate.interval_ns, burst: rate.burst });
            }
        }
        v
    }

    /// Gives `cost` tokens back to the bucket `key`.
    pub fn refund(&self, key: u64, rate: &Limit, cost: u64) {
        if let Some(b) = self.buckets.get(&key) {
            b.refund(cost, rate.interval_ns);
        }
    }
}

/// A rate ready for checks.
#[derive(Debug, Clone)]
pub struct Limit {
    interval_ns: u64,
    burst: u64,
    policy: HeaderValue,
}

impl Limit {
    /// A limit named `name` (the policy name in `RateLimit-Policy`) at rate `r`.
    pub fn from_rate(name: &str, r: &Rate) -> Result<Limit, LimitError> {
        if r.rps == 0 || r.burst == 0 {
            return Err(LimitError::Zero { name: name.to_owned() });
        }
        let window = r.burst.div_ceil(r.rps).max(1);
        let policy = HeaderValue::from_str(&format!("\"{name}\";q={};w={window}", r.burst))
            .map_err(|source| LimitError::Policy { name: name.to_owned(), source })?;
        Ok(Limit { interval_ns: 1_000_000_000 / r.rps, burst: r.burst, policy })
    }
}

/// Why a rate cannot be a [`Limit`].
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// A rate or burst of zero.
    #[error("{name}: rps and burst must be at least 1")]
    Zero {
        /// The policy name.
        name: String,
    },
    /// A policy name that cannot be in a header.
    #[error("{name}: {source}")]
    Policy {
        /// The policy name.
        name: String,
        /// Why.
        source: http::header::InvalidHeaderValue,
    },
}

impl From<LimitError> for ConfigError {
    fn from(e: LimitError) -> ConfigError {
        ConfigError(e.to_string())
    }
}

/// Limits of one plan on one route class.
#[derive(Debug, Clone)]
struct PlanLimits {
    caller: Option<Limit>,
    app: Option<Limit>,
    fail_closed: bool,
}

/// The rate-limit filter of one route. Runs after authentication.
#[derive(Debug)]
pub struct RateLimitFilter {
    limiter: Arc<Limiter>,
    class: Arc<str>,
    class_seed: u64,
    cost: u64,
    plans: Vec<(Box<[u8]>, PlanLimits)>,
}

/// Seeds that keep the kinds of bucket apart (see [`RateLimitFilter`]'s `on_request`).
const KIND_KEY: u64 = 0x6b65_795f_6275_636b;
const KIND_USER: u64 = 0x7573_6572_5f62_7563;
const KIND_APP: u64 = 0x6170_705f_6275_636b;

fn seed(s: &[u8], salt: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(s, salt)
}

impl RateLimitFilter {
    /// The filter for a route of `class` costing `cost` tokens, under the snapshot's plans.
    pub fn new(limiter: Arc<Limiter>, spec: &RouteRate, plans: &BTreeMap<String, Plan>) -> Result<Self, ConfigError> {
        if spec.cost == 0 {
            return Err("rateLimit.cost must be at least 1".into());
        }
        let mut out = Vec::new();
        for (name, plan) in plans {
            let caller = plan.rate_limit.as_ref().map(|r| Limit::from_rate(&spec.class, r)).transpose()?;
            let app = plan.app_rate_limit.as_ref().map(|r| Limit::from_rate("app", r)).transpose()?;
            if caller.is_some() || app.is_some() {
                out.push((Box::from(name.as_bytes()), PlanLimits { caller, app, fail_closed: plan.fail_closed }));
            }
        }
        Ok(RateLimitFilter {
            limiter,
            class_seed: seed(spec.class.as_bytes(), 0x5eed),
            class: Arc::from(spec.class.as_str()),
            cost: u64::from(spec.cost),
            plans: out,
        })
    }

    fn limits(&self, plan: &[u8]) -> Option<&PlanLimits> {
        self.plans.iter().find(|(p, _)| **p == *plan).map(|(_, l)| l)
    }
}

fn state_header(name: &str, v: &Verdict) -> Option<HeaderValue> {
    let text = format!("\"{name}\";r={};t={}", v.remaining, v.reset_s);
    HeaderValue::from_maybe_shared(Bytes::from(text)).ok()
}

impl Filter for RateLimitFilter {
    fn on_request<'a>(&'a self, _req: &'a mut RequestHead, cx: &'a Context) -> Flow<'a> {
        let Some(id) = cx.identity() else { return Flow::Continue };
        let Some(limits) = id.plan.as_ref().and_then(|p| self.limits(p)) else { return Flow::Continue };
        if limits.fail_closed && self.limiter.fleet.as_ref().is_some_and(Fleet::lost) {
            let p = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "rate_limit_unavailable",
                "rate limits cannot be checked fleet-wide; retry shortly",
            )
            .with_header(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Flow::Respond(p.into());
        }
        let now = self.limiter.now();
        // The caller: its API key, or the app's user for an access token. Each kind of
        // bucket hashes under its own seed (and the class's), so an API key, a user of an
        // app and an app's ceiling never share a bucket.
        let caller = match (&id.key_id, &id.client_id, &id.subject) {
            (Some(k), _, _) => seed(k, self.class_seed ^ KIND_KEY),
            (None, c, s) => seed(
                s.as_deref().unwrap_or_default(),
                seed(c.as_deref().unwrap_or_default(), self.class_seed ^ KIND_USER),
            ),
        };
        // The caller's own bucket first, so a key refused there never drains its app's
        // shared ceiling; if the ceiling then refuses, the caller's tokens go back.
        let mut tightest: Option<(Verdict, &Limit, &str)> = None;
        let mut taken: Option<(u64, &Limit)> = None;
        for (limit, key, name) in [
            (&limits.caller, caller, &*self.class),
            (&limits.app, id.client_id.as_ref().map_or(0, |c| seed(c, KIND_APP)), "app"),
        ] {
            let Some(limit) = limit else { continue };
            let v = self.limiter.take(key, limit, self.cost, now);
            let tighter = match &tightest {
                None => true,
                Some((t, tl, _)) => !v.allowed || (t.allowed && v.remaining * tl.burst < t.remaining * limit.burst),
            };
            if tighter {
                tightest = Some((v, limit, name));
            }
            if !v.allowed {
                if let Some((k, l)) = taken {
                    self.limiter.refund(k, l, self.cost);
                }
                break;
            }
            taken = Some((key, limit));
        }
        let Some((v, limit, name)) = tightest else { return Flow::Continue };
        let state = state_header(name, &v);
        if !v.allowed {
            let mut p = Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("rate limit exceeded; retry in {} s", v.reset_s),
            )
            .with_header(http::header::RETRY_AFTER, HeaderValue::from(v.reset_s))
            .with_header(RATELIMIT_POLICY, limit.policy.clone());
            if let Some(s) = state {
                p = p.with_header(RATELIMIT, s);
            }
            return Flow::Respond(p.into());
        }
        if let Some(s) = state {
            let _ = cx.rate_limit.set((limit.policy.clone(), s));
        }
        Flow::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_bucket_admits_its_burst_then_its_rate() {
        let b = Bucket::default();
        let (interval, burst) = (S / 10, 20); // 10/s, burst 20
        let t0 = 1_000 * S;
        let admitted = (0..30).filter(|_| b.take(t0, 1, interval, burst).allowed).count();
        assert_eq!(admitted, 20, "the burst");
        let v = b.take(t0, 1, interval, burst);
        assert!(!v.allowed);
        assert_eq!(v.reset_s, 1, "one token is 100 ms away: Retry-After 1");
        // One second later: ten more tokens.
        let admitted = (0..30).filter(|_| b.take(t0 + S, 1, interval, burst).allowed).count();
        assert_eq!(admitted, 10);
        // Then ten seconds at 50 requests a second: the 10 tokens saved up by t0 + 2 s,
        // plus 10 a second.
        let mut ok = 0;
        for i in 0..500 {
            if b.take(t0 + 2 * S + i * (S / 50), 1, interval, burst).allowed {
                ok += 1;
            }
        }
        assert!((109..=111).contains(&ok), "{ok}");
    }

    #[test]
    fn cost_takes_several_tokens_and_remaining_is_reported() {
        let b = Bucket::default();
        let (interval, burst) = (S / 10, 20);
        let v = b.take(0, 5, interval, burst);
        assert_eq!((v.allowed, v.remaining), (true, 15));
        let v = b.take(0, 15, interval, burst);
        assert_eq!((v.allowed, v.remaining), (true, 0));
        assert!(!b.take(0, 1, interval, burst).allowed);
        assert_eq!(v.reset_s, 2, "20 tokens at 10/s refill in 2 s");
    }

    #[test]
    fn a_refund_gives_tokens_back() {
        let b = Bucket::default();
        assert!(b.take(0, 10, S, 10).allowed);
        assert!(!b.take(0, 1, S, 10).allowed);
        b.refund(3, S);
        assert_eq!(b.take(0, 3, S, 10), Verdict { allowed: true, remaining: 0, reset_s: 10 });
    }

    #[test]
    fn concurrent_takes_never_overshoot() {
        let b = Arc::new(Bucket::default());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| b.take(5 * S, 1, S, 100).allowed).count())
            })
            .collect();
        let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 100);
    }

    #[test]
    fn a_share_scales_the_rate_and_the_burst() {
        // A quarter of 100/s with a burst of 40: 10 tokens at once, then 25 a second.
        let b = Bucket::with_share(SHARE_ONE / 4);
        let (interval, burst) = (S / 100, 40);
        let t0 = 10 * S;
        let admitted = (0..100).filter(|_| b.take(t0, 1, interval, burst).allowed).count();
        assert_eq!(admitted, 10);
        let admitted = (0..100).filter(|_| b.take(t0 + S / 5, 1, interval, burst).allowed).count();
        assert_eq!(admitted, 5, "25 a second");
        let admitted = (0..100).filter(|_| b.take(t0 + 2 * S, 1, interval, burst).allowed).count();
        assert_eq!(admitted, 10, "never more than the share of the burst");
    }

    #[test]
    fn a_fleet_limiter_counts_and_queues_each_bucket_once_per_sync() {
        let l = Limiter::fleet(1024);
        let limit = Limit::from_rate("default", &Rate { rps: 10, burst: 5 }).unwrap();
        let now = l.now() + 100 * S;
        let ok = (0..8).filter(|_| l.take(7, &limit, 1, now).allowed).count();
        assert_eq!(ok, 5);
        l.take(9, &limit, 2, now);
        let fleet = l.fleet_state().unwrap();
        let mut touched = Vec::new();
        fleet.drain(&mut touched);
        let keys: Vec<u64> = touched.iter().map(|t| t.key).collect();
        assert_eq!(keys, [7, 9], "each bucket once");
        assert_eq!(touched[0].bucket.take_counts(), (8, 5));
        assert_eq!(touched[1].bucket.take_counts(), (2, 2));
        // Counts start again, and the bucket queues itself again.
        l.take(7, &limit, 1, now + S);
        fleet.drain(&mut touched);
        assert_eq!(touched.len(), 3);
        assert_eq!(touched[2].bucket.take_counts(), (1, 1));
    }

    #[test]
    fn new_buckets_start_with_an_even_share_and_a_sync_sets_share_and_level() {
        let l = Limiter::fleet(1024);
        let fleet = l.fleet_state().unwrap();
        fleet.set_nodes(4);
        let limit = Limit::from_rate("default", &Rate { rps: 100, burst: 40 }).unwrap();
        let now = 50 * S;
        let ok = (0..100).filter(|_| l.take(1, &limit, 1, now).allowed).count();
        assert_eq!(ok, 10, "a quarter of the burst");
        let mut touched = Vec::new();
        fleet.drain(&mut touched);
        let b = &touched[0].bucket;
        let _ = b.take_counts();
        // The fleet has 20 of 40 tokens left and this node now holds half the limit:
        // 10 tokens now, then 50 a second.
        b.apply(now, SHARE_ONE / 2, 20.0, S / 100, 40);
        assert_eq!(b.share(), SHARE_ONE / 2);
        let ok = (0..100).filter(|_| b.take(now, 1, S / 100, 40).allowed).count();
        assert_eq!(ok, 10);
        let ok = (0..100).filter(|_| b.take(now + S, 1, S / 100, 40).allowed).count();
        assert_eq!(ok, 20, "the burst caps what a second saves up: 40 x 1/2");
        // Overdrawn fleet-wide: nothing until the debt is repaid.
        b.apply(now + S, SHARE_ONE / 2, -40.0, S / 100, 40);
        assert!(!b.take(now + S, 1, S / 100, 40).allowed);
        assert!(!b.take(now + S + S * 3 / 10, 1, S / 100, 40).allowed, "40 tokens short at 100/s fleet-wide");
        assert!(b.take(now + S + S * 45 / 100, 1, S / 100, 40).allowed);
    }

    #[test]
    fn fail_closed_plans_refuse_while_the_sync_is_lost() {
        use postern_filter_contract::{CredentialKind, Identity, Reply};
        let limiter = Arc::new(Limiter::fleet(64));
        let plans: BTreeMap<String, Plan> = [(
            "p".to_owned(),
            Plan {
                products: vec![],
                rate_limit: Some(Rate { rps: 10, burst: 10 }),
                app_rate_limit: None,
                fail_closed: true,
                quota: None,
                priority: None,
            },
        )]
        .into();
        let f = RateLimitFilter::new(limiter.clone(), &RouteRate { class: "default".into(), cost: 1 }, &plans).unwrap();
        let cx = Context::new(Arc::from("r"), HeaderValue::from_static("1"));
        let id = Identity {
            kind: CredentialKind::ApiKey,
            subject: None,
            client_id: Some(Bytes::from_static(b"app")),
            tenant: None,
            key_id: Some(Bytes::from_static(b"k")),
            plan: Some(Bytes::from_static(b"p")),
            scopes: Bytes::new(),
            priority: None,
        };
        let _ = cx.identity.set(Arc::new(id));
        let (mut req, ()) = http::Request::new(()).into_parts();
        assert!(matches!(f.on_request(&mut req, &cx), Flow::Continue));
        limiter.fleet_state().unwrap().set_lost(true);
        match f.on_request(&mut req, &cx) {
            Flow::Respond(Reply::Problem(p)) => assert_eq!(p.code, "rate_limit_unavailable"),
            _ => panic!("expected a refusal"),
        }
        limiter.fleet_state().unwrap().set_lost(false);
        assert!(matches!(f.on_request(&mut req, &cx), Flow::Continue));
    }
}
