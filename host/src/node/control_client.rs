//! The node's client of the control plane (`--control`): receiving versions, ACKing them,
//! reporting traffic for staged rollouts.
//!
//! One long poll per lane (snapshot, credentials): the control plane answers as soon as
//! the lane has a version other than the one this node runs, or after 25 s with nothing,
//! and the node asks again at once — a long-lived stream and a poll in one. A received
//! snapshot is built beside the live one (off the request workers); only if it builds is
//! it swapped in, written to disk atomically (so a restart without the control plane
//! serves it) and ACKed; otherwise it is NACKed with the reason and the live one stays.
//! Filter modules a snapshot names are fetched by digest first, checked against it, and
//! kept beside the snapshot. The control plane going away changes nothing on the request
//! path; the node retries every second.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use sha2::Digest as _;

use postern_model::credentials::DeltaDoc;
use postern_model::disk;
use postern_model::protocol::{self, Ack, Lane, Poll};
use postern_model::report::{Report, Watch};
use postern_model::sign::Trust;

use crate::gateway::Gateway;
use crate::node::live;
use crate::snapshot::Builder;

/// Where the control plane is and who this node is.
#[derive(Debug, Clone)]
pub struct ControlSettings {
    /// Base URL, e.g. `http://127.0.0.1:9400`.
    pub url: String,
    /// Bearer token with the `node` role.
    pub token: String,
    /// This node's name.
    pub node_id: String,
    /// Where the snapshot lives on disk.
    pub snapshot: PathBuf,
    /// Where the credential state lives on disk.
    pub credentials: PathBuf,
    /// Where filter modules live (`<hex>.wasm`).
    pub modules: PathBuf,
    /// Staged rollouts give this node new snapshots first.
    pub canary: bool,
    /// How often to report the routes a rollout compares.
    pub report_every: Duration,
    /// CA certificates (PEM) for an `https://` control plane.
    pub ca: Option<PathBuf>,
    /// The control plane's keys: every version must be signed by one.
    pub trust: Arc<Trust>,
}

type Http = postern_model::tls::ControlClient;

/// Starts both lanes.
pub fn start(gw: Arc<Gateway>, builder: Arc<Builder>, settings: ControlSettings) -> anyhow::Result<()> {
    let client = postern_model::tls::client(settings.ca.as_deref())?;
    let settings = Arc::new(settings);
    for lane in Lane::ALL {
        let (gw, builder, settings, client) = (gw.clone(), builder.clone(), settings.clone(), client.clone());
        tokio::spawn(async move { run(lane, gw, builder, settings, client).await });
    }
    tokio::spawn(async move { report(gw, settings, client).await });
    Ok(())
}

/// Polls `<dir>/credentials.json` every `every`: the signed credentials a control plane
/// also writes there (`posternctl serve --publish-dir`), the second revocation path when
/// its streams are down. A newer version, signed by a trusted key, is applied and written
/// to the node's own credentials file; an older or equal one is left alone.
pub fn watch_drop(gw: Arc<Gateway>, dir: PathBuf, every: Duration, credentials: PathBuf) {
    tokio::spawn(async move {
        let path = dir.join(protocol::DROP_CREDENTIALS);
        let mut seen = None;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // The entry itself (a symbolic link is not followed): each change is read once.
            let stamp = std::fs::symlink_metadata(&path).ok().map(|m| (m.modified().ok(), m.len(), m.file_type()));
            if stamp.is_none() || stamp == seen {
                continue;
            }
            seen = stamp;
            let (gw, path, credentials) = (gw.clone(), path.clone(), credentials.clone());
            let done = tokio::task::spawn_blocking(move || {
                let bytes = live::read_file(&gw, &path, disk::CREDENTIALS_FILE_CAP, live::Origin::Shared)
                    .map_err(|e| e.to_string())?;
                // One writer of the live state and its file at a time: the lanes and this.
                let _one = gw.credentials_writer.lock().unwrap_or_else(|p| p.into_inner());
                let applied = live::apply_credentials_if(&gw, &bytes, |offered, live| offered > live)
                    .map_err(|e| e.to_string())?;
                if applied {
                    live::persist_credentials(&credentials, &bytes).map_err(|e| e.to_string())?;
                }
                Ok::<_, String>(applied)
            })
            .await;
            match done {
                Ok(Ok(true)) => tracing::info!(dir = %dir.display(), "credentials taken from the publish directory"),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    tracing::error!(dir = ?dir, error = ?e, "publish directory: credentials refused")
                }
                Err(e) => tracing::error!(error = %e, "publish directory: reader failed"),
            }
        }
    });
}

/// Reports the routes a rollout compares (per route: responses, 5xx, latency histogram,
/// all since the process started) with the snapshot version running; the answer names
/// the routes to report next time (none while no rollout runs: the report is a heartbeat).
async fn report(gw: Arc<Gateway>, s: Arc<ControlSettings>, client: Http) {
    let url = format!("{}{}", s.url.trim_end_matches('/'), protocol::report_path(&s.node_id));
    let mut watch = Watch::default();
    let mut tick = tokio::time::interval(s.report_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let report = Report {
            snapshot: gw.live.load().version,
            routes: if watch.all || !watch.routes.is_empty() {
                gw.metrics.route_totals(&watch.routes, watch.all)
            } else {
                Default::default()
            },
        };
        let Ok(body) = serde_json::to_vec(&report) else { continue };
        let Ok(req) = Request::post(&url)
            .header(http::header::AUTHORIZATION, format!("Bearer {}", s.token))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
        else {
            continue;
        };
        let answer = async {
            let resp = client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            // The list of routes to watch: small, whatever the answer says.
            let body = Limited::new(resp.into_body(), 1 << 20).collect().await.map_err(|e| e.to_string())?.to_bytes();
            if !status.is_success() {
                return Err(format!("{status}"));
            }
            serde_json::from_slice::<Watch>(&body).map_err(|e| e.to_string())
        };
        match tokio::time::timeout(Duration::from_secs(5), answer).await {
            Ok(Ok(w)) => watch = w,
            Ok(Err(e)) => tracing::debug!(error = %e, "rollout report not taken"),
            Err(_) => tracing::debug!("rollout report: no answer"),
        }
    }
}

/// Fetches the snapshot head once, for a node booting with nothing on disk.
pub async fn fetch_first(settings: &ControlSettings, wait: Duration) -> anyhow::Result<Vec<u8>> {
    let client = postern_model::tls::client(settings.ca.as_deref())?;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let poll = Poll { running: Some(0), wait_s: 5, canary: settings.canary, full: true, ..Poll::default() };
        match get(&client, settings, Lane::Snapshot, poll).await {
            Ok(Some(bytes)) => {
                fetch_modules(&client, settings, &bytes).await.map_err(|e| anyhow::anyhow!(e))?;
                return Ok(bytes.to_vec());
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "no snapshot from the control plane yet"),
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no snapshot on disk and none from the control plane");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn running(gw: &Gateway, lane: Lane) -> u64 {
    match lane {
        Lane::Snapshot => gw.live.load().version,
        Lane::Credentials => gw.auth.credentials.load().version,
    }
}

async fn run(lane: Lane, gw: Arc<Gateway>, builder: Arc<Builder>, settings: Arc<ControlSettings>, client: Http) {
    // A version refused once is not asked for again; a newer one is.
    let mut refused = 0u64;
    // After a delta fails, ask for whole versions until one applies.
    let mut want_full = false;
    let mut backoff = Duration::from_millis(200);
    loop {
        let now = running(&gw, lane);
        let poll = Poll {
            have: now.max(refused),
            running: Some(now),
            canary: settings.canary,
            full: want_full,
            ..Poll::default()
        };
        match get(&client, &settings, lane, poll).await {
            Ok(None) => backoff = Duration::from_millis(200),
            Ok(Some(bytes)) => {
                backoff = Duration::from_millis(200);
                // The credentials lane also carries deltas of the key service's changes.
                let delta = match lane {
                    Lane::Credentials => DeltaDoc::parse(&bytes),
                    Lane::Snapshot => None,
                };
                let version = match &delta {
                    Some(d) => d.as_ref().map_or(0, |d| d.delta.version),
                    None => envelope_version(&bytes),
                };
                let is_delta = delta.is_some();
                let outcome = apply(lane, &gw, &builder, &settings, &client, bytes, delta).await;
                if let Err(why) = &outcome {
                    tracing::error!(lane = lane.as_str(), version, error = %why, "version refused; keeping the live one");
                    if is_delta {
                        want_full = true;
                    } else {
                        refused = version;
                    }
                } else {
                    want_full = false;
                }
                let ack = Ack { version, ok: outcome.is_ok(), error: outcome.err(), running: running(&gw, lane) };
                if let Err(e) = post_ack(&client, &settings, lane, ack).await {
                    tracing::warn!(lane = lane.as_str(), error = %e, "cannot ACK");
                }
            }
            Err(e) => {
                tracing::debug!(lane = lane.as_str(), error = %e, "control plane unreachable; serving the live version");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

fn envelope_version(bytes: &[u8]) -> u64 {
    #[derive(serde::Deserialize)]
    struct V {
        version: u64,
    }
    serde_json::from_slice::<V>(bytes).map_or(0, |v| v.version)
}

async fn apply(
    lane: Lane,
    gw: &Arc<Gateway>,
    builder: &Arc<Builder>,
    settings: &ControlSettings,
    client: &Http,
    bytes: Bytes,
    delta: Option<Result<DeltaDoc, serde_json::Error>>,
) -> Result<(), String> {
    match lane {
        Lane::Snapshot => {
            fetch_modules(client, settings, &bytes).await?;
            let (gw2, builder2, b2) = (gw.clone(), builder.clone(), bytes.clone());
            tokio::task::spawn_blocking(move || live::apply_snapshot(&gw2, &builder2, &b2))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            live::persist_snapshot(&settings.snapshot, &bytes).map_err(|e| e.to_string())
        }
        Lane::Credentials => {
            let doc = delta.transpose().map_err(|e| format!("malformed delta: {e}"))?;
            // Already there (the publish directory brought its version first).
            if doc.as_ref().is_some_and(|d| running(gw, Lane::Credentials) >= d.delta.version) {
                return Ok(());
            }
            let (gw2, path) = (gw.clone(), settings.credentials.clone());
            tokio::task::spawn_blocking(move || {
                let _one = gw2.credentials_writer.lock().unwrap_or_else(|p| p.into_inner());
                match doc {
                    Some(doc) => {
                        live::apply_credentials_delta(&gw2, &doc).map_err(|e| e.to_string())?;
                        live::persist_delta(&path, &bytes).map_err(|e| e.to_string())
                    }
                    None => {
                        live::apply_credentials(&gw2, &bytes).map_err(|e| e.to_string())?;
                        live::persist_credentials(&path, &bytes).map_err(|e| e.to_string())
                    }
                }
            })
            .await
            .map_err(|e| e.to_string())?
        }
    }
}

async fn get(client: &Http, s: &ControlSettings, lane: Lane, poll: Poll) -> Result<Option<Bytes>, String> {
    let url = format!("{}{}?{}", s.url.trim_end_matches('/'), Poll::path(&s.node_id, lane), poll.query());
    let req = Request::get(&url)
        .header(http::header::AUTHORIZATION, format!("Bearer {}", s.token))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(poll.wait_s + 10), client.request(req))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    // A version is no bigger than the file a node would read it from.
    let cap = match lane {
        Lane::Snapshot => disk::SNAPSHOT_FILE_CAP,
        Lane::Credentials => disk::CREDENTIALS_FILE_CAP,
    };
    let body = Limited::new(resp.into_body(), usize::try_from(cap).unwrap_or(usize::MAX))
        .collect()
        .await
        .map_err(|e| format!("{url}: {e} (the limit is {cap} bytes)"))?
        .to_bytes();
    match status {
        StatusCode::OK => Ok(Some(body)),
        StatusCode::NO_CONTENT => Ok(None),
        s => Err(format!("{url}: {s}: {}", String::from_utf8_lossy(&body))),
    }
}

async fn post_ack(client: &Http, s: &ControlSettings, lane: Lane, ack: Ack) -> Result<(), String> {
    let url = format!("{}{}", s.url.trim_end_matches('/'), Ack::path(&s.node_id, lane));
    let body = serde_json::to_vec(&ack).map_err(|e| e.to_string())?;
    let req = Request::post(&url)
        .header(http::header::AUTHORIZATION, format!("Bearer {}", s.token))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())?;
    if resp.status().is_success() { Ok(()) } else { Err(format!("{url}: {}", resp.status())) }
}

/// Fetches every module the snapshot names that is not on disk yet, checking each
/// against its digest.
async fn fetch_modules(client: &Http, s: &ControlSettings, snapshot: &[u8]) -> Result<(), String> {
    let (file, snapshot) = postern_model::SnapshotFile::open(snapshot).map_err(|e| e.to_string())?;
    // Nothing is fetched for a snapshot this node would refuse.
    file.verify(Lane::Snapshot, Some(&s.trust)).map_err(|e| e.to_string())?;
    for hex in snapshot.module_digests() {
        let path = s.modules.join(format!("{hex}.wasm"));
        if path.exists() {
            continue;
        }
        let url = format!("{}{}", s.url.trim_end_matches('/'), protocol::module_path(hex));
        let req = Request::get(&url)
            .header(http::header::AUTHORIZATION, format!("Bearer {}", s.token))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
            .await
            .map_err(|_| format!("module {hex}: no answer"))?
            .map_err(|e| format!("module {hex}: {e}"))?;
        if resp.status() != StatusCode::OK {
            return Err(format!("module {hex}: {}", resp.status()));
        }
        // No bigger than a module a compile would read.
        let cap = disk::MODULE_FILE_CAP;
        let body = Limited::new(resp.into_body(), usize::try_from(cap).unwrap_or(usize::MAX))
            .collect()
            .await
            .map_err(|e| format!("module {hex}: {e} (the limit is {cap} bytes)"))?
            .to_bytes();
        if hex::encode(sha2::Sha256::digest(&body)) != hex {
            return Err(format!("module {hex}: its content does not match its digest"));
        }
        std::fs::create_dir_all(&s.modules).map_err(|e| e.to_string())?;
        disk::write_atomic(&path, &body).map_err(|e| e.to_string())?;
    }
    Ok(())
}
