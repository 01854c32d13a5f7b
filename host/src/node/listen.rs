//! The listeners: one per pool (plain HTTP/1.1 + h2c, or TLS with ALPN h2/http1.1) and
//! the admin listener; connection caps per listener and per source address, and a
//! watchdog on each connection (first request within the handshake timeout; closed when
//! idle).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use postern_model::Pool;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::gateway::Gateway;
use crate::metrics::Metrics;
use crate::node::args::Args;
use crate::request::conn::ConnInfo;

/// Limits on client connections, from [`Args`].
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Per listener.
    pub max: usize,
    /// Per source address and listener.
    pub max_per_ip: u32,
    /// Accept to first request head.
    pub handshake: Duration,
    /// No request in flight and no bytes moving.
    pub idle: Duration,
    /// The send bound: an answer the client takes nothing of.
    pub send: Duration,
    /// A client's share of a busy cluster.
    pub shares: crate::request::conn::Shares,
}

impl ConnLimits {
    /// The limits the command line sets.
    pub fn from_args(a: &Args) -> ConnLimits {
        ConnLimits {
            max: a.max_connections.max(1),
            max_per_ip: a.max_connections_per_ip.max(1),
            handshake: Duration::from_secs(a.handshake_timeout_s.max(1)),
            idle: Duration::from_secs(a.idle_timeout_s.max(1)),
            send: Duration::from_secs(a.downstream_idle_timeout_s.max(1)),
            shares: crate::request::conn::Shares {
                connection: a.client_share_percent,
                address: a.address_share_percent,
            },
        }
    }
}

/// The listeners' settings: addresses, TLS, connection caps and trusted hops.
#[derive(Debug, Clone)]
pub struct ListenSettings {
    public: SocketAddr,
    partner: SocketAddr,
    admin: SocketAddr,
    backlog: u32,
    /// Certificate chain and key (PEM) of both pools.
    tls: Option<(PathBuf, PathBuf)>,
    limits: ConnLimits,
    trusted_hops: Vec<String>,
    /// Where the bound ports are written.
    ports_file: Option<PathBuf>,
}

impl ListenSettings {
    /// The settings the command line gives.
    pub fn from_args(a: &Args) -> ListenSettings {
        ListenSettings {
            public: a.public,
            partner: a.partner,
            admin: a.admin,
            backlog: a.listen_backlog,
            tls: a.tls_cert.clone().zip(a.tls_key.clone()),
            limits: ConnLimits::from_args(a),
            trusted_hops: a.trusted_hops.clone(),
            ports_file: a.ports_file.clone(),
        }
    }

    /// Loads the TLS identity, binds the three listeners and writes their ports.
    pub fn bind(self) -> anyhow::Result<Listeners> {
        use anyhow::Context as _;
        let tls = self.tls.as_ref().map(|(c, k)| load_tls(c, k)).transpose()?;
        let listen = |addr: SocketAddr| {
            postern_model::net::listen(addr, self.backlog).with_context(|| format!("cannot listen on {addr}"))
        };
        let (public, partner, admin) = (listen(self.public)?, listen(self.partner)?, listen(self.admin)?);
        let (pa, pb, ad) = (public.local_addr()?, partner.local_addr()?, admin.local_addr()?);
        tracing::info!(public = %pa, partner = %pb, admin = %ad, tls = tls.is_some(), "listening");
        if let Some(p) = &self.ports_file {
            let json = serde_json::json!({"public": pa.port(), "partner": pb.port(), "admin": ad.port()});
            postern_model::disk::write_atomic(p, json.to_string().as_bytes())?;
        }
        let hops = Arc::new(crate::request::forwarded::Hops::parse(&self.trusted_hops)?);
        if !hops.is_empty() {
            tracing::info!(hops = ?self.trusted_hops, "X-Forwarded-For kept from trusted hops");
        }
        Ok(Listeners { public, partner, admin, tls, limits: self.limits, hops })
    }
}

/// The bound listeners, until their accept loops start.
pub struct Listeners {
    public: TcpListener,
    partner: TcpListener,
    admin: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    hops: Arc<crate::request::forwarded::Hops>,
}

impl Listeners {
    /// Starts the accept loops of both pools and the admin listener, until `stop`.
    pub fn spawn(self, gw: &Arc<Gateway>, stop: &watch::Receiver<bool>) -> [tokio::task::JoinHandle<()>; 3] {
        let Listeners { public, partner, admin, tls, limits, hops } = self;
        [
            tokio::spawn(accept_loop(
                gw.clone(),
                public,
                Pool::Public,
                tls.clone(),
                limits,
                hops.clone(),
                stop.clone(),
            )),
            tokio::spawn(accept_loop(gw.clone(), partner, Pool::Partner, tls, limits, hops, stop.clone())),
            tokio::spawn(admin_loop(gw.clone(), admin, stop.clone())),
        ]
    }
}

/// A listener's open connections, in all and per source address (with the address's
/// backend requests in flight, for its share of a busy cluster).
#[derive(Debug, Default)]
struct Slots {
    open: std::sync::atomic::AtomicUsize,
    per_ip: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, (u32, Arc<AtomicU32>)>>,
}

/// One connection's place in its listener's [`Slots`], given back on drop.
struct Slot {
    slots: Arc<Slots>,
    ip: std::net::IpAddr,
    /// The address's backend requests in flight.
    held: Arc<AtomicU32>,
}

impl Slots {
    /// A slot for a connection from `ip`, or `None` when a cap is reached. Taken at
    /// accept and given back at close, never per request.
    fn take(self: &Arc<Self>, ip: std::net::IpAddr, limits: &ConnLimits) -> Option<Slot> {
        if self.open.fetch_add(1, Ordering::Relaxed) >= limits.max {
            self.open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let (n, held) = map.entry(ip).or_default();
        if *n >= limits.max_per_ip {
            drop(map);
            self.open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        *n += 1;
        let held = held.clone();
        Some(Slot { slots: self.clone(), ip, held })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = self.slots.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((n, _)) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
        drop(map);
        self.slots.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection's watchdog reads: requests in flight, whether one was ever seen,
/// and bytes moved (counted by [`Watched`], without reading a clock).
#[derive(Debug, Default)]
struct Activity {
    inflight: std::sync::atomic::AtomicU32,
    seen: std::sync::atomic::AtomicBool,
    bytes: AtomicU64,
}

/// A request in flight on a connection, for its [`Activity`]; ends on drop (also when
/// the client resets the stream).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(a: &Arc<Activity>) -> InFlight {
        a.seen.store(true, Ordering::Relaxed);
        a.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's I/O, counting the bytes it moves for the idle watchdog.
struct Watched<IO> {
    inner: IO,
    activity: Arc<Activity>,
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<IO> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        this.activity.bytes.fetch_add((buf.filled().len() - before) as u64, Ordering::Relaxed);
        r
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<IO> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            this.activity.bytes.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            this.activity.bytes.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Idle ticks a connection may stay quiet for: it is closed after 3/4 to 4/4 of the
/// idle timeout without bytes or requests.
const IDLE_TICKS: u32 = 4;

pub(crate) fn load_tls(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    Ok(TlsAcceptor::from(postern_model::tls::server_config(cert, key, &[b"h2", b"http/1.1"], None)?))
}

/// HTTP/1 and HTTP/2 settings of every client connection, each set explicitly
/// (docs/security.md lists them with the abuse each bounds).
fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        // A head must arrive whole within 10 s of hyper waiting for it: slow heads, and
        // the wait between keep-alive requests.
        .header_read_timeout(Duration::from_secs(10))
        .max_buf_size(64 * 1024)
        .max_headers(100)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        // Header blocks (CONTINUATION frames included) stop at 64 KiB.
        .max_header_list_size(64 * 1024)
        // Rapid reset: streams reset before they are accepted, and resets the gateway
        // had to send for a client's protocol errors, are bounded; past them, GOAWAY.
        .max_pending_accept_reset_streams(Some(20))
        .max_local_error_reset_streams(Some(256))
        // What a client that stops reading can make the gateway hold: 64 KiB per stream.
        .max_send_buf_size(64 * 1024)
        // What a client may send ahead of the backend reading it.
        .initial_stream_window_size(256 * 1024)
        .initial_connection_window_size(1024 * 1024)
        .max_frame_size(16 * 1024)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    b
}

/// Runs one connection to its end under its watchdog: closed when no first request
/// arrives within the handshake timeout, or when it idles (no request in flight, no
/// bytes moving) for the idle timeout; drained gracefully on shutdown; dropped at once,
/// with every backend request of its streams, when an answer waited on the client
/// through the send bound. A macro because the connection's type differs with its stack
/// (TLS or not, HTTP/1 checked or not).
macro_rules! drive {
    ($conn:expr, $activity:expr, $info:expr, $limits:expr, $stop:expr, $metrics:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let (activity, limits, metrics): (&Activity, &ConnLimits, &Metrics) = (&$activity, &$limits, &$metrics);
        let info: &ConnInfo = &$info;
        let send_period = limits.send / u32::from(crate::request::conn::SEND_TICKS);
        let mut send_tick = tokio::time::interval_at(tokio::time::Instant::now() + send_period, send_period);
        let mut stop = $stop;
        let first = tokio::time::sleep(limits.handshake);
        tokio::pin!(first);
        let period = limits.idle / IDLE_TICKS;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let (mut quiet, mut last) = (0u32, 0u64);
        let (mut closing, mut first_done) = (false, false);
        loop {
            tokio::select! {
                r = conn.as_mut() => break r,
                // A branch's condition is read when this `select!` starts, which may be
                // long before the deadline: whether a request came is judged on firing.
                _ = &mut first, if !closing && !first_done => {
                    first_done = true;
                    if !activity.seen.load(Ordering::Relaxed) {
                        metrics.connections_timed_out.fetch_add(1, Ordering::Relaxed);
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
                _ = tick.tick(), if !closing => {
                    let bytes = activity.bytes.load(Ordering::Relaxed);
                    if bytes != last || activity.inflight.load(Ordering::Relaxed) > 0 {
                        (quiet, last) = (0, bytes);
                    } else {
                        quiet += 1;
                        if quiet >= IDLE_TICKS {
                            metrics.connections_timed_out.fetch_add(1, Ordering::Relaxed);
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                    }
                }
                _ = stop.changed(), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
                _ = send_tick.tick() => {
                    if info.sending.tick() {
                        metrics.connections_stalled.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(peer = %info.peer, "an answer waited on its client for the send bound; closed");
                        break Ok(());
                    }
                }
            }
        }
    }};
}

#[allow(clippy::too_many_arguments)]
async fn serve_conn(
    gw: Arc<Gateway>,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    stream: TcpStream,
    info: Arc<ConnInfo>,
    limits: ConnLimits,
    slot: Slot,
    stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let metrics = gw.metrics.clone();
    metrics.connections.fetch_add(1, Ordering::Relaxed);
    let activity = Arc::new(Activity::default());
    let stream = Watched { inner: stream, activity: activity.clone() };
    let act = activity.clone();
    let watched = info.clone();
    let svc = service_fn(move |req| {
        let gw = gw.clone();
        let info = info.clone();
        let inflight = InFlight::start(&act);
        async move {
            let resp = crate::request::proxy::handle(gw, info, req).await;
            drop(inflight);
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    let result = match tls {
        None => {
            let io = TokioIo::new(crate::request::framing::Strict::new(stream));
            drive!(builder.serve_connection(io, svc).into_owned(), activity, watched, limits, stop, metrics)
        }
        Some(acceptor) => match tokio::time::timeout(limits.handshake, acceptor.accept(stream)).await {
            Ok(Ok(tls_stream)) => {
                if tls_stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                    let io = TokioIo::new(tls_stream);
                    drive!(builder.serve_connection(io, svc).into_owned(), activity, watched, limits, stop, metrics)
                } else {
                    let io = TokioIo::new(crate::request::framing::Strict::new(tls_stream));
                    drive!(builder.serve_connection(io, svc).into_owned(), activity, watched, limits, stop, metrics)
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                Ok(())
            }
            Err(_) => {
                metrics.connections_timed_out.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        },
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
    drop(slot);
    metrics.connections.fetch_sub(1, Ordering::Relaxed);
}

pub(crate) async fn accept_loop(
    gw: Arc<Gateway>,
    listener: TcpListener,
    pool: Pool,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    hops: Arc<crate::request::forwarded::Hops>,
    mut stop: watch::Receiver<bool>,
) {
    let builder = http_builder();
    let slots = Arc::new(Slots::default());
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, pool = pool.as_str(), "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let Some(slot) = slots.take(peer.ip(), &limits) else {
            gw.metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(peer = %peer, pool = pool.as_str(), "connection cap reached; closed at accept");
            drop(stream);
            continue;
        };
        let info = Arc::new(ConnInfo::new(pool, peer, tls.is_some(), &hops, limits.shares, slot.held.clone()));
        tokio::spawn(serve_conn(gw.clone(), builder.clone(), tls.clone(), stream, info, limits, slot, stop.clone()));
    }
}

pub(crate) async fn admin_loop(gw: Arc<Gateway>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let builder = http_builder();
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let gw = gw.clone();
        let builder = builder.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let gw = gw.clone();
                async move { Ok::<_, std::convert::Infallible>(crate::node::admin::handle(gw, req).await) }
            });
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}
