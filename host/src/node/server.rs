//! The process's lifecycle, assembled from subsystems that each build themselves from
//! their own settings (linkerd2-proxy's app assembly): the data plane (the Wasm runtime
//! and the snapshot builder), rate sync ([`ratesync`](crate::node::ratesync)), the
//! control plane link ([`control`](crate::node::control)), usage
//! ([`usage`](crate::node::usage)), observability
//! ([`observability`](crate::node::observability)) and the listeners
//! ([`listen`](crate::node::listen)). `run` wires them into one [`Gateway`], starts the
//! tasks and drains them at shutdown.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use tokio::sync::watch;

use crate::gateway::Gateway;
use crate::metrics::Metrics;
use crate::node::args::Args;
use crate::node::control::{Control, ControlLink, Files};
use crate::node::listen::ListenSettings;
use crate::node::live;
use crate::node::observability::ObserveSettings;
use crate::node::ratesync::SyncSettings;
use crate::node::usage::UsageSettings;
use crate::node::watch::watch_snapshot;
use crate::snapshot::{Builder, Live};

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
    args.check_secrets()?;
    args.check_admin()?;
    let metrics = Arc::new(Metrics::default());
    let files = files(&args);
    let snapshot_dir = args.snapshot.parent().map(Path::to_path_buf).unwrap_or_default();
    let runtime = wasm_runtime(&args, &snapshot_dir)?;
    let usage = UsageSettings::from_args(&args, &snapshot_dir);
    let node_id = node_id(&args, usage.as_ref())?;
    let mut builder = Builder::with_wasm(metrics.clone(), runtime, files.modules.clone());
    let trust = crate::node::control::trust(&args)?;
    if let Some(t) = &trust {
        builder.require_signed(t.clone());
    }
    if let (Some(cert), Some(key)) = (&args.upstream_cert, &args.upstream_key) {
        let id = crate::cluster::connect::Identity::load(cert, key).context("the client certificate for backends")?;
        builder.use_upstream_identity(Arc::new(id));
    }
    let ratesync = SyncSettings::from_args(&args, &node_id).map(|s| s.start(&mut builder)).transpose()?;
    let builder = Arc::new(builder);
    let link = ControlLink::from_args(&args)?;
    let control = Control::from_args(&args, link.as_ref(), trust.as_ref(), &node_id, &files);
    control.fetch_first(&files.snapshot).await?;
    let live = first_snapshot(&builder, &files.snapshot, &metrics)?;
    let usage = usage.map(|u| u.start(&node_id, link.as_ref())).transpose()?;
    let observability = ObserveSettings::from_args(&args).start(&node_id)?;
    let gw = Arc::new(Gateway {
        live: ArcSwap::from_pointee(live),
        metrics,
        auth: builder.authenticator().clone(),
        ratesync,
        body_idle: Duration::from_secs(args.idle_timeout_s.max(1)),
        trust,
        credentials_writer: std::sync::Mutex::new(()),
        usage,
        access_log: observability.access_log,
        tracer: observability.tracer,
        shed: crate::cluster::shedding::NodeShed::new(args.shed_cpu),
        admission: crate::cluster::shedding::Admission::new(args.max_in_flight, args.partner_share),
        compressing: crate::request::compress::Slots::new(args.max_compressing_streams),
    });
    load_credentials(&gw, &files.credentials)?;
    let listeners = ListenSettings::from_args(&args).bind()?;
    control.start(&gw, &builder)?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let watch_every = Duration::from_millis(args.watch_interval_ms.max(10));
    let mut tasks = Vec::from(listeners.spawn(&gw, &stop_rx));
    tasks.extend([
        tokio::spawn(crate::node::shed::run(gw.clone(), args.workers, stop_rx.clone())),
        tokio::spawn(close_idle_connections(builder.clone(), stop_rx.clone())),
        tokio::spawn(watch_snapshot(gw.clone(), builder, files.snapshot, files.credentials, watch_every, stop_rx)),
    ]);

    shutdown_signal().await;
    tracing::info!(
        drain_seconds = args.drain_seconds,
        "shutting down: no new connections, draining in-flight requests"
    );
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    drain(&gw, Duration::from_secs(args.drain_seconds)).await;
    Ok(())
}

/// Where the node keeps its snapshot, credentials and filter modules.
fn files(args: &Args) -> Files {
    let dir = args.snapshot.parent().map(Path::to_path_buf).unwrap_or_default();
    Files {
        snapshot: args.snapshot.clone(),
        credentials: args.credentials.clone().unwrap_or_else(|| dir.join("credentials.json")),
        modules: dir.join("modules"),
    }
}

/// The Wasm runtime the node's filters run in.
fn wasm_runtime(args: &Args, snapshot_dir: &Path) -> anyhow::Result<Arc<postern_wasm::Runtime>> {
    let cache: PathBuf = args.wasm_cache.clone().unwrap_or_else(|| snapshot_dir.join("wasm-cache"));
    postern_wasm::Runtime::new(&postern_wasm::RuntimeConfig {
        // Absolute: the engine's code cache refuses a relative directory (a snapshot
        // given as `snapshot.json` has the empty path as its directory).
        cache_dir: Some(std::path::absolute(cache).context("the Wasm code cache directory")?),
        max_instances: args.wasm_instances.max(1),
        maxima: postern_model::wasm::Limits::MAXIMA,
        init_deadline_ms: args.wasm_init_deadline_ms,
        reset: args.wasm_reset,
        metering: true,
        // As many as the workers: at the lowest priority they take only idle CPU.
        pool_threads: args.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
    })
    .context("cannot start the Wasm runtime")
}

/// The node's name: `--node-id`, else the one its usage spool was written for (its
/// windows are numbered for that node), else made from the host name and process.
fn node_id(args: &Args, usage: Option<&UsageSettings>) -> anyhow::Result<String> {
    let spool_owner = match usage {
        Some(u) => u.spool_owner()?,
        None => None,
    };
    Ok(args.node_id.clone().or(spool_owner).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}-{:08x}", host.trim(), std::process::id(), fastrand::u32(..))
    }))
}

/// The snapshot on disk, built and checked: the node's first live version.
fn first_snapshot(builder: &Builder, path: &Path, metrics: &Metrics) -> anyhow::Result<Live> {
    // The operator's file: a link is followed, to a regular file within the snapshot cap.
    let bytes = postern_model::disk::read_regular(path, postern_model::disk::SNAPSHOT_FILE_CAP)
        .with_context(|| format!("cannot read snapshot {}", path.display()))?;
    let live = builder.build_bytes(&bytes).with_context(|| format!("snapshot {} refused", path.display()))?;
    tracing::info!(version = live.version, hash = %live.hash, routes = live.route_count, "snapshot live");
    metrics.snapshot_version.store(live.version, Ordering::Relaxed);
    Ok(live)
}

/// The credential state on disk and the deltas logged since it was written.
fn load_credentials(gw: &Gateway, credentials: &Path) -> anyhow::Result<()> {
    if credentials.exists() {
        live::reload_credentials(gw, credentials)
            .map_err(|e| anyhow::anyhow!("credentials {} refused: {e}", credentials.display()))?;
        live::replay_deltas(gw, credentials);
    } else {
        tracing::warn!(path = %credentials.display(), "no credentials file: authenticated routes refuse every caller");
    }
    Ok(())
}

/// Waits up to `limit` for the connections to finish, then flushes usage, the access
/// log and traces.
async fn drain(gw: &Gateway, limit: Duration) {
    // Every connection was told to finish (HTTP/2 with GOAWAY) when `stop` changed.
    let drained = async {
        while gw.metrics.connections.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(limit, drained).await.is_err() {
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
}
