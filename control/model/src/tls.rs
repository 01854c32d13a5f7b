//! TLS for both planes (feature `tls`): a server identity from PEM files (the node's
//! listeners, `posternctl serve --tls-cert --tls-key`) and the client nodes and the CLI
//! reach an `https://` control plane with, trusting the CA they are given
//! (`--control-ca`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A client of a control plane, on `http://` or (with a CA) `https://`.
pub type ControlClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Why TLS could not be set up; `{:#}` through `anyhow` shows the cause as well.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate file could not be read.
    #[error("cannot read certificates from {}", path.display())]
    ReadCerts {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// A certificate does not parse.
    #[error("bad certificate in {what}")]
    BadCert {
        /// The file or text it is in.
        what: String,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// There is no certificate.
    #[error("{what}: no certificates")]
    NoCerts {
        /// The file or text.
        what: String,
    },
    /// A private key file could not be read.
    #[error("cannot read a private key from {}", path.display())]
    ReadKey {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// A CA certificate parses but cannot be a trust root.
    #[error("unusable CA certificate in {what}")]
    UnusableCa {
        /// The file or text it is in.
        what: String,
        /// Why.
        source: rustls::Error,
    },
    /// A CA file could not be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The provider offers no safe protocol version.
    #[error("TLS protocol versions")]
    Versions(#[source] rustls::Error),
    /// The client CA cannot verify clients.
    #[error("client CA {}", path.display())]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls::server::VerifierBuilderError,
    },
    /// The certificate does not match the key.
    #[error("certificate and key do not form a valid identity")]
    Identity(#[source] rustls::Error),
}

/// The one crypto provider of both planes (aws-lc-rs).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A certificate chain and its private key from PEM files.
pub fn identity(cert: &Path, key: &Path) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|source| TlsError::ReadCerts { path: cert.to_owned(), source })?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCert { what: cert.display().to_string(), source })?;
    if certs.is_empty() {
        return Err(TlsError::NoCerts { what: cert.display().to_string() });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::ReadKey { path: key.to_owned(), source })?;
    Ok((certs, key))
}

/// The certificates of PEM text `pem` (named `what` in errors) as trust roots.
pub fn roots_pem(pem: &[u8], what: &str) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        roots
            .add(cert.map_err(|source| TlsError::BadCert { what: what.to_owned(), source })?)
            .map_err(|source| TlsError::UnusableCa { what: what.to_owned(), source })?;
    }
    if roots.is_empty() {
        return Err(TlsError::NoCerts { what: what.to_owned() });
    }
    Ok(roots)
}

/// The certificates of the PEM file `ca` as trust roots.
pub fn roots(ca: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let pem = std::fs::read(ca).map_err(|source| TlsError::Read { path: ca.to_owned(), source })?;
    roots_pem(&pem, &ca.display().to_string())
}

/// The server side: the certificate chain and key in PEM files, offering `alpn`; with
/// `client_ca` (PEM), a client certificate signed by it is required.
pub fn server_config(
    cert: &Path,
    key: &Path,
    alpn: &[&[u8]],
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let (certs, key) = identity(cert, key)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                    .build()
                    .map_err(|source| TlsError::ClientCa { path: ca.to_owned(), source })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(TlsError::Identity)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A client trusting the certificates in `ca` (PEM) for `https://` URLs; without one,
/// `https://` URLs are refused at connect (there is no implicit trust store).
pub fn client(ca: Option<&Path>) -> Result<ControlClient, TlsError> {
    let roots = match ca {
        Some(ca) => roots(ca)?,
        None => rustls::RootCertStore::empty(),
    };
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let https =
        hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http1().build();
    Ok(Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(90))
        .build(https))
}
