//! API keys: `ak_live_` or `ak_test_`, 32 random base62 characters (~190 bits), and a
//! 6-character base62 CRC-32 of everything before it.
//!
//! The checksum lets a malformed or mistyped key be refused from its shape alone, before
//! it costs a hash and a lookup. Only the SHA-256 of the whole key is ever stored; a fast
//! hash is safe because the key itself has ~190 random bits.

use sha2::{Digest, Sha256};

/// Prefix of production keys.
pub const LIVE_PREFIX: &str = "ak_live_";
/// Prefix of test keys.
pub const TEST_PREFIX: &str = "ak_test_";
const PREFIX_LEN: usize = 8;
const RANDOM_LEN: usize = 32;
const CHECKSUM_LEN: usize = 6;
/// Length of every key.
pub const KEY_LEN: usize = PREFIX_LEN + RANDOM_LEN + CHECKSUM_LEN;

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Why a key was refused from its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// Not 46 characters.
    #[error("an API key has {KEY_LEN} characters")]
    Length,
    /// Neither `ak_live_` nor `ak_test_`.
    #[error("an API key starts with ak_live_ or ak_test_")]
    Prefix,
    /// A character outside base62.
    #[error("an API key is base62 after its prefix")]
    Charset,
    /// The checksum does not match.
    #[error("the API key's checksum does not match")]
    Checksum,
}

/// Which kind of key to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyEnv {
    /// `ak_live_`.
    Live,
    /// `ak_test_`.
    Test,
}

fn checksum(body: &[u8]) -> [u8; CHECKSUM_LEN] {
    let mut c = u64::from(crc32fast::hash(body));
    let mut out = [b'0'; CHECKSUM_LEN];
    for slot in out.iter_mut().rev() {
        *slot = BASE62[(c % 62) as usize];
        c /= 62;
    }
    out
}

/// Checks a key's prefix, length, alphabet and checksum; no lookup, no allocation.
pub fn check_shape(key: &[u8]) -> Result<(), ShapeError> {
    if key.len() != KEY_LEN {
        return Err(ShapeError::Length);
    }
    let (body, sum) = key.split_at(PREFIX_LEN + RANDOM_LEN);
    let prefix = &body[..PREFIX_LEN];
    if prefix != LIVE_PREFIX.as_bytes() && prefix != TEST_PREFIX.as_bytes() {
        return Err(ShapeError::Prefix);
    }
    if !key[PREFIX_LEN..].iter().all(u8::is_ascii_alphanumeric) {
        return Err(ShapeError::Charset);
    }
    if checksum(body) != sum {
        return Err(ShapeError::Checksum);
    }
    Ok(())
}

/// SHA-256 of the whole key: what the key table is indexed by.
pub fn hash(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// A new random key from the operating system's CSPRNG.
pub fn generate(env: KeyEnv) -> Result<String, getrandom::Error> {
    let mut key = Vec::with_capacity(KEY_LEN);
    key.extend_from_slice(match env {
        KeyEnv::Live => LIVE_PREFIX.as_bytes(),
        KeyEnv::Test => TEST_PREFIX.as_bytes(),
    });
    // Rejection sampling keeps every base62 character equally likely.
    let mut buf = [0u8; 64];
    while key.len() < PREFIX_LEN + RANDOM_LEN {
        getrandom::fill(&mut buf)?;
        for &b in &buf {
            if b < 248 && key.len() < PREFIX_LEN + RANDOM_LEN {
                key.push(BASE62[usize::from(b % 62)]);
            }
        }
    }
    let sum = checksum(&key);
    key.extend_from_slice(&sum);
    Ok(key.into_iter().map(char::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_pass_their_own_check_and_differ() {
        let a = generate(KeyEnv::Live).unwrap();
        let b = generate(KeyEnv::Test).unwrap();
        assert!(a.starts_with("ak_live_") && b.starts_with("ak_test_"));
        assert_eq!(a.len(), KEY_LEN);
        check_shape(a.as_bytes()).unwrap();
        check_shape(b.as_bytes()).unwrap();
        assert_ne!(a[8..], b[8..]);
    }

    #[test]
    fn malformed_keys_are_refused_by_shape() {
        let key = generate(KeyEnv::Live).unwrap();
        assert_eq!(check_shape(&key.as_bytes()[..45]), Err(ShapeError::Length));
        assert_eq!(check_shape(b""), Err(ShapeError::Length));
        let other = key.replacen("ak_live_", "ak_prod_", 1);
        assert_eq!(check_shape(other.as_bytes()), Err(ShapeError::Prefix));
        let mut bad = key.clone().into_bytes();
        bad[20] = b'-';
        assert_eq!(check_shape(&bad), Err(ShapeError::Charset));
        // One changed character anywhere in the random part breaks the checksum.
        for i in 8..40 {
            let mut typo = key.clone().into_bytes();
            typo[i] = if typo[i] == b'a' { b'b' } else { b'a' };
            assert_eq!(check_shape(&typo), Err(ShapeError::Checksum), "position {i}");
        }
        // A test key's checksum does not carry over to the live prefix.
        let test = generate(KeyEnv::Test).unwrap();
        let relabelled = test.replacen("ak_test_", "ak_live_", 1);
        assert_eq!(check_shape(relabelled.as_bytes()), Err(ShapeError::Checksum));
    }

    #[test]
    fn hash_is_sha256_of_the_whole_key() {
        assert_eq!(hex::encode(hash(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
