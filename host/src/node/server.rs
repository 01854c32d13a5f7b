//! Listeners and process lifecycle: one listener per pool (plain HTTP/1.1 + h2c, or TLS
//! with ALPN h2/http1.1), the admin listener, snapshot reloads, graceful shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use postern_model::Pool;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::node::live;
use crate::snapshot::Builder;
use crate::{gateway::Gateway, request::conn::ConnInfo};

/// Node settings (command line).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "postern", version, about = "Postern API gateway (data plane)", args_override_self = true)]
pub struct Args {
    /// Snapshot file to serve (written by `posternctl compile`); reloaded on SIGHUP and
    /// when it changes.
    #[arg(long)]
    pub snapshot: PathBuf,
    /// Public pool listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub public: SocketAddr,
    /// Partner pool listener.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub partner: SocketAddr,
    /// Admin listener (health, metrics, snapshot).
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// Connections each listener holds that the kernel has completed and the node has
    /// not yet accepted (capped by `net.core.somaxconn`). When this queue is full the
    /// kernel drops new handshakes and their clients wait a second or more to retry.
    #[arg(long, default_value_t = postern_model::net::BACKLOG)]
    pub listen_backlog: u32,
    /// PEM certificate chain: serve both pools over TLS (ALPN h2, http/1.1).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate chain the node presents to backends of clusters with `tls:`
    /// (mutual TLS), so they know the identity headers came from a gateway.
    #[arg(long, requires = "upstream_key")]
    pub upstream_cert: Option<PathBuf>,
    /// PEM private key for `--upstream-cert`.
    #[arg(long, requires = "upstream_cert")]
    pub upstream_key: Option<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Write the bound ports as JSON here once listening (for tests and scripts).
    #[arg(long)]
    pub ports_file: Option<PathBuf>,
    /// How often to check the snapshot file for changes, in milliseconds, where the
    /// system cannot report changes (otherwise they are read at once, and checked once a
    /// minute besides).
    #[arg(long, default_value_t = 1000)]
    pub watch_interval_ms: u64,
    /// Credential state (API key hashes, signing keys, apps, deny list) written by
    /// `posternctl compile`; reloaded when it changes (default: `credentials.json` beside
    /// the snapshot). Without it every authenticated route refuses its callers.
    #[arg(long)]
    pub credentials: Option<PathBuf>,
    /// Directory of compiled Wasm filter code, keyed by module and engine version
    /// (default: `wasm-cache` beside the snapshot file).
    #[arg(long)]
    pub wasm_cache: Option<PathBuf>,
    /// Wasm filter instances that may run at once.
    #[arg(long, default_value_t = 256)]
    pub wasm_instances: u32,
    /// CPU milliseconds a Wasm filter's `init` may take at snapshot build (default: the
    /// platform's deadline maximum, 50). Raise it only for a node run under a profiler
    /// such as valgrind, where everything runs tens of times slower.
    #[arg(long, value_name = "MS")]
    pub wasm_init_deadline_ms: Option<u64>,
    /// How a Wasm sandbox's memory is made fresh after each call: `copy` (restore the
    /// module's first 128 KiB in place, no system call), `scan` (the kernel reports the
    /// pages the call dirtied and only those are restored; Linux ≥ 6.7) or `decommit`
    /// (the kernel drops the pages; the next call faults in what it touches). Every way
    /// gives each call a fresh memory; which is cheapest depends on the host.
    #[arg(long, value_name = "HOW", default_value = "copy")]
    pub wasm_reset: postern_wasm::Reset,
    /// Redis for fleet-wide rate limits (`redis://host:port`; repeat, or separate with
    /// commas, for the seed nodes of a cluster). A URL with a password belongs in
    /// POSTERN_RATELIMIT_REDIS, not on the command line, where every process list shows
    /// it. Without it the node enforces every limit alone.
    #[arg(long = "ratelimit-redis", env = "POSTERN_RATELIMIT_REDIS", hide_env_values = true, value_delimiter = ',')]
    pub ratelimit_redis: Vec<String>,
    /// The `--ratelimit-redis` URLs are a Redis Cluster.
    #[arg(long)]
    pub ratelimit_cluster: bool,
    /// Prefix of the keys the fleet's rate sync writes.
    #[arg(long, default_value = "postern:rl:")]
    pub ratelimit_prefix: String,
    /// How often to sync rate limits with the fleet, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub ratelimit_sync_ms: u64,
    /// This node's name in the fleet (default: host name, process id and a random tag).
    #[arg(long)]
    pub node_id: Option<String>,
    /// Control plane to receive snapshots and credentials from (`http://host:port`). The
    /// snapshot file is still where the node boots from when the control plane is away.
    #[arg(long)]
    pub control: Option<String>,
    /// Bearer token (role `node`) for `--control`, from POSTERN_CONTROL_TOKEN (the
    /// command line shows in process lists; prefer the environment or a file).
    #[arg(long, env = "POSTERN_CONTROL_TOKEN", hide_env_values = true)]
    pub control_token: Option<String>,
    /// A file holding the bearer token for `--control` (its first line).
    #[arg(long, conflicts_with = "control_token")]
    pub control_token_file: Option<PathBuf>,
    /// This node is a canary: staged rollouts give it new snapshots first.
    #[arg(long)]
    pub control_canary: bool,
    /// How often to report the routes a rollout compares, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub control_report_ms: u64,
    /// The control plane's public signing key(s): a file of `ed25519:<hex>` lines (its
    /// `signing.pub`). Required with `--control` and `--credentials-dir`; once given,
    /// every snapshot, credentials version and delta, from the network or from disk, must
    /// be signed by one of them.
    #[arg(long, value_name = "FILE")]
    pub control_key: Option<PathBuf>,
    /// CA certificates (PEM) the certificate of an `https://` control plane is checked
    /// against.
    #[arg(long, value_name = "FILE")]
    pub control_ca: Option<PathBuf>,
    /// A directory (a shared volume or a mounted bucket) where the control plane writes
    /// its signed credentials (`posternctl serve --publish-dir`): polled as the second
    /// revocation path, for when the control plane's streams are down.
    #[arg(long, value_name = "DIR", requires = "control_key")]
    pub credentials_dir: Option<PathBuf>,
    /// How often to read `--credentials-dir`, in seconds.
    #[arg(long, default_value_t = postern_model::protocol::DROP_POLL_S)]
    pub credentials_dir_poll_s: u64,
    /// Addresses or CIDR ranges of the hops in front of this node (load balancers) whose
    /// `X-Forwarded-For` and `X-Forwarded-Proto` are kept: the client is the rightmost
    /// address in it that is not a trusted hop. From any other peer, every client-address
    /// header is replaced by the peer's address. Repeat, or separate with commas.
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    pub trusted_hops: Vec<String>,
    /// Usage spool: closed usage windows wait here, on local disk, until the control
    /// plane has applied them (default: `usage-spool` beside the snapshot). Usage is
    /// metered when this is given or `--control` is: the spool's windows are shipped to
    /// the control plane's intake. The spool keeps its node's id: restarted without
    /// `--node-id`, the node takes the spool's.
    #[arg(long, value_name = "DIR")]
    pub usage_spool: Option<PathBuf>,
    /// The spool's size cap (`1GiB`, `64MiB`, `512KiB` or bytes): a full spool refuses
    /// new windows (logged, counted, shown in `/readyz`) and keeps them in memory until
    /// acknowledged windows make room; nothing spooled is dropped.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub usage_spool_max: u64,
    /// Ship usage windows to Kafka (`host:port,...`) instead of the control plane's
    /// intake: one message per window and caller, keyed by the caller, with the idempotent
    /// producer; a window leaves the spool's unacknowledged part only once Kafka has every
    /// part of it. With `--control` too, the node asks the control plane for windows the
    /// usage store lacks and sends them again.
    #[arg(long, value_name = "BROKERS")]
    pub usage_kafka: Option<String>,
    /// The usage topic.
    #[arg(long, default_value = postern_model::usage::KAFKA_TOPIC, value_name = "TOPIC")]
    pub usage_kafka_topic: String,
    /// A librdkafka setting for the producer (`security.protocol=SSL`, `sasl.username=…`);
    /// repeat for more.
    #[arg(long, value_name = "KEY=VALUE")]
    pub usage_kafka_option: Vec<String>,
    /// How often, in seconds, a node on Kafka asks the control plane which of its
    /// windows the usage store lacks (a run is sent again once two asks in a row name it).
    #[arg(long, default_value_t = 30, value_name = "S")]
    pub usage_kafka_missing_poll_s: u64,
    /// How long to let in-flight requests finish on shutdown, in seconds.
    #[arg(long, default_value_t = 10)]
    pub drain_seconds: u64,
    /// Open client connections a pool's listener holds at most; more are closed at accept.
    #[arg(long, default_value_t = 20_000)]
    pub max_connections: usize,
    /// Open client connections one source address holds at most, per listener.
    #[arg(long, default_value_t = 1_000)]
    pub max_connections_per_ip: u32,
    /// From accept to the first request head (protocol sniff and TLS handshake included),
    /// in seconds; a connection that sends none in time is closed.
    #[arg(long, default_value_t = 10)]
    pub handshake_timeout_s: u64,
    /// A connection with no request in flight and no bytes moving either way for this
    /// long is closed (HTTP/2 with GOAWAY), in seconds. It also bounds a body stalled in
    /// either direction. HTTP/1 waits at most 10 s between requests (its header timeout).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout_s: u64,
    /// The node sheds requests by priority (sheddable first, then free, then standard)
    /// while its CPU is at this percentage of its cores or more, measured each 250 ms
    /// over the last second; 0 never sheds on CPU (clusters still shed on their own
    /// overload).
    #[arg(long, default_value_t = 75)]
    pub shed_cpu: u32,
    /// Requests the node serves at once, from arrival to the response head (its
    /// admission budget; 0: none); past it, 503 node_overloaded.
    #[arg(long, default_value_t = 20_000)]
    pub max_in_flight: u32,
    /// The percentage of `--max-in-flight` kept for the partner pool: the public pool
    /// may hold only the rest.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub partner_share: u32,
    /// Write JSON access logs to this file: one line for every error (status 400 and
    /// above) and for a share of successes (`--access-log-sample`), by a thread of their
    /// own behind a bounded queue (when it is full a line is dropped and counted; a
    /// request never waits). Lines name the caller by key id or client_id, never by a
    /// credential.
    #[arg(long, value_name = "FILE")]
    pub access_log: Option<PathBuf>,
    /// The share of successful requests logged, from 0 to 1 (the same requests are the
    /// sampled ones for traces).
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION", value_parser = parse_fraction)]
    pub access_log_sample: f64,
    /// The access log is rotated once it would pass this size (`FILE.1` is the newest).
    #[arg(long, default_value = "100MiB", value_parser = parse_size)]
    pub access_log_max_size: u64,
    /// Rotated access logs kept.
    #[arg(long, default_value_t = 5)]
    pub access_log_keep: u32,
    /// Also send each access-log line to this Kafka topic on the `--usage-kafka`
    /// brokers, keyed by the caller (best effort: the file keeps every line).
    #[arg(long, value_name = "TOPIC", requires_all = ["usage_kafka", "access_log"])]
    pub access_log_kafka_topic: Option<String>,
    /// Export OpenTelemetry traces (OTLP over HTTP/protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (the traces path is added when none is given): a server
    /// span per request with spans for auth, each filter and the upstream call, for
    /// every server error, every request of a caller under `posternctl trace`, and a
    /// share of the rest (`--trace-sample`). Built and sent by a thread of their own
    /// behind a bounded queue; a request never waits.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// The share of requests traced, from 0 to 1, decided on the same random ids as the
    /// access log's sample (a sampled success has both a log line and a trace).
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION", value_parser = parse_fraction)]
    pub trace_sample: f64,
}

/// A fraction from 0 to 1.
fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number"))?;
    postern_observe::LogSettings::rate(f).map(|_| f)
}

/// A size: bytes, or a number with `KiB`, `MiB` or `GiB`.
fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a size (1GiB, 64MiB, 512KiB, bytes)"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" | "K" | "k" => 10,
        "MiB" | "M" => 20,
        "GiB" | "G" => 30,
        u => return Err(format!("{u:?}: sizes are in KiB, MiB or GiB")),
    };
    n.checked_mul(1 << shift).filter(|&b| b > 0).ok_or_else(|| format!("{s:?} is out of range"))
}

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
}

impl ConnLimits {
    /// The limits the command line sets.
    pub fn from_args(a: &Args) -> ConnLimits {
        ConnLimits {
            max: a.max_connections.max(1),
            max_per_ip: a.max_connections_per_ip.max(1),
            handshake: Duration::from_secs(a.handshake_timeout_s.max(1)),
            idle: Duration::from_secs(a.idle_timeout_s.max(1)),
        }
    }
}

/// A listener's open connections, in all and per source address.
#[derive(Debug, Default)]
struct Slots {
    open: std::sync::atomic::AtomicUsize,
    per_ip: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, u32>>,
}

/// One connection's place in its listener's [`Slots`], given back on drop.
struct Slot {
    slots: Arc<Slots>,
    ip: std::net::IpAddr,
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
        let n = map.entry(ip).or_insert(0);
        if *n >= limits.max_per_ip {
            drop(map);
            self.open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        *n += 1;
        Some(Slot { slots: self.clone(), ip })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = self.slots.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
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

fn load_tls(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
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
/// bytes moving) for the idle timeout; drained gracefully on shutdown. A macro because
/// the connection's type differs with its stack (TLS or not, HTTP/1 checked or not).
macro_rules! drive {
    ($conn:expr, $activity:expr, $limits:expr, $stop:expr, $metrics:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let (activity, limits, metrics): (&Activity, &ConnLimits, &Metrics) = (&$activity, &$limits, &$metrics);
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
            drive!(builder.serve_connection(io, svc).into_owned(), activity, limits, stop, metrics)
        }
        Some(acceptor) => match tokio::time::timeout(limits.handshake, acceptor.accept(stream)).await {
            Ok(Ok(tls_stream)) => {
                if tls_stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                    let io = TokioIo::new(tls_stream);
                    drive!(builder.serve_connection(io, svc).into_owned(), activity, limits, stop, metrics)
                } else {
                    let io = TokioIo::new(crate::request::framing::Strict::new(tls_stream));
                    drive!(builder.serve_connection(io, svc).into_owned(), activity, limits, stop, metrics)
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

async fn accept_loop(
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
        let info = Arc::new(ConnInfo::new(pool, peer, tls.is_some(), &hops));
        tokio::spawn(serve_conn(gw.clone(), builder.clone(), tls.clone(), stream, info, limits, slot, stop.clone()));
    }
}

async fn admin_loop(gw: Arc<Gateway>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
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

fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// How often a node with file-change events still looks at its files.
const BACKSTOP_POLL: Duration = Duration::from_secs(60);

/// A watch on the directories of `files`, waking `changed` on any change in them; `None`
/// (with a warning) where the system cannot watch, and the caller polls instead.
fn watch_dirs(files: &[&Path], changed: &Arc<tokio::sync::Notify>) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let n = changed.clone();
    let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| n.notify_one())
        .map_err(|e| tracing::warn!(error = %e, "no file-change events; polling the snapshot file"))
        .ok()?;
    let mut dirs: Vec<&Path> =
        files.iter().map(|f| f.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))).collect();
    dirs.dedup();
    for dir in dirs {
        if let Err(e) = watcher.watch(dir, notify::RecursiveMode::NonRecursive) {
            tracing::warn!(dir = %dir.display(), error = %e, "no file-change events; polling the snapshot file");
            return None;
        }
    }
    Some(watcher)
}

/// Every 10 s, closes the backend connections idle for longer than the idle timeout.
async fn close_idle_connections(builder: Arc<Builder>, mut stop: watch::Receiver<bool>) {
    let every = Duration::from_secs(10);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            _ = tick.tick() => builder.close_idle_connections(),
            _ = stop.changed() => return,
        }
    }
}

/// Reloads the snapshot and credential files when they change (told by the kernel, with a
/// slow backstop poll; or polled every `every` where it cannot tell) or on SIGHUP.
async fn watch_snapshot(
    gw: Arc<Gateway>,
    builder: Arc<Builder>,
    path: PathBuf,
    credentials: PathBuf,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; relying on file changes");
            None
        }
    };
    let mut stamp = file_stamp(&path);
    let mut cred_stamp = file_stamp(&credentials);
    // Told by the kernel when a file in their directories changes; the poll is then
    // only a backstop (for file systems that do not report changes), once a minute.
    let changed = Arc::new(tokio::sync::Notify::new());
    let watcher = watch_dirs(&[&path, &credentials], &changed);
    let every = if watcher.is_some() { every.max(BACKSTOP_POLL) } else { every };
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = tick.tick() => false,
            _ = changed.notified() => false,
            _ = async { match hup.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => true,
            _ = stop.changed() => return,
        };
        let now = file_stamp(&credentials);
        if (forced || now != cred_stamp) && now.is_some() {
            cred_stamp = now;
            let (gw, credentials) = (gw.clone(), credentials.clone());
            let _ = tokio::task::spawn_blocking(move || {
                let _one = gw.credentials_writer.lock().unwrap_or_else(|p| p.into_inner());
                live::reload_credentials(&gw, &credentials)
            })
            .await;
        }
        let now = file_stamp(&path);
        if forced || now != stamp {
            stamp = now;
            // Building compiles every route and filter: keep it off the request workers' queue.
            let (gw, builder, path) = (gw.clone(), builder.clone(), path.clone());
            let _ = tokio::task::spawn_blocking(move || live::reload(&gw, &builder, &path)).await;
        }
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
}

/// Runs the node until SIGTERM or Ctrl-C, then drains.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    let snapshot_dir = args.snapshot.parent().map(Path::to_path_buf).unwrap_or_default();
    let runtime = postern_wasm::Runtime::new(&postern_wasm::RuntimeConfig {
        // Absolute: the engine's code cache refuses a relative directory (a snapshot
        // given as `snapshot.json` has the empty path as its directory).
        cache_dir: Some(
            std::path::absolute(args.wasm_cache.clone().unwrap_or_else(|| snapshot_dir.join("wasm-cache")))
                .context("the Wasm code cache directory")?,
        ),
        max_instances: args.wasm_instances.max(1),
        maxima: postern_model::wasm::Limits::MAXIMA,
        init_deadline_ms: args.wasm_init_deadline_ms,
        reset: args.wasm_reset,
        metering: true,
        // As many as the workers: at the lowest priority they take only idle CPU.
        pool_threads: args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
    })
    .context("cannot start the Wasm runtime")?;
    let usage_dir = (args.usage_spool.is_some() || args.control.is_some() || args.usage_kafka.is_some())
        .then(|| args.usage_spool.clone().unwrap_or_else(|| snapshot_dir.join("usage-spool")));
    // A spool keeps its node's id: its windows are numbered for that node.
    let spool_owner = match &usage_dir {
        Some(dir) => postern_usage::Spool::owner(dir).context("the usage spool")?,
        None => None,
    };
    let node_id = args.node_id.clone().or(spool_owner).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}-{:08x}", host.trim(), std::process::id(), fastrand::u32(..))
    });
    let mut builder = Builder::with_wasm(metrics.clone(), runtime, snapshot_dir.join("modules"));
    anyhow::ensure!(
        args.control.is_none() || args.control_key.is_some(),
        "--control needs --control-key: the control plane's public key (its store's signing.pub), \
         so this node takes only versions it signed"
    );
    let trust = match &args.control_key {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the control key {}", path.display()))?;
            let trust = postern_model::sign::Trust::parse(&text)
                .map_err(|e| anyhow::anyhow!("control key {}: {e}", path.display()))?;
            tracing::info!(key = %trust, "only versions signed by the control plane are taken");
            Some(Arc::new(trust))
        }
        None => None,
    };
    if let Some(t) = &trust {
        builder.require_signed(t.clone());
    }
    if let (Some(cert), Some(key)) = (&args.upstream_cert, &args.upstream_key) {
        let id = crate::cluster::connect::Identity::load(cert, key).context("the client certificate for backends")?;
        builder.use_upstream_identity(Arc::new(id));
    }
    let ratesync = if args.ratelimit_redis.is_empty() {
        None
    } else {
        let limiter = Arc::new(postern_builtin_filters::ratelimit::Limiter::fleet(crate::snapshot::RATE_BUCKETS));
        builder.use_limiter(limiter.clone());
        let settings = crate::node::ratesync::SyncSettings {
            urls: args.ratelimit_redis.clone(),
            cluster: args.ratelimit_cluster,
            prefix: args.ratelimit_prefix.clone(),
            interval: Duration::from_millis(args.ratelimit_sync_ms.max(50)),
            node_id: node_id.clone(),
        };
        let shown: Vec<String> = settings.urls.iter().map(|u| postern_model::redact_url(u)).collect();
        tracing::info!(redis = ?shown, cluster = settings.cluster, node = %settings.node_id, "fleet-wide rate limits");
        Some(crate::node::ratesync::start(limiter, settings).context("cannot start the rate sync")?)
    };
    let builder = Arc::new(builder);
    let credentials = args.credentials.clone().unwrap_or_else(|| snapshot_dir.join("credentials.json"));
    let token = match &args.control_token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the control token from {}", path.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned(),
        None => args.control_token.clone().unwrap_or_default(),
    };
    let control =
        args.control.as_ref().zip(trust.clone()).map(|(url, trust)| crate::node::control_client::ControlSettings {
            url: url.clone(),
            token: token.clone(),
            node_id: node_id.clone(),
            snapshot: args.snapshot.clone(),
            credentials: credentials.clone(),
            modules: snapshot_dir.join("modules"),
            canary: args.control_canary,
            report_every: Duration::from_millis(args.control_report_ms.max(50)),
            ca: args.control_ca.clone(),
            trust,
        });
    if let Some(c) = &control
        && !args.snapshot.exists()
    {
        // First boot: nothing on disk yet, so wait for the control plane's head.
        let bytes = crate::node::control_client::fetch_first(c, Duration::from_secs(30)).await?;
        live::persist_snapshot(&args.snapshot, &bytes)?;
    }
    let bytes =
        std::fs::read(&args.snapshot).with_context(|| format!("cannot read snapshot {}", args.snapshot.display()))?;
    let live = builder.build_bytes(&bytes).with_context(|| format!("snapshot {} refused", args.snapshot.display()))?;
    tracing::info!(version = live.version, hash = %live.hash, routes = live.route_count, "snapshot live");
    metrics.snapshot_version.store(live.version, Ordering::Relaxed);
    let auth = builder.authenticator().clone();
    let body_idle = Duration::from_secs(args.idle_timeout_s.max(1));
    let usage = match &usage_dir {
        Some(dir) => {
            let http = match &args.control {
                Some(url) => Some(
                    postern_usage::HttpSink::new(url, &token, args.control_ca.as_deref(), &node_id)
                        .context("the usage shipper")?,
                ),
                None => None,
            };
            let sink: Option<Box<dyn postern_usage::Sink>> = match &args.usage_kafka {
                Some(brokers) => {
                    let settings = postern_usage::kafka::KafkaSettings {
                        brokers: brokers.clone(),
                        topic: args.usage_kafka_topic.clone(),
                        options: postern_model::usage::kafka_options(&args.usage_kafka_option)
                            .map_err(anyhow::Error::msg)?,
                        missing_poll: Duration::from_secs(args.usage_kafka_missing_poll_s.max(1)),
                    };
                    Some(Box::new(
                        postern_usage::kafka::KafkaSink::new(&settings, &node_id, http)
                            .context("the usage stream (Kafka)")?,
                    ))
                }
                None => http.map(|h| Box::new(h) as Box<dyn postern_usage::Sink>),
            };
            let settings = postern_usage::Settings {
                node: node_id.clone(),
                dir: dir.clone(),
                limits: postern_usage::SpoolLimits::with_cap(args.usage_spool_max),
            };
            let usage = postern_usage::Usage::start(settings, sink).context("cannot start usage metering")?;
            let to = args.usage_kafka.as_ref().map(|b| format!("kafka {b}")).or_else(|| args.control.clone());
            tracing::info!(node = %node_id, spool = %dir.display(), shipped_to = ?to, "usage metered");
            Some(usage)
        }
        None => None,
    };
    let access_log = match &args.access_log {
        Some(path) => {
            let mut settings = postern_observe::LogSettings::new(path.clone());
            settings.success_per_10k =
                postern_observe::LogSettings::rate(args.access_log_sample).map_err(anyhow::Error::msg)?;
            settings.max_bytes = args.access_log_max_size;
            settings.keep = args.access_log_keep;
            let sink: Option<Box<dyn postern_observe::LineSink>> =
                match (&args.access_log_kafka_topic, &args.usage_kafka) {
                    (Some(topic), Some(brokers)) => {
                        let settings = postern_usage::kafka::KafkaSettings {
                            brokers: brokers.clone(),
                            topic: topic.clone(),
                            options: postern_model::usage::kafka_options(&args.usage_kafka_option)
                                .map_err(anyhow::Error::msg)?,
                            missing_poll: Duration::from_secs(30),
                        };
                        Some(Box::new(
                            postern_usage::kafka::KafkaLines::new(&settings, topic, &node_id)
                                .context("the access log's Kafka topic")?,
                        ))
                    }
                    _ => None,
                };
            let log = postern_observe::AccessLog::start(settings, sink)
                .with_context(|| format!("cannot open the access log {}", path.display()))?;
            tracing::info!(path = %path.display(), sample = args.access_log_sample, kafka = ?args.access_log_kafka_topic, "access log on");
            Some(log)
        }
        None => None,
    };
    let tracer = match &args.otlp_endpoint {
        Some(endpoint) => {
            let mut settings = postern_observe::TraceSettings::new(endpoint, &node_id);
            settings.success_per_10k =
                postern_observe::LogSettings::rate(args.trace_sample).map_err(anyhow::Error::msg)?;
            let tracer = postern_observe::Tracer::start(settings)
                .map_err(|e| anyhow::anyhow!("--otlp-endpoint {endpoint}: {e}"))?;
            tracing::info!(endpoint = %endpoint, sample = args.trace_sample, "traces exported");
            Some(tracer)
        }
        None => None,
    };
    let gw = Arc::new(Gateway {
        live: ArcSwap::from_pointee(live),
        metrics,
        auth,
        ratesync,
        body_idle,
        trust,
        credentials_writer: std::sync::Mutex::new(()),
        usage,
        access_log,
        tracer,
        shed: crate::cluster::shedding::NodeShed::new(args.shed_cpu),
        admission: crate::cluster::shedding::Admission::new(args.max_in_flight, args.partner_share),
    });
    if credentials.exists() {
        live::reload_credentials(&gw, &credentials)
            .map_err(|e| anyhow::anyhow!("credentials {} refused: {e}", credentials.display()))?;
        live::replay_deltas(&gw, &credentials);
    } else {
        tracing::warn!(path = %credentials.display(), "no credentials file: authenticated routes refuse every caller");
    }

    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(c), Some(k)) => Some(load_tls(c, k)?),
        _ => None,
    };
    let listen = |addr: SocketAddr| {
        postern_model::net::listen(addr, args.listen_backlog).with_context(|| format!("cannot listen on {addr}"))
    };
    let (public, partner, admin) = (listen(args.public)?, listen(args.partner)?, listen(args.admin)?);
    let (pa, pb, ad) = (public.local_addr()?, partner.local_addr()?, admin.local_addr()?);
    tracing::info!(public = %pa, partner = %pb, admin = %ad, tls = tls.is_some(), "listening");
    if let Some(p) = &args.ports_file {
        let json = serde_json::json!({"public": pa.port(), "partner": pb.port(), "admin": ad.port()});
        postern_model::disk::write_atomic(p, json.to_string().as_bytes())?;
    }

    if let Some(c) = control {
        crate::node::control_client::start(gw.clone(), builder.clone(), c)?;
    }
    if let Some(dir) = &args.credentials_dir {
        let every = Duration::from_secs(args.credentials_dir_poll_s.max(1));
        crate::node::control_client::watch_drop(gw.clone(), dir.clone(), every, credentials.clone());
    }
    let limits = ConnLimits::from_args(&args);
    let hops = Arc::new(crate::request::forwarded::Hops::parse(&args.trusted_hops).map_err(|e| anyhow::anyhow!(e))?);
    if !hops.is_empty() {
        tracing::info!(hops = ?args.trusted_hops, "X-Forwarded-For kept from trusted hops");
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let watch_every = Duration::from_millis(args.watch_interval_ms.max(10));
    let tasks = [
        tokio::spawn(accept_loop(gw.clone(), public, Pool::Public, tls.clone(), limits, hops.clone(), stop_rx.clone())),
        tokio::spawn(accept_loop(gw.clone(), partner, Pool::Partner, tls, limits, hops, stop_rx.clone())),
        tokio::spawn(admin_loop(gw.clone(), admin, stop_rx.clone())),
        tokio::spawn(crate::node::shed::run(gw.clone(), args.workers, stop_rx.clone())),
        tokio::spawn(close_idle_connections(builder.clone(), stop_rx.clone())),
        tokio::spawn(watch_snapshot(gw.clone(), builder, args.snapshot.clone(), credentials, watch_every, stop_rx)),
    ];

    shutdown_signal().await;
    tracing::info!(
        drain_seconds = args.drain_seconds,
        "shutting down: no new connections, draining in-flight requests"
    );
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    // Every connection was told to finish (HTTP/2 with GOAWAY) when `stop` changed.
    let drained = async {
        while gw.metrics.connections.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(args.drain_seconds), drained).await.is_err() {
        tracing::warn!("drain timed out; closing the remaining connections");
    }
    if let Some(usage) = gw.usage.clone() {
        // Every window, the open one too, into the spool; one last send.
        let _ = tokio::task::spawn_blocking(move || usage.stop()).await;
    }
    if let Some(log) = gw.access_log.clone() {
        let _ = tokio::task::spawn_blocking(move || log.shutdown()).await;
    }
    if let Some(tracer) = gw.tracer.clone() {
        let _ = tokio::task::spawn_blocking(move || tracer.shutdown()).await;
    }
    Ok(())
}
