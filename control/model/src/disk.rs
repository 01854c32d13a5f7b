//! Durable files, as both planes write them: a whole file replaced atomically, a line
//! appended and synced, and the wall clock in Unix seconds.
//!
//! Every state a process keeps on disk (snapshots, credential states, delta logs, keys,
//! store versions) goes through these, so a crash leaves the old file or the new one, and
//! at most a partial last line of a log.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// A file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {}: {source}", .path.display())]
pub struct DiskError {
    /// What was being done (`write`, `move`, `open`).
    pub action: &'static str,
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

fn failed<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DiskError + 'a {
    move |source| DiskError { action, path: path.to_path_buf(), source }
}

/// Replaces `path` with `bytes` atomically: writes `<name>.tmp` beside it, syncs it,
/// renames it over `path`, then syncs the directory, so a reader (or a restart after a
/// crash) sees the old file or the new one, never a partial one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let tmp = path.with_file_name(format!("{name}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(failed("write", &tmp)(e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(failed("move", &tmp)(e));
    }
    sync_dir(path).map_err(failed("sync the folder of", path))
}

/// Syncs the folder holding `path`, so a rename or a new file in it survives a crash.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Appends `line` (newlines in it dropped) and a newline to `path`, created if missing,
/// synced before returning: a crash leaves at most a partial last line, which a replay
/// stops at.
pub fn append_line(path: &Path, line: &[u8]) -> Result<(), DiskError> {
    let created = !path.exists();
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(failed("open", path))?;
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend(line.iter().copied().filter(|b| *b != b'\n'));
    buf.push(b'\n');
    f.write_all(&buf).and_then(|()| f.sync_data()).map_err(failed("write", path))?;
    if created {
        sync_dir(path).map_err(failed("sync the folder of", path))?;
    }
    Ok(())
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_replaced_whole_and_no_temporary_is_left() {
        let dir = std::env::temp_dir().join(format!("postern-disk-{}-{}", std::process::id(), unix_now()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);

        let log = dir.join("deltas");
        append_line(&log, b"a\nb").unwrap();
        append_line(&log, b"c").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"ab\nc\n");

        let err = write_atomic(&dir.join("missing").join("x"), b"x").unwrap_err();
        assert_eq!(err.action, "write");
        assert!(err.to_string().starts_with("cannot write "), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
