//! The process's lifecycle: the node's state built from its settings and first versions,
//! its listeners and tasks started, and a graceful shutdown that drains them.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use postern_model::Pool;
use tokio::sync::watch;

use crate::gateway::Gateway;
use crate::metrics::Metrics;
use crate::node::args::Args;
use crate::node::listen::{ConnLimits, accept_loop, admin_loop, load_tls};
use crate::node::live;
use crate::node::watch::watch_snapshot;
use crate::snapshot::Builder;

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
