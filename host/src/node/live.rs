//! A node's live state: the snapshot and the credential state it serves, and their
//! copies on disk (the snapshot file, the credentials file and the log of fast-lane deltas
//! beside it). Both ways versions arrive — the file watcher and SIGHUP in [`crate::node::watch`],
//! the control plane in [`crate::node::control_client`] — apply and persist them through here,
//! and nothing else swaps or writes them.
//!
//! Applying builds beside the live version and swaps one pointer; a version that fails to
//! build, or is not newer, is refused with the reason and the live one stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use postern_builtin_filters::auth::StoreError;
use postern_model::SnapshotError;
use postern_model::disk::{self, DiskError};

use crate::gateway::Gateway;
use crate::snapshot::{BuildError, Builder};

/// Why a version was refused; the live one stays. Its text is the NACK's reason.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The file could not be read.
    #[error("cannot read: {0}")]
    Read(#[source] std::io::Error),
    /// The snapshot does not build on this node.
    #[error(transparent)]
    Snapshot(#[from] BuildError),
    /// The credential state's envelope is malformed or fails its hash.
    #[error(transparent)]
    Envelope(#[from] SnapshotError),
    /// An entry of the credential state (or of a delta) is invalid.
    #[error(transparent)]
    Credentials(#[from] StoreError),
    /// A snapshot not newer than the live one (versions are never reused).
    #[error("version {version} is not newer than the live {live} (versions are never reused)")]
    NotNewer {
        /// The version offered.
        version: u64,
        /// The live version.
        live: u64,
    },
    /// A credential state older than the live one.
    #[error("version {version} is older than the live {live}")]
    Older {
        /// The version offered.
        version: u64,
        /// The live version.
        live: u64,
    },
    /// A delta that does not start from the live credential state.
    #[error("delta from v{base} to v{version}, but v{live} is live")]
    DeltaBase {
        /// The version the delta starts from.
        base: u64,
        /// The version it makes.
        version: u64,
        /// The live version.
        live: u64,
    },
}

/// Where a file a node reads lies: the node's own files (named by its operator, a
/// symbolic link into a mounted configuration followed) or a folder others write (the
/// publish directory: no link followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `--snapshot`, `--credentials`: [`disk::read_regular`].
    Own,
    /// `--credentials-dir`: [`disk::read_untrusted`].
    Shared,
}

/// Reads a file a node serves from, a regular file of at most `cap` bytes (see
/// [`Origin`]); a refusal (a symbolic link where none is followed, not a regular file,
/// over the cap) is counted in `postern_files_refused_total`.
pub fn read_file(gw: &Gateway, path: &Path, cap: u64, origin: Origin) -> std::io::Result<Vec<u8>> {
    let read = match origin {
        Origin::Own => disk::read_regular(path, cap),
        Origin::Shared => disk::read_untrusted(path, cap),
    };
    if let Err(e) = &read
        && disk::is_refusal(e)
    {
        gw.metrics.files_refused.fetch_add(1, Ordering::Relaxed);
    }
    read
}

/// Reads the snapshot file and swaps it in, unless it fails to build or is not newer.
pub fn reload(gw: &Gateway, builder: &Builder, path: &Path) {
    let bytes = match read_file(gw, path, disk::SNAPSHOT_FILE_CAP, Origin::Own) {
        Ok(b) => b,
        Err(e) => {
            gw.metrics.reloads_failed.fetch_add(1, Ordering::Relaxed);
            tracing::error!(path = ?path, error = %e, "snapshot refused: cannot read it; keeping the live one");
            return;
        }
    };
    if let Err(e) = apply_snapshot(gw, builder, &bytes) {
        tracing::error!(path = %path.display(), error = %e, "snapshot refused; keeping the live one");
    }
}

/// Builds a snapshot beside the live one and swaps it in if it builds and is newer (the
/// same contents again are a no-op); otherwise the live one stays and the reason is
/// returned.
pub fn apply_snapshot(gw: &Gateway, builder: &Builder, bytes: &[u8]) -> Result<(), ApplyError> {
    let started = std::time::Instant::now();
    let refuse = |why: ApplyError| {
        gw.metrics.reloads_failed.fetch_add(1, Ordering::Relaxed);
        Err(why)
    };
    let live = match builder.build_bytes(bytes) {
        Ok(l) => l,
        Err(e) => return refuse(e.into()),
    };
    let current = gw.live.load();
    if live.hash == current.hash && live.version == current.version {
        return Ok(());
    }
    if live.version <= current.version {
        return refuse(ApplyError::NotNewer { version: live.version, live: current.version });
    }
    let (version, hash, routes) = (live.version, live.hash.clone(), live.route_count);
    gw.live.store(Arc::new(live));
    gw.metrics.reloads_ok.fetch_add(1, Ordering::Relaxed);
    gw.metrics.snapshot_version.store(version, Ordering::Relaxed);
    tracing::info!(version, %hash, routes, build_ms = started.elapsed().as_millis() as u64, "snapshot live");
    Ok(())
}

/// Reads the credentials file and swaps it in whole, unless it is not newer than the live
/// one; a refused file leaves the live state in place.
pub fn reload_credentials(gw: &Gateway, path: &Path) -> Result<(), ApplyError> {
    let result = match read_file(gw, path, disk::CREDENTIALS_FILE_CAP, Origin::Own) {
        Ok(bytes) => apply_credentials(gw, &bytes),
        Err(e) => {
            gw.metrics.credentials_failed.fetch_add(1, Ordering::Relaxed);
            Err(ApplyError::Read(e))
        }
    };
    if let Err(why) = &result {
        tracing::error!(path = ?path, error = %why, "credentials refused; keeping the live ones");
    }
    result
}

/// Swaps in a credential state if it opens, builds and is newer; the same version again
/// is a no-op; otherwise the live state stays and the reason is returned.
pub fn apply_credentials(gw: &Gateway, bytes: &[u8]) -> Result<(), ApplyError> {
    // The file the node itself just wrote (or any file of the live version) is not parsed
    // again: for a large key table that is most of a change's cost.
    apply_credentials_if(gw, bytes, |offered, live| offered == 0 || offered != live).map(|_| ())
}

/// As [`apply_credentials`], but only a version `wanted(offered, live)` says yes to is
/// parsed at all; whether it was applied.
pub fn apply_credentials_if(
    gw: &Gateway,
    bytes: &[u8],
    wanted: impl FnOnce(u64, u64) -> bool,
) -> Result<bool, ApplyError> {
    let refuse = |why: ApplyError| {
        gw.metrics.credentials_failed.fetch_add(1, Ordering::Relaxed);
        Err(why)
    };
    let current = gw.auth.credentials.load();
    let opened = postern_model::credentials::Credentials::open_if(bytes, |v| wanted(v, current.version));
    let (file, creds) = match opened {
        Ok(Some(x)) => x,
        Ok(None) => return Ok(false),
        Err(e) => return refuse(e.into()),
    };
    if let Err(e) = file.verify(gw.trust.as_deref()) {
        return refuse(e.into());
    }
    if file.version <= current.version {
        if file.version < current.version {
            return refuse(ApplyError::Older { version: file.version, live: current.version });
        }
        return Ok(false);
    }
    let now = disk::unix_now();
    let store = match postern_builtin_filters::auth::CredentialStore::build(file.version, &creds, now) {
        Ok(s) => s,
        Err(e) => return refuse(e.into()),
    };
    let (keys, signing, apps, deny) = store.counts();
    gw.auth.credentials.store(Arc::new(store));
    gw.metrics.credentials_ok.fetch_add(1, Ordering::Relaxed);
    gw.metrics.credentials_version.store(file.version, Ordering::Relaxed);
    tracing::info!(version = file.version, keys, signing, apps, deny, "credentials live");
    Ok(true)
}

/// Applies a fast-lane delta to the live credential state; it must start from the live
/// version.
pub fn apply_credentials_delta(gw: &Gateway, doc: &postern_model::credentials::DeltaDoc) -> Result<(), ApplyError> {
    if let Err(e) = doc.verify(gw.trust.as_deref()) {
        gw.metrics.credentials_failed.fetch_add(1, Ordering::Relaxed);
        return Err(e.into());
    }
    let d = &doc.delta;
    let live = gw.auth.credentials.load();
    if live.version != d.base {
        gw.metrics.credentials_failed.fetch_add(1, Ordering::Relaxed);
        return Err(ApplyError::DeltaBase { base: d.base, version: d.version, live: live.version });
    }
    let now = disk::unix_now();
    let store = live.with_changes(d.version, &d.keys, &d.deny, &d.over_quota, &d.debug_trace, now).map_err(|e| {
        gw.metrics.credentials_failed.fetch_add(1, Ordering::Relaxed);
        ApplyError::from(e)
    })?;
    gw.auth.credentials.store(Arc::new(store));
    gw.metrics.credentials_ok.fetch_add(1, Ordering::Relaxed);
    gw.metrics.credentials_version.store(d.version, Ordering::Relaxed);
    tracing::info!(
        version = d.version,
        keys = d.keys.len(),
        deny = d.deny.len(),
        over_quota = d.over_quota.len(),
        "credentials live (delta)"
    );
    Ok(())
}

/// The log of fast-lane deltas applied since the credentials file was written, one JSON
/// document a line, beside it.
pub fn delta_log(credentials: &Path) -> PathBuf {
    credentials.with_extension("deltas")
}

/// Replays the delta log over the credentials file just loaded; stops at the first line
/// that is partial, corrupted or does not follow (a crash mid-append loses only that one).
pub fn replay_deltas(gw: &Gateway, credentials: &Path) {
    let Ok(text) = std::fs::read_to_string(delta_log(credentials)) else { return };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let applied = match postern_model::credentials::DeltaDoc::parse(line.as_bytes()) {
            Some(Ok(doc)) => apply_credentials_delta(gw, &doc).map_err(|e| e.to_string()),
            Some(Err(e)) => Err(e.to_string()),
            None => Err("not a delta".to_owned()),
        };
        if let Err(e) = applied {
            tracing::warn!(error = %e, "credential delta log: stopped replaying");
            return;
        }
    }
}

/// Writes a snapshot the node applied to its file, so a restart without the control
/// plane serves it.
pub fn persist_snapshot(path: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    disk::write_atomic(path, bytes)
}

/// Writes a whole credential state the node applied to its file; it holds every delta
/// before it, so the delta log is cleared.
pub fn persist_credentials(path: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    disk::write_atomic(path, bytes)?;
    let log = delta_log(path);
    match std::fs::remove_file(&log) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(DiskError { action: "clear", path: log, source: e }),
        _ => Ok(()),
    }
}

/// Appends a delta the node applied to the log beside its credentials file (synced), for
/// [`replay_deltas`] at the next start.
pub fn persist_delta(credentials: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    disk::append_line(&delta_log(credentials), bytes)
}
