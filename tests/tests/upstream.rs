//! The transport to backends, through a real node: HTTP/2 over TLS to a backend that
//! requires a client certificate (the node's, signed by the backend's CA), HTTP/1.1
//! over TLS checked against a configured server name, and h2c; a node without the
//! client certificate is refused by that backend; bad transport and outlier settings are
//! refused at compile.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::path::Path;

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, new_key};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

/// A CA, a server certificate for 127.0.0.1 and `orders.internal`, and a client
/// certificate named `postern-gateway`, written as PEM files into `dir`.
fn pki(dir: &Path) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "backends CA");
    std::fs::write(dir.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |name: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    };
    leaf("backend", vec!["127.0.0.1".into(), "orders.internal".into()], ExtendedKeyUsagePurpose::ServerAuth);
    leaf("postern-gateway", vec![], ExtendedKeyUsagePurpose::ClientAuth);
}

fn clusters(tls: &Echo, plain: &Echo, extra: &str) -> String {
    format!(
        "clusters:
  secure:
    endpoints: [\"{tls}\"]
    protocol: http2
    tls: {{ ca: platform/ca.pem }}
  secure-h1:
    endpoints: [\"{tls}\"]
    tls: {{ ca: platform/ca.pem, serverName: orders.internal }}
  plain-h2:
    endpoints: [\"{plain}\"]
    protocol: http2
{extra}",
        tls = tls.addr(),
        plain = plain.addr()
    )
}

const ROUTES: &str = "routes:
  - name: secure
    match: { path: { value: /secure } }
    auth: { methods: [apiKey], product: orders }
    backendRefs: [{ name: secure }]
    timeouts: { connect: 1s, response: 2s }
  - name: secure-h1
    public: true
    match: { path: { value: /secure-h1 } }
    backendRefs: [{ name: secure-h1 }]
    timeouts: { connect: 1s, response: 2s }
  - name: h2c
    public: true
    match: { path: { value: /h2c } }
    backendRefs: [{ name: plain-h2 }]
    timeouts: { connect: 1s, response: 2s }
    maxBodyBytes: 1000
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_get_http2_and_the_gateways_client_certificate_over_tls() {
    let pki_dir = tempfile::tempdir().unwrap();
    let d = pki_dir.path();
    pki(d);
    let arg = |f: &str| d.join(f).to_str().unwrap().to_owned();
    let tls = Echo::start_with(
        "tls",
        &["--tls-cert", &arg("backend.pem"), "--tls-key", &arg("backend.key"), "--client-ca", &arg("ca.pem")],
    );
    let plain = Echo::start("plain");
    let repo = Repo::new();
    std::fs::create_dir_all(repo.path().join("platform")).unwrap();
    std::fs::copy(d.join("ca.pem"), repo.path().join("platform/ca.pem")).unwrap();
    repo.write("platform/clusters.yaml", &clusters(&tls, &plain, ""));
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [orders]\nplans:\n  gold: { products: [orders] }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let key = new_key(repo.path(), "k1", "app-1", "acme", "gold", &[]);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);

    let node = Node::start(
        &snap,
        &["--upstream-cert", &arg("postern-gateway.pem"), "--upstream-key", &arg("postern-gateway.key")],
    );
    // h2 over TLS, the node's certificate presented, the identity headers received.
    let r = get(&node.url("/secure"), &[("x-api-key", &key)]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    assert_eq!(j["version"], "HTTP/2.0", "{j}");
    assert_eq!(j["client_cert"], true, "{j}");
    assert_eq!(j["client_cert_cn"], "postern-gateway", "{j}");
    assert_eq!(r.echoed("x-auth-plan").as_deref(), Some("gold"), "{j}");
    assert_eq!(r.echoed("x-auth-tenant").as_deref(), Some("acme"), "{j}");
    // On HTTP/2 the routed host travels in X-Forwarded-Host, with no Host beside :authority.
    assert!(r.echoed("x-forwarded-host").is_some() && r.echoed("host").is_none(), "{j}");
    // Many requests at once share the HTTP/2 connection.
    let many: Vec<_> = (0..50)
        .map(|_| {
            let (url, key) = (node.url("/secure"), key.clone());
            tokio::spawn(async move { get(&url, &[("x-api-key", &key)]).await.status })
        })
        .collect();
    for h in many {
        assert_eq!(h.await.unwrap(), StatusCode::OK);
    }
    // HTTP/1.1 over TLS, the certificate checked against the configured name.
    let r = get(&node.url("/secure-h1"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!((r.json()["version"].as_str(), r.json()["client_cert"].as_bool()), (Some("HTTP/1.1"), Some(true)));
    // h2c with prior knowledge to a plain backend.
    let r = get(&node.url("/h2c"), &[]).await;
    assert_eq!(r.json()["version"], "HTTP/2.0", "{:?}", r.body);
    // A chunked upload over the route's limit is the caller's fault on HTTP/2 too: 413,
    // and nothing recorded against the backend.
    let mut req = b"POST /h2c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n7d0\r\n".to_vec();
    req.extend(std::iter::repeat_n(b'x', 2000));
    req.extend(b"\r\n0\r\n\r\n");
    // Read until the node closes the connection (it does after a 413); 30 s only guards
    // against a hang.
    let answer = postern_e2e::raw(node.public, &req, std::time::Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let state = get(&node.admin_url("/readyz"), &[]).await.json();
    assert_eq!(state["clusters"]["plain-h2"]["hosts"][0]["ejections"], 0, "{state}");
    drop(node);

    // A node without the client certificate: the backend refuses the handshake.
    let bare = Node::start(&snap, &[]);
    let r = get(&bare.url("/secure"), &[("x-api-key", &key)]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["code"], "upstream_unavailable");
    println!("without the client certificate: {}", String::from_utf8_lossy(&r.body));
    // ...and a certificate for another name is refused by the gateway.
    let wrong = clusters(&tls, &plain, "").replace("serverName: orders.internal", "serverName: search.internal");
    repo.write("platform/clusters.yaml", &wrong);
    repo.compile_ok(&snap);
    bare.wait_version(2).await;
    let r = get(&bare.url("/secure-h1"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn bad_transport_settings_are_refused_at_compile() {
    let repo = Repo::new();
    std::fs::create_dir_all(repo.path().join("platform")).unwrap();
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write("platform/not-a-ca.pem", "hello\n");
    repo.write("teams/t/routes.yaml", "routes:\n  - name: r\n    public: true\n    match: { path: { value: /r } }\n    backendRefs: [{ name: c }]\n    timeouts: { connect: 1s, response: 2s }\n");
    for (cluster, field, says) in [
        ("protocol: http3", "clusters.c.protocol", "unknown protocol"),
        ("tls: { ca: ../outside.pem }", "clusters.c.tls.ca", "inside the repository"),
        ("tls: { ca: platform/missing.pem }", "clusters.c.tls.ca", "cannot read"),
        ("tls: { ca: platform/not-a-ca.pem }", "clusters.c.tls.ca", "no certificates"),
        ("tls: { ca: platform/not-a-ca.pem, sni: x }", "sni", "unknown field"),
        ("outlier: { maxEjectedPercent: 101 }", "clusters.c.outlier.maxEjectedPercent", "out of range"),
        ("outlier: { consecutiveFailures: 0 }", "clusters.c.outlier.consecutiveFailures", "out of range"),
        ("outlier: { ejectFor: 10m, maxEjectFor: 1m }", "clusters.c.outlier.maxEjectFor", "at least ejectFor"),
    ] {
        repo.write(
            "platform/clusters.yaml",
            &format!("clusters:\n  c:\n    endpoints: [\"127.0.0.1:1\"]\n    {cluster}\n"),
        );
        let out = repo.compile(&repo.path().join("bad.json"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{cluster}: refused");
        assert!(stderr.contains("platform/clusters.yaml") && stderr.contains(field), "{cluster}: {stderr}");
        assert!(stderr.contains(says), "{cluster}: {stderr}");
    }
}
