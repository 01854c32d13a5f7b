//! Postern's control plane. This crate compiles a team config repository into one
//! immutable, numbered, content-hashed snapshot ([`compile::compile`],
//! [`publish`]) and validates it; serving, staging and the fast lane build on it.

pub mod compile;
pub mod config;
pub mod filter_run;

use std::path::Path;

use postern_model::SnapshotFile;

use crate::compile::Compiled;

/// Writes the snapshot to `out` atomically (temp file + rename), and every filter module
/// it references to `modules/<hex>.wasm` beside it (first), and returns its envelope.
///
/// The version is `version` if given; otherwise, when `out` already holds a valid
/// snapshot, the same number if the content is unchanged, or the next one if it changed;
/// otherwise 1.
pub fn publish(compiled: &Compiled, out: &Path, version: Option<u64>) -> anyhow::Result<SnapshotFile> {
    let snapshot = &compiled.snapshot;
    if !compiled.modules.is_empty() {
        let dir = out.parent().unwrap_or(Path::new(".")).join("modules");
        std::fs::create_dir_all(&dir).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        for (digest, src) in &compiled.modules {
            let hex = digest.trim_start_matches("sha256:");
            let dst = dir.join(format!("{hex}.wasm"));
            if dst.exists() {
                continue; // content-addressed: same name, same bytes
            }
            let tmp = dir.join(format!("{hex}.wasm.tmp"));
            std::fs::copy(src, &tmp).map_err(|e| anyhow::anyhow!("cannot copy {}: {e}", src.display()))?;
            std::fs::rename(&tmp, &dst)?;
        }
    }
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
