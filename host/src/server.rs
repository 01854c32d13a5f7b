//! Listeners and process lifecycle: one listener per pool (plain HTTP/1.1 + h2c, or TLS
//! with ALPN h2/http1.1), the admin listener, snapshot reloads, graceful shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use postern_model::Pool;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::live;
use crate::metrics::Metrics;
use crate::proxy::{ConnInfo, Gateway};
use crate::snapshot::Builder;

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
    /// PEM certificate chain: serve both pools over TLS (ALPN h2, http/1.1).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Write the bound ports as JSON here once listening (for tests and scripts).
    #[arg(long)]
    pub ports_file: Option<PathBuf>,
    /// How often to check the snapshot file for changes, in milliseconds.
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
    /// Redis for fleet-wide rate limits (`redis://host:port`; repeat for the seed nodes of
    /// a cluster). Without it the node enforces every limit alone.
    #[arg(long = "ratelimit-redis")]
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
    /// Bearer token (role `node`) for `--control` (or POSTERN_CONTROL_TOKEN).
    #[arg(long, env = "POSTERN_CONTROL_TOKEN", hide_env_values = true)]
    pub control_token: Option<String>,
    /// This node is a canary: staged rollouts give it new snapshots first.
    #[arg(long)]
    pub control_canary: bool,
    /// How often to report the routes a rollout compares, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub control_report_ms: u64,
    /// How long to let in-flight requests finish on shutdown, in seconds.
    #[arg(long, default_value_t = 10)]
    pub drain_seconds: u64,
}

fn load_tls(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("cannot read certificates from {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("bad certificate in {}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("cannot read a private key from {}", key.display()))?;
    let mut config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .context("certificate and key do not form a valid identity")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .max_buf_size(64 * 1024)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .max_header_list_size(64 * 1024);
    b
}

async fn serve_conn(
    gw: Arc<Gateway>,
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    stream: TcpStream,
    info: Arc<ConnInfo>,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let _ = stream.set_nodelay(true);
    let metrics = gw.metrics.clone();
    metrics.connections.fetch_add(1, Ordering::Relaxed);
    let svc = service_fn(move |req| {
        let gw = gw.clone();
        let info = info.clone();
        async move { Ok::<_, std::convert::Infallible>(crate::proxy::handle(gw, info, req).await) }
    });
    let result = match tls {
        None => watcher.watch(builder.serve_connection(TokioIo::new(stream), svc).into_owned()).await,
        Some(acceptor) => match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
            Ok(Ok(tls_stream)) => {
                watcher.watch(builder.serve_connection(TokioIo::new(tls_stream), svc).into_owned()).await
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                Ok(())
            }
            Err(_) => Ok(()),
        },
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
    metrics.connections.fetch_sub(1, Ordering::Relaxed);
}

async fn accept_loop(
    gw: Arc<Gateway>,
    listener: TcpListener,
    pool: Pool,
    tls: Option<TlsAcceptor>,
    graceful: Arc<GracefulShutdown>,
    mut stop: watch::Receiver<bool>,
) {
    let builder = http_builder();
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
        let info = Arc::new(ConnInfo::new(pool, peer, tls.is_some()));
        let watcher = graceful.watcher();
        tokio::spawn(serve_conn(gw.clone(), builder.clone(), tls.clone(), stream, info, watcher));
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
                async move { Ok::<_, std::convert::Infallible>(crate::admin::handle(gw, req).await) }
            });
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

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
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = tick.tick() => false,
            _ = async { match hup.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => true,
            _ = stop.changed() => return,
        };
        let now = file_stamp(&credentials);
        if (forced || now != cred_stamp) && now.is_some() {
            cred_stamp = now;
            let (gw, credentials) = (gw.clone(), credentials.clone());
            let _ = tokio::task::spawn_blocking(move || live::reload_credentials(&gw, &credentials)).await;
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
        cache_dir: Some(args.wasm_cache.clone().unwrap_or_else(|| snapshot_dir.join("wasm-cache"))),
        max_instances: args.wasm_instances.max(1),
        maxima: postern_model::wasm::Limits::MAXIMA,
        metering: true,
        // As many as the workers: at the lowest priority they take only idle CPU.
        pool_threads: args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
    })
    .context("cannot start the Wasm runtime")?;
    let node_id = args.node_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}-{:08x}", host.trim(), std::process::id(), fastrand::u32(..))
    });
    let mut builder = Builder::with_wasm(metrics.clone(), runtime, snapshot_dir.join("modules"));
    let ratesync = if args.ratelimit_redis.is_empty() {
        None
    } else {
        let limiter = Arc::new(postern_builtin_filters::ratelimit::Limiter::fleet(crate::snapshot::RATE_BUCKETS));
        builder.use_limiter(limiter.clone());
        let settings = crate::ratesync::SyncSettings {
            urls: args.ratelimit_redis.clone(),
            cluster: args.ratelimit_cluster,
            prefix: args.ratelimit_prefix.clone(),
            interval: Duration::from_millis(args.ratelimit_sync_ms.max(50)),
            node_id: node_id.clone(),
        };
        tracing::info!(redis = ?settings.urls, cluster = settings.cluster, node = %settings.node_id, "fleet-wide rate limits");
        Some(crate::ratesync::start(limiter, settings).context("cannot start the rate sync")?)
    };
    let builder = Arc::new(builder);
    let credentials = args.credentials.clone().unwrap_or_else(|| snapshot_dir.join("credentials.json"));
    let control = args.control.as_ref().map(|url| crate::control_client::ControlSettings {
        url: url.clone(),
        token: args.control_token.clone().unwrap_or_default(),
        node_id: node_id.clone(),
        snapshot: args.snapshot.clone(),
        credentials: credentials.clone(),
        modules: snapshot_dir.join("modules"),
        canary: args.control_canary,
        report_every: Duration::from_millis(args.control_report_ms.max(50)),
    });
    if let Some(c) = &control
        && !args.snapshot.exists()
    {
        // First boot: nothing on disk yet, so wait for the control plane's head.
        let bytes = crate::control_client::fetch_first(c, Duration::from_secs(30)).await?;
        live::persist_snapshot(&args.snapshot, &bytes)?;
    }
    let bytes =
        std::fs::read(&args.snapshot).with_context(|| format!("cannot read snapshot {}", args.snapshot.display()))?;
    let live = builder.build_bytes(&bytes).with_context(|| format!("snapshot {} refused", args.snapshot.display()))?;
    tracing::info!(version = live.version, hash = %live.hash, routes = live.route_count, "snapshot live");
    metrics.snapshot_version.store(live.version, Ordering::Relaxed);
    let auth = builder.authenticator().clone();
    let gw = Arc::new(Gateway { live: ArcSwap::from_pointee(live), metrics, auth, ratesync });
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
    let public = TcpListener::bind(args.public).await.with_context(|| format!("cannot listen on {}", args.public))?;
    let partner =
        TcpListener::bind(args.partner).await.with_context(|| format!("cannot listen on {}", args.partner))?;
    let admin = TcpListener::bind(args.admin).await.with_context(|| format!("cannot listen on {}", args.admin))?;
    let (pa, pb, ad) = (public.local_addr()?, partner.local_addr()?, admin.local_addr()?);
    tracing::info!(public = %pa, partner = %pb, admin = %ad, tls = tls.is_some(), "listening");
    if let Some(p) = &args.ports_file {
        let json = serde_json::json!({"public": pa.port(), "partner": pb.port(), "admin": ad.port()});
        postern_model::disk::write_atomic(p, json.to_string().as_bytes())?;
    }

    if let Some(c) = control {
        crate::control_client::start(gw.clone(), builder.clone(), c);
    }
    let graceful = Arc::new(GracefulShutdown::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    let watch_every = Duration::from_millis(args.watch_interval_ms.max(10));
    let tasks = [
        tokio::spawn(accept_loop(gw.clone(), public, Pool::Public, tls.clone(), graceful.clone(), stop_rx.clone())),
        tokio::spawn(accept_loop(gw.clone(), partner, Pool::Partner, tls, graceful.clone(), stop_rx.clone())),
        tokio::spawn(admin_loop(gw.clone(), admin, stop_rx.clone())),
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
    let graceful = Arc::try_unwrap(graceful).map_err(|_| anyhow::anyhow!("listener still running"))?;
    if tokio::time::timeout(Duration::from_secs(args.drain_seconds), graceful.shutdown()).await.is_err() {
        tracing::warn!("drain timed out; closing the remaining connections");
    }
    Ok(())
}
