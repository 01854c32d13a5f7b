//! Postern's control plane. This crate compiles a team config repository into one
//! immutable, numbered, content-hashed snapshot ([`compile::compile`],
//! [`publish`]) and validates it; serving, staging and the fast lane build on it.
//! The credential state travels beside it ([`credentials`]), and [`keys`] manages API
//! keys and development signing keys.

/// `print!` to stdout, except that a reader that went away (`posternctl … | head`) ends
/// the process quietly with status 141, as SIGPIPE ends other Unix tools, instead of a
/// panic; any other write error is reported and exits 1.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// `println!` to stdout, as [`out!`].
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

pub mod compile;
pub mod config;
pub mod credentials;
pub mod engines;
pub mod filter_cost;
pub mod filter_new;
pub mod filter_review;
pub mod filter_run;
pub mod keys;
pub mod keyservice;
pub mod openapi;
pub mod plan;
pub mod rollout;
pub mod serve;
pub mod store;
pub mod usage;

use std::path::Path;

use postern_model::SnapshotFile;

use crate::compile::Compiled;

/// Ends the process after a failed write to stdout (see [`out!`]).
#[doc(hidden)]
pub fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("error: cannot write to stdout: {e}");
    std::process::exit(1)
}

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
            // Read again as the compile read it (a regular file within the cap) and checked
            // against the digest the compile took, so the file cannot change in between.
            let bytes = postern_model::disk::read_untrusted(src, postern_model::disk::MODULE_FILE_CAP)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", src.display()))?;
            anyhow::ensure!(
                postern_model::content_hash(&bytes) == *digest,
                "{} changed while it was compiled",
                src.display()
            );
            write_atomic(&dst, &bytes)?;
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
    write_atomic(out, &bytes)?;
    Ok(file)
}

pub use postern_model::disk::write_atomic;
