//! Authentication and authorisation, from memory: API keys and OAuth access tokens (JWTs)
//! checked against pushed state, then the route's scopes and the caller's plan.
//!
//! The filter runs first on every route that is not public. On success it takes the
//! credential out of the request (`Authorization`, `x-api-key` are never forwarded), sets
//! the identity headers (`x-auth-*`; the proxy already deleted any the client sent) and
//! records the caller in the request context for the filters after it. On failure the
//! request gets 401 `invalid_credentials` (with `WWW-Authenticate`) or 403
//! `insufficient_scope` / `product_not_in_plan`, and nothing reaches the backend.
//!
//! The credential state ([`CredentialStore`]) is swapped whole by the node when its file
//! changes; a request loads it once, so a revoked key fails on the very next request,
//! on an already-open connection too.

pub use postern_model::apikey;
pub mod jwt;
pub mod store;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use postern_filter_contract::{ConfigError, Context, Filter, Flow, Identity, Problem, RequestHead};
use postern_model::{AuthMethod, Plan, RouteAuth};

use crate::ratelimit::{RATELIMIT, RATELIMIT_POLICY};

pub use store::{CredentialStore, Flagged, StoreError};

#[cfg(test)]
mod tests;

/// The API key header.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const X_AUTH_SUBJECT: HeaderName = HeaderName::from_static("x-auth-subject");
const X_AUTH_CLIENT_ID: HeaderName = HeaderName::from_static("x-auth-client-id");
const X_AUTH_TENANT: HeaderName = HeaderName::from_static("x-auth-tenant");
const X_AUTH_SCOPES: HeaderName = HeaderName::from_static("x-auth-scopes");
const X_AUTH_PLAN: HeaderName = HeaderName::from_static("x-auth-plan");
const X_AUTH_KEY_ID: HeaderName = HeaderName::from_static("x-auth-key-id");

/// Why a request was refused (or `Ok`), counted in metrics. Clients only ever see the
/// class: 401 `invalid_credentials`, or one of the two 403 codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Reason {
    /// Authenticated and authorised.
    Ok,
    /// No credential.
    Missing,
    /// Both an API key and a bearer token, or a header sent twice.
    Ambiguous,
    /// Not an API key or a compact JWT by its shape (or a bad checksum).
    Malformed,
    /// Over the size cap.
    Oversized,
    /// An API key not in the table.
    UnknownKey,
    /// A revoked API key.
    KeyRevoked,
    /// An API key past its rotation overlap.
    KeyExpired,
    /// A JOSE header that is malformed or asks for something refused.
    BadHeader,
    /// A `kid` that names no pushed signing key.
    UnknownKid,
    /// An `alg` other than the key's pinned one.
    BadAlg,
    /// The signature does not verify.
    BadSignature,
    /// Past `exp` (plus leeway).
    Expired,
    /// Before `nbf` or `iat` (minus leeway).
    NotYetValid,
    /// Lives longer than the platform allows.
    TooLongLived,
    /// `iss` is not the key's issuer.
    WrongIssuer,
    /// `aud` names none of the gateway's audiences.
    WrongAudience,
    /// A required claim is missing or of the wrong type.
    BadClaims,
    /// On the deny list.
    Revoked,
    /// A required scope is missing.
    InsufficientScope,
    /// The caller's plan does not include the route's product.
    NotInPlan,
    /// The caller's hard quota on the route's product is used up.
    QuotaExceeded,
    /// A token's `client_id` names an app bound to another issuer than the token's.
    AppIssuerMismatch,
}

impl Reason {
    /// Every reason, in index order.
    pub const ALL: [Reason; 23] = [
        Reason::Ok,
        Reason::Missing,
        Reason::Ambiguous,
        Reason::Malformed,
        Reason::Oversized,
        Reason::UnknownKey,
        Reason::KeyRevoked,
        Reason::KeyExpired,
        Reason::BadHeader,
        Reason::UnknownKid,
        Reason::BadAlg,
        Reason::BadSignature,
        Reason::Expired,
        Reason::NotYetValid,
        Reason::TooLongLived,
        Reason::WrongIssuer,
        Reason::WrongAudience,
        Reason::BadClaims,
        Reason::Revoked,
        Reason::InsufficientScope,
        Reason::NotInPlan,
        Reason::QuotaExceeded,
        Reason::AppIssuerMismatch,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Ok => "ok",
            Reason::Missing => "missing",
            Reason::Ambiguous => "ambiguous",
            Reason::Malformed => "malformed",
            Reason::Oversized => "oversized",
            Reason::UnknownKey => "unknown_key",
            Reason::KeyRevoked => "key_revoked",
            Reason::KeyExpired => "key_expired",
            Reason::BadHeader => "bad_header",
            Reason::UnknownKid => "unknown_kid",
            Reason::BadAlg => "bad_alg",
            Reason::BadSignature => "bad_signature",
            Reason::Expired => "expired",
            Reason::NotYetValid => "not_yet_valid",
            Reason::TooLongLived => "too_long_lived",
            Reason::WrongIssuer => "wrong_issuer",
            Reason::WrongAudience => "wrong_audience",
            Reason::BadClaims => "bad_claims",
            Reason::Revoked => "revoked",
            Reason::InsufficientScope => "insufficient_scope",
            Reason::NotInPlan => "product_not_in_plan",
            Reason::QuotaExceeded => "quota_exceeded",
            Reason::AppIssuerMismatch => "app_issuer_mismatch",
        }
    }
}

/// Outcome counters by [`Reason`].
#[derive(Debug, Default)]
pub struct AuthStats {
    counts: [AtomicU64; Reason::ALL.len()],
}

impl AuthStats {
    fn count(&self, r: Reason) {
        if let Some(c) = self.counts.get(r as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every reason with its count.
    pub fn snapshot(&self) -> impl Iterator<Item = (Reason, u64)> + '_ {
        Reason::ALL.iter().zip(&self.counts).map(|(r, c)| (*r, c.load(Ordering::Relaxed)))
    }
}

/// The node's authentication state: the live credentials, the verified-token cache and
/// the counters. One per node, shared by every route's filter across snapshots.
#[derive(Debug)]
pub struct Authenticator {
    /// Swapped whole when the credentials change.
    pub credentials: ArcSwap<CredentialStore>,
    /// Tokens already verified.
    pub tokens: jwt::TokenCache,
    /// Outcomes.
    pub stats: AuthStats,
}

impl Authenticator {
    /// No credentials yet, and a token cache of `cache_capacity` entries and at most
    /// `cache_bytes` bytes.
    pub fn new(cache_capacity: usize, cache_bytes: u64) -> Authenticator {
        Authenticator {
            credentials: ArcSwap::from_pointee(CredentialStore::empty()),
            tokens: jwt::TokenCache::new(cache_capacity, cache_bytes),
            stats: AuthStats::default(),
        }
    }

    /// Authenticates the credential in `headers` for a route accepting `methods`.
    pub fn authenticate(&self, headers: &HeaderMap, methods: Methods, now: u64) -> Result<Arc<Identity>, Reason> {
        self.authenticate_in(&self.credentials.load(), headers, methods, now)
    }

    /// As [`Authenticator::authenticate`], against `store`.
    fn authenticate_in(
        &self,
        store: &CredentialStore,
        headers: &HeaderMap,
        methods: Methods,
        now: u64,
    ) -> Result<Arc<Identity>, Reason> {
        let mut keys = headers.get_all(X_API_KEY).iter();
        let key = if methods.api_key { keys.next() } else { None };
        let mut auths = headers.get_all(AUTHORIZATION).iter();
        let bearer = if methods.jwt { auths.next() } else { None };
        if keys.next().is_some() || auths.next().is_some() || (key.is_some() && bearer.is_some()) {
            return Err(Reason::Ambiguous);
        }
        if let Some(key) = key {
            let key = key.as_bytes();
            apikey::check_shape(key).map_err(|_| Reason::Malformed)?;
            let entry = store.key(&apikey::hash(key)).ok_or(Reason::UnknownKey)?;
            if !entry.active {
                return Err(Reason::KeyRevoked);
            }
            if now >= entry.expires_at {
                return Err(Reason::KeyExpired);
            }
            return Ok(entry.identity.clone());
        }
        let Some(auth) = bearer else { return Err(Reason::Missing) };
        if auth.len() > store.jwt.max_token_bytes + 16 {
            return Err(Reason::Oversized);
        }
        let value = auth.to_str().map_err(|_| Reason::Malformed)?;
        let (scheme, token) = value.split_once(' ').ok_or(Reason::Malformed)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(Reason::Missing);
        }
        jwt::authenticate(&self.tokens, store, token.trim_start_matches(' '), now)
    }
}

/// Why [`AuthFilter::check`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not authenticated, or not authorised.
    Auth(Reason),
    /// The caller's hard quota on the route's product is used up.
    Quota(Flagged),
}

/// Which credentials a route accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Methods {
    /// `x-api-key`.
    pub api_key: bool,
    /// `Authorization: Bearer`.
    pub jwt: bool,
}

pub use postern_model::disk::unix_now;

/// The authentication filter of one route.
#[derive(Debug)]
pub struct AuthFilter {
    auth: Arc<Authenticator>,
    route: Arc<str>,
    methods: Methods,
    scopes: Vec<String>,
    product: String,
    /// Plans that include the route's product.
    plans: Vec<Box<[u8]>>,
    challenge: Vec<HeaderValue>,
    challenge_invalid: Vec<HeaderValue>,
    challenge_scope: Option<HeaderValue>,
}

impl AuthFilter {
    /// The filter for `route`, given the snapshot's plans.
    pub fn new(
        auth: Arc<Authenticator>,
        route: Arc<str>,
        spec: &RouteAuth,
        plans: &BTreeMap<String, Plan>,
    ) -> Result<AuthFilter, ConfigError> {
        let methods = Methods {
            api_key: spec.methods.contains(&AuthMethod::ApiKey),
            jwt: spec.methods.contains(&AuthMethod::Jwt),
        };
        if !methods.api_key && !methods.jwt {
            return Err("auth.methods: name api_key, jwt or both".into());
        }
        for s in &spec.scopes {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') {
                return Err(format!("auth.scopes: {s:?} is not a valid scope").into());
            }
        }
        let allowed: Vec<Box<[u8]>> = plans
            .iter()
            .filter(|(_, p)| p.products.contains(&spec.product))
            .map(|(name, _)| Box::from(name.as_bytes()))
            .collect();
        let mut challenge = Vec::new();
        let mut challenge_invalid = Vec::new();
        if methods.jwt {
            challenge.push(HeaderValue::from_static("Bearer realm=\"postern\""));
            challenge_invalid.push(HeaderValue::from_static("Bearer realm=\"postern\", error=\"invalid_token\""));
        }
        if methods.api_key {
            challenge.push(HeaderValue::from_static("ApiKey realm=\"postern\", header=\"x-api-key\""));
            challenge_invalid.push(HeaderValue::from_static("ApiKey realm=\"postern\", header=\"x-api-key\""));
        }
        let challenge_scope = if methods.jwt && !spec.scopes.is_empty() {
            let v =
                format!("Bearer realm=\"postern\", error=\"insufficient_scope\", scope=\"{}\"", spec.scopes.join(" "));
            Some(HeaderValue::from_str(&v).map_err(|e| format!("auth.scopes: {e}"))?)
        } else {
            None
        };
        Ok(AuthFilter {
            auth,
            route,
            methods,
            scopes: spec.scopes.clone(),
            product: spec.product.clone(),
            plans: allowed,
            challenge,
            challenge_invalid,
            challenge_scope,
        })
    }

    /// Checks the request's credential, the route's scopes and product, and the caller's
    /// quota on it. A caller under a debug-trace flag is marked in `cx`, refused or not.
    pub fn check(&self, headers: &HeaderMap, now: u64, cx: Option<&Context>) -> Result<Arc<Identity>, Refused> {
        let store = self.auth.credentials.load();
        let id = self.auth.authenticate_in(&store, headers, self.methods, now).map_err(Refused::Auth)?;
        if let (Some(cx), Some((payer, caller))) = (cx, id.caller())
            && store.debug_trace.holds(payer, caller, now)
        {
            let _ = cx.debug_trace.set(());
        }
        // Entitlement first: a caller whose plan lacks the product is told so, whatever
        // its scopes.
        let plan: &[u8] = id.plan.as_deref().unwrap_or_default();
        if !self.plans.iter().any(|p| **p == *plan) {
            return Err(Refused::Auth(Reason::NotInPlan));
        }
        if !self.scopes.iter().all(|s| id.has_scope(s)) {
            return Err(Refused::Auth(Reason::InsufficientScope));
        }
        if let Some((payer, caller)) = id.caller()
            && let Some(flag) = store.over_quota.get(payer, caller, &self.product, now)
        {
            return Err(Refused::Quota(flag));
        }
        Ok(id)
    }

    /// 429 `quota_exceeded`, with headers apart from rate limiting's: `Retry-After` to
    /// the period's end and a `quota` policy whose window is the period.
    fn over_quota(&self, flag: Flagged, now: u64) -> Problem {
        let left = flag.until.saturating_sub(now).max(1);
        let detail = format!(
            "the caller's quota of {} calls to the {} API is used up; it renews in {left} s",
            flag.quota, self.product
        );
        let mut p = Problem::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", detail);
        let values = [
            (http::header::RETRY_AFTER, left.to_string()),
            (RATELIMIT_POLICY, format!("\"quota\";q={};w={}", flag.quota, flag.period_s)),
            (RATELIMIT, format!("\"quota\";r=0;t={left}")),
        ];
        for (name, v) in values {
            if let Ok(v) = HeaderValue::from_str(&v) {
                p.headers.insert(name, v);
            }
        }
        p
    }

    fn refuse(&self, reason: Reason) -> Problem {
        let (status, code, detail, challenges): (_, _, std::borrow::Cow<'static, str>, _) = match reason {
            Reason::InsufficientScope => (
                StatusCode::FORBIDDEN,
                "insufficient_scope",
                format!("this route requires the scopes: {}", self.scopes.join(" ")).into(),
                self.challenge_scope.as_slice(),
            ),
            Reason::NotInPlan => (
                StatusCode::FORBIDDEN,
                "product_not_in_plan",
                format!("the caller's plan does not include the {} API", self.product).into(),
                &[][..],
            ),
            Reason::QuotaExceeded => {
                (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", "the caller's quota is used up".into(), &[][..])
            }
            Reason::Missing => (
                StatusCode::UNAUTHORIZED,
                "invalid_credentials",
                "this route requires credentials".into(),
                self.challenge.as_slice(),
            ),
            _ => (
                StatusCode::UNAUTHORIZED,
                "invalid_credentials",
                "the credentials are not valid".into(),
                self.challenge_invalid.as_slice(),
            ),
        };
        let mut p = Problem::new(status, code, detail);
        for c in challenges {
            p.headers.append(WWW_AUTHENTICATE, c.clone());
        }
        p
    }
}

/// Sets the identity headers a backend reads.
fn set_identity_headers(headers: &mut HeaderMap, id: &Identity) {
    let pairs = [
        (X_AUTH_SUBJECT, &id.subject),
        (X_AUTH_CLIENT_ID, &id.client_id),
        (X_AUTH_TENANT, &id.tenant),
        (X_AUTH_PLAN, &id.plan),
        (X_AUTH_KEY_ID, &id.key_id),
    ];
    for (name, value) in pairs {
        if let Some(v) = value.as_ref().and_then(Identity::header) {
            headers.insert(name, v);
        }
    }
    if let Some(v) = Identity::header(&id.scopes) {
        headers.insert(X_AUTH_SCOPES, v);
    }
}

/// Removes the credentials a client may send: they are never forwarded.
pub fn strip_credentials(headers: &mut HeaderMap) {
    headers.remove(AUTHORIZATION);
    headers.remove(X_API_KEY);
}

impl Filter for AuthFilter {
    fn on_request<'a>(&'a self, req: &'a mut RequestHead, cx: &'a Context) -> Flow<'a> {
        let now = unix_now();
        let result = self.check(&req.headers, now, Some(cx));
        strip_credentials(&mut req.headers);
        match result {
            Ok(id) => {
                self.auth.stats.count(Reason::Ok);
                set_identity_headers(&mut req.headers, &id);
                let _ = cx.identity.set(id);
                Flow::Continue
            }
            Err(Refused::Auth(reason)) => {
                self.auth.stats.count(reason);
                tracing::debug!(route = %self.route, reason = reason.as_str(), "request refused by authentication");
                Flow::Respond(self.refuse(reason).into())
            }
            Err(Refused::Quota(flag)) => {
                self.auth.stats.count(Reason::QuotaExceeded);
                Flow::Respond(self.over_quota(flag, now).into())
            }
        }
    }
}
