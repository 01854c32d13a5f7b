//! The key service behind `posternctl serve`: create, rotate and revoke API keys, and
//! revoke tokens, as changes to the repository's credential files
//! (`platform/keys.jsonl`, `platform/deny.jsonl`) that are compiled into a credential
//! state before anything is published. A change that does not compile leaves the files as
//! they were. The raw key of a new key is in the answer only; the files hold its SHA-256.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use postern_model::Plan;
use postern_model::apikey::KeyEnv;
use postern_model::credentials::Credentials;
use postern_model::disk::unix_now;
use serde::{Deserialize, Serialize};

use crate::credentials::{DENY_FILE, KEYS_FILE, compile_credentials};
use crate::keys;

/// `POST /v1/keys`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// Key id (not secret).
    pub id: String,
    /// The app the key belongs to.
    pub app: String,
    /// The tenant that owns the app.
    pub tenant: String,
    /// The plan.
    pub plan: String,
    /// Granted scopes.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// The key's own priority class (none: its plan's).
    #[serde(default)]
    pub priority: Option<postern_model::credentials::Priority>,
    /// An `ak_test_` key.
    #[serde(default)]
    pub test: bool,
}

/// `POST /v1/keys/<id>/rotate`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotateBody {
    /// The new key's id.
    pub new_id: String,
    /// How long the old key keeps working (default 24h).
    #[serde(default)]
    pub overlap: Option<String>,
    /// An `ak_test_` key.
    #[serde(default)]
    pub test: bool,
}

/// `POST /v1/keys/revoke`: exactly one of the two.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevokeBody {
    /// The key's id.
    #[serde(default)]
    pub id: Option<String>,
    /// The raw key, e.g. one reported leaked.
    #[serde(default)]
    pub key: Option<String>,
}

/// `POST /v1/deny`: exactly one of the three.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyBody {
    /// One token.
    #[serde(default)]
    pub jti: Option<String>,
    /// Every token of a user issued before now.
    #[serde(default)]
    pub sub: Option<String>,
    /// Every token of an app issued before now.
    #[serde(default)]
    pub client_id: Option<String>,
}

/// One change.
#[derive(Debug, Clone)]
pub enum Op {
    /// A new key.
    Create(CreateBody),
    /// Replace key `id`.
    Rotate(String, RotateBody),
    /// Revoke a key.
    Revoke(RevokeBody),
    /// Revoke tokens.
    Deny(DenyBody),
}

impl Op {
    /// The audit trail's action and note (never a secret).
    pub fn describe(&self) -> (&'static str, String) {
        match self {
            Op::Create(b) => ("key-create", format!("key {} for app {} on plan {}", b.id, b.app, b.plan)),
            Op::Rotate(id, b) => ("key-rotate", format!("key {id} replaced by {}", b.new_id)),
            Op::Revoke(b) => match &b.id {
                Some(id) => ("key-revoke", format!("key {id}")),
                None => ("key-revoke", "key given by its raw value".to_owned()),
            },
            Op::Deny(b) => {
                let what = match (&b.jti, &b.sub, &b.client_id) {
                    (Some(j), _, _) => format!("token jti {j}"),
                    (_, Some(s), _) => format!("tokens of user {s} issued before now"),
                    (_, _, Some(c)) => format!("tokens of app {c} issued before now"),
                    _ => String::new(),
                };
                ("token-revoke", what)
            }
        }
    }
}

/// The files a change may touch, as they were, to put back on failure.
struct Saved(Vec<(std::path::PathBuf, Option<Vec<u8>>)>);

impl Saved {
    fn take(repo: &Path) -> Saved {
        Saved([KEYS_FILE, DENY_FILE].iter().map(|f| (repo.join(f), std::fs::read(repo.join(f)).ok())).collect())
    }

    fn restore(&self) {
        for (path, bytes) in &self.0 {
            let _ = match bytes {
                Some(b) => crate::write_atomic(path, b).map_err(anyhow::Error::from),
                None => std::fs::remove_file(path).map_err(anyhow::Error::from),
            };
        }
    }
}

/// What a change did: the answer for the caller, the state to publish, and the records
/// it added or changed (the fast lane's delta).
#[derive(Debug)]
pub struct Applied {
    /// For the caller; holds the raw key of a new key.
    pub answer: serde_json::Value,
    /// The whole state after the change.
    pub credentials: Credentials,
    /// Key records added or changed.
    pub keys: Vec<postern_model::credentials::ApiKey>,
    /// Deny entries added.
    pub deny: Vec<postern_model::credentials::DenyEntry>,
}

/// Applies `op` to the repository and compiles the credential state against `plans`; on
/// any error the files are left as they were.
pub fn apply(repo: &Path, plans: &BTreeMap<String, Plan>, op: Op) -> Result<Applied, Vec<String>> {
    let saved = Saved::take(repo);
    // The records the change touched: the rotated key here, the answer's key below.
    let mut ids: Vec<String> = match &op {
        Op::Rotate(id, b) => vec![id.clone(), b.new_id.clone()],
        _ => Vec::new(),
    };
    let answer = change(repo, op).map_err(|e| vec![format!("{e:#}")]);
    let result = answer.and_then(|a| compile_credentials(repo, plans).map(|c| (a, c)));
    let (answer, credentials) = match result {
        Ok(r) => r,
        Err(e) => {
            saved.restore();
            return Err(e);
        }
    };
    if let Some(id) = answer["id"].as_str() {
        ids.push(id.to_owned());
    }
    let keys = credentials.keys.iter().filter(|k| ids.contains(&k.id)).cloned().collect();
    let deny = serde_json::from_value(answer["deny"].clone()).map(|d| vec![d]).unwrap_or_default();
    Ok(Applied { answer, credentials, keys, deny })
}

fn env(test: bool) -> KeyEnv {
    if test { KeyEnv::Test } else { KeyEnv::Live }
}

fn change(repo: &Path, op: Op) -> anyhow::Result<serde_json::Value> {
    let now = unix_now();
    Ok(match op {
        Op::Create(b) => {
            let spec = keys::NewKey {
                id: b.id.clone(),
                app: b.app,
                tenant: b.tenant,
                plan: b.plan,
                scopes: b.scopes,
                priority: b.priority,
                env: env(b.test),
            };
            let raw = keys::new_key(repo, &spec)?;
            serde_json::json!({"id": b.id, "key": raw})
        }
        Op::Rotate(id, b) => {
            let overlap = match &b.overlap {
                Some(s) => crate::config::parse_duration(s).map_err(anyhow::Error::msg)?,
                None => Duration::from_secs(24 * 3600),
            };
            let r = keys::rotate_key(repo, &id, &b.new_id, overlap, env(b.test), now)?;
            serde_json::json!({"id": b.new_id, "key": r.raw_key, "replaces": id, "old_expires_at": r.old_expires_at})
        }
        Op::Revoke(b) => {
            let by = match (&b.id, &b.key) {
                (Some(id), None) => keys::RevokeBy::Id(id),
                (None, Some(k)) => keys::RevokeBy::RawKey(k),
                _ => anyhow::bail!("give exactly one of id or key"),
            };
            let r = keys::revoke_key(repo, by)?;
            serde_json::json!({"id": r.id, "already": r.already})
        }
        Op::Deny(b) => {
            let by = match (&b.jti, &b.sub, &b.client_id) {
                (Some(j), None, None) => keys::DenyBy::Jti(j),
                (None, Some(s), None) => keys::DenyBy::Sub(s),
                (None, None, Some(c)) => keys::DenyBy::ClientId(c),
                _ => anyhow::bail!("give exactly one of jti, sub or client_id"),
            };
            let jwt = crate::credentials::jwt_settings(repo);
            let lifetime = jwt.max_lifetime_s.saturating_add(jwt.leeway_s);
            let entry = keys::deny(repo, by, now, lifetime)?;
            serde_json::json!({"deny": entry})
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> (tempfile::TempDir, BTreeMap<String, Plan>) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(dir.path().join("platform")).unwrap_or_else(|e| panic!("{e}"));
        let plans: BTreeMap<String, Plan> =
            serde_json::from_str(r#"{"gold": {"products": []}}"#).unwrap_or_else(|e| panic!("{e}"));
        (dir, plans)
    }

    fn create(id: &str, plan: &str) -> Op {
        Op::Create(CreateBody {
            id: id.into(),
            app: "app".into(),
            tenant: "acme".into(),
            plan: plan.into(),
            scopes: vec![],
            priority: Default::default(),
            test: false,
        })
    }

    #[test]
    fn keys_are_created_rotated_and_revoked_and_a_failed_change_leaves_the_files() {
        let (dir, plans) = repo();
        let Applied { answer, credentials: creds, keys, .. } =
            apply(dir.path(), &plans, create("k1", "gold")).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(keys.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(), ["k1"], "the delta");
        let raw = answer["key"].as_str().unwrap_or_default().to_owned();
        assert!(raw.starts_with("ak_live_"), "{answer}");
        assert_eq!(creds.keys.len(), 1);
        let file = std::fs::read_to_string(dir.path().join(KEYS_FILE)).unwrap_or_default();
        assert!(!file.contains(&raw), "only the hash is kept");

        // An unknown plan, a duplicate id: refused, and the file is unchanged.
        let e = apply(dir.path(), &plans, create("k2", "platinum")).err().unwrap_or_default();
        assert!(e[0].contains("platinum"), "{e:?}");
        let e = apply(dir.path(), &plans, create("k1", "gold")).err().unwrap_or_default();
        assert!(e[0].contains("already exists"), "{e:?}");
        assert_eq!(std::fs::read_to_string(dir.path().join(KEYS_FILE)).unwrap_or_default(), file);

        let rotate = RotateBody { new_id: "k1b".into(), overlap: Some("1h".into()), test: false };
        let Applied { answer, credentials: creds, keys, .. } =
            apply(dir.path(), &plans, Op::Rotate("k1".into(), rotate)).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(answer["replaces"], "k1");
        assert_eq!(creds.keys.len(), 2);
        assert_eq!(keys.len(), 2, "both records changed");
        let revoke = RevokeBody { id: None, key: Some(raw) };
        let answer = apply(dir.path(), &plans, Op::Revoke(revoke)).unwrap_or_else(|e| panic!("{e:?}")).answer;
        assert_eq!((answer["id"].as_str(), answer["already"].as_bool()), (Some("k1"), Some(false)));
    }

    #[test]
    fn tokens_are_denied_by_jti_user_or_app() {
        let (dir, plans) = repo();
        let jti = DenyBody { jti: Some("t-1".into()), sub: None, client_id: None };
        let Applied { answer, credentials: creds, deny, .. } =
            apply(dir.path(), &plans, Op::Deny(jti)).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(answer["deny"]["expires_at"].as_u64().is_some(), "{answer}");
        assert_eq!(deny.len(), 1, "the delta");
        let sub = DenyBody { jti: None, sub: Some("alice".into()), client_id: None };
        let Applied { answer, credentials: creds2, .. } =
            apply(dir.path(), &plans, Op::Deny(sub)).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(answer["deny"]["issued_before"].as_u64().is_some(), "{answer}");
        assert_eq!((creds.deny.len(), creds2.deny.len()), (1, 2));
        let both = DenyBody { jti: Some("x".into()), sub: Some("y".into()), client_id: None };
        assert!(apply(dir.path(), &plans, Op::Deny(both)).is_err());
    }
}
