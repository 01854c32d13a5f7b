//! OAuth access tokens (JWTs), checked from memory.
//!
//! Before any decoding: a size cap and the compact shape (three base64url parts). Then
//! the header alone, parsed by us so nothing in it is trusted: `kid` must name a pushed
//! signing key (an unknown `kid` is refused, never fetched), `alg` must be the one pinned
//! for that key (so `none`, HMAC-with-a-public-key and algorithm swaps fail), and header
//! parameters that would change how the token is read — `crit`, `zip`, `b64` — or that
//! carry or point to keys — `jwk`, `jku`, `x5u`, `x5c` — are refused (RFC 8725, RFC 7515).
//! The signature is checked with the key parsed once when the credential state was built
//! (aws-lc; `jsonwebtoken` re-parses the key on every verification, which cost about a
//! third of the time), then the claims: `exp`/`nbf` with the leeway, `iss` equal to the
//! key's issuer, `aud` naming one of the gateway's audiences. The required claims are
//! `iss`, `aud`, `sub`, `client_id`, `scope`, `jti` and `exp`, each of the right type;
//! duplicate claim names are refused.
//!
//! A bounded cache holds tokens already verified, keyed by the whole token. It stores the
//! verification only: expiry, revocation, the signing key still being the same, and the
//! app's plan are checked again on every request.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use postern_filter_contract::{CredentialKind, Identity};
use serde::Deserialize;

use super::Reason;
use super::store::CredentialStore;

/// A token whose signature and claims were verified.
#[derive(Debug)]
pub struct Verified {
    /// `jti`.
    pub jti: Box<str>,
    /// `sub`.
    pub sub: Box<str>,
    /// `client_id`.
    pub client_id: Box<str>,
    /// `iat`, if present.
    pub iat: Option<u64>,
    /// `exp`.
    pub exp: u64,
    /// `kid` of the key that signed it.
    pub kid: Box<str>,
    /// That key's fingerprint when it verified the token.
    pub fingerprint: u64,
    subject: Bytes,
    client: Bytes,
    scopes: Bytes,
}

/// A cache entry: the verification, and the identity made from it against one version
/// of the credential state (apps' plans may change; the identity is remade then).
#[derive(Debug)]
pub struct Cached {
    verified: Arc<Verified>,
    identity: Arc<Identity>,
    built_for: u64,
}

/// The weight of a cached token: its own bytes and what its entry holds (claims,
/// identity), so the cache is bounded in bytes as well as entries.
#[derive(Debug, Clone, Copy)]
struct ByBytes;

impl quick_cache::Weighter<Box<str>, Arc<Cached>> for ByBytes {
    fn weight(&self, token: &Box<str>, c: &Arc<Cached>) -> u64 {
        let v = &c.verified;
        let id = &c.identity;
        let held = token.len()
            + v.jti.len()
            + v.sub.len()
            + v.client_id.len()
            + v.kid.len()
            + v.subject.len()
            + v.client.len()
            + v.scopes.len()
            + id.tenant.as_ref().map_or(0, |t| t.len())
            + id.plan.as_ref().map_or(0, |p| p.len());
        // Fixed parts of an entry (the Arcs, the records, the map slot).
        (held + 320) as u64
    }
}

/// Verified tokens, bounded in entries and in bytes.
pub struct TokenCache {
    cache: quick_cache::sync::Cache<Box<str>, Arc<Cached>, ByBytes>,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache").field("len", &self.cache.len()).finish()
    }
}

impl TokenCache {
    /// A cache of up to `capacity` tokens and `bytes` bytes (tokens and what their
    /// entries hold), whichever is reached first.
    pub fn new(capacity: usize, bytes: u64) -> TokenCache {
        TokenCache { cache: quick_cache::sync::Cache::with_weighter(capacity.max(16), bytes.max(1 << 16), ByBytes) }
    }

    /// The bytes the cached tokens weigh.
    pub fn weight(&self) -> u64 {
        self.cache.weight()
    }

    /// Cached tokens.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

#[derive(Deserialize)]
struct JoseHeader<'a> {
    #[serde(borrow)]
    alg: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    kid: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    typ: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    crit: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    zip: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    b64: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    jwk: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    jku: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    x5u: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    x5c: Option<serde::de::IgnoredAny>,
}

/// `aud`: one string or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum Audience {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct Claims {
    iss: String,
    aud: Audience,
    #[serde(default)]
    nbf: Option<u64>,
    sub: String,
    client_id: String,
    scope: String,
    jti: String,
    exp: u64,
    /// Required: a user's or app's deny entry covers tokens issued before it, which only
    /// a token's `iat` can answer.
    iat: u64,
}

fn is_b64url(part: &[u8]) -> bool {
    !part.is_empty() && part.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A claim that will be forwarded as a header: printable ASCII, bounded.
fn text_value(s: &str) -> Result<Bytes, Reason> {
    if s.is_empty() || s.len() > 1024 || !s.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Err(Reason::BadClaims);
    }
    Ok(Bytes::copy_from_slice(s.as_bytes()))
}

/// Verifies `token` cold: shape, header, signature, claims. Allocates only within the
/// size cap.
pub fn verify(store: &CredentialStore, token: &str, now: u64) -> Result<Verified, Reason> {
    let limits = &store.jwt;
    if token.len() > limits.max_token_bytes {
        return Err(Reason::Oversized);
    }
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(Reason::Malformed);
    };
    if !is_b64url(h.as_bytes()) || !is_b64url(p.as_bytes()) || !is_b64url(s.as_bytes()) {
        return Err(Reason::Malformed);
    }
    let header_json = URL_SAFE_NO_PAD.decode(h).map_err(|_| Reason::Malformed)?;
    let header: JoseHeader<'_> = serde_json::from_slice(&header_json).map_err(|_| Reason::BadHeader)?;
    if header.crit.is_some()
        || header.zip.is_some()
        || header.b64.is_some()
        || header.jwk.is_some()
        || header.jku.is_some()
        || header.x5u.is_some()
        || header.x5c.is_some()
    {
        return Err(Reason::BadHeader);
    }
    if let Some(typ) = &header.typ
        && !["JWT", "at+jwt", "application/at+jwt"].iter().any(|t| t.eq_ignore_ascii_case(typ))
    {
        return Err(Reason::BadHeader);
    }
    let kid = header.kid.as_deref().ok_or(Reason::UnknownKid)?;
    let key = store.signing_key(kid).ok_or(Reason::UnknownKid)?;
    if header.alg != key.alg {
        return Err(Reason::BadAlg);
    }
    // The signature over `header.payload`, with the key's pinned algorithm.
    if s.len() > 1024 {
        return Err(Reason::Malformed);
    }
    let sig = URL_SAFE_NO_PAD.decode(s).map_err(|_| Reason::Malformed)?;
    let signed = &token.as_bytes()[..h.len() + 1 + p.len()];
    key.key.verify_sig(signed, &sig).map_err(|_| Reason::BadSignature)?;
    let payload = URL_SAFE_NO_PAD.decode(p).map_err(|_| Reason::Malformed)?;
    let c: Claims = serde_json::from_slice(&payload).map_err(|_| Reason::BadClaims)?;
    if now > c.exp.saturating_add(limits.leeway) {
        return Err(Reason::Expired);
    }
    if c.nbf.is_some_and(|nbf| nbf > now.saturating_add(limits.leeway)) {
        return Err(Reason::NotYetValid);
    }
    if *c.iss != *key.issuer {
        return Err(Reason::WrongIssuer);
    }
    let ours = |a: &String| store.audiences.iter().any(|x| **x == **a);
    let aud_ok = match &c.aud {
        Audience::One(a) => ours(a),
        Audience::Many(list) => list.iter().any(ours),
    };
    if !aud_ok {
        return Err(Reason::WrongAudience);
    }
    // An app bound to its issuer: another issuer's token naming its client_id would act
    // (and be billed) as that app.
    if store.app(&c.client_id).and_then(|a| a.issuer.as_deref()).is_some_and(|iss| *iss != *c.iss) {
        return Err(Reason::AppIssuerMismatch);
    }
    // Lifetime: not issued in the future, not longer-lived than the platform allows (which
    // is also how long user and app deny entries live).
    if c.iat > now.saturating_add(limits.leeway) {
        return Err(Reason::NotYetValid);
    }
    if c.exp.saturating_sub(c.iat) > limits.max_lifetime {
        return Err(Reason::TooLongLived);
    }
    if c.jti.is_empty() || c.jti.len() > 256 {
        return Err(Reason::BadClaims);
    }
    Ok(Verified {
        subject: text_value(&c.sub)?,
        client: text_value(&c.client_id)?,
        scopes: if c.scope.is_empty() { Bytes::new() } else { text_value(&c.scope)? },
        jti: c.jti.into(),
        sub: c.sub.into(),
        client_id: c.client_id.into(),
        iat: Some(c.iat),
        exp: c.exp,
        kid: kid.into(),
        fingerprint: key.fingerprint,
    })
}

fn identity(v: &Verified, store: &CredentialStore) -> Identity {
    let app = store.app(&v.client_id);
    Identity {
        kind: CredentialKind::Jwt,
        subject: Some(v.subject.clone()),
        client_id: Some(v.client.clone()),
        tenant: app.and_then(|a| a.tenant.clone()),
        key_id: None,
        plan: app.map(|a| a.plan.clone()),
        scopes: v.scopes.clone(),
        priority: app.and_then(|a| a.priority),
    }
}

/// Checks that hold per request, cached or not: expiry, the signing key, revocation.
fn still_valid(v: &Verified, store: &CredentialStore, now: u64) -> Result<(), Reason> {
    if now > v.exp.saturating_add(store.jwt.leeway) {
        return Err(Reason::Expired);
    }
    match store.signing_key(&v.kid) {
        Some(k) if k.fingerprint == v.fingerprint => {}
        _ => return Err(Reason::UnknownKid),
    }
    if store.deny.is_denied(&v.jti, &v.sub, &v.client_id, v.iat, now) {
        return Err(Reason::Revoked);
    }
    Ok(())
}

/// Authenticates a bearer token: from the cache when it was verified before, otherwise
/// verified and cached. Revocation and expiry apply either way.
pub fn authenticate(
    cache: &TokenCache,
    store: &CredentialStore,
    token: &str,
    now: u64,
) -> Result<Arc<Identity>, Reason> {
    if token.len() > store.jwt.max_token_bytes {
        return Err(Reason::Oversized);
    }
    if let Some(hit) = cache.cache.get(token)
        && hit.built_for == store.version
    {
        still_valid(&hit.verified, store, now)?;
        return Ok(hit.identity.clone());
    }
    // Not cached, or cached under another credential state (audiences, lifetime limits,
    // keys and apps may all have changed): verified whole again.
    let verified = verify(store, token, now)?;
    still_valid(&verified, store, now)?;
    let id = Arc::new(identity(&verified, store));
    let entry = Cached { verified: Arc::new(verified), identity: id.clone(), built_for: store.version };
    cache.cache.insert(Box::from(token), Arc::new(entry));
    Ok(id)
}
