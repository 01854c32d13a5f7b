//! Property tests for the JWT parser: any string, and any header and claims signed with a
//! pinned key, end in a verdict, never a panic. Random text and random bytes are refused;
//! a signed header and claims pass only if they say what the issuer would mint (the pinned
//! algorithm and key, its issuer, our audience, an expiry); a token the issuer mints passes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use postern_builtin_filters::auth::{CredentialStore, jwt, unix_now};
use postern_model::credentials::{Alg, Credentials, SigningKey};
use proptest::prelude::*;

const EC_PRIVATE: &str = include_str!("../src/auth/testdata/ec-test-private.pem");
const EC_PUBLIC: &str = include_str!("../src/auth/testdata/ec-test-public.pem");
const ISS: &str = "https://id.example.com";

fn store() -> CredentialStore {
    let mut creds = Credentials::empty();
    creds.jwt.audiences = vec!["api".into()];
    creds.signing_keys =
        vec![SigningKey { kid: "e1".into(), alg: Alg::ES256, issuer: ISS.into(), public_key_pem: EC_PUBLIC.into() }];
    CredentialStore::build(1, &creds, unix_now()).unwrap()
}

fn signed(header: &[u8], claims: &[u8]) -> String {
    let msg = format!("{}.{}", URL_SAFE_NO_PAD.encode(header), URL_SAFE_NO_PAD.encode(claims));
    let key = jsonwebtoken::EncodingKey::from_ec_pem(EC_PRIVATE.as_bytes()).unwrap();
    let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &key, jsonwebtoken::Algorithm::ES256).unwrap();
    format!("{msg}.{sig}")
}

/// JSON-ish text: real JSON values of the claim and header fields, or junk.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"ES256\"".to_owned()),
        Just("\"e1\"".to_owned()),
        Just("\"at+jwt\"".to_owned()),
        Just(format!("\"{ISS}\"")),
        Just("\"api\"".to_owned()),
        Just("[\"api\", 1]".to_owned()),
        Just("null".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("1e400".to_owned()),
        "\"[ -~]{0,12}\"",
        "[ -~]{0,8}",
    ]
}

fn object(names: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::collection::vec((prop::sample::select(names), field()), 0..10).prop_map(|kv| {
        let body: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    })
}

const HEADER: &[&str] = &["alg", "kid", "typ", "crit", "zip", "b64", "jwk", "jku", "x5u", "x5c", "cty"];
const CLAIMS: &[&str] = &["iss", "aud", "sub", "client_id", "scope", "jti", "exp", "iat", "nbf", "extra"];

/// The header fields a verdict of `Ok` depends on (others are ignored, as the verifier
/// ignores them).
#[derive(serde::Deserialize)]
struct Header {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
}

/// `aud`: one string or a list.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Aud {
    One(String),
    Many(Vec<String>),
}

/// The claims a verdict of `Ok` depends on.
#[derive(serde::Deserialize)]
struct Minted {
    iss: String,
    aud: Aud,
    sub: String,
    client_id: String,
    jti: String,
    exp: u64,
}

/// Whether a verdict of `Ok` for `header` and `claims` (signed with the pinned key) is
/// one the issuer's own tokens could get: the header names the pinned key and algorithm,
/// and the claims name the issuer and our audience, with the subject, client, id and
/// expiry `v` reports. (The verifier refuses a field it reads that appears twice, so
/// these parse whenever it passed a token, and to the values it read.)
fn mintable(header: &[u8], claims: &[u8], v: &jwt::Verified) -> bool {
    let (Ok(h), Ok(c)) = (serde_json::from_slice::<Header>(header), serde_json::from_slice::<Minted>(claims)) else {
        return false;
    };
    let ours = match &c.aud {
        Aud::One(a) => a == "api",
        Aud::Many(list) => list.iter().any(|a| a == "api"),
    };
    h.alg == "ES256"
        && h.kid.as_deref() == Some("e1")
        && &*v.kid == "e1"
        && c.iss == ISS
        && ours
        && c.exp == v.exp
        && *c.jti == *v.jti
        && *c.sub == *v.sub
        && *c.client_id == *v.client_id
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn any_string_is_refused(token in "[ -~]{0,300}") {
        // Text no key signed: never a valid token, whatever the store holds.
        let verdict = jwt::verify(&store(), &token, unix_now());
        prop_assert!(verdict.is_err(), "random text verified: {:?} -> {:?}", token, verdict);
        let verdict = jwt::verify(&CredentialStore::empty(), &token, unix_now());
        prop_assert!(verdict.is_err(), "random text verified with no keys: {:?} -> {:?}", token, verdict);
    }

    #[test]
    fn a_signed_header_and_claims_pass_only_as_the_issuer_mints_them(
        header in object(HEADER),
        claims in object(CLAIMS),
    ) {
        if let Ok(v) = jwt::verify(&store(), &signed(header.as_bytes(), claims.as_bytes()), unix_now()) {
            prop_assert!(mintable(header.as_bytes(), claims.as_bytes(), &v), "passed: {} {} -> {:?}", header, claims, v);
        }
    }

    #[test]
    fn raw_bytes_in_either_part_are_refused(
        header in prop::collection::vec(any::<u8>(), 0..64),
        claims in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        // Signed, but random bytes: not the header and claims of any token that passes.
        let verdict = jwt::verify(&store(), &signed(&header, &claims), unix_now());
        prop_assert!(verdict.is_err(), "random bytes verified: {:?} {:?} -> {:?}", header, claims, verdict);
    }
}

#[test]
fn a_token_the_issuer_mints_passes() {
    let t = unix_now();
    let claims = format!(
        "{{\"iss\":\"{ISS}\",\"aud\":\"api\",\"sub\":\"u\",\"client_id\":\"c\",\"scope\":\"\",\"jti\":\"j\",\"iat\":{t},\"exp\":{}}}",
        t + 600
    );
    let header = br#"{"alg":"ES256","kid":"e1","typ":"at+jwt"}"#;
    let token = signed(header, claims.as_bytes());
    let v = jwt::verify(&store(), &token, t).unwrap();
    // And the property's test of a pass agrees: this is what the issuer mints.
    assert!(mintable(header, claims.as_bytes(), &v), "{v:?}");
}
