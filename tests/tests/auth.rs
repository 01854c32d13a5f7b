//! Authentication end to end: API keys made by `posternctl key new`, JWTs signed with the
//! test keys, the credential state compiled beside the snapshot and loaded by a real
//! node; identity headers at a real backend; revocation on a kept-alive connection; and
//! no credential anywhere in the logs or the forwarded requests.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use postern_e2e::{Echo, Node, Repo, Resp, bin, get, platform};
use serde_json::{Value, json};

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../builtin-filters/src/auth/testdata");
const ISS: &str = "https://id.example.com";
const AUD: &str = "api.example.com";

fn pem(name: &str) -> String {
    std::fs::read_to_string(Path::new(TESTDATA).join(name)).unwrap()
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn sign(header: &Value, claims: &Value) -> String {
    let msg = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(header).unwrap()),
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap())
    );
    let key = jsonwebtoken::EncodingKey::from_ec_pem(pem("ec-test-private.pem").as_bytes()).unwrap();
    let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &key, jsonwebtoken::Algorithm::ES256).unwrap();
    format!("{msg}.{sig}")
}

fn claims(sub: &str, jti: &str) -> Value {
    let t = now();
    json!({"iss": ISS, "aud": AUD, "sub": sub, "client_id": "app-1", "scope": "orders:read",
           "jti": jti, "iat": t, "exp": t + 900})
}

fn token(sub: &str, jti: &str) -> String {
    sign(&json!({"alg": "ES256", "kid": "e1", "typ": "at+jwt"}), &claims(sub, jti))
}

fn ctl(args: &[&str]) -> String {
    let o = Command::new(bin("posternctl")).args(args).output().unwrap();
    assert!(o.status.success(), "posternctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_owned()
}

fn indent(text: &str, by: usize) -> String {
    text.lines().map(|l| format!("{}{l}\n", " ".repeat(by))).collect()
}

fn auth_yaml(deny: &str) -> String {
    format!(
        "jwt:\n  audiences: [{AUD}]\nsigning_keys:\n  - kid: e1\n    alg: ES256\n    issuer: {ISS}\n    public_key_pem: |\n{}apps:\n  app-1: {{ plan: partner, tenant: acme }}\ndeny: [{deny}]\n",
        indent(&pem("ec-test-public.pem"), 6)
    )
}

struct Setup {
    echo: Echo,
    repo: Repo,
    out: tempfile::TempDir,
    key: String,
    free_key: String,
}

impl Setup {
    fn new() -> Setup {
        let echo = Echo::start("orders");
        let repo = Repo::new();
        platform(&repo, &[("e", &echo.addr())]);
        repo.write(
            "platform/plans.yaml",
            "scopes: [orders:read, orders:write]\nproducts: [orders, search]\nplans:\n  partner: { products: [orders, search] }\n  free: { products: [search] }\n",
        );
        repo.write("platform/auth.yaml", &auth_yaml(""));
        repo.write(
            "teams/t/routes.yaml",
            "routes:\n  - name: orders\n    match: { path: { value: /orders } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n    auth: { methods: [apiKey, jwt], scopes: [orders:read], product: orders }\n  - name: open\n    public: true\n    match: { path: { value: /open } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n",
        );
        let root = repo.path().to_str().unwrap().to_owned();
        let key = ctl(&[
            "key",
            "new",
            &root,
            "--id",
            "k-1",
            "--app",
            "app-1",
            "--tenant",
            "acme",
            "--plan",
            "partner",
            "--scope",
            "orders:read",
        ]);
        let free_key = ctl(&[
            "key",
            "new",
            &root,
            "--id",
            "k-free",
            "--app",
            "app-2",
            "--tenant",
            "beta",
            "--plan",
            "free",
            "--scope",
            "orders:read",
        ]);
        let out = tempfile::tempdir().unwrap();
        let s = Setup { echo, repo, out, key, free_key };
        s.compile();
        s
    }

    fn snapshot(&self) -> std::path::PathBuf {
        self.out.path().join("snapshot.json")
    }

    fn compile(&self) {
        self.repo.compile_ok(&self.snapshot());
    }
}

async fn credentials_version(node: &Node) -> u64 {
    get(&node.admin_url("/readyz"), &[]).await.json()["credentials"]["version"].as_u64().unwrap_or(0)
}

async fn wait_credentials(node: &Node, version: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while credentials_version(node).await < version {
        assert!(Instant::now() < deadline, "credentials v{version} not applied; log:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_refused(r: &Resp, status: StatusCode, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {:?}", r.body);
    let j = r.json();
    assert_eq!(j["code"], code, "{what}");
    let mut keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "detail", "request_id", "status", "title", "type"], "{what}: one body shape");
    assert_eq!(r.header("content-type"), Some("application/problem+json"), "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_reach_backends_only_as_identity() {
    let s = Setup::new();
    let node = Node::start(&s.snapshot(), &[]);
    wait_credentials(&node, 1).await;
    let url = node.url("/orders");
    let mut seen = Vec::new();

    // An API key: identity headers, and neither the key nor client-sent identity.
    let r = get(&url, &[("x-api-key", &s.key), ("x-auth-plan", "gold"), ("x-auth-subject", "root")]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.echoed("x-auth-key-id").as_deref(), Some("k-1"));
    assert_eq!(r.echoed("x-auth-client-id").as_deref(), Some("app-1"));
    assert_eq!(r.echoed("x-auth-tenant").as_deref(), Some("acme"));
    assert_eq!(r.echoed("x-auth-plan").as_deref(), Some("partner"));
    assert_eq!(r.echoed("x-auth-scopes").as_deref(), Some("orders:read"));
    assert_eq!(r.echoed("x-auth-subject"), None);
    assert_eq!(r.echoed("x-api-key"), None);
    seen.push(r);

    // A JWT.
    let jwt = token("alice", "jti-1");
    let r = get(&url, &[("authorization", &format!("Bearer {jwt}"))]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.echoed("x-auth-subject").as_deref(), Some("alice"));
    assert_eq!(r.echoed("x-auth-client-id").as_deref(), Some("app-1"));
    assert_eq!(r.echoed("x-auth-plan").as_deref(), Some("partner"));
    assert_eq!(r.echoed("authorization"), None);
    seen.push(r);

    // A public route forwards no identity and no credential.
    let r = get(&node.url("/open"), &[("authorization", &format!("Bearer {jwt}")), ("x-api-key", &s.key)]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.echoed("authorization"), None);
    assert_eq!(r.echoed("x-api-key"), None);
    assert_eq!(r.echoed("x-auth-key-id"), None);
    seen.push(r);

    // Refusals: no backend call, one body shape.
    let before = s.echo.count().await;
    let t = now();
    let expired = sign(
        &json!({"alg": "ES256", "kid": "e1"}),
        &json!({"iss": ISS, "aud": AUD, "sub": "a", "client_id": "app-1", "scope": "orders:read", "jti": "x", "iat": t - 1000, "exp": t - 100}),
    );
    let forged = {
        let mut p: Vec<&str> = jwt.split('.').collect();
        let other = token("mallory", "jti-9");
        let o: Vec<&str> = other.split('.').collect();
        p[1] = o[1];
        p.join(".")
    };
    let none = format!(
        "{}.{}.",
        URL_SAFE_NO_PAD.encode(br#"{"alg":"none","kid":"e1"}"#),
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims("root", "n")).unwrap())
    );
    let huge = "A".repeat(60_000);
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, StatusCode, &'a str);
    let cases: Vec<Case<'_>> = vec![
        ("no credential", vec![], StatusCode::UNAUTHORIZED, "invalid_credentials"),
        ("malformed key", vec![("x-api-key", "ak_live_123".into())], StatusCode::UNAUTHORIZED, "invalid_credentials"),
        (
            "bad checksum",
            // The last character changed (to `0`, or to `1` when it is a `0`).
            vec![(
                "x-api-key",
                format!("{}{}", &s.key[..s.key.len() - 1], if s.key.ends_with('0') { '1' } else { '0' }),
            )],
            StatusCode::UNAUTHORIZED,
            "invalid_credentials",
        ),
        (
            "expired token",
            vec![("authorization", format!("Bearer {expired}"))],
            StatusCode::UNAUTHORIZED,
            "invalid_credentials",
        ),
        (
            "forged token",
            vec![("authorization", format!("Bearer {forged}"))],
            StatusCode::UNAUTHORIZED,
            "invalid_credentials",
        ),
        (
            "alg none",
            vec![("authorization", format!("Bearer {none}"))],
            StatusCode::UNAUTHORIZED,
            "invalid_credentials",
        ),
        (
            "oversized token",
            vec![("authorization", format!("Bearer {huge}"))],
            StatusCode::UNAUTHORIZED,
            "invalid_credentials",
        ),
        (
            "plan without the product",
            vec![("x-api-key", s.free_key.clone())],
            StatusCode::FORBIDDEN,
            "product_not_in_plan",
        ),
    ];
    for (what, headers, status, code) in &cases {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = get(&url, &h).await;
        assert_refused(&r, *status, code, what);
        if *status == StatusCode::UNAUTHORIZED {
            assert!(r.header("www-authenticate").is_some(), "{what}");
        }
        seen.push(r);
    }
    assert_eq!(s.echo.count().await, before, "nothing refused reached the backend");

    let metrics = get(&node.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(text.contains("postern_auth_requests_total{outcome=\"ok\"} 2"), "{text}");
    assert!(text.contains("postern_auth_requests_total{outcome=\"expired\"} 1"), "{text}");

    // No credential used here appears in the node's log or in anything a backend got.
    let log = node.log();
    let forwarded: String = seen.iter().map(|r| String::from_utf8_lossy(&r.body).into_owned()).collect();
    for secret in [&s.key, &s.free_key, &jwt, &expired, &forged] {
        assert!(!log.contains(secret.as_str()), "a credential is in the log");
        assert!(!forwarded.contains(secret.as_str()), "a credential reached a backend");
    }
    // Nor a token's signature alone.
    let sig = jwt.rsplit('.').next().unwrap();
    assert!(!log.contains(sig) && !forwarded.contains(sig));
}

/// Sends GET `path` with `headers` on an already-open HTTP/1.1 connection.
async fn on_conn(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> StatusCode {
    let mut req = Request::builder().method(Method::GET).uri(path).header("host", host);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    // The connection must have finished the previous exchange before it takes another.
    sender.ready().await.unwrap();
    let resp = sender.send_request(req.body(Full::new(Bytes::new())).unwrap()).await.unwrap();
    let status = resp.status();
    let _ = resp.into_body().collect().await;
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocations_apply_on_a_kept_alive_connection() {
    let s = Setup::new();
    let node = Node::start(&s.snapshot(), &[]);
    wait_credentials(&node, 1).await;
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", node.public)).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(conn);
    let host = format!("127.0.0.1:{}", node.public);
    let jwt = token("alice", "jti-revoke-me");
    let bearer = format!("Bearer {jwt}");

    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("x-api-key", &s.key)]).await, StatusCode::OK);
    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("authorization", &bearer)]).await, StatusCode::OK);

    // The leaked key is reported raw; the key service revokes it by hash.
    let root = s.repo.path().to_str().unwrap().to_owned();
    ctl(&["key", "revoke", &root, "--key", &s.key]);
    // And the token by its jti.
    s.repo.write("platform/auth.yaml", &auth_yaml(&format!("{{ jti: jti-revoke-me, expires_at: {} }}", now() + 900)));
    let started = Instant::now();
    s.compile();
    wait_credentials(&node, 2).await;
    let applied = started.elapsed();

    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("x-api-key", &s.key)]).await, StatusCode::UNAUTHORIZED);
    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("authorization", &bearer)]).await, StatusCode::UNAUTHORIZED);
    // Another user's token still works on the same connection.
    let other = format!("Bearer {}", token("bob", "jti-bob"));
    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("authorization", &other)]).await, StatusCode::OK);
    assert!(!conn.is_finished(), "the same connection carried every request");
    eprintln!("revocation applied {} ms after compile started", applied.as_millis());

    // A corrupted credentials file is refused and the live state stays. It is put in
    // place whole (renamed over the good one), so the cut file is all the node can read;
    // once the node has counted and logged its refusal, the live state is checked.
    let creds = s.out.path().join("credentials.json");
    let text = std::fs::read_to_string(&creds).unwrap();
    let refused = "postern_credentials_reload_failures_total";
    let before = node.metric(refused).await;
    let cut = s.out.path().join("credentials.json.cut");
    std::fs::write(&cut, &text[..text.len() / 2]).unwrap();
    std::fs::rename(&cut, &creds).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.metric(refused).await == before || !node.log().contains("credentials refused") {
        assert!(Instant::now() < deadline, "the cut credentials file was not refused in 30 s:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(node.metric(refused).await, before + 1, "one refusal of one file");
    assert_eq!(credentials_version(&node).await, 2);
    assert_eq!(on_conn(&mut sender, &host, "/orders", &[("authorization", &other)]).await, StatusCode::OK);
    assert!(node.log().contains("credentials refused"));
}

/// With two identity services, each OAuth app is bound to its issuer: a token one service
/// signed that names the other's app is refused (401, counted as `app_issuer_mismatch`),
/// and `posternctl compile` refuses an app without its issuer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_client_id_is_honoured_only_from_its_own_issuer() {
    const OTHER: &str = "https://other-id.example.com";
    let echo = Echo::start("orders");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "platform/plans.yaml",
        "scopes: [orders:read]\nproducts: [orders]\nplans:\n  partner: { products: [orders] }\n  other: { products: [orders] }\n",
    );
    let auth = |apps: &str| {
        format!(
            "jwt:\n  audiences: [{AUD}]\nsigning_keys:\n  - kid: e1\n    alg: ES256\n    issuer: {ISS}\n    public_key_pem: |\n{}  - kid: r1\n    alg: RS256\n    issuer: {OTHER}\n    public_key_pem: |\n{}apps:\n{apps}",
            indent(&pem("ec-test-public.pem"), 6),
            indent(&pem("rsa-test-public.pem"), 6)
        )
    };
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: orders\n    match: { path: { value: /orders } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n    auth: { methods: [jwt], scopes: [orders:read], product: orders }\n",
    );
    let out = tempfile::tempdir().unwrap();
    let snap = out.path().join("snapshot.json");
    // An app not bound to an issuer, with two issuers: refused at compile, by name.
    repo.write("platform/auth.yaml", &auth("  app-1: { plan: partner }\n"));
    let o = repo.compile(&snap);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("apps.app-1.issuer: required when the signing keys name more than one issuer"),
        "{err}"
    );

    repo.write(
        "platform/auth.yaml",
        &auth(&format!(
            "  app-1: {{ plan: partner, issuer: \"{ISS}\" }}\n  app-2: {{ plan: other, issuer: \"{OTHER}\" }}\n"
        )),
    );
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    let rs256 = |client: &str, jti: &str| {
        let mut c = claims("mallory", jti);
        c["iss"] = json!(OTHER);
        c["client_id"] = json!(client);
        let msg = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&json!({"alg": "RS256", "kid": "r1", "typ": "at+jwt"})).unwrap()),
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&c).unwrap())
        );
        let key = jsonwebtoken::EncodingKey::from_rsa_pem(pem("rsa-test-private.pem").as_bytes()).unwrap();
        let sig = jsonwebtoken::crypto::sign(msg.as_bytes(), &key, jsonwebtoken::Algorithm::RS256).unwrap();
        format!("Bearer {msg}.{sig}")
    };
    const REFUSED: &str = "postern_auth_requests_total{outcome=\"app_issuer_mismatch\"}";
    // The other service's token naming app-1: refused, like any bad token, and counted.
    let r = get(&node.url("/orders"), &[("authorization", &rs256("app-1", "jti-x"))]).await;
    assert_refused(&r, StatusCode::UNAUTHORIZED, "invalid_credentials", "another issuer's token for app-1");
    assert_eq!(node.metric(REFUSED).await, 1);
    // Each service's token for its own app: served, as that app.
    let r = get(&node.url("/orders"), &[("authorization", &rs256("app-2", "jti-y"))]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.echoed("x-auth-client-id").as_deref(), Some("app-2"));
    assert_eq!(r.echoed("x-auth-plan").as_deref(), Some("other"));
    let r = get(&node.url("/orders"), &[("authorization", &format!("Bearer {}", token("alice", "jti-z")))]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.echoed("x-auth-client-id").as_deref(), Some("app-1"));
    assert_eq!(echo.count().await, 2, "the refused token never reached the backend");
    assert_eq!(node.metric(REFUSED).await, 1);
}
