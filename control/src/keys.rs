//! API key lifecycle in a config repository (`platform/keys.jsonl`: create, rotate,
//! revoke) and development helpers for JWT signing keys (generate a key pair, mint a
//! token).
//!
//! Raw API keys are never stored: a new key is returned once, to be shown to its owner,
//! and only its SHA-256 goes into the repository. Every change to `keys.jsonl` rewrites
//! the whole file atomically, leaving the lines it does not change as they were.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use postern_model::apikey::{self, KeyEnv};
use postern_model::credentials::{Alg, ApiKey, DenyEntry, KeyStatus, Priority};
use serde::Serialize;

use crate::credentials::{DENY_FILE, KEYS_FILE, parse_keys};

/// A name that is not a priority class, as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a priority: use critical, standard, free or sheddable")]
pub struct UnknownPriority(pub String);

/// A name that is not a supported signature algorithm, as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a supported algorithm: use ES256 or RS256")]
pub struct UnknownAlg(pub String);

/// Parses a priority class: `critical`, `standard`, `free` or `sheddable`.
pub fn parse_priority(s: &str) -> Result<Priority, UnknownPriority> {
    Priority::parse(s).ok_or_else(|| UnknownPriority(s.to_owned()))
}

/// Parses a signature algorithm: `ES256` or `RS256`.
pub fn parse_alg(s: &str) -> Result<Alg, UnknownAlg> {
    match s {
        "ES256" | "es256" => Ok(Alg::ES256),
        "RS256" | "rs256" => Ok(Alg::RS256),
        _ => Err(UnknownAlg(s.to_owned())),
    }
}

/// Checks a key id: 1 to 128 characters among ASCII letters, digits, `-`, `_`, `.`, `:`
/// (it is sent to backends in a header).
fn check_id(what: &str, id: &str) -> anyhow::Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if !ok {
        bail!("{what} {id:?}: use 1 to 128 characters among letters, digits, '-', '_', '.' and ':'");
    }
    Ok(())
}

fn check_name(what: &str, value: &str) -> anyhow::Result<()> {
    if value.is_empty() || value.len() > 256 || value.chars().any(|c| c.is_control()) {
        bail!("{what} {value:?}: use 1 to 256 printable characters");
    }
    Ok(())
}

/// `platform/keys.jsonl`, loaded for an edit.
struct KeysFile {
    path: PathBuf,
    /// Every line of the file, as read (changed ones replaced).
    lines: Vec<String>,
    /// Every record, with its 1-based line number.
    keys: Vec<(usize, ApiKey)>,
}

impl KeysFile {
    fn load(repo: &Path) -> anyhow::Result<KeysFile> {
        if !repo.is_dir() {
            bail!("{} is not a directory (expected a config repository)", repo.display());
        }
        let path = repo.join(KEYS_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => bail!("cannot read {}: {e}", path.display()),
        };
        let (keys, errors) = parse_keys(&text);
        if !errors.is_empty() {
            bail!("fix {} first:\n  {}", path.display(), errors.join("\n  "));
        }
        Ok(KeysFile { path, lines: text.lines().map(str::to_owned).collect(), keys })
    }

    fn find(&self, id: &str) -> Option<usize> {
        self.keys.iter().position(|(_, k)| k.id == id)
    }

    fn set(&mut self, index: usize, key: ApiKey) -> anyhow::Result<()> {
        let line = serde_json::to_string(&key)?;
        let (n, slot) = &mut self.keys[index];
        self.lines[*n - 1] = line;
        *slot = key;
        Ok(())
    }

    fn push(&mut self, key: ApiKey) -> anyhow::Result<()> {
        if self.find(&key.id).is_some() {
            bail!("{}: a key with id {:?} already exists", self.path.display(), key.id);
        }
        self.lines.push(serde_json::to_string(&key)?);
        self.keys.push((self.lines.len(), key));
        Ok(())
    }

    fn save(&self) -> anyhow::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let mut text = self.lines.join("\n");
        text.push('\n');
        Ok(crate::write_atomic(&self.path, text.as_bytes())?)
    }
}

fn generate(env: KeyEnv) -> anyhow::Result<String> {
    apikey::generate(env).map_err(|e| anyhow!("cannot generate a key: the system random source failed: {e}"))
}

/// A key to create with [`new_key`].
#[derive(Debug, Clone)]
pub struct NewKey {
    /// Key id (not secret).
    pub id: String,
    /// The app the key belongs to.
    pub app: String,
    /// The tenant that owns the app.
    pub tenant: String,
    /// The plan.
    pub plan: String,
    /// Granted scopes.
    pub scopes: Vec<String>,
    /// The key's own priority class (none: its plan's).
    pub priority: Option<Priority>,
    /// `ak_live_` or `ak_test_`.
    pub env: KeyEnv,
}

/// Generates a key, appends its record (hash only, active) to `<repo>/platform/keys.jsonl`
/// and returns the raw key, which exists nowhere else: show it once.
///
/// Refuses an id already in the file. The plan is checked by `compile`/`validate`.
pub fn new_key(repo: &Path, spec: &NewKey) -> anyhow::Result<String> {
    check_id("--id", &spec.id)?;
    check_name("--app", &spec.app)?;
    check_name("--tenant", &spec.tenant)?;
    check_name("--plan", &spec.plan)?;
    for s in &spec.scopes {
        if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("--scope {s:?}: a scope is one word; repeat --scope for several");
        }
    }
    let mut file = KeysFile::load(repo)?;
    let raw = generate(spec.env)?;
    file.push(ApiKey {
        id: spec.id.clone(),
        sha256: hex::encode(apikey::hash(raw.as_bytes())),
        app: spec.app.clone(),
        tenant: spec.tenant.clone(),
        plan: spec.plan.clone(),
        scopes: spec.scopes.clone(),
        priority: spec.priority,
        status: KeyStatus::Active,
        successor: None,
        expires_at: None,
    })?;
    file.save()?;
    Ok(raw)
}

/// The result of [`rotate_key`].
#[derive(Debug, Clone)]
pub struct Rotated {
    /// The new raw key: show it once.
    pub raw_key: String,
    /// Unix seconds when the old key stops working.
    pub old_expires_at: u64,
}

/// Replaces key `old_id` with a new key `new_id` (same app, tenant, plan, scopes and
/// priority): the old record gets `successor: new_id` and `expires_at: now + overlap`, so
/// both work until then. Returns the new raw key.
pub fn rotate_key(
    repo: &Path,
    old_id: &str,
    new_id: &str,
    overlap: Duration,
    env: KeyEnv,
    now: u64,
) -> anyhow::Result<Rotated> {
    check_id("--new-id", new_id)?;
    let mut file = KeysFile::load(repo)?;
    let index = file.find(old_id).ok_or_else(|| anyhow!("{}: no key with id {old_id:?}", file.path.display()))?;
    let old = file.keys[index].1.clone();
    if old.status == KeyStatus::Revoked {
        bail!("key {old_id:?} is revoked; create a new key with `posternctl key new` instead");
    }
    if let Some(s) = &old.successor {
        bail!("key {old_id:?} was already rotated to {s:?}; rotate that one instead");
    }
    if old.expires_at.is_some_and(|e| e <= now) {
        bail!("key {old_id:?} has already expired; create a new key with `posternctl key new` instead");
    }
    let raw = generate(env)?;
    let overlap_end = now.saturating_add(overlap.as_secs());
    let new = ApiKey {
        id: new_id.to_owned(),
        sha256: hex::encode(apikey::hash(raw.as_bytes())),
        status: KeyStatus::Active,
        successor: None,
        expires_at: None,
        ..old.clone()
    };
    file.push(new)?;
    // An earlier expiry (set by hand) is kept: rotation never extends a key's life.
    let expires_at = old.expires_at.map_or(overlap_end, |e| e.min(overlap_end));
    file.set(index, ApiKey { successor: Some(new_id.to_owned()), expires_at: Some(expires_at), ..old })?;
    file.save()?;
    Ok(Rotated { raw_key: raw, old_expires_at: expires_at })
}

/// Which key [`revoke_key`] revokes.
#[derive(Debug, Clone, Copy)]
pub enum RevokeBy<'a> {
    /// By key id.
    Id(&'a str),
    /// By the raw key (e.g. one reported leaked): its hash is looked up.
    RawKey(&'a str),
}

/// The result of [`revoke_key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoked {
    /// The revoked key's id.
    pub id: String,
    /// It was already revoked; the file was not changed.
    pub already: bool,
}

/// Sets a key's status to revoked.
pub fn revoke_key(repo: &Path, by: RevokeBy<'_>) -> anyhow::Result<Revoked> {
    let mut file = KeysFile::load(repo)?;
    let index = match by {
        RevokeBy::Id(id) => file.find(id).ok_or_else(|| anyhow!("{}: no key with id {id:?}", file.path.display()))?,
        RevokeBy::RawKey(raw) => {
            let raw = raw.trim();
            apikey::check_shape(raw.as_bytes()).map_err(|e| {
                anyhow!("--key is not a Postern API key ({e}); check that it was copied whole, or revoke by --id")
            })?;
            let sha = hex::encode(apikey::hash(raw.as_bytes()));
            file.keys.iter().position(|(_, k)| k.sha256.eq_ignore_ascii_case(&sha)).ok_or_else(|| {
                anyhow!(
                    "{}: no key has this hash (sha256 {sha}); it may belong to another environment",
                    file.path.display()
                )
            })?
        }
    };
    let key = file.keys[index].1.clone();
    let id = key.id.clone();
    if key.status == KeyStatus::Revoked {
        return Ok(Revoked { id, already: true });
    }
    file.set(index, ApiKey { status: KeyStatus::Revoked, ..key })?;
    file.save()?;
    Ok(Revoked { id, already: false })
}

/// Whose tokens [`deny`] revokes.
#[derive(Debug, Clone, Copy)]
pub enum DenyBy<'a> {
    /// One token, by its `jti`.
    Jti(&'a str),
    /// Every token of one user issued before now.
    Sub(&'a str),
    /// Every token of one app issued before now.
    ClientId(&'a str),
}

/// Appends a deny entry to `<repo>/platform/deny.jsonl` and returns it. A `jti` entry
/// lives for the longest token lifetime (`lifetime_s`, leeway included) from `now`; a
/// user's or app's covers tokens issued before `now` and lives as long after that.
pub fn deny(repo: &Path, by: DenyBy<'_>, now: u64, lifetime_s: u64) -> anyhow::Result<DenyEntry> {
    if !repo.is_dir() {
        bail!("{} is not a directory (expected a config repository)", repo.display());
    }
    let (flag, value) = match by {
        DenyBy::Jti(v) => ("--jti", v),
        DenyBy::Sub(v) => ("--sub", v),
        DenyBy::ClientId(v) => ("--client-id", v),
    };
    if value.is_empty() || value.len() > 256 || value.chars().any(char::is_control) {
        bail!("{flag} must be 1 to 256 characters with no control characters");
    }
    let none = DenyEntry { jti: None, sub: None, client_id: None, issued_before: None, expires_at: None };
    let entry = match by {
        DenyBy::Jti(j) => {
            DenyEntry { jti: Some(j.to_owned()), expires_at: Some(now.saturating_add(lifetime_s)), ..none }
        }
        DenyBy::Sub(s) => DenyEntry { sub: Some(s.to_owned()), issued_before: Some(now), ..none },
        DenyBy::ClientId(c) => DenyEntry { client_id: Some(c.to_owned()), issued_before: Some(now), ..none },
    };
    let path = repo.join(DENY_FILE);
    let mut text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => bail!("cannot read {}: {e}", path.display()),
    };
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&serde_json::to_string(&entry)?);
    text.push('\n');
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    crate::write_atomic(&path, text.as_bytes())?;
    Ok(entry)
}

/// A generated signing key pair, as PEM.
#[derive(Debug, Clone)]
pub struct KeyPairPem {
    /// PKCS#8 private key (`-----BEGIN PRIVATE KEY-----`).
    pub private_pem: String,
    /// SubjectPublicKeyInfo public key (`-----BEGIN PUBLIC KEY-----`).
    pub public_pem: String,
}

/// Generates a signing key pair: P-256 for ES256, 2048-bit RSA for RS256.
pub fn keygen(alg: Alg) -> anyhow::Result<KeyPairPem> {
    let sig = match alg {
        Alg::ES256 => &rcgen::PKCS_ECDSA_P256_SHA256,
        Alg::RS256 => &rcgen::PKCS_RSA_SHA256,
    };
    let pair = rcgen::KeyPair::generate_for(sig).map_err(|e| anyhow!("cannot generate {} key: {e}", alg.as_str()))?;
    Ok(KeyPairPem { private_pem: pair.serialize_pem(), public_pem: pair.public_key_pem() })
}

/// The signing-key record for `platform/auth.yaml`, as a YAML list item to paste under
/// `signing_keys:` (the PEM as a block scalar).
pub fn signing_key_yaml(kid: &str, alg: Alg, issuer: &str, public_pem: &str) -> anyhow::Result<String> {
    // JSON strings are valid YAML double-quoted scalars.
    let mut out = format!(
        "  - kid: {}\n    alg: {}\n    issuer: {}\n    public_key_pem: |\n",
        serde_json::to_string(kid)?,
        alg.as_str(),
        serde_json::to_string(issuer)?
    );
    for line in public_pem.trim().lines() {
        out.push_str("      ");
        out.push_str(line.trim_end());
        out.push('\n');
    }
    Ok(out)
}

/// Writes a private key to a new file, readable by its owner only (mode 0600 on Unix).
/// Refuses to overwrite an existing file.
pub fn write_private_key(path: &Path, pem: &str) -> anyhow::Result<()> {
    use std::io::Write;

    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            anyhow!("{} already exists; refusing to overwrite a private key", path.display())
        } else {
            anyhow!("cannot create {}: {e}", path.display())
        }
    })?;
    f.write_all(pem.as_bytes()).and_then(|()| f.sync_all()).map_err(|e| anyhow!("cannot write {}: {e}", path.display()))
}

/// Reads the control plane's signing key (`ed25519-seed:<hex>`).
pub fn read_signer(path: &Path) -> anyhow::Result<postern_model::sign::Signer> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow!("cannot read the signing key {}: {e} (`posternctl signing-key new FILE` makes one)", path.display())
    })?;
    postern_model::sign::Signer::parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The signing key of a directory store: `<store>/signing.key`, made on first start (mode
/// 0600), with its public half in `<store>/signing.pub` for nodes to pin.
pub fn store_signer(store: &Path) -> anyhow::Result<postern_model::sign::Signer> {
    let path = store.join("signing.key");
    let signer = if path.exists() {
        read_signer(&path)?
    } else {
        std::fs::create_dir_all(store).map_err(|e| anyhow!("cannot create {}: {e}", store.display()))?;
        let signer = postern_model::sign::Signer::generate()?;
        write_private_key(&path, &signer.to_text())?;
        signer
    };
    postern_model::disk::write_atomic(&store.join("signing.pub"), format!("{}\n", signer.public()).as_bytes())?;
    Ok(signer)
}

/// A development access token to sign with [`mint`].
#[derive(Debug, Clone)]
pub struct MintRequest<'a> {
    /// Algorithm of the private key.
    pub alg: Alg,
    /// `kid` header: the signing key's id in `platform/auth.yaml`.
    pub kid: &'a str,
    /// `iss`.
    pub issuer: &'a str,
    /// `aud`.
    pub audience: &'a str,
    /// `sub`: the user.
    pub sub: &'a str,
    /// `client_id`: the OAuth app.
    pub client_id: &'a str,
    /// `scope`: space-separated scopes, if any.
    pub scope: Option<&'a str>,
    /// Lifetime (`exp - iat`).
    pub ttl: Duration,
    /// `jti`; random if not given.
    pub jti: Option<&'a str>,
    /// Unix seconds: `iat` and `nbf`.
    pub now: u64,
}

#[derive(Serialize)]
struct Claims<'a> {
    iss: &'a str,
    aud: &'a str,
    sub: &'a str,
    client_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    scope: Option<&'a str>,
    jti: String,
    iat: u64,
    nbf: u64,
    exp: u64,
}

/// Signs an access token (header `{alg, kid, typ: "at+jwt"}`) with a PEM private key.
/// For development and tests only: production tokens come from the identity provider.
pub fn mint(private_pem: &str, req: &MintRequest<'_>) -> anyhow::Result<String> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};

    if req.ttl.as_secs() == 0 {
        bail!("--ttl must be at least 1s");
    }
    let (algorithm, key) = match req.alg {
        Alg::ES256 => (Algorithm::ES256, EncodingKey::from_ec_pem(private_pem.as_bytes())),
        Alg::RS256 => (Algorithm::RS256, EncodingKey::from_rsa_pem(private_pem.as_bytes())),
    };
    let key = key.map_err(|e| anyhow!("--key is not a PKCS#8 {} private key PEM: {e}", req.alg.as_str()))?;
    let jti = match req.jti {
        Some(j) => j.to_owned(),
        None => {
            let mut bytes = [0u8; 16];
            getrandom::fill(&mut bytes).map_err(|e| anyhow!("cannot generate a jti: {e}"))?;
            hex::encode(bytes)
        }
    };
    let mut header = Header::new(algorithm);
    header.kid = Some(req.kid.to_owned());
    header.typ = Some("at+jwt".to_owned());
    let claims = Claims {
        iss: req.issuer,
        aud: req.audience,
        sub: req.sub,
        client_id: req.client_id,
        scope: req.scope,
        jti,
        iat: req.now,
        nbf: req.now,
        exp: req.now.saturating_add(req.ttl.as_secs()),
    };
    jsonwebtoken::encode(&header, &claims, &key).map_err(|e| anyhow!("cannot sign the token: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str) -> NewKey {
        NewKey {
            id: id.into(),
            app: "app1".into(),
            tenant: "acme".into(),
            plan: "gold".into(),
            scopes: vec!["orders:read".into(), "orders:write".into()],
            priority: Some(Priority::Critical),
            env: KeyEnv::Live,
        }
    }

    fn records(repo: &Path) -> Vec<ApiKey> {
        let text = std::fs::read_to_string(repo.join(KEYS_FILE)).unwrap();
        let (keys, errors) = parse_keys(&text);
        assert!(errors.is_empty(), "{errors:?}");
        keys.into_iter().map(|(_, k)| k).collect()
    }

    #[test]
    fn new_key_appends_its_hash() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("platform")).unwrap();
        // Lines already there are kept as they were.
        let existing = r#"{"id":"old","sha256":"00","app":"a","tenant":"t","plan":"p"}"#;
        std::fs::write(dir.path().join(KEYS_FILE), format!("{existing}\n\n")).unwrap();

        let raw = new_key(dir.path(), &spec("k1")).unwrap();
        assert!(raw.starts_with("ak_live_"));
        apikey::check_shape(raw.as_bytes()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(KEYS_FILE)).unwrap();
        assert!(text.starts_with(&format!("{existing}\n\n")));
        let keys = records(dir.path());
        assert_eq!(keys.len(), 2);
        let k = &keys[1];
        assert_eq!(k.sha256, hex::encode(apikey::hash(raw.as_bytes())));
        assert_eq!((k.id.as_str(), k.status, k.priority), ("k1", KeyStatus::Active, Some(Priority::Critical)));
        assert_eq!(k.scopes, ["orders:read", "orders:write"]);

        let err = new_key(dir.path(), &spec("k1")).unwrap_err().to_string();
        assert!(err.contains("already exists"), "{err}");
        let test = new_key(dir.path(), &NewKey { env: KeyEnv::Test, ..spec("k2") }).unwrap();
        assert!(test.starts_with("ak_test_"));
        assert!(new_key(dir.path(), &spec("bad id")).is_err());
    }

    #[test]
    fn new_key_creates_platform_dir_and_refuses_a_broken_file() {
        let dir = tempfile::tempdir().unwrap();
        new_key(dir.path(), &spec("k1")).unwrap();
        assert_eq!(records(dir.path()).len(), 1);
        std::fs::write(dir.path().join(KEYS_FILE), "{not json\n").unwrap();
        let err = new_key(dir.path(), &spec("k2")).unwrap_err().to_string();
        assert!(err.contains("platform/keys.jsonl:1:"), "{err}");
    }

    #[test]
    fn rotate_sets_successor_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        new_key(dir.path(), &spec("k1")).unwrap();
        let now = 1_700_000_000;
        let rotated = rotate_key(dir.path(), "k1", "k2", Duration::from_secs(86_400), KeyEnv::Live, now).unwrap();
        let keys = records(dir.path());
        let (old, new) = (&keys[0], &keys[1]);
        assert_eq!(old.successor.as_deref(), Some("k2"));
        assert_eq!(old.expires_at, Some(now + 86_400));
        assert_eq!(rotated.old_expires_at, now + 86_400);
        assert_eq!(old.status, KeyStatus::Active);
        assert_eq!(new.id, "k2");
        assert_eq!(new.sha256, hex::encode(apikey::hash(rotated.raw_key.as_bytes())));
        assert_eq!((&new.app, &new.tenant, &new.plan), (&old.app, &old.tenant, &old.plan));
        assert_eq!((&new.scopes, new.priority), (&old.scopes, old.priority));
        assert_eq!((new.successor.as_ref(), new.expires_at), (None, None));

        let err = rotate_key(dir.path(), "k1", "k3", Duration::from_secs(60), KeyEnv::Live, now).unwrap_err();
        assert!(err.to_string().contains("already rotated"), "{err}");
        assert!(rotate_key(dir.path(), "nope", "k3", Duration::from_secs(60), KeyEnv::Live, now).is_err());
        assert!(rotate_key(dir.path(), "k2", "k1", Duration::from_secs(60), KeyEnv::Live, now).is_err());
    }

    #[test]
    fn revoke_by_raw_key_and_by_id() {
        let dir = tempfile::tempdir().unwrap();
        let raw1 = new_key(dir.path(), &spec("k1")).unwrap();
        new_key(dir.path(), &spec("k2")).unwrap();

        let r = revoke_key(dir.path(), RevokeBy::RawKey(&format!(" {raw1}\n"))).unwrap();
        assert_eq!(r, Revoked { id: "k1".into(), already: false });
        let keys = records(dir.path());
        assert_eq!((keys[0].status, keys[1].status), (KeyStatus::Revoked, KeyStatus::Active));

        let r = revoke_key(dir.path(), RevokeBy::Id("k1")).unwrap();
        assert!(r.already);
        assert!(!revoke_key(dir.path(), RevokeBy::Id("k2")).unwrap().already);
        assert!(records(dir.path()).iter().all(|k| k.status == KeyStatus::Revoked));

        let mut bad = raw1.clone();
        bad.pop();
        bad.push(if raw1.ends_with('0') { '1' } else { '0' });
        let err = revoke_key(dir.path(), RevokeBy::RawKey(&bad)).unwrap_err().to_string();
        assert!(err.contains("not a Postern API key"), "{err}");
        let unknown = apikey::generate(KeyEnv::Live).unwrap();
        let err = revoke_key(dir.path(), RevokeBy::RawKey(&unknown)).unwrap_err().to_string();
        assert!(err.contains("no key has this hash"), "{err}");
    }

    #[test]
    fn parsers() {
        assert_eq!(parse_priority("sheddable"), Ok(Priority::Sheddable));
        assert!(parse_priority("urgent").is_err());
        assert_eq!(parse_alg("RS256"), Ok(Alg::RS256));
        assert!(parse_alg("HS256").is_err());
    }

    fn mint_and_verify(alg: Alg) {
        use jsonwebtoken::{Algorithm, DecodingKey, Validation};

        let pair = keygen(alg).unwrap();
        let now = postern_model::disk::unix_now();
        let req = MintRequest {
            alg,
            kid: "k1",
            issuer: "https://idp.example",
            audience: "api",
            sub: "user1",
            client_id: "cid1",
            scope: Some("orders:read orders:write"),
            ttl: Duration::from_secs(900),
            jti: None,
            now,
        };
        let token = mint(&pair.private_pem, &req).unwrap();
        let (algorithm, key) = match alg {
            Alg::ES256 => (Algorithm::ES256, DecodingKey::from_ec_pem(pair.public_pem.as_bytes()).unwrap()),
            Alg::RS256 => (Algorithm::RS256, DecodingKey::from_rsa_pem(pair.public_pem.as_bytes()).unwrap()),
        };
        let mut validation = Validation::new(algorithm);
        validation.set_audience(&["api"]);
        validation.set_issuer(&["https://idp.example"]);
        validation.validate_nbf = true;
        let data = jsonwebtoken::decode::<serde_json::Value>(&token, &key, &validation).unwrap();
        assert_eq!(data.header.kid.as_deref(), Some("k1"));
        assert_eq!(data.header.typ.as_deref(), Some("at+jwt"));
        let c = data.claims;
        assert_eq!((c["sub"].as_str(), c["client_id"].as_str()), (Some("user1"), Some("cid1")));
        assert_eq!(c["scope"].as_str(), Some("orders:read orders:write"));
        assert_eq!(c["exp"].as_u64(), Some(now + 900));
        assert_eq!(c["jti"].as_str().map(str::len), Some(32));

        // A wrong audience is refused.
        let mut other = Validation::new(algorithm);
        other.set_audience(&["other"]);
        assert!(jsonwebtoken::decode::<serde_json::Value>(&token, &key, &other).is_err());
    }

    #[test]
    fn minted_es256_token_verifies_with_the_keygen_public_key() {
        mint_and_verify(Alg::ES256);
    }

    #[test]
    fn minted_rs256_token_verifies_with_the_keygen_public_key() {
        mint_and_verify(Alg::RS256);
    }

    #[test]
    fn keygen_snippet_and_key_file_compile_into_credentials() {
        #[derive(serde::Deserialize)]
        struct Doc {
            signing_keys: Vec<postern_model::credentials::SigningKey>,
        }
        let pair = keygen(Alg::ES256).unwrap();
        let yaml = signing_key_yaml("k1", Alg::ES256, "https://idp.example", &pair.public_pem).unwrap();
        let doc: Doc = serde_yaml_ng::from_str(&format!("signing_keys:\n{yaml}")).unwrap();
        assert_eq!(doc.signing_keys[0].kid, "k1");
        assert_eq!(doc.signing_keys[0].public_key_pem.trim(), pair.public_pem.trim());

        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("k1.pem");
        write_private_key(&private, &pair.private_pem).unwrap();
        assert!(write_private_key(&private, &pair.private_pem).is_err(), "never overwrites");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&private).unwrap().permissions().mode() & 0o777, 0o600);
        }

        std::fs::create_dir_all(dir.path().join("platform/keys")).unwrap();
        std::fs::write(dir.path().join("platform/keys/k1.pub.pem"), &pair.public_pem).unwrap();
        let auth = format!(
            "jwt:\n  audiences: [api]\nsigning_keys:\n{yaml}  - kid: k2\n    alg: ES256\n    issuer: i\n    \
             public_key_file: platform/keys/k1.pub.pem\napps:\n  cid1: {{plan: gold, issuer: i}}\n"
        );
        std::fs::write(dir.path().join("platform/auth.yaml"), auth).unwrap();
        new_key(dir.path(), &spec("key1")).unwrap();
        let plans = [(
            "gold".to_owned(),
            postern_model::Plan {
                products: vec![],
                rate_limit: None,
                app_rate_limit: None,
                fail_closed: false,
                quota: None,
                priority: None,
            },
        )]
        .into_iter()
        .collect();
        let creds = crate::credentials::compile_credentials(dir.path(), &plans).unwrap();
        assert_eq!((creds.signing_keys.len(), creds.keys.len(), creds.apps.len()), (2, 1, 1));
        assert_eq!(creds.signing_keys[1].public_key_pem, pair.public_pem);
    }
}
