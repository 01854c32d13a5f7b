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

/// Replaces `path` with `bytes` atomically: writes a randomly named temporary file
/// (`.postern-<random>.tmp`) beside it, created exclusively (`O_EXCL`: a planted file or
/// symbolic link there is never opened), syncs it, renames it over `path` (a symbolic
/// link at `path` is replaced, never followed), then syncs the directory, so a reader (or
/// a restart after a crash) sees the old file or the new one, never a partial one. Two
/// writers sharing the folder each write their own temporary file; the last rename wins.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DiskError> {
    let dir = folder_of(path);
    let mut tmp = tempfile::Builder::new()
        .prefix(".postern-")
        .suffix(".tmp")
        // What `File::create` gives (0o666 less the umask): nodes running as another user
        // read what this writes.
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .tempfile_in(dir)
        .map_err(failed("write", path))?;
    // Dropping `tmp` on an error removes the temporary file.
    tmp.write_all(bytes).and_then(|()| tmp.as_file().sync_all()).map_err(failed("write", tmp.path()))?;
    tmp.persist(path).map_err(|e| DiskError { action: "move", path: path.to_path_buf(), source: e.error })?;
    sync_dir(path).map_err(failed("sync the folder of", path))
}

/// The folder holding `path` (`.` for a bare name).
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The largest snapshot file a node reads, or takes from the control plane: 256 MiB.
pub const SNAPSHOT_FILE_CAP: u64 = 256 << 20;

/// The largest credentials file (`credentials.json`, signed) a node reads, from the
/// publish directory or its own: 1 GiB.
pub const CREDENTIALS_FILE_CAP: u64 = 1 << 30;

/// The largest Wasm module a node downloads, or a compile reads: 32 MiB.
pub const MODULE_FILE_CAP: u64 = 32 << 20;

/// Why [`read_untrusted`] refused a file (inside its `io::Error`): the rule, as text.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(String);

/// Whether `e` is a refusal by [`read_untrusted`] (a rule it enforces), not a failure to
/// read (a missing file, no permission).
pub fn is_refusal(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Refused>())
}

/// Reads a whole file from a place others can write, refusing what would hurt the reader:
/// a symbolic link (opened with `O_NOFOLLOW`), anything but a regular file (a FIFO, a
/// device such as `/dev/zero`, a folder: opened with `O_NONBLOCK` so a FIFO cannot hang the
/// open, then checked with `fstat`), and a file over `cap` bytes (by its size, then read
/// through `take(cap + 1)` so a file that grows while read is refused too). Each refusal is
/// an `io::Error` whose message names the rule ([`is_refusal`] tells it apart).
pub fn read_untrusted(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    read_bounded(path, cap, false)
}

/// As [`read_untrusted`], but a symbolic link is followed: for a file the operator names
/// (a node's own `--snapshot` and credentials files, often links into a mounted
/// configuration). What it leads to must still be a regular file within `cap`.
pub fn read_regular(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    read_bounded(path, cap, true)
}

fn read_bounded(path: &Path, cap: u64, follow: bool) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let refused = |kind: std::io::ErrorKind, why: String| std::io::Error::new(kind, Refused(why));
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nofollow | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        // O_NOFOLLOW on a symbolic link fails with ELOOP.
        Err(e) if !follow && e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refused(std::io::ErrorKind::InvalidInput, "a symbolic link, refused".into()));
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(refused(std::io::ErrorKind::InvalidInput, "not a regular file, refused".into()));
    }
    let over = |n: u64| refused(std::io::ErrorKind::InvalidData, format!("{n} bytes, over the limit of {cap}"));
    if meta.len() > cap {
        return Err(over(meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    let read = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
    if read > cap {
        return Err(over(read));
    }
    Ok(bytes)
}

/// Syncs the folder holding `path`, so a rename or a new file in it survives a crash.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(folder_of(path))?.sync_all()
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

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("postern-disk-{tag}-{}-{}", std::process::id(), unix_now()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_planted_symbolic_link_is_replaced_never_followed() {
        let dir = scratch("plant");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = dir.join("credentials.json");
        // The old fixed temporary name, and the target itself, point at a file the writer
        // can write.
        std::os::unix::fs::symlink(&victim, dir.join("credentials.json.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_file());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["credentials.json", "credentials.json.tmp", "victim"].map(std::ffi::OsString::from));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_untrusted_read_refuses_links_devices_fifos_and_oversize_files() {
        let dir = scratch("untrusted");
        let ok = dir.join("ok");
        std::fs::write(&ok, b"12345").unwrap();
        assert_eq!(read_untrusted(&ok, 5).unwrap(), b"12345");
        assert_eq!(read_untrusted(&ok, 4).unwrap_err().to_string(), "5 bytes, over the limit of 4");

        let link = dir.join("link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert_eq!(read_untrusted(&link, 1 << 20).unwrap_err().to_string(), "a symbolic link, refused");
        assert!(is_refusal(&read_untrusted(&link, 1 << 20).unwrap_err()));
        // An operator's own file may be a link, to a regular file only.
        assert_eq!(read_regular(&link, 1 << 20).unwrap_err().to_string(), "not a regular file, refused");
        let good_link = dir.join("good-link");
        std::os::unix::fs::symlink(&ok, &good_link).unwrap();
        assert_eq!(read_regular(&good_link, 5).unwrap(), b"12345");
        assert_eq!(read_untrusted(&good_link, 5).unwrap_err().to_string(), "a symbolic link, refused");
        assert_eq!(
            read_untrusted(Path::new("/dev/zero"), 1 << 20).unwrap_err().to_string(),
            "not a regular file, refused"
        );
        assert_eq!(read_untrusted(&dir, 1 << 20).unwrap_err().to_string(), "not a regular file, refused");

        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        // No writer: a blocking open would wait forever; this answers at once.
        assert_eq!(read_untrusted(&fifo, 1 << 20).unwrap_err().to_string(), "not a regular file, refused");

        let sparse = dir.join("sparse");
        std::fs::File::create(&sparse).unwrap().set_len(50 << 30).unwrap();
        assert_eq!(
            read_untrusted(&sparse, CREDENTIALS_FILE_CAP).unwrap_err().to_string(),
            format!("{} bytes, over the limit of {CREDENTIALS_FILE_CAP}", 50u64 << 30)
        );
        let missing = read_untrusted(&dir.join("missing"), 1).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        assert!(!is_refusal(&missing));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
