//! Connections to backends. A [`Client`] opens them (one per connect timeout and
//! cluster transport: HTTP/1.1 or HTTP/2, plain or TLS with the node's client
//! certificate); a [`HostPool`] keeps one host's idle ones (one per transport and host,
//! kept across snapshot reloads). A cluster holds its hosts' pools by the same index as
//! its hosts, so a request takes a connection with one uncontended lock and no hashing.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use http::uri::Authority;
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::request::body::UpstreamBody;

/// How long a connection may wait idle in its pool before it is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// The most idle connections a pool keeps to one host.
const MAX_IDLE: usize = 1024;

/// Why an exchange with a backend failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection: the connector (TCP, its timeout, TLS) or the protocol's handshake
    /// failed. The request was not sent.
    #[error("connecting to the backend")]
    Connect(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The exchange failed once under way (the request, or part of it, may have gone).
    #[error("the exchange with the backend failed")]
    Send(#[source] hyper::Error),
}

impl Error {
    /// Whether no connection could be made.
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect(_))
    }
}

/// The sending half of a backend connection; its connection runs in a task of its own.
enum Sender {
    H1(http1::SendRequest<UpstreamBody>),
    H2(http2::SendRequest<UpstreamBody>),
}

impl Sender {
    fn is_ready(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_ready(),
            Sender::H2(s) => s.is_ready(),
        }
    }
}

/// One host's idle connections over one transport. HTTP/1.1 connections wait here one
/// per exchange, the most recently used on top; an HTTP/2 connection is shared by every
/// exchange and stays here while it is open.
pub struct HostPool {
    /// `scheme://host:port`, what the connector dials.
    dst: Uri,
    http2: bool,
    idle: Mutex<Vec<(Sender, Instant)>>,
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool").field("dst", &self.dst).field("http2", &self.http2).finish_non_exhaustive()
    }
}

impl HostPool {
    fn new(dst: Uri, http2: bool) -> HostPool {
        HostPool { dst, http2, idle: Mutex::new(Vec::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Sender, Instant)>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready connection, if one waits: HTTP/1.1's most recent (closed ones are
    /// dropped on the way), or the shared HTTP/2 one.
    fn checkout(&self) -> Option<Sender> {
        let mut idle = self.lock();
        if self.http2 {
            match idle.last() {
                Some((Sender::H2(s), _)) if s.is_ready() => return Some(Sender::H2(s.clone())),
                Some(_) => idle.clear(),
                None => {}
            }
            return None;
        }
        while let Some((s, _)) = idle.pop() {
            if s.is_ready() {
                return Some(s);
            }
        }
        None
    }

    /// Puts an idle HTTP/1.1 connection back (or a new HTTP/2 one in place of the
    /// shared one); past [`MAX_IDLE`] the oldest closes.
    fn put(&self, s: Sender) {
        let now = Instant::now();
        let mut idle = self.lock();
        let old = if !idle.is_empty() && (self.http2 || idle.len() >= MAX_IDLE) { Some(idle.remove(0)) } else { None };
        idle.push((s, now));
        drop(idle);
        // Closed outside the lock.
        drop(old);
    }

    /// Closes the HTTP/1.1 connections idle since before `now - IDLE_TIMEOUT` (the oldest
    /// are at the bottom). A shared HTTP/2 connection stays while it is open.
    fn close_idle(&self, now: Instant) {
        if self.http2 {
            return;
        }
        let mut idle = self.lock();
        let stale = idle.iter().take_while(|(_, at)| now.saturating_duration_since(*at) >= IDLE_TIMEOUT).count();
        let closing: Vec<(Sender, Instant)> = idle.drain(..stale).collect();
        drop(idle);
        drop(closing);
    }

    /// Gives an HTTP/1.1 connection back once its exchange is over: now if it already
    /// is, else when the response body has been read (a small task waits for it). A
    /// connection whose body was not read to the end closes instead.
    fn give_back(self: &Arc<Self>, mut s: http1::SendRequest<UpstreamBody>) {
        if s.is_ready() {
            self.put(Sender::H1(s));
            return;
        }
        let pool = self.clone();
        tokio::spawn(async move {
            if s.ready().await.is_ok() {
                pool.put(Sender::H1(s));
            }
        });
    }
}

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

impl Transport {
    /// The scheme of the hosts' URIs: `https` with TLS, else `http`.
    pub fn scheme(&self) -> http::uri::Scheme {
        if self.tls.is_some() { http::uri::Scheme::HTTPS } else { http::uri::Scheme::HTTP }
    }
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

/// Opens connections to a cluster's hosts with one connect timeout and transport, and
/// sends requests over them (taken from, and given back to, the host's [`HostPool`]).
#[derive(Clone)]
pub struct Client {
    connector: HttpsConnector<Counting>,
    h1: http1::Builder,
    h2: Option<http2::Builder<TokioExecutor>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("http2", &self.h2.is_some()).finish_non_exhaustive()
    }
}

impl Client {
    /// Sends `req` (its URI absolute: the host's scheme and authority) to the host whose
    /// pool is `pool`, over an idle connection or a new one. A request an idle
    /// connection gave back unsent (the backend had just closed it) goes out again on
    /// another; a failure on a new connection is final.
    pub async fn send(
        &self,
        pool: &Arc<HostPool>,
        mut req: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, Error> {
        if self.h2.is_none() {
            // HTTP/1.1 asks in origin form; the `Host` header names the host.
            let pq = req.uri().path_and_query().cloned().unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
            *req.uri_mut() = Uri::from(pq);
        }
        loop {
            let (sender, reused) = match pool.checkout() {
                Some(s) => (s, true),
                // Boxed: a connection is made rarely, and its future (TLS, the HTTP/2
                // handshake) would otherwise make every request's future larger.
                None => (Box::pin(self.connect(pool)).await?, false),
            };
            let mut refused = match sender {
                Sender::H1(mut s) => match s.try_send_request(req).await {
                    Ok(resp) => {
                        pool.give_back(s);
                        return Ok(resp);
                    }
                    Err(e) => e,
                },
                Sender::H2(mut s) => match s.try_send_request(req).await {
                    Ok(resp) => return Ok(resp),
                    Err(e) => e,
                },
            };
            match refused.take_message() {
                Some(r) if reused => req = r,
                _ => return Err(Error::Send(refused.into_error())),
            }
        }
    }

    /// A new connection to the pool's host, its task started; an HTTP/2 one is shared
    /// through the pool from now on.
    async fn connect(&self, pool: &Arc<HostPool>) -> Result<Sender, Error> {
        use tower_service::Service;
        let mut connector = self.connector.clone();
        let io = connector.call(pool.dst.clone()).await.map_err(Error::Connect)?;
        let handshake = |e: hyper::Error| Error::Connect(Box::new(e));
        match &self.h2 {
            Some(h2) => {
                let (mut s, conn) = h2.handshake(io).await.map_err(handshake)?;
                tokio::spawn(run(conn));
                s.ready().await.map_err(handshake)?;
                pool.put(Sender::H2(s.clone()));
                Ok(Sender::H2(s))
            }
            None => {
                let (mut s, conn) = self.h1.handshake(io).await.map_err(handshake)?;
                tokio::spawn(run(conn));
                s.ready().await.map_err(handshake)?;
                Ok(Sender::H1(s))
            }
        }
    }
}

/// Runs a backend connection until it closes.
async fn run<C: Future<Output = hyper::Result<()>>>(conn: C) {
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "a backend connection closed on an error");
    }
}

/// Clients by connect timeout and transport, and hosts' pools by transport and host.
#[derive(Debug, Default)]
pub struct Clients {
    clients: HashMap<(Duration, Transport), Client>,
    pools: HashMap<(Transport, Authority), Arc<HostPool>>,
    identity: Option<Arc<Identity>>,
    /// Open connections by backend host, across every client.
    pub conns: Arc<Conns>,
}

impl Clients {
    /// Clients that present `identity` to TLS backends.
    pub fn with_identity(identity: Option<Arc<Identity>>) -> Clients {
        Clients { identity, ..Clients::default() }
    }

    /// The client with this connect timeout and transport, made on first use.
    pub fn get(&mut self, connect_timeout: Duration, transport: &Transport) -> Result<Client, ClientError> {
        let key = (connect_timeout, transport.clone());
        if let Some(c) = self.clients.get(&key) {
            return Ok(c.clone());
        }
        let client = build(connect_timeout, transport, self.identity.as_deref(), &self.conns)?;
        self.clients.insert(key, client.clone());
        Ok(client)
    }

    /// The pool of `host`'s connections over `transport`, made on first use and kept
    /// while a snapshot uses it.
    pub fn pool(&mut self, transport: &Transport, host: &Authority) -> Arc<HostPool> {
        let key = (transport.clone(), host.clone());
        if let Some(p) = self.pools.get(&key) {
            return p.clone();
        }
        let mut dst = http::uri::Parts::default();
        dst.scheme = Some(transport.scheme());
        dst.authority = Some(host.clone());
        dst.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        // A scheme, an authority and a path always make a URI.
        let dst = Uri::from_parts(dst).unwrap_or_default();
        let pool = Arc::new(HostPool::new(dst, transport.http2));
        self.pools.insert(key, pool.clone());
        pool
    }

    /// Closes every pool's connections idle for longer than the idle timeout (90 s).
    pub fn close_idle(&self) {
        let now = Instant::now();
        for pool in self.pools.values() {
            pool.close_idle(now);
        }
    }

    /// Forgets the pools no snapshot uses any more (their idle connections close when
    /// the last snapshot that used them goes).
    pub fn forget_unused_pools(&mut self) {
        self.pools.retain(|_, p| Arc::strong_count(p) > 1);
    }
}

/// Why a client for a cluster's transport cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The cluster's CA certificates are not usable (shown with their cause).
    #[error("{}", with_causes(.0))]
    Roots(postern_model::tls::TlsError),
    /// The provider offers no safe protocol version.
    #[error("TLS protocol versions: {0}")]
    Versions(#[source] rustls::Error),
    /// The node's client certificate is not usable.
    #[error("the node's client certificate: {0}")]
    ClientCert(#[source] rustls::Error),
    /// The cluster's server name is not a DNS name or address.
    #[error("server name {name:?}: {source}")]
    ServerName {
        /// As configured.
        name: String,
        /// Why.
        source: rustls_pki_types::InvalidDnsNameError,
    },
}

/// An error and its causes, `outer: inner: …`.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

fn build(
    connect_timeout: Duration,
    transport: &Transport,
    identity: Option<&Identity>,
    conns: &Arc<Conns>,
) -> Result<Client, ClientError> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    connector.enforce_http(false);
    let connector = Counting { inner: connector, conns: conns.clone() };
    let roots = match &transport.tls {
        Some(t) => {
            postern_model::tls::roots_pem(t.ca_pem.as_bytes(), "the cluster's CA").map_err(ClientError::Roots)?
        }
        None => rustls::RootCertStore::empty(),
    };
    let config = rustls::ClientConfig::builder_with_provider(postern_model::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(ClientError::Versions)?
        .with_root_certificates(roots);
    let config = match identity {
        Some(id) if transport.tls.is_some() => {
            config.with_client_auth_cert(id.certs.clone(), id.key.clone_key()).map_err(ClientError::ClientCert)?
        }
        _ => config.with_no_client_auth(),
    };
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http();
    let builder = match transport.tls.as_ref().and_then(|t| t.server_name.as_deref()) {
        Some(name) => {
            let name = ServerName::try_from(name.to_owned())
                .map_err(|source| ClientError::ServerName { name: name.to_owned(), source })?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let connector = if transport.http2 {
        builder.enable_http2().wrap_connector(connector)
    } else {
        builder.enable_http1().wrap_connector(connector)
    };
    let mut h1 = http1::Builder::new();
    // As the listeners' (`node::listen::http_builder`): a backend connection's read buffer
    // stops at 64 KiB instead of hyper's ~400 KiB, so a large response streams through
    // in small chunks.
    h1.max_buf_size(64 * 1024);
    let h2 = transport.http2.then(|| {
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        h2
    });
    Ok(Client { connector, h1, h2 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::AtomicUsize;

    /// A backend on 127.0.0.1 answering `ok` over HTTP/1.1 or HTTP/2 (h2c), counting the
    /// connections it accepts; `close_after_one` closes each connection after one answer.
    async fn backend(http2: bool, close_after_one: bool) -> (Authority, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let io = hyper_util::rt::TokioIo::new(stream);
                let svc = hyper::service::service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(bytes::Bytes::from(
                        "ok",
                    ))))
                });
                tokio::spawn(async move {
                    if http2 {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, svc)
                            .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .keep_alive(!close_after_one)
                            .serve_connection(io, svc)
                            .await;
                    }
                });
            }
        });
        (addr.to_string().parse().unwrap(), accepted)
    }

    /// Connections to `host` (over h2c when `http2`): the clients, their client and the
    /// host's pool.
    fn to(host: &Authority, http2: bool) -> (Clients, Client, Arc<HostPool>) {
        let mut clients = Clients::default();
        let transport = Transport { http2, tls: None };
        let client = clients.get(Duration::from_secs(1), &transport).unwrap();
        let pool = clients.pool(&transport, host);
        (clients, client, pool)
    }

    fn get(host: &Authority) -> Request<UpstreamBody> {
        let mut req = Request::get(format!("http://{host}/x?y=1")).body(UpstreamBody::Full(None)).unwrap();
        req.headers_mut().insert(http::header::HOST, http::HeaderValue::from_str(host.as_str()).unwrap());
        req
    }

    /// Waits up to a second for `done` (a connection's task runs on its own).
    async fn until(done: impl Fn() -> bool) {
        for _ in 0..200 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn body(resp: Response<Incoming>) -> bytes::Bytes {
        resp.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn an_http1_connection_is_reused_once_its_answer_is_read() {
        let (host, accepted) = backend(false, false).await;
        let (clients, client, pool) = to(&host, false);
        for _ in 0..5 {
            let resp = client.send(&pool, get(&host)).await.unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(body(resp).await, "ok");
            // The connection goes back once its task has seen the answer's end.
            until(|| !pool.lock().is_empty()).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for five exchanges");
        assert_eq!(clients.conns.open(host.as_str()), 1);

        // Two at once need two connections; both are kept.
        let (a, b) = tokio::join!(client.send(&pool, get(&host)), client.send(&pool, get(&host)));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!((body(a).await, body(b).await), (bytes::Bytes::from("ok"), bytes::Bytes::from("ok")));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_the_backend_closed_is_not_taken_again() {
        let (host, accepted) = backend(false, true).await;
        let (clients, client, pool) = to(&host, false);
        for i in 1..=3 {
            let resp = client.send(&pool, get(&host)).await.unwrap();
            assert_eq!(body(resp).await, "ok");
            assert_eq!(accepted.load(Ordering::SeqCst), i, "a new connection for each exchange");
        }
        // The closed ones are gone from the count once their tasks end.
        until(|| clients.conns.open(host.as_str()) == 0).await;
        assert_eq!(clients.conns.open(host.as_str()), 0);
    }

    #[tokio::test]
    async fn http2_exchanges_share_one_connection() {
        let (host, accepted) = backend(true, false).await;
        let (_clients, client, pool) = to(&host, true);
        let first = client.send(&pool, get(&host)).await.unwrap();
        assert_eq!(body(first).await, "ok");
        let sends: Vec<_> = (0..20).map(|_| client.send(&pool, get(&host))).collect();
        for resp in futures_util::future::join_all(sends).await {
            assert_eq!(body(resp.unwrap()).await, "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "21 exchanges over one HTTP/2 connection");
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (host, _) = backend(false, false).await;
        let (clients, client, pool) = to(&host, false);
        let (a, b) = tokio::join!(client.send(&pool, get(&host)), client.send(&pool, get(&host)));
        let _ = (body(a.unwrap()).await, body(b.unwrap()).await);
        until(|| pool.lock().len() == 2).await;
        assert_eq!(pool.lock().len(), 2);
        pool.close_idle(Instant::now() + IDLE_TIMEOUT - Duration::from_secs(1));
        assert_eq!(pool.lock().len(), 2, "not yet");
        clients.close_idle();
        assert_eq!(pool.lock().len(), 2, "not yet");
        pool.close_idle(Instant::now() + IDLE_TIMEOUT);
        assert!(pool.lock().is_empty());
        until(|| clients.conns.open(host.as_str()) == 0).await;
        assert_eq!(clients.conns.open(host.as_str()), 0, "the connections are closed");
    }

    #[test]
    fn a_pool_is_kept_while_a_snapshot_uses_it() {
        let mut clients = Clients::default();
        let transport = Transport::default();
        let host: Authority = "127.0.0.1:1".parse().unwrap();
        let used = clients.pool(&transport, &host);
        assert!(Arc::ptr_eq(&used, &clients.pool(&transport, &host)), "the same host's pool again");
        let other = Transport { http2: true, tls: None };
        assert!(!Arc::ptr_eq(&used, &clients.pool(&other, &host)), "another transport, another pool");
        clients.forget_unused_pools();
        assert_eq!(clients.pools.len(), 1, "only the pool still in use is kept");
        drop(used);
        clients.forget_unused_pools();
        assert!(clients.pools.is_empty());
    }
}
