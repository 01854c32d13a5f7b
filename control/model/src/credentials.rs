//! Credential state: the API key table (hashes only), the JWT signing keys, the OAuth
//! apps' plans and the revocation deny list.
//!
//! This is not part of the staged snapshot: it changes in seconds (a new key, a leaked
//! key revoked, a signing key announced) and travels on its own fast lane. On disk it is
//! a sealed envelope like the snapshot ([`crate::SnapshotFile`]: version, content hash,
//! exact content bytes), so a node never loads a corrupted or partial file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use serde_json::value::RawValue;

use crate::{SnapshotError, content_hash};

/// The number and hash of a sealed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    /// Version.
    pub version: u64,
    /// `sha256:<hex>` of the content.
    pub hash: String,
    /// The control plane's signature, if any.
    pub sig: Option<String>,
}

impl Sealed {
    /// Checks the signature as a credentials version when `key` is pinned.
    pub fn verify(&self, key: Option<&crate::sign::Trust>) -> Result<(), SnapshotError> {
        let subject = crate::sign::Subject::Whole {
            lane: crate::protocol::Lane::Credentials,
            version: self.version,
            hash: &self.hash,
        };
        Ok(crate::sign::check(key, &subject, self.sig.as_deref())?)
    }
}

/// The sealed envelope, with its content borrowed from the bytes read.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvelopeRef<'a> {
    version: u64,
    hash: String,
    #[serde(default)]
    sig: Option<String>,
    #[serde(borrow)]
    content: &'a RawValue,
}

/// Version of the credentials format.
pub const CREDENTIALS_SCHEMA: u32 = 1;

/// Everything a node needs to authenticate callers from memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    /// Format version, [`CREDENTIALS_SCHEMA`].
    pub schema: u32,
    /// How access tokens are checked.
    #[serde(default)]
    pub jwt: JwtSettings,
    /// Public keys that sign access tokens, by `kid`.
    #[serde(default)]
    pub signing_keys: Vec<SigningKey>,
    /// OAuth apps by `client_id`: their plan and tenant.
    #[serde(default)]
    pub apps: BTreeMap<String, App>,
    /// API keys, by the SHA-256 of the raw key.
    #[serde(default)]
    pub keys: Vec<ApiKey>,
    /// Revoked tokens, users and apps.
    #[serde(default)]
    pub deny: Vec<DenyEntry>,
    /// Callers whose hard quota is used up, from the quota service.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub over_quota: Vec<QuotaFlag>,
    /// Callers every request of which is traced, until each flag's expiry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub debug_trace: Vec<TraceFlag>,
}

/// A caller (API key or OAuth app) whose every request is traced until `until`, which
/// the node reads on its own clock, so the flag turns itself off without a message.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceFlag {
    /// Key id or `client_id`.
    pub caller: String,
    /// `key` or `app`.
    pub kind: crate::usage::CallerKind,
    /// Unix seconds: when tracing stops.
    pub until: u64,
}

/// Sets `flags` in `into`: a flag for a caller already there replaces it (a later
/// `posternctl trace` lengthens, shortens or ends the earlier one).
pub fn set_trace_flags(into: &mut Vec<TraceFlag>, flags: &[TraceFlag]) {
    for f in flags {
        match into.iter_mut().find(|x| (&x.caller, x.kind) == (&f.caller, f.kind)) {
            Some(slot) => *slot = f.clone(),
            None => into.push(f.clone()),
        }
    }
}

/// A caller (API key or OAuth app) that used up its hard quota for one product: refused
/// with 429 `quota_exceeded` until `until`, the period's end, which the node reads on
/// its own clock, so the flag lifts without a message.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaFlag {
    /// Key id or `client_id`.
    pub caller: String,
    /// `key` or `app`.
    pub kind: crate::usage::CallerKind,
    /// The product.
    pub product: String,
    /// Unix seconds: the period's end.
    pub until: u64,
    /// The quota (calls per period), for `RateLimit-Policy`.
    pub quota: u64,
    /// The period's length in seconds, for `RateLimit-Policy`.
    pub period_s: u64,
}

impl QuotaFlag {
    /// The flag's identity: one per caller and product.
    pub fn key(&self) -> (&str, crate::usage::CallerKind, &str) {
        (&self.caller, self.kind, &self.product)
    }
}

/// Adds `flags` to `into`: a flag for a caller and product already there takes the later
/// period.
pub fn merge_flags(into: &mut Vec<QuotaFlag>, flags: &[QuotaFlag]) {
    for f in flags {
        match into.iter_mut().find(|x| x.key() == f.key()) {
            Some(slot) if slot.until < f.until => *slot = f.clone(),
            Some(_) => {}
            None => into.push(f.clone()),
        }
    }
}

impl Credentials {
    /// This state with a delta's changes made as a node makes them: a key record replaces
    /// the one with the same hash or is added; deny entries are added.
    pub fn with_delta(&self, d: &CredentialsDelta) -> Credentials {
        let mut out = self.clone();
        for k in &d.keys {
            match out.keys.iter_mut().find(|x| x.sha256.eq_ignore_ascii_case(&k.sha256)) {
                Some(slot) => *slot = k.clone(),
                None => out.keys.push(k.clone()),
            }
        }
        out.deny.extend(d.deny.iter().cloned());
        merge_flags(&mut out.over_quota, &d.over_quota);
        set_trace_flags(&mut out.debug_trace, &d.debug_trace);
        out
    }

    /// Keeps the run-time flags of `was` (over-quota flags from the quota service,
    /// debug-trace flags from the platform): a publish of keys and settings never drops
    /// them.
    pub fn keep_flags(&mut self, was: Option<&Credentials>) {
        self.over_quota = was.map(|c| c.over_quota.clone()).unwrap_or_default();
        self.debug_trace = was.map(|c| c.debug_trace.clone()).unwrap_or_default();
    }

    /// Whether two states grant the same: equal token settings, signing keys and apps,
    /// the same key records by hash and the same deny entries, in any order.
    pub fn same_state(&self, other: &Credentials) -> bool {
        fn keys(c: &Credentials) -> BTreeMap<String, &ApiKey> {
            c.keys.iter().map(|k| (k.sha256.to_ascii_lowercase(), k)).collect()
        }
        fn deny(c: &Credentials) -> std::collections::BTreeSet<String> {
            c.deny.iter().filter_map(|d| serde_json::to_string(d).ok()).collect()
        }
        fn flags(c: &Credentials) -> std::collections::BTreeSet<&QuotaFlag> {
            c.over_quota.iter().collect()
        }
        fn traced(c: &Credentials) -> std::collections::BTreeSet<&TraceFlag> {
            c.debug_trace.iter().collect()
        }
        self.schema == other.schema
            && self.jwt == other.jwt
            && self.signing_keys == other.signing_keys
            && self.apps == other.apps
            && keys(self) == keys(other)
            && deny(self) == deny(other)
            && flags(self) == flags(other)
            && traced(self) == traced(other)
    }

    /// No keys, no signing keys: every credential is refused.
    pub fn empty() -> Credentials {
        Credentials {
            schema: CREDENTIALS_SCHEMA,
            jwt: JwtSettings::default(),
            signing_keys: Vec::new(),
            apps: BTreeMap::new(),
            keys: Vec::new(),
            deny: Vec::new(),
            over_quota: Vec::new(),
            debug_trace: Vec::new(),
        }
    }

    /// Parses a sealed credentials file, checking its hash and schema.
    pub fn open(bytes: &[u8]) -> Result<(Sealed, Credentials), SnapshotError> {
        Self::open_envelope(serde_json::from_slice(bytes)?)
    }

    /// As [`Credentials::open`], but only if `wanted` says yes to the file's version:
    /// otherwise `None`, without hashing or parsing the content (a node skips the file it
    /// just wrote itself).
    ///
    /// A table of a million keys is a couple of hundred megabytes: the envelope is read
    /// without copying its content, and the content is hashed on a second thread while
    /// it is parsed on this one.
    pub fn open_if(
        bytes: &[u8],
        wanted: impl FnOnce(u64) -> bool,
    ) -> Result<Option<(Sealed, Credentials)>, SnapshotError> {
        let file: EnvelopeRef<'_> = serde_json::from_slice(bytes)?;
        if !wanted(file.version) {
            return Ok(None);
        }
        Self::open_envelope(file).map(Some)
    }

    fn open_envelope(file: EnvelopeRef<'_>) -> Result<(Sealed, Credentials), SnapshotError> {
        let content = file.content.get();
        let (actual, creds) = std::thread::scope(|s| {
            let hashing = s.spawn(|| content_hash(content.as_bytes()));
            let creds = serde_json::from_str::<Credentials>(content);
            (hashing.join().unwrap_or_default(), creds)
        });
        if actual != file.hash {
            return Err(SnapshotError::HashMismatch { expected: file.hash, actual });
        }
        let creds = creds?;
        if creds.schema != CREDENTIALS_SCHEMA {
            return Err(SnapshotError::Schema(creds.schema));
        }
        Ok((Sealed { version: file.version, hash: file.hash, sig: file.sig }, creds))
    }
}

/// Access-token checks shared by every signing key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JwtSettings {
    /// The `aud` values this gateway accepts; a token must name one of them.
    pub audiences: Vec<String>,
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    pub leeway_s: u64,
    /// Longest token accepted, in bytes, checked before any decoding.
    pub max_token_bytes: usize,
    /// Longest token lifetime (`exp - iat`) accepted, in seconds; it also bounds how long
    /// a deny entry for a user or an app has to live.
    pub max_lifetime_s: u64,
}

impl Default for JwtSettings {
    fn default() -> JwtSettings {
        JwtSettings { audiences: Vec::new(), leeway_s: 30, max_token_bytes: 4096, max_lifetime_s: 3600 }
    }
}

/// A signature algorithm, pinned per signing key (never taken from the token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Alg {
    /// ECDSA P-256 with SHA-256.
    ES256,
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    RS256,
}

impl Alg {
    /// The JOSE name.
    pub fn as_str(self) -> &'static str {
        match self {
            Alg::ES256 => "ES256",
            Alg::RS256 => "RS256",
        }
    }
}

/// A public key that signs access tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningKey {
    /// Key id, matched against the token header's `kid`.
    pub kid: String,
    /// The only algorithm accepted with this key.
    pub alg: Alg,
    /// The issuer (`iss`) whose tokens this key signs.
    pub issuer: String,
    /// SubjectPublicKeyInfo PEM (`-----BEGIN PUBLIC KEY-----`).
    pub public_key_pem: String,
}

/// A key's or an app's priority class (the same classes as a plan's).
pub use crate::Priority;

/// An OAuth app (`client_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct App {
    /// The app's plan.
    pub plan: String,
    /// The tenant (developer organisation) that owns the app.
    #[serde(default)]
    pub tenant: Option<String>,
    /// The app's own priority class: when set, its requests' class, above its plan's and
    /// below a route's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The issuer (`iss`) whose tokens may carry this `client_id`: a token of another
    /// issuer naming it is refused (`app_issuer_mismatch`). Required when the signing
    /// keys name more than one issuer; with one, that issuer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
}

/// Whether an API key works.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStatus {
    /// Accepted.
    #[default]
    Active,
    /// Refused for good (leaked, deleted).
    Revoked,
}

/// One API key. Only its SHA-256 is known; the raw key was shown once, at creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// Key id (not secret), sent to backends as `x-auth-key-id`.
    pub id: String,
    /// Lowercase hex SHA-256 of the whole raw key.
    pub sha256: String,
    /// The app the key belongs to (sent as `x-auth-client-id`).
    pub app: String,
    /// The tenant that owns the app.
    pub tenant: String,
    /// The plan (entitlements: which API products the key may call).
    pub plan: String,
    /// Granted scopes.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// The key's own priority class: when set, its requests' class, above its plan's and
    /// below a route's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Active or revoked.
    #[serde(default)]
    pub status: KeyStatus,
    /// The key that replaces this one, during a rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub successor: Option<String>,
    /// Unix seconds after which the key stops working (the end of a rotation's overlap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
}

/// A revocation. Exactly one of `jti`, `sub` or `client_id` is set; `sub` and
/// `client_id` entries revoke every token issued before `issued_before`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyEntry {
    /// One token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// Every token of one user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub: Option<String>,
    /// Every token of one app.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// Unix seconds: tokens issued (`iat`) before this are revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_before: Option<u64>,
    /// Unix seconds when every token the entry covers has expired, so the entry can go.
    /// Defaults to `issued_before` plus the longest token lifetime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
}

/// A fast-lane change to the credential state: key records added or replaced (matched by
/// hash) and deny entries added, from version `base` to `version`. A node running `base`
/// applies it to its live state instead of loading the whole table; any other node, or a
/// node that fails to, takes the whole version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialsDelta {
    /// The version it applies to.
    pub base: u64,
    /// The version it makes.
    pub version: u64,
    /// Key records added or changed.
    #[serde(default)]
    pub keys: Vec<ApiKey>,
    /// Deny entries added.
    #[serde(default)]
    pub deny: Vec<DenyEntry>,
    /// Over-quota flags added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub over_quota: Vec<QuotaFlag>,
    /// Debug-trace flags set (each replaces the caller's earlier one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub debug_trace: Vec<TraceFlag>,
}

impl CredentialsDelta {
    /// A delta from `base` to `version` that changes nothing yet.
    pub fn between(base: u64, version: u64) -> CredentialsDelta {
        CredentialsDelta {
            base,
            version,
            keys: Vec::new(),
            deny: Vec::new(),
            over_quota: Vec::new(),
            debug_trace: Vec::new(),
        }
    }
}

/// A delta as sent and stored: `{"delta": {...}}`, told apart from a sealed envelope by
/// its one field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeltaDoc {
    /// The change.
    pub delta: CredentialsDelta,
    /// The control plane's signature over base, version and the delta's JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

impl DeltaDoc {
    /// `delta`, signed by `signer` when there is one.
    pub fn new(delta: CredentialsDelta, signer: Option<&crate::sign::Signer>) -> Result<DeltaDoc, serde_json::Error> {
        let mut doc = DeltaDoc { delta, sig: None };
        if let Some(signer) = signer {
            let hash = doc.hash()?;
            doc.sig = Some(signer.sign(&doc.subject(&hash)));
        }
        Ok(doc)
    }

    /// The hash a signature covers: of the delta serialised (a function of its value, so
    /// the node computes it again from what it parsed).
    fn hash(&self) -> Result<String, serde_json::Error> {
        Ok(content_hash(&serde_json::to_vec(&self.delta)?))
    }

    fn subject<'a>(&self, hash: &'a str) -> crate::sign::Subject<'a> {
        crate::sign::Subject::Delta { base: self.delta.base, version: self.delta.version, hash }
    }

    /// Checks the signature when `key` is pinned.
    pub fn verify(&self, key: Option<&crate::sign::Trust>) -> Result<(), SnapshotError> {
        let Some(key) = key else { return Ok(()) };
        let hash = self.hash()?;
        Ok(key.verify(&self.subject(&hash), self.sig.as_deref())?)
    }

    /// The delta in `bytes`, if they hold one (`None`: a sealed envelope or garbage).
    pub fn parse(bytes: &[u8]) -> Option<Result<DeltaDoc, serde_json::Error>> {
        let head = bytes.iter().position(|b| !b.is_ascii_whitespace()).map_or(&[][..], |i| &bytes[i..]);
        let is_delta = head.starts_with(b"{\"delta\"");
        is_delta.then(|| serde_json::from_slice(bytes))
    }
}
