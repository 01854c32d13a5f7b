//! TLS termination with ALPN: HTTP/2 and HTTP/1.1 over rustls.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use postern_e2e::{Echo, Node, Repo, platform};
use rustls_pki_types::{CertificateDer, ServerName};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_alpn_h2_and_http11() {
    let echo = Echo::start("tls-echo");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: r\n    public: true\n    match: { path: { value: /s } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 2s }\n",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert_pem = repo.path().join("cert.pem");
    let key_pem = repo.path().join("key.pem");
    std::fs::write(&cert_pem, ck.cert.pem()).unwrap();
    std::fs::write(&key_pem, ck.signing_key.serialize_pem()).unwrap();
    let node = Node::start(&snap, &["--tls-cert", cert_pem.to_str().unwrap(), "--tls-key", key_pem.to_str().unwrap()]);

    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(ck.cert.der().to_vec())).unwrap();
    for (alpn, want) in [(b"h2".as_slice(), http::Version::HTTP_2), (b"http/1.1".as_slice(), http::Version::HTTP_11)] {
        let mut cfg =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
        cfg.alpn_protocols = vec![alpn.to_vec()];
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", node.public)).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(alpn));
        let req =
            Request::get("https://localhost/s/x").header("host", "localhost").body(Empty::<Bytes>::new()).unwrap();
        let resp = if want == http::Version::HTTP_2 {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
            tokio::spawn(conn);
            send.send_request(req).await.unwrap()
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
            tokio::spawn(conn);
            send.send_request(req).await.unwrap()
        };
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), want);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["backend"], "tls-echo");
        assert_eq!(v["path"], "/s/x");
        let proto = v["headers"].as_array().unwrap().iter().find(|h| h[0] == "x-forwarded-proto").unwrap()[1].clone();
        assert_eq!(proto, "https");
    }
}
