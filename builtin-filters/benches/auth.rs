//! Authentication costs: API key check, ES256 verify cold and from the verified cache,
//! deny-list check; plus the key table's memory at 100 k keys and load time at 1 M
//! (printed before the criterion runs: they are one-off measurements, not loops).
//!
//! `cargo bench -p postern-builtin-filters --bench auth`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use criterion::{Criterion, criterion_group};
use http::{HeaderMap, HeaderValue};
use postern_builtin_filters::auth::{Authenticator, CredentialStore, Methods, apikey, jwt, unix_now};
use postern_model::SnapshotFile;
use postern_model::credentials::{Alg, ApiKey, App, Credentials, DenyEntry, KeyStatus, SigningKey};

/// The node's allocator, so load figures match the node's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const EC_PRIVATE: &str = include_str!("../src/auth/testdata/ec-test-private.pem");
const EC_PUBLIC: &str = include_str!("../src/auth/testdata/ec-test-public.pem");

fn key_record(i: usize, raw: &str) -> ApiKey {
    ApiKey {
        id: format!("key-{i:07}"),
        sha256: hex::encode(apikey::hash(raw.as_bytes())),
        app: format!("app-{}", i / 2),
        tenant: format!("tenant-{}", i / 10),
        plan: ["free", "pro", "partner"][i % 3].to_owned(),
        scopes: vec!["orders:read".into(), "orders:write".into()],
        priority: None,
        status: KeyStatus::Active,
        successor: None,
        expires_at: None,
    }
}

fn credentials(keys: usize) -> (Credentials, String) {
    let mut c = Credentials::empty();
    c.jwt.audiences = vec!["api".into()];
    c.signing_keys = vec![SigningKey {
        kid: "e1".into(),
        alg: Alg::ES256,
        issuer: "https://id".into(),
        public_key_pem: EC_PUBLIC.into(),
    }];
    c.apps.insert(
        "app-1".into(),
        App { plan: "partner".into(), tenant: Some("acme".into()), priority: None, issuer: None },
    );
    let first = apikey::generate(apikey::KeyEnv::Live).unwrap();
    c.keys.push(key_record(0, &first));
    for i in 1..keys {
        // Distinct hashes without paying for a CSPRNG key each.
        let mut raw = first.clone();
        raw.push_str(&i.to_string());
        c.keys.push(key_record(i, &raw));
    }
    let now = unix_now();
    for i in 0..100u64 {
        c.deny.push(DenyEntry {
            jti: Some(format!("revoked-{i}")),
            sub: None,
            client_id: None,
            issued_before: None,
            expires_at: Some(now + 900),
        });
    }
    (c, first)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn one_off_figures() {
    let (c, _) = credentials(100_000);
    let before = rss_kib();
    let store = CredentialStore::build(1, &c, unix_now()).unwrap();
    let after = rss_kib();
    println!("key table: 100k keys resident {:.1} MiB", (after.saturating_sub(before)) as f64 / 1024.0);
    drop(store);
    drop(c);

    let (c, _) = credentials(1_000_000);
    let bytes = serde_json::to_vec(&SnapshotFile::seal_value(1, &c).unwrap()).unwrap();
    drop(c);
    let t = Instant::now();
    let (file, creds) = Credentials::open(&bytes).unwrap();
    let opened = t.elapsed();
    let store = CredentialStore::build(file.version, &creds, unix_now()).unwrap();
    println!(
        "key table: 1M keys ({:.0} MiB file) opened, checked and indexed in {:.2} s (open and parse {:.2} s, index {:.2} s)",
        bytes.len() as f64 / 1048576.0,
        t.elapsed().as_secs_f64(),
        opened.as_secs_f64(),
        (t.elapsed() - opened).as_secs_f64()
    );
    black_box(store);
}

fn token(claims: &serde_json::Value) -> String {
    let header = serde_json::json!({"alg": "ES256", "kid": "e1", "typ": "at+jwt"});
    let msg = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(&header).unwrap()),
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap())
    );
    let key = jsonwebtoken::EncodingKey::from_ec_pem(EC_PRIVATE.as_bytes()).unwrap();
    let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &key, jsonwebtoken::Algorithm::ES256).unwrap();
    format!("{msg}.{sig}")
}

fn bench(c: &mut Criterion) {
    let (creds, raw) = credentials(100_000);
    let auth = Arc::new(Authenticator::new(65_536, 64 << 20));
    auth.credentials.store(Arc::new(CredentialStore::build(1, &creds, unix_now()).unwrap()));
    let now = unix_now();

    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", HeaderValue::from_str(&raw).unwrap());
    let keys = Methods { api_key: true, jwt: false };
    c.bench_function("api key check (shape, sha256, lookup in 100k)", |b| {
        b.iter(|| black_box(auth.authenticate(black_box(&headers), keys, now)).is_ok())
    });

    let claims = serde_json::json!({"iss": "https://id", "aud": "api", "sub": "alice", "client_id": "app-1",
        "scope": "orders:read", "jti": "t-1", "iat": now, "exp": now + 900});
    let tok = token(&claims);
    let store = auth.credentials.load_full();
    c.bench_function("es256 verify cold", |b| b.iter(|| black_box(jwt::verify(&store, black_box(&tok), now)).is_ok()));

    let mut bearer = HeaderMap::new();
    bearer.insert("authorization", HeaderValue::from_str(&format!("Bearer {tok}")).unwrap());
    let jwts = Methods { api_key: false, jwt: true };
    assert!(auth.authenticate(&bearer, jwts, now).is_ok());
    c.bench_function("es256 from the verified cache (deny list checked)", |b| {
        b.iter(|| black_box(auth.authenticate(black_box(&bearer), jwts, now)).is_ok())
    });

    c.bench_function("deny list check (100 entries)", |b| {
        b.iter(|| black_box(store.deny.is_denied(black_box("t-1"), "alice", "app-1", Some(now), now)))
    });
}

criterion_group!(benches, bench);

fn main() {
    one_off_figures();
    benches();
    criterion::Criterion::default().configure_from_args().final_summary();
}
