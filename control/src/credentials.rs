//! Compiles the credential state (API keys, JWT signing keys, OAuth apps, deny list) from
//! a config repository and publishes it as a sealed, numbered `credentials.json`.
//!
//! Two optional files feed it:
//!
//! - `platform/auth.yaml`: `jwt` settings, `signing_keys` (each with `public_key_pem`
//!   inline or `public_key_file`, a path relative to the repository root), `apps` and
//!   `deny`, with the model's own field names;
//! - `platform/keys.jsonl`: one API key record per line (hashes only), as written by
//!   `posternctl key new`;
//! - `platform/deny.jsonl`: one deny entry per line, as written by `posternctl token
//!   revoke`, added to `deny` in `auth.yaml`.
//!
//! The result is checked exactly as a node would load it ([`crate::engines::check_credentials`])
//! before anything is written.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

use crate::engines::StoreError;
use postern_model::credentials::{
    Alg, ApiKey, App, CREDENTIALS_SCHEMA, Credentials, DenyEntry, JwtSettings, SigningKey,
};
use postern_model::disk::unix_now;
use postern_model::{Plan, SnapshotFile};
use serde::Deserialize;

/// The auth settings file, relative to the repository root.
pub const AUTH_FILE: &str = "platform/auth.yaml";
/// The API key table, relative to the repository root.
pub const KEYS_FILE: &str = "platform/keys.jsonl";
/// Token revocations, one deny entry per line, relative to the repository root.
pub const DENY_FILE: &str = "platform/deny.jsonl";
/// The credentials file's name, written beside the snapshot.
pub const CREDENTIALS_FILE: &str = "credentials.json";

/// `platform/auth.yaml`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthDoc {
    #[serde(default)]
    jwt: JwtSettings,
    #[serde(default)]
    signing_keys: Vec<SigningKeyDoc>,
    #[serde(default)]
    apps: BTreeMap<String, App>,
    #[serde(default)]
    deny: Vec<DenyEntry>,
}

/// A signing key as written in `platform/auth.yaml`: the PEM inline or in a file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SigningKeyDoc {
    kid: String,
    alg: Alg,
    issuer: String,
    #[serde(default)]
    public_key_pem: Option<String>,
    #[serde(default)]
    public_key_file: Option<PathBuf>,
}

/// Parses `platform/keys.jsonl` text: one [`ApiKey`] per line, blank lines ignored.
///
/// Returns every record with its 1-based line number, and one error per bad line (a line
/// that is not a key record, or an id already used), each naming `platform/keys.jsonl:LINE`.
pub fn parse_keys(text: &str) -> (Vec<(usize, ApiKey)>, Vec<String>) {
    let mut keys = Vec::new();
    let mut errors = Vec::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<ApiKey>(line) {
            Ok(key) => {
                if let Some(first) = ids.get(&key.id) {
                    errors.push(format!("{KEYS_FILE}:{n}: id {:?} is already used on line {first}", key.id));
                    continue;
                }
                ids.insert(key.id.clone(), n);
                keys.push((n, key));
            }
            Err(e) => errors.push(format!("{KEYS_FILE}:{n}: not an API key record: {e}")),
        }
    }
    (keys, errors)
}

/// The JWT settings of `platform/auth.yaml` (the defaults when it is absent or invalid).
pub fn jwt_settings(root: &Path) -> JwtSettings {
    load_auth(root, &mut Vec::new()).map(|a| a.jwt).unwrap_or_default()
}

fn load_auth(root: &Path, errors: &mut Vec<String>) -> Option<AuthDoc> {
    let path = root.join(AUTH_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(AuthDoc::default()),
        Err(e) => {
            errors.push(format!("{AUTH_FILE}: cannot read: {e}"));
            return None;
        }
    };
    if text.trim().is_empty() {
        return Some(AuthDoc::default());
    }
    match crate::config::parse_yaml::<AuthDoc>(&text) {
        Ok(doc) => Some(doc),
        Err((field, msg)) => {
            if field.is_empty() {
                errors.push(format!("{AUTH_FILE}: {msg}"));
            } else {
                errors.push(format!("{AUTH_FILE}: {field}: {msg}"));
            }
            None
        }
    }
}

/// A relative path that stays inside the repository.
fn inside_repo(path: &Path) -> bool {
    !path.as_os_str().is_empty() && path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

fn signing_key(root: &Path, i: usize, doc: SigningKeyDoc, errors: &mut Vec<String>) -> Option<SigningKey> {
    let at = format!("{AUTH_FILE}: signing_keys[{i}] (kid {:?})", doc.kid);
    let pem = match (doc.public_key_pem, doc.public_key_file) {
        (Some(pem), None) => pem,
        (None, Some(file)) => {
            if !inside_repo(&file) {
                errors.push(format!(
                    "{at}: public_key_file {:?} must be a path relative to the repository root, inside it",
                    file.display().to_string()
                ));
                return None;
            }
            match std::fs::read_to_string(root.join(&file)) {
                Ok(pem) => pem,
                Err(e) => {
                    errors.push(format!("{at}: public_key_file: cannot read {}: {e}", file.display()));
                    return None;
                }
            }
        }
        (Some(_), Some(_)) => {
            errors.push(format!("{at}: set public_key_pem or public_key_file, not both"));
            return None;
        }
        (None, None) => {
            errors.push(format!("{at}: set public_key_pem or public_key_file"));
            return None;
        }
    };
    Some(SigningKey { kid: doc.kid, alg: doc.alg, issuer: doc.issuer, public_key_pem: pem })
}

fn unknown_plan(plan: &str, plans: &BTreeMap<String, Plan>) -> String {
    if plans.is_empty() {
        format!("plan {plan:?} is not defined (no plans are defined)")
    } else {
        let known: Vec<&str> = plans.keys().map(String::as_str).collect();
        format!("plan {plan:?} is not defined (known plans: {})", known.join(", "))
    }
}

/// Reads `platform/auth.yaml` and `platform/keys.jsonl` under `root` (both optional) into
/// one credential state, checks that every key's and app's plan is in `plans`, and
/// validates the whole state as a node would load it.
///
/// Returns every problem found, each naming its file and field or line.
pub fn compile_credentials(root: &Path, plans: &BTreeMap<String, Plan>) -> Result<Credentials, Vec<String>> {
    let mut errors = Vec::new();
    let auth = load_auth(root, &mut errors).unwrap_or_default();

    let keys_path = root.join(KEYS_FILE);
    let keys_text = match std::fs::read_to_string(&keys_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => {
            errors.push(format!("{KEYS_FILE}: cannot read: {e}"));
            String::new()
        }
    };
    let (keys, key_errors) = parse_keys(&keys_text);
    errors.extend(key_errors);
    let mut deny = auth.deny;
    match std::fs::read_to_string(root.join(DENY_FILE)) {
        Ok(text) => {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<DenyEntry>(line) {
                    Ok(d) => deny.push(d),
                    Err(e) => errors.push(format!("{DENY_FILE}:{}: not a deny entry: {e}", i + 1)),
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => errors.push(format!("{DENY_FILE}: cannot read: {e}")),
    }

    let mut signing_keys = Vec::with_capacity(auth.signing_keys.len());
    for (i, doc) in auth.signing_keys.into_iter().enumerate() {
        if let Some(k) = signing_key(root, i, doc, &mut errors) {
            signing_keys.push(k);
        }
    }
    let issuers: std::collections::BTreeSet<&str> = signing_keys.iter().map(|k| k.issuer.as_str()).collect();
    for (client_id, app) in &auth.apps {
        if !plans.contains_key(&app.plan) {
            errors.push(format!("{AUTH_FILE}: apps.{client_id}.plan: {}", unknown_plan(&app.plan, plans)));
        }
        // With several issuers, an app not bound to one would take any issuer's token
        // naming its client_id.
        if app.issuer.is_none() && issuers.len() > 1 {
            let list = issuers.iter().copied().collect::<Vec<_>>().join(", ");
            errors.push(format!(
                "{AUTH_FILE}: apps.{client_id}.issuer: required when the signing keys name more than one issuer ({list})"
            ));
        }
    }
    for (line, key) in &keys {
        if !plans.contains_key(&key.plan) {
            errors.push(format!("{KEYS_FILE}:{line}: key {:?}: {}", key.id, unknown_plan(&key.plan, plans)));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }

    let lines: Vec<usize> = keys.iter().map(|(n, _)| *n).collect();
    let creds = Credentials {
        schema: CREDENTIALS_SCHEMA,
        jwt: auth.jwt,
        signing_keys,
        apps: auth.apps,
        keys: keys.into_iter().map(|(_, k)| k).collect(),
        deny,
        over_quota: Vec::new(),
        debug_trace: Vec::new(),
    };
    match crate::engines::check_credentials(&creds, unix_now()) {
        Ok(()) => Ok(creds),
        Err(e) => Err(vec![locate_store_error(&e, &lines)]),
    }
}

/// Names the file (and line, for a key) a credential state's error is about.
fn locate_store_error(e: &StoreError, lines: &[usize]) -> String {
    match e {
        StoreError::Key { index, id, problem } => match lines.get(*index) {
            Some(line) => format!("{KEYS_FILE}:{line}: key (id {id:?}): {problem}"),
            None => format!("{KEYS_FILE}: {e}"),
        },
        StoreError::Other(_) => format!("{AUTH_FILE}: {e}"),
    }
}

/// Writes `creds` to `out` as a sealed envelope, atomically, and returns the envelope.
///
/// The version is the previous one in `out` (if it holds a valid credentials file) when
/// the content is unchanged, the next one when it changed, otherwise 1.
pub fn publish_credentials(creds: &Credentials, out: &Path) -> anyhow::Result<SnapshotFile> {
    let previous = std::fs::read(out).ok().and_then(|b| Credentials::open(&b).ok()).map(|(f, _)| f);
    let mut file = SnapshotFile::seal_value(1, creds)?;
    if let Some(prev) = previous {
        file.version = if prev.hash == file.hash { prev.version } else { prev.version + 1 };
    }
    let bytes = serde_json::to_vec(&file)?;
    crate::write_atomic(out, &bytes)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(names: &[&str]) -> BTreeMap<String, Plan> {
        names.iter().map(|n| ((*n).to_owned(), Plan::of_products(&["orders"]))).collect()
    }

    fn key_line(id: &str, plan: &str) -> String {
        let sha = hex::encode(postern_model::apikey::hash(id.as_bytes()));
        format!(r#"{{"id":"{id}","sha256":"{sha}","app":"app1","tenant":"t1","plan":"{plan}"}}"#)
    }

    fn repo(auth: Option<&str>, keys: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("platform")).unwrap();
        if let Some(a) = auth {
            std::fs::write(dir.path().join(AUTH_FILE), a).unwrap();
        }
        if let Some(k) = keys {
            std::fs::write(dir.path().join(KEYS_FILE), k).unwrap();
        }
        dir
    }

    #[test]
    fn apps_name_their_issuer_when_the_keys_name_several() {
        use postern_model::credentials::Alg;
        let (a, b) = (crate::keys::keygen(Alg::ES256).unwrap(), crate::keys::keygen(Alg::ES256).unwrap());
        let key = |kid: &str, iss: &str, pem: &str| crate::keys::signing_key_yaml(kid, Alg::ES256, iss, pem).unwrap();
        let base = format!(
            "jwt:\n  audiences: [api]\nsigning_keys:\n{}{}apps:\n",
            key("a", "https://a.example", &a.public_pem),
            key("b", "https://b.example", &b.public_pem)
        );
        let compile = |app: &str| {
            let dir = repo(Some(&format!("{base}  cid: {app}\n")), None);
            compile_credentials(dir.path(), &plans(&["gold"]))
        };
        assert_eq!(
            compile("{plan: gold}").unwrap_err(),
            vec![
                "platform/auth.yaml: apps.cid.issuer: required when the signing keys name more than one issuer \
                 (https://a.example, https://b.example)"
                    .to_owned()
            ]
        );
        let creds = compile(r#"{plan: gold, issuer: "https://b.example"}"#).unwrap();
        assert_eq!(creds.apps["cid"].issuer.as_deref(), Some("https://b.example"));
        let e = compile(r#"{plan: gold, issuer: "https://c.example"}"#).unwrap_err();
        assert!(e.len() == 1 && e[0].contains("apps.cid.issuer: no signing key has the issuer"), "{e:?}");
    }

    #[test]
    fn empty_repo_compiles_to_empty_credentials() {
        let dir = repo(None, None);
        let creds = compile_credentials(dir.path(), &BTreeMap::new()).unwrap();
        assert_eq!(creds, Credentials::empty());
    }

    #[test]
    fn keys_and_apps_compile() {
        let keys = format!("{}\n\n{}\n", key_line("k1", "gold"), key_line("k2", "free"));
        let auth =
            "jwt:\n  audiences: [api]\n  leeway_s: 10\napps:\n  cid1: {plan: gold, tenant: t1, priority: critical}\n";
        let dir = repo(Some(auth), Some(&keys));
        let creds = compile_credentials(dir.path(), &plans(&["gold", "free"])).unwrap();
        assert_eq!(creds.keys.len(), 2);
        assert_eq!(creds.jwt.leeway_s, 10);
        assert_eq!(creds.jwt.max_token_bytes, JwtSettings::default().max_token_bytes);
        assert_eq!(creds.apps["cid1"].plan, "gold");
    }

    #[test]
    fn unknown_plan_is_refused_naming_line_and_plan() {
        let keys = format!("{}\n{}\n", key_line("k1", "gold"), key_line("k2", "platinum"));
        let dir = repo(Some("apps:\n  cid1: {plan: bronze}\n"), Some(&keys));
        let errors = compile_credentials(dir.path(), &plans(&["gold"])).unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors.iter().any(|e| e.starts_with("platform/auth.yaml: apps.cid1.plan:") && e.contains("\"bronze\""))
        );
        assert!(errors.iter().any(|e| e.starts_with("platform/keys.jsonl:2:") && e.contains("\"platinum\"")));
    }

    #[test]
    fn bad_keys_line_is_refused_naming_the_line() {
        let keys = format!("{}\n\nnot json\n{}\n", key_line("k1", "gold"), key_line("k1", "gold"));
        let dir = repo(None, Some(&keys));
        let errors = compile_credentials(dir.path(), &plans(&["gold"])).unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].starts_with("platform/keys.jsonl:3: not an API key record"), "{errors:?}");
        assert!(errors[1].starts_with("platform/keys.jsonl:4: id \"k1\" is already used on line 1"), "{errors:?}");
    }

    #[test]
    fn store_errors_name_the_key_line() {
        let bad = r#"{"id":"k9","sha256":"zz","app":"a","tenant":"t","plan":"gold"}"#;
        let keys = format!("{}\n{bad}\n", key_line("k1", "gold"));
        let dir = repo(None, Some(&keys));
        let errors = compile_credentials(dir.path(), &plans(&["gold"])).unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(errors[0].starts_with("platform/keys.jsonl:2: key (id \"k9\"): sha256"), "{errors:?}");
    }

    #[test]
    fn auth_yaml_errors_name_the_field() {
        let dir = repo(Some("jwt:\n  leeway: 5\n"), None);
        let errors = compile_credentials(dir.path(), &BTreeMap::new()).unwrap_err();
        assert!(errors[0].starts_with("platform/auth.yaml: jwt.leeway: unknown field `leeway`"), "{errors:?}");

        let dir = repo(Some("signing_keys:\n  - {kid: k1, alg: HS256, issuer: i, public_key_pem: x}\n"), None);
        let errors = compile_credentials(dir.path(), &BTreeMap::new()).unwrap_err();
        assert!(errors[0].starts_with("platform/auth.yaml: signing_keys[0].alg:"), "{errors:?}");

        let dir = repo(Some("signing_keys:\n  - {kid: k1, alg: ES256, issuer: i, public_key_file: /etc/x}\n"), None);
        let errors = compile_credentials(dir.path(), &BTreeMap::new()).unwrap_err();
        assert!(errors[0].contains("public_key_file"), "{errors:?}");

        let auth =
            "jwt: {audiences: [api]}\nsigning_keys:\n  - {kid: k1, alg: ES256, issuer: i, public_key_pem: nope}\n";
        let dir = repo(Some(auth), None);
        let errors = compile_credentials(dir.path(), &BTreeMap::new()).unwrap_err();
        assert!(
            errors[0].starts_with("platform/auth.yaml: signing_keys[0] (kid \"k1\"): public_key_pem"),
            "{errors:?}"
        );
    }

    #[test]
    fn publish_versions_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(CREDENTIALS_FILE);
        let mut creds = Credentials::empty();
        assert_eq!(publish_credentials(&creds, &out).unwrap().version, 1);
        assert_eq!(publish_credentials(&creds, &out).unwrap().version, 1);
        creds.jwt.leeway_s = 5;
        assert_eq!(publish_credentials(&creds, &out).unwrap().version, 2);
        let (file, back) = Credentials::open(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!((file.version, back), (2, creds));
        std::fs::write(&out, b"garbage").unwrap();
        assert_eq!(publish_credentials(&Credentials::empty(), &out).unwrap().version, 1);
    }
}
