//! Postern's control plane. This crate compiles a team config repository into one
//! immutable, numbered, content-hashed snapshot ([`compile::compile`],
//! [`publish`]) and validates it; serving, staging and the fast lane build on it.

pub mod compile;
pub mod config;

use std::path::Path;

use postern_model::{Snapshot, SnapshotFile};

/// Writes `snapshot` to `out` atomically (temp file + rename) and returns its envelope.
///
/// The version is `version` if given; otherwise, when `out` already holds a valid
/// snapshot, the same number if the content is unchanged, or the next one if it changed;
/// otherwise 1.
pub fn publish(snapshot: &Snapshot, out: &Path, version: Option<u64>) -> anyhow::Result<SnapshotFile> {
    let previous = std::fs::read(out).ok().and_then(|b| SnapshotFile::open(&b).ok()).map(|(f, _)| f);
    let mut file = SnapshotFile::seal(version.unwrap_or(1), snapshot)?;
    if version.is_none()
        && let Some(prev) = previous
    {
        file.version = if prev.hash == file.hash { prev.version } else { prev.version + 1 };
    }
    let bytes = serde_json::to_vec(&file)?;
    let tmp = out.with_extension("json.tmp");
    std::fs::write(&tmp, &bytes).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tmp.display()))?;
    {
        let f = std::fs::File::open(&tmp)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, out)
        .map_err(|e| anyhow::anyhow!("cannot move {} to {}: {e}", tmp.display(), out.display()))?;
    Ok(file)
}
