//! Property tests for the JWT parser: any string, and any header and claims signed with a
//! pinned key, end in a verdict, never a panic; a token the issuer would mint passes.
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn any_string_is_a_verdict(token in "[ -~]{0,300}") {
        let _ = jwt::verify(&store(), &token, unix_now());
        let _ = jwt::verify(&CredentialStore::empty(), &token, unix_now());
    }

    #[test]
    fn any_signed_header_and_claims_are_a_verdict(header in object(HEADER), claims in object(CLAIMS)) {
        let _ = jwt::verify(&store(), &signed(header.as_bytes(), claims.as_bytes()), unix_now());
    }

    #[test]
    fn raw_bytes_in_either_part_are_a_verdict(
        header in prop::collection::vec(any::<u8>(), 0..64),
        claims in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let _ = jwt::verify(&store(), &signed(&header, &claims), unix_now());
    }
}

#[test]
fn a_token_the_issuer_mints_passes() {
    let t = unix_now();
    let claims = format!(
        "{{\"iss\":\"{ISS}\",\"aud\":\"api\",\"sub\":\"u\",\"client_id\":\"c\",\"scope\":\"\",\"jti\":\"j\",\"iat\":{t},\"exp\":{}}}",
        t + 600
    );
    let token = signed(br#"{"alg":"ES256","kid":"e1","typ":"at+jwt"}"#, claims.as_bytes());
    assert!(jwt::verify(&store(), &token, t).is_ok());
}
