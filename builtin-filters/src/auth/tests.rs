//! The authentication filter against every class of bad credential (RFC 8725 included),
//! with real ES256 and RS256 keys (test-only fixtures in `testdata/`).

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use jsonwebtoken::{Algorithm, EncodingKey};
use postern_filter_contract::{Context, Filter, Flow, Reply};
use postern_model::credentials::{
    Alg, ApiKey, App, Credentials, DenyEntry, KeyStatus, Priority, SigningKey as SigningKeySpec,
};
use postern_model::{AuthMethod, Plan, RouteAuth};
use serde_json::{Value, json};

use super::*;

const EC_PRIVATE: &str = include_str!("testdata/ec-test-private.pem");
const EC_PUBLIC: &str = include_str!("testdata/ec-test-public.pem");
const RSA_PRIVATE: &str = include_str!("testdata/rsa-test-private.pem");
const RSA_PUBLIC: &str = include_str!("testdata/rsa-test-public.pem");
const ISS: &str = "https://id.example.com";
const AUD: &str = "api.example.com";

fn now() -> u64 {
    unix_now()
}

struct Fixture {
    auth: Arc<Authenticator>,
    creds: Credentials,
    key: String,
    free_key: String,
}

fn api_key(id: &str, raw: &str, plan: &str, scopes: &[&str]) -> ApiKey {
    ApiKey {
        id: id.into(),
        sha256: hex::encode(apikey::hash(raw.as_bytes())),
        app: "app-1".into(),
        tenant: "acme".into(),
        plan: plan.into(),
        scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
        priority: None,
        status: KeyStatus::Active,
        successor: None,
        expires_at: None,
    }
}

impl Fixture {
    fn new() -> Fixture {
        let key = apikey::generate(apikey::KeyEnv::Live).unwrap();
        let free_key = apikey::generate(apikey::KeyEnv::Test).unwrap();
        let mut creds = Credentials::empty();
        creds.jwt.audiences = vec![AUD.into()];
        creds.signing_keys = vec![
            SigningKeySpec { kid: "e1".into(), alg: Alg::ES256, issuer: ISS.into(), public_key_pem: EC_PUBLIC.into() },
            SigningKeySpec { kid: "r1".into(), alg: Alg::RS256, issuer: ISS.into(), public_key_pem: RSA_PUBLIC.into() },
        ];
        creds.apps.insert(
            "app-1".into(),
            App { plan: "partner".into(), tenant: Some("acme".into()), priority: None, issuer: None },
        );
        creds.apps.insert(
            "app-free".into(),
            App { plan: "free".into(), tenant: None, priority: Some(Priority::Free), issuer: None },
        );
        creds.keys = vec![
            api_key("k-1", &key, "partner", &["orders:read", "orders:write"]),
            api_key("k-free", &free_key, "free", &["orders:read"]),
        ];
        let auth = Arc::new(Authenticator::new(1024, 1 << 20));
        let f = Fixture { auth, creds, key, free_key };
        f.apply(1);
        f
    }

    fn apply(&self, version: u64) {
        let store = CredentialStore::build(version, &self.creds, now()).unwrap();
        self.auth.credentials.store(Arc::new(store));
    }

    fn filter(&self, methods: &[AuthMethod], scopes: &[&str]) -> AuthFilter {
        let mut plans = BTreeMap::new();
        plans.insert("partner".to_owned(), Plan::of_products(&["orders"]));
        plans.insert(
            "free".to_owned(),
            Plan {
                products: vec!["search".into()],
                rate_limit: None,
                app_rate_limit: None,
                fail_closed: false,
                quota: None,
                priority: None,
            },
        );
        let spec = RouteAuth {
            methods: methods.to_vec(),
            scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
            product: "orders".into(),
        };
        AuthFilter::new(self.auth.clone(), Arc::from("t/orders"), &spec, &plans).unwrap()
    }
}

fn claims(sub: &str) -> Value {
    let t = now();
    json!({"iss": ISS, "aud": AUD, "sub": sub, "client_id": "app-1", "scope": "orders:read profile",
           "jti": format!("jti-{sub}-{t}"), "iat": t, "exp": t + 900})
}

/// Signs any header and claims, including ones no honest issuer would produce.
fn sign(header: &Value, claims: &Value, alg: Algorithm, pem: &str) -> String {
    let msg = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(header).unwrap()),
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap())
    );
    let key = match alg {
        Algorithm::ES256 => EncodingKey::from_ec_pem(pem.as_bytes()).unwrap(),
        Algorithm::RS256 => EncodingKey::from_rsa_pem(pem.as_bytes()).unwrap(),
        _ => EncodingKey::from_secret(pem.as_bytes()).unwrap(),
    };
    let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &key, alg).unwrap();
    format!("{msg}.{sig}")
}

fn es256(claims: &Value) -> String {
    sign(&json!({"alg": "ES256", "kid": "e1", "typ": "at+jwt"}), claims, Algorithm::ES256, EC_PRIVATE)
}

/// Runs the filter on a request with these headers: the status (200 if it continued)
/// and the head as it would be forwarded.
fn run(filter: &AuthFilter, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Option<Reply>, Context) {
    let mut b = Request::builder().uri("/orders");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let (mut parts, ()) = b.body(()).unwrap().into_parts();
    let cx = Context::new(Arc::from("t/orders"), HeaderValue::from_static("rid"));
    let reply = match filter.on_request(&mut parts, &cx) {
        Flow::Continue => None,
        Flow::Respond(r) => Some(r),
        Flow::Wait(_) => panic!("the auth filter never waits"),
    };
    let status = match &reply {
        None => StatusCode::OK,
        Some(Reply::Problem(p)) => p.status,
        Some(Reply::Custom { status, .. }) => *status,
    };
    (status, parts.headers, reply, cx)
}

fn code(r: &Option<Reply>) -> &'static str {
    match r {
        Some(Reply::Problem(p)) => p.code,
        _ => "",
    }
}

fn bearer(t: &str) -> String {
    format!("Bearer {t}")
}

#[test]
fn an_api_key_authenticates_and_sets_identity_headers() {
    let f = Fixture::new();
    let filter = f.filter(&[AuthMethod::ApiKey, AuthMethod::Jwt], &["orders:read"]);
    let (status, h, _, cx) = run(&filter, &[("x-api-key", &f.key)]);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h["x-auth-key-id"], "k-1");
    assert_eq!(h["x-auth-client-id"], "app-1");
    assert_eq!(h["x-auth-tenant"], "acme");
    assert_eq!(h["x-auth-plan"], "partner");
    assert_eq!(h["x-auth-scopes"], "orders:read orders:write");
    assert!(h.get("x-auth-subject").is_none());
    assert!(h.get("x-api-key").is_none(), "the credential is never forwarded");
    let id = cx.identity().unwrap();
    assert_eq!(id.kind, postern_filter_contract::CredentialKind::ApiKey);
    assert_eq!(id.priority, None, "no class of its own: its plan's");
}

#[test]
fn a_keys_own_priority_class_reaches_its_identity() {
    let mut f = Fixture::new();
    f.creds.keys[0].priority = Some(Priority::Critical);
    f.apply(2);
    let filter = f.filter(&[AuthMethod::ApiKey], &["orders:read"]);
    let (status, _, _, cx) = run(&filter, &[("x-api-key", &f.key)]);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cx.identity().unwrap().priority, Some(Priority::Critical.rank_u8()));
}

#[test]
fn a_jwt_authenticates_with_either_pinned_algorithm() {
    let f = Fixture::new();
    let filter = f.filter(&[AuthMethod::Jwt], &["orders:read"]);
    let token = es256(&claims("alice"));
    let (status, h, r, _) = run(&filter, &[("authorization", &bearer(&token))]);
    assert_eq!(status, StatusCode::OK, "{r:?}");
    assert_eq!(h["x-auth-subject"], "alice");
    assert_eq!(h["x-auth-client-id"], "app-1");
    assert_eq!(h["x-auth-tenant"], "acme");
    assert_eq!(h["x-auth-plan"], "partner");
    assert_eq!(h["x-auth-scopes"], "orders:read profile");
    assert!(h.get("authorization").is_none());
    // From the cache the second time: same answer.
    let (status, ..) = run(&filter, &[("authorization", &bearer(&token))]);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(f.auth.tokens.len(), 1);

    // Within the 30 s leeway: just expired, not quite valid yet.
    let mut edge = claims("dave");
    edge["exp"] = json!(now() - 10);
    edge["nbf"] = json!(now() + 10);
    assert_eq!(run(&filter, &[("authorization", &bearer(&es256(&edge)))]).0, StatusCode::OK);

    let rs = sign(&json!({"alg": "RS256", "kid": "r1"}), &claims("bob"), Algorithm::RS256, RSA_PRIVATE);
    let (status, h, ..) = run(&filter, &[("authorization", &bearer(&rs))]);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h["x-auth-subject"], "bob");
}

#[test]
fn every_bad_token_class_is_a_401_with_the_same_shape() {
    let f = Fixture::new();
    let filter = f.filter(&[AuthMethod::Jwt], &[]);
    let good = claims("alice");
    let with = |k: &str, v: Value| {
        let mut c = good.clone();
        c[k] = v;
        c
    };
    let without = |k: &str| {
        let mut c = good.clone();
        c.as_object_mut().unwrap().remove(k);
        c
    };
    let hdr = |extra: Value| {
        let mut h = json!({"alg": "ES256", "kid": "e1"});
        for (k, v) in extra.as_object().unwrap() {
            h[k] = v.clone();
        }
        h
    };
    let t = now();
    let tampered = {
        let tok = es256(&good);
        let mut parts: Vec<String> = tok.split('.').map(str::to_owned).collect();
        parts[1] = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&with("sub", json!("mallory"))).unwrap());
        parts.join(".")
    };
    let cases: Vec<(&str, String, Reason)> = vec![
        (
            "alg none",
            format!(
                "{}.{}.",
                URL_SAFE_NO_PAD.encode(br#"{"alg":"none","kid":"e1"}"#),
                URL_SAFE_NO_PAD.encode(serde_json::to_vec(&good).unwrap())
            ),
            Reason::Malformed,
        ),
        (
            "alg none with a signature",
            sign(&hdr(json!({"alg": "none"})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadAlg,
        ),
        (
            "HS256 keyed with the public key",
            sign(&hdr(json!({"alg": "HS256"})), &good, Algorithm::HS256, EC_PUBLIC),
            Reason::BadAlg,
        ),
        (
            "RS256 token under an ES256 kid",
            sign(&hdr(json!({"alg": "RS256"})), &good, Algorithm::RS256, RSA_PRIVATE),
            Reason::BadAlg,
        ),
        (
            "ES256 token under an RS256 kid",
            sign(&hdr(json!({"kid": "r1"})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadAlg,
        ),
        ("unknown kid", sign(&hdr(json!({"kid": "nope"})), &good, Algorithm::ES256, EC_PRIVATE), Reason::UnknownKid),
        ("no kid", sign(&json!({"alg": "ES256"}), &good, Algorithm::ES256, EC_PRIVATE), Reason::UnknownKid),
        (
            "embedded jwk",
            sign(&hdr(json!({"jwk": {"kty": "EC"}})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadHeader,
        ),
        (
            "jku pointer",
            sign(&hdr(json!({"jku": "https://evil.example/keys"})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadHeader,
        ),
        (
            "x5u pointer",
            sign(&hdr(json!({"x5u": "https://evil.example/cert"})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadHeader,
        ),
        (
            "crit extension",
            sign(&hdr(json!({"crit": ["exp"]})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadHeader,
        ),
        ("compressed", sign(&hdr(json!({"zip": "DEF"})), &good, Algorithm::ES256, EC_PRIVATE), Reason::BadHeader),
        (
            "wrong typ (an ID token)",
            sign(&hdr(json!({"typ": "id_token+jwt"})), &good, Algorithm::ES256, EC_PRIVATE),
            Reason::BadHeader,
        ),
        ("tampered claims", tampered, Reason::BadSignature),
        (
            "signed by another key",
            sign(&hdr(json!({})), &good, Algorithm::ES256, &other_ec_key()),
            Reason::BadSignature,
        ),
        ("expired (past the 30 s leeway)", es256(&with("exp", json!(t - 45))), Reason::Expired),
        ("not yet valid (past the 30 s leeway)", es256(&with("nbf", json!(t + 45))), Reason::NotYetValid),
        ("issued in the future", es256(&with("iat", json!(t + 120))), Reason::NotYetValid),
        ("lives too long", es256(&with("exp", json!(t + 7200))), Reason::TooLongLived),
        ("wrong issuer", es256(&with("iss", json!("https://evil.example"))), Reason::WrongIssuer),
        ("wrong audience", es256(&with("aud", json!("other-api"))), Reason::WrongAudience),
        ("no audience", es256(&without("aud")), Reason::BadClaims),
        ("no sub", es256(&without("sub")), Reason::BadClaims),
        ("no client_id", es256(&without("client_id")), Reason::BadClaims),
        ("no scope", es256(&without("scope")), Reason::BadClaims),
        ("no jti", es256(&without("jti")), Reason::BadClaims),
        ("no exp", es256(&without("exp")), Reason::BadClaims),
        ("no iat (a deny entry could not tell its age)", es256(&without("iat")), Reason::BadClaims),
        ("exp as a string", es256(&with("exp", json!("tomorrow"))), Reason::BadClaims),
        ("sub not a string", es256(&with("sub", json!(42))), Reason::BadClaims),
        ("sub with a newline", es256(&with("sub", json!("alice\nx-auth-plan: gold"))), Reason::BadClaims),
        ("two parts", "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhIn0".into(), Reason::Malformed),
        ("four parts", format!("{}.x", es256(&good)), Reason::Malformed),
        ("padding", format!("{}=", es256(&good)), Reason::Malformed),
        (
            "header not JSON",
            format!("{}.{}.AAAA", URL_SAFE_NO_PAD.encode(b"not json"), URL_SAFE_NO_PAD.encode(b"{}")),
            Reason::BadHeader,
        ),
        (
            "oversized",
            format!("{}.{}.AAAA", URL_SAFE_NO_PAD.encode(br#"{"alg":"ES256","kid":"e1"}"#), "A".repeat(5000)),
            Reason::Oversized,
        ),
    ];
    let mut shapes = Vec::new();
    for (name, token, reason) in cases {
        assert_eq!(jwt_reason(&f, &token), Err(reason), "{name}");
        let (status, h, r, _) = run(&filter, &[("authorization", &bearer(&token))]);
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{name}");
        assert_eq!(code(&r), "invalid_credentials", "{name}");
        assert!(h.get("authorization").is_none(), "{name}: the token never goes on");
        let Some(Reply::Problem(p)) = r else { unreachable!() };
        assert_eq!(p.headers[http::header::WWW_AUTHENTICATE], "Bearer realm=\"postern\", error=\"invalid_token\"");
        shapes.push(p.detail.clone());
    }
    shapes.dedup();
    assert_eq!(shapes.len(), 1, "one detail for every invalid credential: {shapes:?}");
    assert_eq!(f.auth.tokens.len(), 0, "nothing invalid is cached");
}

/// A P-256 key the gateway does not know: same algorithm, same kid, wrong key.
fn other_ec_key() -> String {
    include_str!("testdata/ec-other-private.pem").to_owned()
}

fn jwt_reason(f: &Fixture, token: &str) -> Result<(), Reason> {
    let store = f.auth.credentials.load();
    jwt::verify(&store, token, now()).map(|_| ())
}

#[test]
fn malformed_unknown_revoked_and_expired_keys_are_refused() {
    let mut f = Fixture::new();
    let filter = f.filter(&[AuthMethod::ApiKey], &[]);
    let unknown = apikey::generate(apikey::KeyEnv::Live).unwrap();
    let mut typo = f.key.clone().into_bytes();
    typo[12] = if typo[12] == b'x' { b'y' } else { b'x' };
    let typo = String::from_utf8(typo).unwrap();
    for (name, key, reason) in [
        ("short", "ak_live_abc", Reason::Malformed),
        ("typo", typo.as_str(), Reason::Malformed),
        ("unknown", unknown.as_str(), Reason::UnknownKey),
        ("huge", &*"a".repeat(10_000), Reason::Malformed),
    ] {
        assert_eq!(f.auth.authenticate(&headers(&[("x-api-key", key)]), filter.methods, now()).err(), Some(reason));
        let (status, _, r, _) = run(&filter, &[("x-api-key", key)]);
        assert_eq!((status, code(&r)), (StatusCode::UNAUTHORIZED, "invalid_credentials"), "{name}");
    }
    assert_eq!(run(&filter, &[]).0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        f.auth.authenticate(&headers(&[("x-api-key", &f.key), ("x-api-key", &f.key)]), filter.methods, now()).err(),
        Some(Reason::Ambiguous)
    );

    // Revoked: the very next request fails.
    assert_eq!(run(&filter, &[("x-api-key", &f.key)]).0, StatusCode::OK);
    f.creds.keys[0].status = KeyStatus::Revoked;
    f.apply(2);
    let (status, _, r, _) = run(&filter, &[("x-api-key", &f.key)]);
    assert_eq!((status, code(&r)), (StatusCode::UNAUTHORIZED, "invalid_credentials"));

    // Rotated: works until its overlap ends.
    f.creds.keys[0].status = KeyStatus::Active;
    f.creds.keys[0].successor = Some("k-2".into());
    f.creds.keys[0].expires_at = Some(now() + 60);
    f.apply(3);
    assert_eq!(run(&filter, &[("x-api-key", &f.key)]).0, StatusCode::OK);
    f.creds.keys[0].expires_at = Some(now() - 1);
    f.apply(4);
    assert_eq!(
        f.auth.authenticate(&headers(&[("x-api-key", &f.key)]), filter.methods, now()).err(),
        Some(Reason::KeyExpired)
    );
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
    }
    h
}

#[test]
fn scopes_and_plans_are_enforced_with_403s() {
    let f = Fixture::new();
    let filter = f.filter(&[AuthMethod::ApiKey, AuthMethod::Jwt], &["orders:admin"]);
    // The partner key's plan includes orders, but it lacks orders:admin.
    let (status, _, r, _) = run(&filter, &[("x-api-key", &f.key)]);
    assert_eq!((status, code(&r)), (StatusCode::FORBIDDEN, "insufficient_scope"));
    let Some(Reply::Problem(p)) = r else { unreachable!() };
    assert_eq!(
        p.headers[http::header::WWW_AUTHENTICATE],
        "Bearer realm=\"postern\", error=\"insufficient_scope\", scope=\"orders:admin\""
    );
    // The free key holds orders:read, but its plan does not include the orders API; the
    // plan is checked first, so it hears that whatever its scopes.
    let reader = f.filter(&[AuthMethod::ApiKey], &["orders:read"]);
    let (status, _, r, _) = run(&reader, &[("x-api-key", &f.free_key)]);
    assert_eq!((status, code(&r)), (StatusCode::FORBIDDEN, "product_not_in_plan"));
    assert_eq!(code(&run(&filter, &[("x-api-key", &f.free_key)]).2), "product_not_in_plan");
    // A token of an app unknown to the gateway has no plan.
    let jwt_reader = f.filter(&[AuthMethod::Jwt], &["orders:read"]);
    let token = es256(&{
        let mut c = claims("carol");
        c["client_id"] = json!("app-unknown");
        c
    });
    let (status, h, r, _) = run(&jwt_reader, &[("authorization", &bearer(&token))]);
    assert_eq!((status, code(&r)), (StatusCode::FORBIDDEN, "product_not_in_plan"));
    assert!(h.get("x-auth-subject").is_none(), "nothing is set on a refused request");
    // Both credentials at once is refused; a key on a JWT-only route is ignored (missing).
    let token = es256(&claims("alice"));
    let both = [("x-api-key", f.key.as_str()), ("authorization", &bearer(&token))];
    assert_eq!(f.auth.authenticate(&headers(&both), filter.methods, now()).err(), Some(Reason::Ambiguous));
    assert_eq!(run(&jwt_reader, &[("x-api-key", &f.key)]).0, StatusCode::UNAUTHORIZED);
}

#[test]
fn revocation_applies_to_cached_tokens() {
    let mut f = Fixture::new();
    let filter = f.filter(&[AuthMethod::Jwt], &[]);
    let c = claims("alice");
    let token = es256(&c);
    assert_eq!(run(&filter, &[("authorization", &bearer(&token))]).0, StatusCode::OK);
    assert_eq!(f.auth.tokens.len(), 1);

    // By jti.
    f.creds.deny = vec![DenyEntry {
        jti: c["jti"].as_str().map(str::to_owned),
        sub: None,
        client_id: None,
        issued_before: None,
        expires_at: None,
    }];
    f.apply(2);
    assert_eq!(
        jwt::authenticate(&f.auth.tokens, &f.auth.credentials.load(), &token, now()).err(),
        Some(Reason::Revoked)
    );

    // By user, issued before T; a token issued after T works.
    let t = now() + 1;
    f.creds.deny = vec![DenyEntry {
        jti: None,
        sub: Some("alice".into()),
        client_id: None,
        issued_before: Some(t),
        expires_at: None,
    }];
    f.apply(3);
    assert_eq!(run(&filter, &[("authorization", &bearer(&token))]).0, StatusCode::UNAUTHORIZED);
    let mut later = claims("alice");
    later["iat"] = json!(t);
    later["jti"] = json!("later");
    assert_eq!(run(&filter, &[("authorization", &bearer(&es256(&later)))]).0, StatusCode::OK);

    // By app.
    f.creds.deny = vec![DenyEntry {
        jti: None,
        sub: None,
        client_id: Some("app-1".into()),
        issued_before: Some(t + 1),
        expires_at: None,
    }];
    f.apply(4);
    assert_eq!(run(&filter, &[("authorization", &bearer(&es256(&later)))]).0, StatusCode::UNAUTHORIZED);

    // Retiring the signing key ends its cached tokens too; a plan change reaches them.
    f.creds.deny.clear();
    f.apply(5);
    assert_eq!(run(&filter, &[("authorization", &bearer(&token))]).0, StatusCode::OK);
    f.creds.apps.get_mut("app-1").unwrap().plan = "free".into();
    f.apply(6);
    let (status, _, r, _) = run(&filter, &[("authorization", &bearer(&token))]);
    assert_eq!((status, code(&r)), (StatusCode::FORBIDDEN, "product_not_in_plan"));
    f.creds.signing_keys.retain(|k| k.kid != "e1");
    f.apply(7);
    assert_eq!(
        jwt::authenticate(&f.auth.tokens, &f.auth.credentials.load(), &token, now()).err(),
        Some(Reason::UnknownKid)
    );
}

#[test]
fn a_cached_token_is_verified_again_under_new_settings() {
    let mut f = Fixture::new();
    let token = es256(&claims("carol"));
    let store = || f.auth.credentials.load_full();
    assert!(jwt::authenticate(&f.auth.tokens, &store(), &token, now()).is_ok());
    // The platform stops accepting this audience: the cached token is refused too.
    f.creds.jwt.audiences = vec!["another-api".into()];
    f.apply(2);
    assert_eq!(jwt::authenticate(&f.auth.tokens, &store(), &token, now()).err(), Some(Reason::WrongAudience));
    // ... and a shorter lifetime limit applies to tokens verified under the longer one.
    f.creds.jwt.audiences = vec![AUD.into()];
    f.apply(3);
    assert!(jwt::authenticate(&f.auth.tokens, &store(), &token, now()).is_ok());
    f.creds.jwt.max_lifetime_s = 600;
    f.apply(4);
    assert_eq!(jwt::authenticate(&f.auth.tokens, &store(), &token, now()).err(), Some(Reason::TooLongLived));
}

#[test]
fn the_token_cache_is_bounded_in_bytes() {
    let f = Fixture::new();
    let cache = jwt::TokenCache::new(100_000, 1 << 16);
    let store = f.auth.credentials.load_full();
    for i in 0..2000 {
        let mut c = claims(&format!("user-{i}"));
        c["jti"] = json!(format!("{i}-{}", "j".repeat(200)));
        assert!(jwt::authenticate(&cache, &store, &es256(&c), now()).is_ok());
    }
    assert!(cache.weight() <= 1 << 16, "{} bytes", cache.weight());
    assert!(cache.len() < 2000, "{} tokens", cache.len());
}

#[test]
fn outcomes_are_counted_by_reason() {
    let f = Fixture::new();
    let filter = f.filter(&[AuthMethod::ApiKey], &[]);
    run(&filter, &[("x-api-key", &f.key)]);
    run(&filter, &[]);
    let counts: BTreeMap<&str, u64> = f.auth.stats.snapshot().map(|(r, n)| (r.as_str(), n)).collect();
    assert_eq!(counts["ok"], 1);
    assert_eq!(counts["missing"], 1);
}

#[test]
fn a_caller_over_its_hard_quota_gets_429_until_the_period_ends() {
    use postern_model::credentials::QuotaFlag;
    use postern_model::usage::CallerKind;
    let mut f = Fixture::new();
    let filter = f.filter(&[AuthMethod::ApiKey, AuthMethod::Jwt], &["orders:read"]);
    let until = now() + 90;
    f.creds.over_quota = vec![
        QuotaFlag {
            caller: "k-1".into(),
            kind: CallerKind::Key,
            product: "orders".into(),
            until,
            quota: 500,
            period_s: 3600,
        },
        // The same name as an app, and another product: neither applies to k-1 here.
        QuotaFlag {
            caller: "app-1".into(),
            kind: CallerKind::App,
            product: "search".into(),
            until,
            quota: 5,
            period_s: 60,
        },
    ];
    f.apply(2);
    let (status, h, r, cx) = run(&filter, &[("x-api-key", &f.key)]);
    assert_eq!((status, code(&r)), (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"));
    assert!(h.get("x-auth-key-id").is_none() && cx.identity().is_none(), "a refused call is not the caller's");
    let Some(Reply::Problem(p)) = r else { unreachable!() };
    let retry: u64 = p.headers[http::header::RETRY_AFTER].to_str().unwrap().parse().unwrap();
    assert!((88..=90).contains(&retry), "Retry-After runs to the period's end: {retry}");
    assert_eq!(p.headers["ratelimit-policy"], "\"quota\";q=500;w=3600");
    assert!(p.headers["ratelimit"].to_str().unwrap().starts_with("\"quota\";r=0;t="));
    // A token of app-1 is not flagged on orders: it passes.
    let (status, ..) = run(&filter, &[("authorization", &bearer(&es256(&claims("alice"))))]);
    assert_eq!(status, StatusCode::OK);
    // Past `until` on the node's own clock the flag is ignored, with no new state.
    let store = f.auth.credentials.load();
    assert!(store.over_quota.get(postern_filter_contract::Payer::Key, b"k-1", "orders", until).is_none());
    assert_eq!(
        filter
            .check(&headers(&[("x-api-key", &f.key)]), until, None)
            .map(|id| id.key_id.clone())
            .ok()
            .flatten()
            .as_deref(),
        Some(&b"k-1"[..])
    );
    let refused = f.auth.stats.snapshot().find(|(r, _)| *r == Reason::QuotaExceeded).map(|(_, n)| n);
    assert_eq!(refused, Some(1));
}

#[test]
fn an_app_bound_to_its_issuer_takes_no_other_issuers_token() {
    let mut f = Fixture::new();
    // Two issuers: the RSA key signs for another identity service.
    const OTHER: &str = "https://other-id.example.com";
    f.creds.signing_keys[1].issuer = OTHER.into();
    f.creds.apps.get_mut("app-1").unwrap().issuer = Some(ISS.into());
    f.apply(2);
    let rs256 = |claims: &Value| {
        sign(&json!({"alg": "RS256", "kid": "r1", "typ": "at+jwt"}), claims, Algorithm::RS256, RSA_PRIVATE)
    };
    let mut theirs = claims("mallory");
    theirs["iss"] = json!(OTHER);
    // The other issuer's token naming app-1 (its signature and issuer are good).
    assert_eq!(jwt_reason(&f, &rs256(&theirs)), Err(Reason::AppIssuerMismatch));
    let filter = f.filter(&[AuthMethod::Jwt], &["orders:read"]);
    let (status, _, r, _) = run(&filter, &[("authorization", &bearer(&rs256(&theirs)))]);
    assert_eq!((status, code(&r)), (StatusCode::UNAUTHORIZED, "invalid_credentials"));
    let refused = f.auth.stats.snapshot().find(|(r, _)| *r == Reason::AppIssuerMismatch).unwrap().1;
    assert_eq!(refused, 1);
    // App-1's own issuer: taken. Another app, not bound, takes the other issuer's token.
    assert_eq!(jwt_reason(&f, &es256(&claims("alice"))), Ok(()));
    theirs["client_id"] = json!("app-free");
    assert_eq!(jwt_reason(&f, &rs256(&theirs)), Ok(()));
    // An app bound to an issuer no signing key has is refused when the state is built.
    f.creds.apps.get_mut("app-1").unwrap().issuer = Some("https://nobody.example".into());
    let e = CredentialStore::build(3, &f.creds, now()).unwrap_err().to_string();
    assert!(e.contains("apps.app-1.issuer: no signing key has the issuer"), "{e}");
    assert_eq!(Reason::AppIssuerMismatch.as_str(), "app_issuer_mismatch");
}
