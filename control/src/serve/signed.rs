//! Which key speaks for which node on the usage stream (`--usage-node-keys`): once any
//! node has a key, every batch to the intake and every part on Kafka must carry its node's
//! signature over the bytes sent ([`postern_model::sign::Subject::Usage`]), so a process
//! that may post to the intake or write the topic cannot speak for a node it is not.

use std::collections::BTreeMap;
use std::path::Path;

use postern_model::sign::{PublicKey, Subject};

/// The rule a usage batch or part breaks when its signature is missing or not its node's.
pub const RULE: &str = "usage_signature";

/// The nodes' public usage keys, by node (two during a key change).
#[derive(Debug, Default)]
pub struct UsageKeys(BTreeMap<String, Vec<PublicKey>>);

/// A key file is read whole only within this size.
const KEYS_FILE_CAP: u64 = 1 << 20;

impl UsageKeys {
    /// Reads a JSON object of node → `"ed25519:<hex>"` or a list of them (a regular file
    /// within 1 MiB); none when no file is given.
    pub fn load(path: Option<&Path>) -> anyhow::Result<UsageKeys> {
        let Some(path) = path else { return Ok(UsageKeys::default()) };
        let bytes = postern_model::disk::read_regular(path, KEYS_FILE_CAP)
            .map_err(|e| anyhow::anyhow!("--usage-node-keys {}: {e}", path.display()))?;
        UsageKeys::parse(&bytes).map_err(|e| anyhow::anyhow!("--usage-node-keys {}: {e}", path.display()))
    }

    fn parse(bytes: &[u8]) -> Result<UsageKeys, String> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Keys {
            One(String),
            Many(Vec<String>),
        }
        let raw: BTreeMap<String, Keys> = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let mut out = BTreeMap::new();
        for (node, keys) in raw {
            let keys = match keys {
                Keys::One(k) => vec![k],
                Keys::Many(ks) => ks,
            };
            if node.is_empty() || node.len() > 128 || keys.is_empty() || keys.len() > 4 {
                return Err(format!("node {node:?}: a node name of 1 to 128 bytes, with 1 to 4 keys"));
            }
            let keys = keys
                .iter()
                .map(|k| PublicKey::parse(k).map_err(|e| format!("node {node}: {e}")))
                .collect::<Result<Vec<_>, _>>()?;
            out.insert(node, keys);
        }
        Ok(UsageKeys(out))
    }

    /// Whether usage must be signed: some node has a key.
    pub fn enforced(&self) -> bool {
        !self.0.is_empty()
    }

    /// Checks `sig` (as the header carries it) over `bytes` sent as `node`'s usage: `Ok`
    /// when no node has a key, else only for a signature by one of `node`'s keys.
    pub fn check(&self, node: &str, bytes: &[u8], sig: Option<&[u8]>) -> Result<(), String> {
        if !self.enforced() {
            return Ok(());
        }
        let Some(keys) = self.0.get(node) else {
            return Err(format!("node {node} has no usage key (--usage-node-keys): its usage is refused"));
        };
        let Some(sig) = sig else {
            return Err(format!("unsigned: node {node}'s usage must be signed with its key"));
        };
        let sig = std::str::from_utf8(sig).map_err(|_| "the signature is not text".to_owned())?;
        let hash = postern_model::content_hash(bytes);
        let subject = Subject::Usage { node, hash: &hash };
        if keys.iter().any(|k| k.verify(&subject, Some(sig)).is_ok()) {
            return Ok(());
        }
        Err(format!("the signature is not by node {node}'s usage key"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use postern_model::sign::Signer;

    #[test]
    fn only_a_nodes_own_key_speaks_for_it_once_any_node_has_one() {
        let (a, b) = (Signer::generate().unwrap(), Signer::generate().unwrap());
        let sign = |s: &Signer, node: &str, bytes: &[u8]| {
            let hash = postern_model::content_hash(bytes);
            s.sign(&Subject::Usage { node, hash: &hash })
        };
        assert_eq!(UsageKeys::default().check("a", b"x", None), Ok(()), "nothing enforced without keys");
        let keys =
            UsageKeys::parse(format!(r#"{{"a": "{}", "b": ["{}"]}}"#, a.public(), b.public()).as_bytes()).unwrap();
        assert!(keys.enforced());
        assert_eq!(keys.check("a", b"x", Some(sign(&a, "a", b"x").as_bytes())), Ok(()));
        for (node, bytes, sig) in [
            ("a", &b"x"[..], None),
            ("a", b"y", Some(sign(&a, "a", b"x"))),
            ("a", b"x", Some(sign(&b, "a", b"x"))),
            ("b", b"x", Some(sign(&a, "a", b"x"))),
            ("c", b"x", Some(sign(&a, "c", b"x"))),
            ("a", b"x", Some("ed25519:00".to_owned())),
        ] {
            assert!(keys.check(node, bytes, sig.as_deref().map(str::as_bytes)).is_err(), "{node} {sig:?}");
        }
        for bad in [r#"{"a": "rsa:1"}"#, r#"{"a": []}"#, r#"{"": "x"}"#, r#"["a"]"#] {
            assert!(UsageKeys::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
