//! Connections to backends: pooled keep-alive clients, one per connect timeout and
//! cluster transport (HTTP/1.1 or HTTP/2, plain or TLS with the node's client
//! certificate), kept across snapshot reloads; hyper pools by endpoint inside each.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use http::Uri;

use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::body::UpstreamBody;

/// A pooled HTTP client for backends (`http://` or `https://` endpoints).
pub type Client = hyper_util::client::legacy::Client<HttpsConnector<Counting>, UpstreamBody>;

/// Open connections to backends by host (`host:port`), counted by the connector when a
/// connection opens and when it closes: never per request.
#[derive(Debug, Default)]
pub struct Conns(std::sync::Mutex<HashMap<String, Arc<AtomicU64>>>);

impl Conns {
    fn counter(&self, authority: &str) -> Arc<AtomicU64> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(authority) {
            return c.clone();
        }
        let c = Arc::new(AtomicU64::new(0));
        map.insert(authority.to_owned(), c.clone());
        c
    }

    /// Connections open to `authority` now.
    pub fn open(&self, authority: &str) -> u64 {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(authority).map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// hyper-util's TCP connector, counting the connections it opens in [`Conns`].
#[derive(Debug, Clone)]
pub struct Counting {
    inner: HttpConnector,
    conns: Arc<Conns>,
}

type Tcp = hyper_util::rt::TokioIo<tokio::net::TcpStream>;

impl tower_service::Service<Uri> for Counting {
    type Response = Counted;
    type Error = <HttpConnector as tower_service::Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Counted, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
        let counter = self.conns.counter(&format!("{}:{port}", uri.host().unwrap_or_default()));
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(Counted { io, counter })
        })
    }
}

/// A backend connection, counted while it is open.
#[derive(Debug)]
pub struct Counted {
    io: Tcp,
    counter: Arc<AtomicU64>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::Relaxed);
    }
}

impl hyper::rt::Read for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl hyper_util::client::legacy::connect::Connection for Counted {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.io.connected()
    }
}

/// How the gateway speaks to a cluster's hosts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Transport {
    /// HTTP/2 (h2 over TLS, else h2c with prior knowledge) instead of HTTP/1.1.
    pub http2: bool,
    /// TLS with this cluster's CA and name.
    pub tls: Option<postern_model::ClusterTls>,
}

/// The node's client certificate for TLS to backends (mTLS).
#[derive(Debug)]
pub struct Identity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    /// The certificate chain and key in PEM files.
    pub fn load(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<Identity> {
        let (certs, key) = postern_model::tls::identity(cert, key)?;
        Ok(Identity { certs, key })
    }
}

/// Clients by connect timeout and transport.
#[derive(Debug, Default)]
pub struct Clients {
    clients: HashMap<(Duration, Transport), Client>,
    identity: Option<Arc<Identity>>,
    /// Open connections by backend host, across every client.
    pub conns: Arc<Conns>,
}

impl Clients {
    /// Clients that present `identity` to TLS backends.
    pub fn with_identity(identity: Option<Arc<Identity>>) -> Clients {
        Clients { clients: HashMap::new(), identity, conns: Arc::default() }
    }

    /// The client with this connect timeout and transport, made on first use.
    pub fn get(&mut self, connect_timeout: Duration, transport: &Transport) -> Result<Client, String> {
        let key = (connect_timeout, transport.clone());
        if let Some(c) = self.clients.get(&key) {
            return Ok(c.clone());
        }
        let client = build(connect_timeout, transport, self.identity.as_deref(), &self.conns)?;
        self.clients.insert(key, client.clone());
        Ok(client)
    }
}

fn build(
    connect_timeout: Duration,
    transport: &Transport,
    identity: Option<&Identity>,
    conns: &Arc<Conns>,
) -> Result<Client, String> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    connector.enforce_http(false);
    let connector = Counting { inner: connector, conns: conns.clone() };
    let roots = match &transport.tls {
        Some(t) => {
            postern_model::tls::roots_pem(t.ca_pem.as_bytes(), "the cluster's CA").map_err(|e| format!("{e:#}"))?
        }
        None => rustls::RootCertStore::empty(),
    };
    let config = rustls::ClientConfig::builder_with_provider(postern_model::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_root_certificates(roots);
    let config = match identity {
        Some(id) if transport.tls.is_some() => config
            .with_client_auth_cert(id.certs.clone(), id.key.clone_key())
            .map_err(|e| format!("the node's client certificate: {e}"))?,
        _ => config.with_no_client_auth(),
    };
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http();
    let builder = match transport.tls.as_ref().and_then(|t| t.server_name.as_deref()) {
        Some(name) => {
            let name = ServerName::try_from(name.to_owned()).map_err(|e| format!("server name {name:?}: {e}"))?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let https = if transport.http2 {
        builder.enable_http2().wrap_connector(connector)
    } else {
        builder.enable_http1().wrap_connector(connector)
    };
    let mut client = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    client
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        // As the listeners' (`server::http_builder`): a backend connection's read buffer
        // stops at 64 KiB instead of hyper's ~400 KiB, so a large response streams
        // through in small chunks.
        .http1_max_buf_size(64 * 1024);
    if transport.http2 {
        client
            .http2_only(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .http2_keep_alive_timeout(Duration::from_secs(10));
    }
    Ok(client.build(https))
}

/// A request's place in its cluster's cap on requests in flight; given back on drop.
#[derive(Debug)]
pub struct Permit(Arc<AtomicU32>);

impl Permit {
    /// A place under `max` in `gate`, or `None` when the cluster is at its cap.
    pub fn take(gate: &Arc<AtomicU32>, max: u32) -> Option<Permit> {
        if gate.fetch_add(1, Ordering::Relaxed) >= max {
            gate.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Permit(gate.clone()))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
