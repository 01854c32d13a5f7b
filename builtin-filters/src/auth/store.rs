//! The credential state indexed for requests: API keys by hash, signing keys by `kid`,
//! apps by `client_id`, and the deny list. Built beside the live one and swapped whole,
//! so a request sees one consistent state and a status change applies to the next
//! request, on any connection.

use std::collections::HashMap;
use std::sync::Arc;

use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED, ParsedPublicKey, RSA_PKCS1_2048_8192_SHA256};
use bytes::Bytes;
use jsonwebtoken::DecodingKey;
use postern_filter_contract::{CredentialKind, Identity, Payer};
use postern_model::credentials::{Alg, ApiKey, Credentials, DenyEntry, KeyStatus, QuotaFlag, TraceFlag};
use postern_model::usage::CallerKind;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// An API key ready for requests.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    /// The caller this key proves, with its header values made once.
    pub identity: Arc<Identity>,
    /// Revoked keys stay in the table so they are told apart from unknown ones.
    pub active: bool,
    /// Unix seconds after which the key stops working (`u64::MAX`: never).
    pub expires_at: u64,
}

/// A signing key ready to verify: parsed and checked once, here, rather than on every
/// verification.
pub struct SigningEntry {
    /// The public key, with its pinned algorithm.
    pub key: ParsedPublicKey,
    /// The pinned algorithm's JOSE name.
    pub alg: &'static str,
    /// The only `iss` accepted with this key.
    pub issuer: Box<str>,
    /// Changes when the key material, algorithm or issuer changes: a cached verification
    /// holds only while its key is still the same.
    pub fingerprint: u64,
}

impl std::fmt::Debug for SigningEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningEntry").field("alg", &self.alg).field("fingerprint", &self.fingerprint).finish()
    }
}

/// An OAuth app's entitlements.
#[derive(Debug)]
pub struct AppEntry {
    /// Plan.
    pub plan: Bytes,
    /// Tenant.
    pub tenant: Option<Bytes>,
    /// The app's own priority class, as a rank ([`Identity::priority`]).
    pub priority: Option<u8>,
    /// The only issuer whose tokens may name this app, when it is bound to one.
    pub issuer: Option<Box<str>>,
}

#[derive(Debug, Clone, Copy)]
struct Before {
    issued_before: u64,
    expires_at: u64,
}

/// Revoked tokens (by `jti`), users (`sub`) and apps (`client_id`), each entry living
/// until every token it covers has expired.
#[derive(Debug, Default, Clone)]
pub struct DenyList {
    jti: FastMap<Box<str>, u64>,
    sub: FastMap<Box<str>, Before>,
    client: FastMap<Box<str>, Before>,
}

impl DenyList {
    /// Whether a token with these claims is revoked at `now`. A token without `iat`
    /// cannot show it was issued after a user or app revocation, so it is revoked too.
    pub fn is_denied(&self, jti: &str, sub: &str, client_id: &str, iat: Option<u64>, now: u64) -> bool {
        if self.jti.is_empty() && self.sub.is_empty() && self.client.is_empty() {
            return false;
        }
        if self.jti.get(jti).is_some_and(|&exp| now <= exp) {
            return true;
        }
        let covers = |b: &Before| now <= b.expires_at && iat.is_none_or(|t| t < b.issued_before);
        self.sub.get(sub).is_some_and(covers) || self.client.get(client_id).is_some_and(covers)
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.jti.len() + self.sub.len() + self.client.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A caller's used-up hard quota on one product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flagged {
    /// Unix seconds: the period's end, when the flag lifts.
    pub until: u64,
    /// Calls per period.
    pub quota: u64,
    /// The period's length, seconds.
    pub period_s: u64,
}

type ByCaller = FastMap<Box<str>, FastMap<Box<[u8]>, Flagged>>;

/// Over-quota flags by product, then caller (API keys and apps apart); a flag past its
/// `until` is ignored, so a period's end lifts it without a message.
#[derive(Debug, Default, Clone)]
pub struct OverQuota {
    keys: ByCaller,
    apps: ByCaller,
}

impl OverQuota {
    /// The live flag of `caller` on `product` at `now`, if any. Nothing is allocated.
    pub fn get(&self, payer: Payer, caller: &[u8], product: &str, now: u64) -> Option<Flagged> {
        let by = match payer {
            Payer::Key => &self.keys,
            Payer::App => &self.apps,
        };
        if by.is_empty() {
            return None;
        }
        by.get(product)?.get(caller).copied().filter(|f| now < f.until)
    }

    /// Adds a flag unless it has lifted at `now`; the later period wins.
    fn add(&mut self, f: &QuotaFlag, now: u64) {
        if f.until <= now {
            return;
        }
        let by = match f.kind {
            CallerKind::Key => &mut self.keys,
            CallerKind::App => &mut self.apps,
        };
        let flag = Flagged { until: f.until, quota: f.quota, period_s: f.period_s };
        let slot = by.entry(Box::from(f.product.as_str())).or_default();
        let e = slot.entry(Box::from(f.caller.as_bytes())).or_insert(flag);
        if e.until < flag.until {
            *e = flag;
        }
    }

    /// Flags held (some may have lifted since).
    pub fn len(&self) -> usize {
        self.keys.values().chain(self.apps.values()).map(FastMap::len).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Callers under a debug-trace flag (API keys and apps apart), with the flag's expiry;
/// a flag past it is ignored, so it turns itself off without a message.
#[derive(Debug, Default, Clone)]
pub struct DebugTrace {
    keys: FastMap<Box<[u8]>, u64>,
    apps: FastMap<Box<[u8]>, u64>,
}

impl DebugTrace {
    /// Whether every request of `caller` is traced at `now`. Nothing is allocated, and
    /// with no flag set nothing is hashed.
    pub fn holds(&self, payer: Payer, caller: &[u8], now: u64) -> bool {
        let by = match payer {
            Payer::Key => &self.keys,
            Payer::App => &self.apps,
        };
        !by.is_empty() && by.get(caller).is_some_and(|&until| now < until)
    }

    /// Sets a caller's flag (replacing its earlier one); a flag already over at `now`
    /// turns the caller's tracing off.
    fn set(&mut self, f: &TraceFlag, now: u64) {
        let by = match f.kind {
            CallerKind::Key => &mut self.keys,
            CallerKind::App => &mut self.apps,
        };
        if f.until <= now {
            by.remove(f.caller.as_bytes());
        } else {
            by.insert(Box::from(f.caller.as_bytes()), f.until);
        }
    }

    /// Flags held (some may have ended since).
    pub fn len(&self) -> usize {
        self.keys.len() + self.apps.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// JWT checks that do not depend on the key.
#[derive(Debug, Clone)]
pub struct JwtLimits {
    /// Clock skew, seconds.
    pub leeway: u64,
    /// Largest token, bytes.
    pub max_token_bytes: usize,
    /// Longest lifetime, seconds.
    pub max_lifetime: u64,
}

/// Everything a request needs to authenticate, immutable once built.
#[derive(Debug)]
pub struct CredentialStore {
    /// The credentials file's version (0: none loaded).
    pub version: u64,
    keys: FastMap<[u8; 32], KeyEntry>,
    /// Shared with the states derived from this one by [`CredentialStore::with_changes`].
    signing: Arc<FastMap<Box<str>, SigningEntry>>,
    apps: Arc<FastMap<Box<str>, AppEntry>>,
    /// Revocations.
    pub deny: DenyList,
    /// Callers over their hard quota.
    pub over_quota: OverQuota,
    /// Callers every request of which is traced.
    pub debug_trace: DebugTrace,
    /// Token limits.
    pub jwt: JwtLimits,
    /// The `aud` values accepted.
    pub audiences: Vec<Box<str>>,
}

/// Why a credential state was refused, naming the entry it is about, so a caller can
/// point at the entry's source (a key's line in `keys.jsonl`) without reading the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// API key record `index` (its id, and what is wrong with it).
    #[error("keys[{index}] (id {id:?}): {problem}")]
    Key {
        /// The record's index in `keys`.
        index: usize,
        /// The record's id.
        id: String,
        /// What is wrong.
        problem: String,
    },
    /// Any other entry or setting; the text names its field.
    #[error("{0}")]
    Other(String),
}

/// A deny entry that is out of shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum DenyError {
    #[error("deny[{0}]: issued_before is required")]
    IssuedBefore(usize),
    #[error("deny[{0}]: set exactly one of jti, sub or client_id")]
    OneOf(usize),
}

/// A value that cannot be an identity header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} must be 1 to 1024 printable ASCII characters")]
struct BadHeaderValue {
    what: String,
    value: String,
}

/// A signing key that does not parse as its algorithm's public key.
#[derive(Debug, thiserror::Error)]
enum BadKey {
    #[error("{0}")]
    Pem(#[from] jsonwebtoken::errors::Error),
    #[error("{0}")]
    Rejected(#[from] aws_lc_rs::error::KeyRejected),
}

impl From<DenyError> for StoreError {
    fn from(e: DenyError) -> StoreError {
        StoreError::Other(e.to_string())
    }
}

impl From<BadHeaderValue> for StoreError {
    fn from(e: BadHeaderValue) -> StoreError {
        StoreError::Other(e.to_string())
    }
}

impl From<String> for StoreError {
    fn from(s: String) -> StoreError {
        StoreError::Other(s)
    }
}

impl From<&str> for StoreError {
    fn from(s: &str) -> StoreError {
        StoreError::Other(s.to_owned())
    }
}

/// Indexes one key record (`i` names it in errors); `last_scopes` carries the previous
/// record's scope set, which most records share.
fn key_entry(
    i: usize,
    k: &ApiKey,
    names: &mut Interner,
    last_scopes: &mut (Vec<String>, Bytes),
) -> Result<([u8; 32], KeyEntry), StoreError> {
    let at = |problem: String| StoreError::Key { index: i, id: k.id.clone(), problem };
    let mut hash = [0u8; 32];
    hex::decode_to_slice(&k.sha256, &mut hash).map_err(|_| at("sha256 must be 64 hex digits".into()))?;
    // Keys share few scope sets: join only when the set differs from the last one.
    if k.scopes != last_scopes.0 {
        let joined = k.scopes.join(" ");
        let value = if joined.is_empty() {
            Bytes::new()
        } else {
            names.get(&joined, "scopes").map_err(|e| at(e.to_string()))?
        };
        *last_scopes = (k.scopes.clone(), value);
    }
    let identity = Identity {
        kind: CredentialKind::ApiKey,
        subject: None,
        client_id: Some(names.get(&k.app, "app").map_err(|e| at(e.to_string()))?),
        tenant: Some(names.get(&k.tenant, "tenant").map_err(|e| at(e.to_string()))?),
        key_id: Some(header_value(&k.id, "id").map_err(|e| at(e.to_string()))?),
        plan: Some(names.get(&k.plan, "plan").map_err(|e| at(e.to_string()))?),
        scopes: last_scopes.1.clone(),
        priority: k.priority.map(postern_model::Priority::rank_u8),
    };
    let entry = KeyEntry {
        identity: Arc::new(identity),
        active: k.status == KeyStatus::Active,
        expires_at: k.expires_at.unwrap_or(u64::MAX),
    };
    Ok((hash, entry))
}

impl DenyList {
    /// Adds entry `i`, unless every token it covers has already expired at `now`.
    fn add(&mut self, i: usize, d: &DenyEntry, lifetime: u64, now: u64) -> Result<(), DenyError> {
        match (&d.jti, &d.sub, &d.client_id) {
            (Some(jti), None, None) => {
                let exp = d.expires_at.unwrap_or(now.saturating_add(lifetime));
                if exp >= now {
                    let e = self.jti.entry(Box::from(jti.as_str())).or_insert(0);
                    *e = (*e).max(exp);
                }
            }
            (None, Some(who), None) | (None, None, Some(who)) => {
                let before = d.issued_before.ok_or(DenyError::IssuedBefore(i))?;
                let exp = d.expires_at.unwrap_or(before.saturating_add(lifetime));
                if exp >= now {
                    let map = if d.sub.is_some() { &mut self.sub } else { &mut self.client };
                    let e = map.entry(Box::from(who.as_str())).or_insert(Before { issued_before: 0, expires_at: 0 });
                    e.issued_before = e.issued_before.max(before);
                    e.expires_at = e.expires_at.max(exp);
                }
            }
            _ => return Err(DenyError::OneOf(i)),
        }
        Ok(())
    }
}

/// Header values shared by many keys and apps (a tenant, a plan, a scope set) are made
/// once; cloning them only bumps a reference count.
#[derive(Default)]
struct Interner(std::collections::HashSet<Bytes, foldhash::fast::RandomState>);

impl Interner {
    fn get(&mut self, s: &str, what: &str) -> Result<Bytes, BadHeaderValue> {
        if let Some(v) = self.0.get(s.as_bytes()) {
            return Ok(v.clone());
        }
        let v = header_value(s, what)?;
        self.0.insert(v.clone());
        Ok(v)
    }
}

fn header_value(s: &str, what: &str) -> Result<Bytes, BadHeaderValue> {
    if s.is_empty() || s.len() > 1024 || !s.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Err(BadHeaderValue { what: what.to_owned(), value: s.to_owned() });
    }
    // Printable ASCII is a valid header value; clones share one allocation.
    Ok(Bytes::copy_from_slice(s.as_bytes()))
}

/// The key in `pem` (SubjectPublicKeyInfo), parsed for `alg` (`jsonwebtoken` reads the
/// PEM; aws-lc checks the key once, e.g. that an EC point is on the curve).
fn parse_key(alg: Alg, pem: &str) -> Result<ParsedPublicKey, BadKey> {
    let (key, verification): (_, &'static dyn aws_lc_rs::signature::VerificationAlgorithm) = match alg {
        Alg::ES256 => (DecodingKey::from_ec_pem(pem.as_bytes()), &ECDSA_P256_SHA256_FIXED),
        Alg::RS256 => (DecodingKey::from_rsa_pem(pem.as_bytes()), &RSA_PKCS1_2048_8192_SHA256),
    };
    let key = key?;
    let bytes = key.try_get_as_bytes()?;
    Ok(ParsedPublicKey::new(verification, bytes)?)
}

impl CredentialStore {
    /// No credentials: every authenticated request is refused.
    pub fn empty() -> CredentialStore {
        CredentialStore {
            version: 0,
            keys: FastMap::default(),
            signing: Arc::default(),
            apps: Arc::default(),
            deny: DenyList::default(),
            over_quota: OverQuota::default(),
            debug_trace: DebugTrace::default(),
            jwt: JwtLimits { leeway: 30, max_token_bytes: 4096, max_lifetime: 3600 },
            audiences: Vec::new(),
        }
    }

    /// This state with key records added or replaced (matched by hash), deny entries and
    /// over-quota flags added, as version `version`: the fast lane's change to a large
    /// table costs a copy of the key index, not a rebuild. Signing keys, apps and JWT
    /// settings are shared.
    pub fn with_changes(
        &self,
        version: u64,
        keys: &[ApiKey],
        deny: &[DenyEntry],
        flags: &[QuotaFlag],
        traced: &[TraceFlag],
        now: u64,
    ) -> Result<CredentialStore, StoreError> {
        let mut names = Interner::default();
        let mut last_scopes: (Vec<String>, Bytes) = (Vec::new(), Bytes::new());
        let mut index = self.keys.clone();
        for (i, k) in keys.iter().enumerate() {
            let (hash, entry) = key_entry(i, k, &mut names, &mut last_scopes)?;
            index.insert(hash, entry);
        }
        let mut list = self.deny.clone();
        let lifetime = self.jwt.max_lifetime.saturating_add(self.jwt.leeway);
        for (i, d) in deny.iter().enumerate() {
            list.add(i, d, lifetime, now)?;
        }
        let mut over_quota = self.over_quota.clone();
        for f in flags {
            over_quota.add(f, now);
        }
        let mut debug_trace = self.debug_trace.clone();
        for f in traced {
            debug_trace.set(f, now);
        }
        Ok(CredentialStore {
            version,
            keys: index,
            signing: self.signing.clone(),
            apps: self.apps.clone(),
            deny: list,
            over_quota,
            debug_trace,
            jwt: self.jwt.clone(),
            audiences: self.audiences.clone(),
        })
    }

    /// Indexes `creds`; refuses the whole state if any entry is invalid, naming it.
    /// Deny entries already expired at `now` are dropped.
    pub fn build(version: u64, creds: &Credentials, now: u64) -> Result<CredentialStore, StoreError> {
        let settings = &creds.jwt;
        if settings.max_token_bytes < 64 || settings.max_token_bytes > 64 * 1024 {
            return Err("jwt.max_token_bytes must be 64 to 65536".into());
        }
        if !creds.signing_keys.is_empty() && settings.audiences.is_empty() {
            return Err("jwt.audiences: name at least one audience when signing keys are set".into());
        }
        let mut names = Interner::default();

        let mut signing = FastMap::default();
        for (i, k) in creds.signing_keys.iter().enumerate() {
            let at = format!("signing_keys[{i}] (kid {:?})", k.kid);
            if k.kid.is_empty() || k.kid.len() > 256 {
                return Err(format!("{at}: kid must be 1 to 256 characters").into());
            }
            let key = parse_key(k.alg, &k.public_key_pem)
                .map_err(|e| format!("{at}: public_key_pem is not a {} public key: {e}", k.alg.as_str()))?;
            if k.issuer.is_empty() {
                return Err(format!("{at}: issuer is required").into());
            }
            let name = k.alg.as_str();
            let mut material = Vec::with_capacity(k.public_key_pem.len() + k.issuer.len() + 8);
            material.extend_from_slice(name.as_bytes());
            material.extend_from_slice(k.issuer.as_bytes());
            material.push(0);
            material.extend_from_slice(k.public_key_pem.trim().as_bytes());
            let entry = SigningEntry {
                key,
                alg: name,
                issuer: Box::from(k.issuer.as_str()),
                fingerprint: xxhash_rust::xxh3::xxh3_64(&material),
            };
            if signing.insert(Box::from(k.kid.as_str()), entry).is_some() {
                return Err(format!("{at}: kid is listed twice").into());
            }
        }

        let mut apps = FastMap::default();
        for (client_id, app) in &creds.apps {
            let at = format!("apps.{client_id}");
            let plan = names.get(&app.plan, &format!("{at}.plan"))?;
            let tenant = match &app.tenant {
                Some(t) => Some(names.get(t, &format!("{at}.tenant"))?),
                None => None,
            };
            if let Some(iss) = &app.issuer
                && !creds.signing_keys.iter().any(|k| k.issuer == *iss)
            {
                return Err(format!("{at}.issuer: no signing key has the issuer {iss:?}").into());
            }
            let issuer = app.issuer.as_deref().map(Box::from);
            let priority = app.priority.map(postern_model::Priority::rank_u8);
            apps.insert(Box::from(client_id.as_str()), AppEntry { plan, tenant, priority, issuer });
        }

        let mut keys = FastMap::with_capacity_and_hasher(creds.keys.len(), foldhash::fast::RandomState::default());
        let mut last_scopes: (Vec<String>, Bytes) = (Vec::new(), Bytes::new());
        for (i, k) in creds.keys.iter().enumerate() {
            let (hash, entry) = key_entry(i, k, &mut names, &mut last_scopes)?;
            if keys.insert(hash, entry).is_some() {
                let problem = "the same key hash is listed twice".into();
                return Err(StoreError::Key { index: i, id: k.id.clone(), problem });
            }
        }

        let mut deny = DenyList::default();
        let lifetime = settings.max_lifetime_s.saturating_add(settings.leeway_s);
        for (i, d) in creds.deny.iter().enumerate() {
            deny.add(i, d, lifetime, now)?;
        }
        let mut over_quota = OverQuota::default();
        for f in &creds.over_quota {
            over_quota.add(f, now);
        }
        let mut debug_trace = DebugTrace::default();
        for f in &creds.debug_trace {
            debug_trace.set(f, now);
        }

        Ok(CredentialStore {
            version,
            keys,
            signing: Arc::new(signing),
            apps: Arc::new(apps),
            deny,
            over_quota,
            debug_trace,
            jwt: JwtLimits {
                leeway: settings.leeway_s,
                max_token_bytes: settings.max_token_bytes,
                max_lifetime: settings.max_lifetime_s,
            },
            audiences: settings.audiences.iter().map(|a| Box::from(a.as_str())).collect(),
        })
    }

    /// The key with this hash.
    pub fn key(&self, hash: &[u8; 32]) -> Option<&KeyEntry> {
        self.keys.get(hash)
    }

    /// The signing key with this `kid`.
    pub fn signing_key(&self, kid: &str) -> Option<&SigningEntry> {
        self.signing.get(kid)
    }

    /// The app with this `client_id`.
    pub fn app(&self, client_id: &str) -> Option<&AppEntry> {
        self.apps.get(client_id)
    }

    /// Counts: keys, signing keys, apps, deny entries.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (self.keys.len(), self.signing.len(), self.apps.len(), self.deny.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postern_model::credentials::DenyEntry;

    fn deny(entries: Vec<DenyEntry>, now: u64) -> DenyList {
        let mut c = Credentials::empty();
        c.deny = entries;
        CredentialStore::build(1, &c, now).unwrap().deny
    }

    fn entry() -> DenyEntry {
        DenyEntry { jti: None, sub: None, client_id: None, issued_before: None, expires_at: None }
    }

    #[test]
    fn deny_entries_cover_tokens_until_they_expire() {
        let now = 1_000_000;
        let d = deny(
            vec![
                DenyEntry { jti: Some("t1".into()), expires_at: Some(now + 60), ..entry() },
                DenyEntry { sub: Some("alice".into()), issued_before: Some(now), ..entry() },
                DenyEntry { client_id: Some("app-9".into()), issued_before: Some(now - 10), ..entry() },
                DenyEntry { jti: Some("gone".into()), expires_at: Some(now - 1), ..entry() },
            ],
            now,
        );
        assert_eq!(d.len(), 3, "the expired entry is dropped");
        assert!(d.is_denied("t1", "bob", "app", Some(now), now));
        assert!(!d.is_denied("t1", "bob", "app", Some(now), now + 61), "the jti entry expired with its token");
        assert!(d.is_denied("x", "alice", "app", Some(now - 1), now));
        assert!(!d.is_denied("x", "alice", "app", Some(now), now), "issued at T is after the revocation");
        assert!(d.is_denied("x", "alice", "app", None, now), "no iat: cannot prove it is newer");
        assert!(d.is_denied("x", "bob", "app-9", Some(now - 11), now));
        assert!(!d.is_denied("x", "bob", "app-9", Some(now - 10), now));
        // The user entry lasts for the longest token lifetime plus leeway past T.
        assert!(d.is_denied("x", "alice", "app", Some(now - 1), now + 3600 + 30));
        assert!(!d.is_denied("x", "alice", "app", Some(now - 1), now + 3600 + 31));
    }

    #[test]
    fn changes_replace_keys_by_hash_and_add_deny_entries() {
        let key = |id: &str, hash: &str, status| postern_model::credentials::ApiKey {
            id: id.into(),
            sha256: hash.repeat(32),
            app: "a".into(),
            tenant: "t".into(),
            plan: "p".into(),
            scopes: vec!["s".into()],
            priority: Default::default(),
            status,
            successor: None,
            expires_at: None,
        };
        let mut c = Credentials::empty();
        c.keys = vec![key("k1", "ab", KeyStatus::Active)];
        let base = CredentialStore::build(1, &c, 100).unwrap();
        let next = base
            .with_changes(
                2,
                &[key("k1", "ab", KeyStatus::Revoked), key("k2", "cd", KeyStatus::Active)],
                &[DenyEntry { jti: Some("t1".into()), expires_at: Some(200), ..entry() }],
                &[],
                &[],
                100,
            )
            .unwrap();
        assert_eq!(next.version, 2);
        assert_eq!(next.counts(), (2, 0, 0, 1));
        let h = |x: &str| {
            let mut b = [0u8; 32];
            hex::decode_to_slice(x.repeat(32), &mut b).unwrap();
            b
        };
        assert!(!next.key(&h("ab")).unwrap().active, "replaced by hash");
        assert!(next.key(&h("cd")).unwrap().active);
        assert!(next.deny.is_denied("t1", "x", "y", None, 150));
        // The state it came from is untouched.
        assert!(base.key(&h("ab")).unwrap().active);
        assert_eq!(base.counts(), (1, 0, 0, 0));
        let bad = base.with_changes(3, &[key("k3", "zz", KeyStatus::Active)], &[], &[], &[], 100);
        assert!(bad.unwrap_err().to_string().contains("keys[0] (id \"k3\")"));
    }

    #[test]
    fn malformed_state_is_refused_whole() {
        let mut c = Credentials::empty();
        c.deny = vec![DenyEntry { sub: Some("a".into()), client_id: Some("b".into()), ..entry() }];
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("deny[0]"));
        c.deny = vec![DenyEntry { sub: Some("a".into()), ..entry() }];
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("issued_before"));

        let mut c = Credentials::empty();
        c.keys = vec![postern_model::credentials::ApiKey {
            id: "k1".into(),
            sha256: "zz".into(),
            app: "a".into(),
            tenant: "t".into(),
            plan: "p".into(),
            scopes: vec![],
            priority: Default::default(),
            status: KeyStatus::Active,
            successor: None,
            expires_at: None,
        }];
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("keys[0] (id \"k1\"): sha256"));
        assert!(matches!(
            CredentialStore::build(1, &c, 0).unwrap_err(),
            StoreError::Key { index: 0, ref id, ref problem } if id == "k1" && problem == "sha256 must be 64 hex digits"
        ));
        c.keys[0].sha256 = "ab".repeat(32);
        c.keys[0].tenant = "bad\ntenant".into();
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("tenant"));
        c.keys[0].tenant = "t".into();
        c.keys.push(c.keys[0].clone());
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("twice"));

        let mut c = Credentials::empty();
        c.jwt.audiences = vec!["api".into()];
        c.signing_keys = vec![postern_model::credentials::SigningKey {
            kid: "k".into(),
            alg: Alg::ES256,
            issuer: "https://id".into(),
            public_key_pem: "not a key".into(),
        }];
        assert!(CredentialStore::build(1, &c, 0).unwrap_err().to_string().contains("signing_keys[0]"));
    }

    #[test]
    fn over_quota_flags_hold_until_their_period_ends() {
        let flag = |caller: &str, kind, product: &str, until| QuotaFlag {
            caller: caller.into(),
            kind,
            product: product.into(),
            until,
            quota: 100,
            period_s: 60,
        };
        let mut c = Credentials::empty();
        c.over_quota = vec![flag("k1", CallerKind::Key, "search", 200), flag("gone", CallerKind::Key, "search", 90)];
        let store = CredentialStore::build(1, &c, 100).unwrap();
        assert_eq!(store.over_quota.len(), 1, "a flag already lifted is dropped");
        let f = store.over_quota.get(Payer::Key, b"k1", "search", 150).unwrap();
        assert_eq!((f.until, f.quota, f.period_s), (200, 100, 60));
        assert_eq!(store.over_quota.get(Payer::Key, b"k1", "search", 200), None, "lifted at the period's end");
        assert_eq!(store.over_quota.get(Payer::Key, b"k1", "orders", 150), None, "another product");
        assert_eq!(store.over_quota.get(Payer::App, b"k1", "search", 150), None, "an app of the same name");
        let next = store.with_changes(2, &[], &[], &[flag("app-1", CallerKind::App, "search", 300)], &[], 100).unwrap();
        assert!(next.over_quota.get(Payer::App, b"app-1", "search", 250).is_some());
        assert!(next.over_quota.get(Payer::Key, b"k1", "search", 150).is_some(), "kept from the base");
    }

    #[test]
    fn debug_trace_flags_hold_until_their_expiry_and_a_later_one_replaces_them() {
        let flag = |caller: &str, kind, until| TraceFlag { caller: caller.into(), kind, until };
        let mut c = Credentials::empty();
        c.debug_trace = vec![flag("k1", CallerKind::Key, 200), flag("old", CallerKind::Key, 90)];
        let store = CredentialStore::build(1, &c, 100).unwrap();
        assert_eq!(store.debug_trace.len(), 1, "a flag already over is dropped");
        assert!(store.debug_trace.holds(Payer::Key, b"k1", 150));
        assert!(!store.debug_trace.holds(Payer::Key, b"k1", 200), "off at its expiry");
        assert!(!store.debug_trace.holds(Payer::App, b"k1", 150), "an app of the same name");
        let next = store.with_changes(2, &[], &[], &[], &[flag("app-1", CallerKind::App, 300)], 100).unwrap();
        assert!(next.debug_trace.holds(Payer::App, b"app-1", 250));
        assert!(next.debug_trace.holds(Payer::Key, b"k1", 150), "kept from the base");
        let off = next.with_changes(3, &[], &[], &[], &[flag("k1", CallerKind::Key, 120)], 120).unwrap();
        assert!(!off.debug_trace.holds(Payer::Key, b"k1", 150), "a shorter flag replaces a longer one");
        assert_eq!(off.debug_trace.len(), 1);
    }
}
