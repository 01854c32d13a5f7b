//! Signed envelopes: the control plane signs every version it hands out (a snapshot, a
//! credentials version, a credentials delta) with its own Ed25519 key, and a node that
//! pins the public key refuses anything unsigned or signed by another key, whether it
//! came over the network, from its own disk or from a polled directory.
//!
//! What is signed is one line per field, so no two subjects share a message:
//!
//! ```text
//! postern-envelope-v1\n<lane>\n<version>\n<sha256:content hash>
//! postern-envelope-v1\ndelta\n<base>\n<version>\n<sha256:hash of the delta's JSON>
//! postern-envelope-v1\nusage\n<node>\n<sha256:hash of the usage bytes sent>
//! ```
//!
//! A node signs the usage it ships with a key of its own (`--usage-signing-key`), which
//! the control plane knows by node (`--usage-node-keys`).
//!
//! The version is inside the signature, so a signed version 7 cannot be passed off as
//! version 9, nor a credentials version as a snapshot. Keys and signatures are written as
//! `ed25519:<hex>`; a private key file holds `ed25519-seed:<hex of the 32-byte seed>`.

use aws_lc_rs::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};

use crate::protocol::Lane;

/// The first line of every signed message.
pub const CONTEXT: &str = "postern-envelope-v1";

const PUBLIC_PREFIX: &str = "ed25519:";
const SEED_PREFIX: &str = "ed25519-seed:";

/// What a signature vouches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject<'a> {
    /// A whole version of a lane, by its content hash.
    Whole {
        /// The lane.
        lane: Lane,
        /// Its number.
        version: u64,
        /// `sha256:<hex>` of its content.
        hash: &'a str,
    },
    /// Usage a node ships (a batch of windows to the intake, or one part on the usage
    /// stream), by the hash of its bytes as sent: signed by the node's own key.
    Usage {
        /// The node whose windows they are.
        node: &'a str,
        /// `sha256:<hex>` of the bytes sent.
        hash: &'a str,
    },
    /// A credentials delta from `base` to `version`, by the hash of its JSON.
    Delta {
        /// The version it applies to.
        base: u64,
        /// The version it makes.
        version: u64,
        /// `sha256:<hex>` of the delta as serialised.
        hash: &'a str,
    },
}

impl Subject<'_> {
    /// The bytes signed.
    pub fn message(&self) -> String {
        match self {
            Subject::Whole { lane, version, hash } => format!("{CONTEXT}\n{}\n{version}\n{hash}", lane.as_str()),
            Subject::Delta { base, version, hash } => format!("{CONTEXT}\ndelta\n{base}\n{version}\n{hash}"),
            Subject::Usage { node, hash } => format!("{CONTEXT}\nusage\n{node}\n{hash}"),
        }
    }
}

/// Why a signature or key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The envelope carries no signature, and this node pins a key.
    #[error("unsigned: this node accepts only versions signed by the control plane's key {0}")]
    Unsigned(String),
    /// The signature does not verify under the pinned key.
    #[error("bad signature: not signed by the control plane's key {0}")]
    Mismatch(String),
    /// A key or signature that is not `ed25519:<hex>` of the right length.
    #[error("malformed {0}: expected {1}")]
    Malformed(&'static str, &'static str),
    /// No random seed could be drawn, or the seed was refused.
    #[error("cannot make a signing key: {0}")]
    Key(String),
}

/// A control plane's public key, as nodes pin it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    /// Reads `ed25519:<64 hex digits>` (surrounding whitespace ignored).
    pub fn parse(text: &str) -> Result<PublicKey, SignatureError> {
        let malformed = || SignatureError::Malformed("public key", "ed25519:<64 hex digits>");
        let hex_part = text.trim().strip_prefix(PUBLIC_PREFIX).ok_or_else(malformed)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut out).map_err(|_| malformed())?;
        Ok(PublicKey(out))
    }

    /// Checks `sig` (as written in an envelope) over `subject`.
    pub fn verify(&self, subject: &Subject<'_>, sig: Option<&str>) -> Result<(), SignatureError> {
        let Some(sig) = sig else { return Err(SignatureError::Unsigned(self.to_string())) };
        let malformed = || SignatureError::Malformed("signature", "ed25519:<128 hex digits>");
        let hex_part = sig.strip_prefix(PUBLIC_PREFIX).ok_or_else(malformed)?;
        let mut raw = [0u8; 64];
        hex::decode_to_slice(hex_part, &mut raw).map_err(|_| malformed())?;
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(subject.message().as_bytes(), &raw)
            .map_err(|_| SignatureError::Mismatch(self.to_string()))
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{PUBLIC_PREFIX}{}", hex::encode(self.0))
    }
}

/// The keys a node accepts signatures from: one normally, two while the control plane's
/// key is rotated (nodes learn the new one before the control plane signs with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trust(Vec<PublicKey>);

impl Trust {
    /// Reads a key file: one `ed25519:<hex>` per line; blank lines and `#` comments are
    /// skipped; at least one key.
    pub fn parse(text: &str) -> Result<Trust, SignatureError> {
        let keys = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(PublicKey::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(SignatureError::Malformed("key file", "at least one ed25519:<hex> line"));
        }
        Ok(Trust(keys))
    }

    /// Trusts one key.
    pub fn one(key: PublicKey) -> Trust {
        Trust(vec![key])
    }

    /// Checks `sig` over `subject` against every trusted key.
    pub fn verify(&self, subject: &Subject<'_>, sig: Option<&str>) -> Result<(), SignatureError> {
        let mut last = Err(SignatureError::Unsigned(self.to_string()));
        for key in &self.0 {
            last = key.verify(subject, sig);
            if last.is_ok() || sig.is_none() {
                break;
            }
        }
        last.map_err(|e| match e {
            SignatureError::Unsigned(_) => SignatureError::Unsigned(self.to_string()),
            SignatureError::Mismatch(_) => SignatureError::Mismatch(self.to_string()),
            other => other,
        })
    }
}

impl std::fmt::Display for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, k) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" or ")?;
            }
            write!(f, "{k}")?;
        }
        Ok(())
    }
}

/// Checks `sig` over `subject` when keys are pinned; with none, anything passes (a node
/// run from a snapshot file its operator compiled).
pub fn check(trust: Option<&Trust>, subject: &Subject<'_>, sig: Option<&str>) -> Result<(), SignatureError> {
    trust.map_or(Ok(()), |t| t.verify(subject, sig))
}

/// The control plane's private key.
pub struct Signer {
    seed: [u8; 32],
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({})", self.public())
    }
}

impl Signer {
    /// A new key from the operating system's random source.
    pub fn generate() -> Result<Signer, SignatureError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| SignatureError::Key(e.to_string()))?;
        Signer::from_seed(seed)
    }

    fn from_seed(seed: [u8; 32]) -> Result<Signer, SignatureError> {
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).map_err(|e| SignatureError::Key(e.to_string()))?;
        Ok(Signer { seed, pair })
    }

    /// Reads a private key file's text, `ed25519-seed:<64 hex digits>`.
    pub fn parse(text: &str) -> Result<Signer, SignatureError> {
        let malformed = || SignatureError::Malformed("signing key", "ed25519-seed:<64 hex digits>");
        let hex_part = text.trim().strip_prefix(SEED_PREFIX).ok_or_else(malformed)?;
        let mut seed = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut seed).map_err(|_| malformed())?;
        Signer::from_seed(seed)
    }

    /// The private key file's text (keep it secret).
    pub fn to_text(&self) -> String {
        format!("{SEED_PREFIX}{}\n", hex::encode(self.seed))
    }

    /// The public key nodes pin.
    pub fn public(&self) -> PublicKey {
        let mut out = [0u8; 32];
        out.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey(out)
    }

    /// The signature over `subject`, as written in an envelope.
    pub fn sign(&self, subject: &Subject<'_>) -> String {
        format!("{PUBLIC_PREFIX}{}", hex::encode(self.pair.sign(subject.message().as_bytes()).as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_its_key_lane_and_version() {
        let signer = Signer::generate().unwrap();
        let key = Trust::parse(&format!("# ours\n{}\n", signer.public())).unwrap();
        let subject = Subject::Whole { lane: Lane::Credentials, version: 7, hash: "sha256:ab" };
        let sig = signer.sign(&subject);
        assert_eq!(key.verify(&subject, Some(&sig)), Ok(()));
        for other in [
            Subject::Whole { lane: Lane::Snapshot, version: 7, hash: "sha256:ab" },
            Subject::Whole { lane: Lane::Credentials, version: 8, hash: "sha256:ab" },
            Subject::Whole { lane: Lane::Credentials, version: 7, hash: "sha256:ac" },
            Subject::Delta { base: 6, version: 7, hash: "sha256:ab" },
            Subject::Usage { node: "7", hash: "sha256:ab" },
        ] {
            assert!(matches!(key.verify(&other, Some(&sig)), Err(SignatureError::Mismatch(_))), "{other:?}");
        }
        let stranger = Signer::generate().unwrap().public();
        assert!(matches!(stranger.verify(&subject, Some(&sig)), Err(SignatureError::Mismatch(_))));
        let rotating = Trust::parse(&format!("{stranger}\n{}", signer.public())).unwrap();
        assert_eq!(rotating.verify(&subject, Some(&sig)), Ok(()), "either key of a rotation");
        assert!(Trust::parse("# none\n").is_err());
        assert!(matches!(key.verify(&subject, None), Err(SignatureError::Unsigned(_))));
        assert!(matches!(key.verify(&subject, Some("ed25519:zz")), Err(SignatureError::Malformed(..))));
        assert_eq!(check(None, &subject, None), Ok(()));
    }

    #[test]
    fn keys_read_back_what_they_write() {
        let signer = Signer::generate().unwrap();
        let again = Signer::parse(&signer.to_text()).unwrap();
        assert_eq!(again.public(), signer.public());
        assert!(Signer::parse("ed25519:00").is_err());
        assert!(PublicKey::parse("ed25519-seed:00").is_err());
        assert!(PublicKey::parse(&format!("ed25519:{}", "0".repeat(63))).is_err());
        assert!(!format!("{signer:?}").contains(&hex::encode(signer.seed)));
    }

    #[test]
    fn envelopes_and_deltas_are_signed_and_checked() {
        use crate::credentials::{Credentials, CredentialsDelta, DeltaDoc};
        let signer = Signer::generate().unwrap();
        let key = Trust::one(signer.public());
        let mut file = crate::SnapshotFile::seal_value(3, &Credentials::empty()).unwrap();
        assert!(file.verify(Lane::Credentials, Some(&key)).is_err(), "unsigned");
        assert!(file.verify(Lane::Credentials, None).is_ok(), "no key pinned");
        file.sign(Lane::Credentials, &signer);
        let bytes = serde_json::to_vec(&file).unwrap();
        let (sealed, _) = Credentials::open(&bytes).unwrap();
        sealed.verify(Some(&key)).unwrap();
        let back = crate::SnapshotFile::open_envelope(&bytes).unwrap();
        back.verify(Lane::Credentials, Some(&key)).unwrap();
        assert!(back.verify(Lane::Snapshot, Some(&key)).is_err(), "a credentials version is not a snapshot");
        let renumbered = String::from_utf8(bytes).unwrap().replacen("\"version\":3", "\"version\":4", 1);
        let (sealed, _) = Credentials::open(renumbered.as_bytes()).unwrap();
        assert!(sealed.verify(Some(&key)).is_err(), "the version is signed");

        let delta = CredentialsDelta::between(3, 4);
        let doc = DeltaDoc::new(delta, Some(&signer)).unwrap();
        let back = DeltaDoc::parse(&serde_json::to_vec(&doc).unwrap()).unwrap().unwrap();
        back.verify(Some(&key)).unwrap();
        assert!(DeltaDoc::new(back.delta.clone(), None).unwrap().verify(Some(&key)).is_err());
        let mut moved = back.clone();
        moved.delta.version = 5;
        assert!(moved.verify(Some(&key)).is_err());
        assert!(back.verify(Some(&Trust::one(Signer::generate().unwrap().public()))).is_err());
    }
}
