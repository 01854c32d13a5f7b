//! Per-second rate limits with bursts, decided in memory on every request.
//!
//! Each bucket is one `AtomicU64` holding a GCRA "theoretical arrival time" (the token
//! bucket, expressed as the time at which it will be full again): a check is a load, a
//! little arithmetic and one compare-and-swap. Buckets are per (caller, route class) —
//! the caller being the API key, or the app and user of an access token — plus a ceiling
//! per OAuth app (`client_id`) across all its users; rate and burst come from the
//! caller's plan, and a route may cost several tokens. Buckets live in a bounded cache
//! keyed by a 64-bit hash, so millions of distinct keys cannot grow memory without bound:
//! an idle bucket is evicted and comes back full, which is what it would have refilled to.
//!
//! A refused request gets 429 `rate_limited` with `Retry-After`; every request on a
//! limited route gets `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-
//! headers) for its most restrictive bucket.
//!
//! This is the single-node (embedded) mode: each node enforces the whole limit. The
//! fleet-wide mode, where a background sync through Redis gives each node its share, is
//! not built yet.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use postern_filter_contract::{Context, Filter, Flow, Problem, RequestHead, ResponseFlow, ResponseHead};
use postern_model::{Plan, Rate, RouteRate};

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// One token bucket as GCRA: the instant (ns since the limiter's epoch) at which the
/// bucket will be full again.
#[derive(Debug, Default)]
pub struct Bucket {
    tat: AtomicU64,
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
    /// Takes `cost` tokens at `now` (ns) from a bucket refilling one token every
    /// `interval` ns up to `burst` tokens.
    pub fn take(&self, now: u64, cost: u64, interval: u64, burst: u64) -> Verdict {
        let capacity = burst.saturating_mul(interval);
        let increment = cost.saturating_mul(interval);
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
                        remaining: (capacity - used) / interval.max(1),
                        reset_s: used.div_ceil(1_000_000_000),
                    };
                }
                Err(current) => tat = current,
            }
        }
    }
}

impl Bucket {
    /// Gives back `cost` tokens taken by a request another bucket then refused.
    pub fn refund(&self, cost: u64, interval: u64) {
        let increment = cost.saturating_mul(interval);
        let _ = self.tat.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t.saturating_sub(increment)));
    }
}

/// The node's buckets, shared by every route and snapshot.
pub struct Limiter {
    epoch: Instant,
    buckets: quick_cache::sync::Cache<u64, Arc<Bucket>>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").field("buckets", &self.buckets.len()).finish()
    }
}

impl Limiter {
    /// A limiter keeping at most `capacity` buckets (the least recently used idle ones go).
    pub fn new(capacity: usize) -> Limiter {
        Limiter { epoch: Instant::now(), buckets: quick_cache::sync::Cache::new(capacity.max(16)) }
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
        let b = Arc::new(Bucket::default());
        // Two first requests may race here; the loser's bucket is dropped after one use.
        self.buckets.insert(key, b.clone());
        b
    }

    /// Takes `cost` tokens from the bucket `key` under `rate` at `now`.
    pub fn take(&self, key: u64, rate: &Limit, cost: u64, now: u64) -> Verdict {
        self.bucket(key).take(now, cost, rate.interval_ns, rate.burst)
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
    pub fn from_rate(name: &str, r: &Rate) -> Result<Limit, String> {
        if r.rps == 0 || r.burst == 0 {
            return Err(format!("{name}: rps and burst must be at least 1"));
        }
        let window = r.burst.div_ceil(r.rps).max(1);
        let policy = HeaderValue::from_str(&format!("\"{name}\";q={};w={window}", r.burst))
            .map_err(|e| format!("{name}: {e}"))?;
        Ok(Limit { interval_ns: 1_000_000_000 / r.rps, burst: r.burst, policy })
    }
}

/// Limits of one plan on one route class.
#[derive(Debug, Clone)]
struct PlanLimits {
    caller: Option<Limit>,
    app: Option<Limit>,
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

fn seed(s: &[u8], salt: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(s, salt)
}

impl RateLimitFilter {
    /// The filter for a route of `class` costing `cost` tokens, under the snapshot's plans.
    pub fn new(limiter: Arc<Limiter>, spec: &RouteRate, plans: &BTreeMap<String, Plan>) -> Result<Self, String> {
        if spec.cost == 0 {
            return Err("rateLimit.cost must be at least 1".into());
        }
        let mut out = Vec::new();
        for (name, plan) in plans {
            let caller = plan.rate_limit.as_ref().map(|r| Limit::from_rate(&spec.class, r)).transpose()?;
            let app = plan.app_rate_limit.as_ref().map(|r| Limit::from_rate("app", r)).transpose()?;
            if caller.is_some() || app.is_some() {
                out.push((Box::from(name.as_bytes()), PlanLimits { caller, app }));
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
        let now = self.limiter.now();
        // The caller: its API key, or the app's user for an access token.
        let caller = match (&id.key_id, &id.client_id, &id.subject) {
            (Some(k), _, _) => seed(k, self.class_seed),
            (None, c, s) => {
                seed(s.as_deref().unwrap_or_default(), seed(c.as_deref().unwrap_or_default(), self.class_seed))
            }
        };
        // The caller's own bucket first, so a key refused there never drains its app's
        // shared ceiling; if the ceiling then refuses, the caller's tokens go back.
        let mut tightest: Option<(Verdict, &Limit, &str)> = None;
        let mut taken: Option<(u64, &Limit)> = None;
        for (limit, key, name) in [
            (&limits.caller, caller, &*self.class),
            (&limits.app, id.client_id.as_ref().map_or(0, |c| seed(c, 0xa99)), "app"),
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

    fn on_response<'a>(&'a self, resp: &'a mut ResponseHead, cx: &'a Context) -> ResponseFlow<'a> {
        if let Some((policy, state)) = cx.rate_limit.get() {
            resp.headers.insert(RATELIMIT_POLICY, policy.clone());
            resp.headers.insert(RATELIMIT, state.clone());
        }
        ResponseFlow::Done
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
}
