//! Versions from files: the snapshot and credential files reloaded when they change
//! (told by the kernel, with a slow backstop poll) or on SIGHUP.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::gateway::Gateway;
use crate::node::live;
use crate::snapshot::Builder;

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

/// Reloads the snapshot and credential files when they change (told by the kernel, with a
/// slow backstop poll; or polled every `every` where it cannot tell) or on SIGHUP.
pub(crate) async fn watch_snapshot(
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
