//! TLS for both planes (feature `tls`): a server identity from PEM files (the node's
//! listeners, `posternctl serve --tls-cert --tls-key`) and the client nodes and the CLI
//! reach an `https://` control plane with, trusting the CA they are given
//! (`--control-ca`).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A client of a control plane, on `http://` or (with a CA) `https://`.
pub type ControlClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The one crypto provider of both planes (aws-lc-rs).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A certificate chain and its private key from PEM files.
pub fn identity(cert: &Path, key: &Path) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let certs = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("cannot read certificates from {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("bad certificate in {}", cert.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{}: no certificates", cert.display());
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    Ok((certs, key))
}

/// The certificates of PEM text `pem` (named `what` in errors) as trust roots.
pub fn roots_pem(pem: &[u8], what: &str) -> anyhow::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        roots
            .add(cert.with_context(|| format!("bad certificate in {what}"))?)
            .with_context(|| format!("unusable CA certificate in {what}"))?;
    }
    anyhow::ensure!(!roots.is_empty(), "{what}: no certificates");
    Ok(roots)
}

/// The certificates of the PEM file `ca` as trust roots.
pub fn roots(ca: &Path) -> anyhow::Result<rustls::RootCertStore> {
    let pem = std::fs::read(ca).with_context(|| format!("cannot read {}", ca.display()))?;
    roots_pem(&pem, &ca.display().to_string())
}

/// The server side: the certificate chain and key in PEM files, offering `alpn`; with
/// `client_ca` (PEM), a client certificate signed by it is required.
pub fn server_config(
    cert: &Path,
    key: &Path,
    alpn: &[&[u8]],
    client_ca: Option<&Path>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let (certs, key) = identity(cert, key)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                    .build()
                    .with_context(|| format!("client CA {}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config =
        builder.with_single_cert(certs, key).context("certificate and key do not form a valid identity")?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A client trusting the certificates in `ca` (PEM) for `https://` URLs; without one,
/// `https://` URLs are refused at connect (there is no implicit trust store).
pub fn client(ca: Option<&Path>) -> anyhow::Result<ControlClient> {
    let roots = match ca {
        Some(ca) => roots(ca)?,
        None => rustls::RootCertStore::empty(),
    };
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let https =
        hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http1().build();
    Ok(Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(90))
        .build(https))
}
