//! Where published versions live: every accepted snapshot and credential state, each
//! immutable, numbered and content-hashed, plus the filter modules they name and an
//! audit trail.
//!
//! Two stores, one behaviour: a directory (the embedded default for one machine) and
//! PostgreSQL (production; several `posternctl serve` instances share one database).
//! Numbers come from the store, under its lock, so they are never reused: publishing old
//! contents again (a rollback) makes a new, higher version.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use postern_model::SnapshotFile;
use postern_model::disk::unix_now;
use postern_model::sign::Signer;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

pub use postern_model::protocol::Lane;

/// One published version.
#[derive(Debug, Clone)]
pub struct Version {
    /// Its number.
    pub number: u64,
    /// `sha256:<hex>` of its content.
    pub hash: String,
    /// The sealed envelope, as nodes receive it.
    pub bytes: Arc<[u8]>,
    /// Its signature, if it was published with a signing key.
    pub sig: Option<String>,
}

/// A version to publish, and who publishes it why.
#[derive(Debug, Clone, Copy)]
pub struct Change<'a> {
    /// Which lane.
    pub kind: Lane,
    /// The content (JSON), sealed with the next number.
    pub content: &'a serde_json::value::RawValue,
    /// Who (audited).
    pub who: &'a str,
    /// What (`publish`, `rollback`).
    pub action: &'a str,
    /// Free text.
    pub note: &'a str,
}

/// One audited change.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Unix seconds.
    pub at: u64,
    /// Who (the admin token's name).
    pub who: String,
    /// What (`publish`, `rollback`, ...).
    pub action: String,
    /// Which lane.
    pub kind: Lane,
    /// The version made.
    pub version: u64,
    /// Free text (e.g. "rollback to v3").
    pub note: String,
}

/// Whether a store spec names PostgreSQL (else it is a directory).
pub fn is_postgres(spec: &str) -> bool {
    spec.starts_with("postgres://") || spec.starts_with("postgresql://")
}

/// A version store, and the key it signs new versions with.
pub struct Store {
    backend: Backend,
    signer: Option<Arc<Signer>>,
}

enum Backend {
    /// Files in a directory.
    Dir(DirStore),
    /// PostgreSQL tables.
    Postgres(Box<PgStore>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.backend {
            Backend::Dir(d) => write!(f, "Store::Dir({})", d.root.display()),
            Backend::Postgres(_) => write!(f, "Store::Postgres"),
        }
    }
}

impl Store {
    /// Opens `spec`: a `postgres://` URL, or a directory path. Versions it publishes are
    /// signed with `signer`, when there is one.
    pub async fn open(spec: &str, signer: Option<Arc<Signer>>) -> anyhow::Result<Store> {
        let backend = if is_postgres(spec) {
            Backend::Postgres(Box::new(PgStore::connect(spec).await?))
        } else {
            Backend::Dir(DirStore::open(Path::new(spec))?)
        };
        Ok(Store { backend, signer })
    }

    /// The key new versions are signed with.
    pub fn signer(&self) -> Option<&Signer> {
        self.signer.as_deref()
    }

    /// The newest version of `kind`.
    pub async fn head(&self, kind: Lane) -> anyhow::Result<Option<Version>> {
        match &self.backend {
            Backend::Dir(d) => d.head(kind).await,
            Backend::Postgres(p) => p.head(kind).await,
        }
    }

    /// Version `number` of `kind`.
    pub async fn get(&self, kind: Lane, number: u64) -> anyhow::Result<Option<Version>> {
        match &self.backend {
            Backend::Dir(d) => d.get(kind, number),
            Backend::Postgres(p) => p.get(kind, number).await,
        }
    }

    /// Publishes the change's content as the next version of its lane, unless it equals
    /// the head's content (then the head is returned, and `false`). Audited.
    pub async fn publish(&self, change: &Change<'_>) -> anyhow::Result<(Version, bool)> {
        match &self.backend {
            Backend::Dir(d) => d.publish(change, self.signer.as_deref()).await,
            Backend::Postgres(p) => p.publish(change, self.signer.as_deref()).await,
        }
    }

    /// Stores a filter module by its digest (idempotent).
    pub async fn put_module(&self, digest_hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
        match &self.backend {
            Backend::Dir(d) => d.put_module(digest_hex, bytes),
            Backend::Postgres(p) => p.put_module(digest_hex, bytes).await,
        }
    }

    /// A filter module by its digest.
    pub async fn module(&self, digest_hex: &str) -> anyhow::Result<Option<Vec<u8>>> {
        match &self.backend {
            Backend::Dir(d) => d.module(digest_hex),
            Backend::Postgres(p) => p.module(digest_hex).await,
        }
    }

    /// The audit trail, oldest first.
    pub async fn audit(&self) -> anyhow::Result<Vec<AuditEntry>> {
        match &self.backend {
            Backend::Dir(d) => d.audit(),
            Backend::Postgres(p) => p.audit().await,
        }
    }
}

fn seal(
    kind: Lane,
    number: u64,
    content: &serde_json::value::RawValue,
    signer: Option<&Signer>,
) -> anyhow::Result<Version> {
    let mut file = SnapshotFile {
        version: number,
        hash: postern_model::content_hash(content.get().as_bytes()),
        sig: None,
        content: content.to_owned(),
    };
    if let Some(signer) = signer {
        file.sign(kind, signer);
    }
    let bytes = serde_json::to_vec(&file)?;
    Ok(Version { number, hash: file.hash, bytes: bytes.into(), sig: file.sig })
}

/// Whether `head` may stand for new content with its hash: yes, unless a signing key is
/// set and `head` is not signed by it (a store from before the key, or another key's):
/// then the same content is published again, signed.
fn reusable(kind: Lane, head: &Version, hash: &str, signer: Option<&Signer>) -> bool {
    let subject = postern_model::sign::Subject::Whole { lane: kind, version: head.number, hash: &head.hash };
    head.hash == hash && signer.is_none_or(|s| s.public().verify(&subject, head.sig.as_deref()).is_ok())
}

fn is_hex_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// The embedded store: `<root>/<kind>/<number>.json` (written whole, then renamed),
/// `<root>/modules/<hex>.wasm` and `<root>/audit.jsonl`. One writer: the serving process.
pub struct DirStore {
    root: PathBuf,
    lock: Mutex<()>,
}

impl DirStore {
    /// Opens (and creates) the store at `root`.
    pub fn open(root: &Path) -> anyhow::Result<DirStore> {
        for sub in ["snapshot", "credentials", "modules"] {
            std::fs::create_dir_all(root.join(sub))
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", root.join(sub).display()))?;
        }
        Ok(DirStore { root: root.to_path_buf(), lock: Mutex::new(()) })
    }

    fn numbers(&self, kind: Lane) -> anyhow::Result<Vec<u64>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.root.join(kind.as_str()))? {
            let name = entry?.file_name();
            if let Some(n) = name.to_str().and_then(|n| n.strip_suffix(".json")).and_then(|n| n.parse().ok()) {
                out.push(n);
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    fn get(&self, kind: Lane, number: u64) -> anyhow::Result<Option<Version>> {
        let path = self.root.join(kind.as_str()).join(format!("{number}.json"));
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        };
        let file = SnapshotFile::open_envelope(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(Some(Version { number: file.version, hash: file.hash, sig: file.sig, bytes: bytes.into() }))
    }

    async fn head(&self, kind: Lane) -> anyhow::Result<Option<Version>> {
        match self.numbers(kind)?.last() {
            Some(&n) => self.get(kind, n),
            None => Ok(None),
        }
    }

    async fn publish(&self, change: &Change<'_>, signer: Option<&Signer>) -> anyhow::Result<(Version, bool)> {
        let Change { kind, content, who, action, note } = *change;
        let _guard = self.lock.lock().await;
        let last = self.numbers(kind)?.last().copied();
        if let Some(n) = last
            && let Some(head) = self.get(kind, n)?
            && reusable(kind, &head, &postern_model::content_hash(content.get().as_bytes()), signer)
        {
            return Ok((head, false));
        }
        let v = seal(kind, last.unwrap_or(0) + 1, content, signer)?;
        crate::write_atomic(&self.root.join(kind.as_str()).join(format!("{}.json", v.number)), &v.bytes)?;
        let entry = AuditEntry {
            at: unix_now(),
            who: who.to_owned(),
            action: action.to_owned(),
            kind,
            version: v.number,
            note: note.to_owned(),
        };
        let mut line = serde_json::to_vec(&entry)?;
        line.push(b'\n');
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(self.root.join("audit.jsonl"))?;
        f.write_all(&line)?;
        f.sync_data()?;
        Ok((v, true))
    }

    fn put_module(&self, hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
        anyhow::ensure!(is_hex_digest(hex), "bad module digest {hex:?}");
        let path = self.root.join("modules").join(format!("{hex}.wasm"));
        if !path.exists() {
            crate::write_atomic(&path, bytes)?;
        }
        Ok(())
    }

    fn module(&self, hex: &str) -> anyhow::Result<Option<Vec<u8>>> {
        if !is_hex_digest(hex) {
            return Ok(None);
        }
        match std::fs::read(self.root.join("modules").join(format!("{hex}.wasm"))) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn audit(&self) -> anyhow::Result<Vec<AuditEntry>> {
        let text = match std::fs::read_to_string(self.root.join("audit.jsonl")) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        // A torn last line (a crash mid-append) is skipped, never fatal.
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    }
}

/// The PostgreSQL store. Versions are numbered under a transaction-scoped advisory lock
/// per lane, so concurrent publishers from several instances never take one number twice.
pub struct PgStore {
    /// Reads.
    client: tokio_postgres::Client,
    /// Publishing transactions, one at a time, on their own connection so no read of
    /// another task runs inside one.
    writer: Mutex<tokio_postgres::Client>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS postern_versions (
    kind text NOT NULL,
    version bigint NOT NULL,
    hash text NOT NULL,
    body bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, version)
);
CREATE TABLE IF NOT EXISTS postern_modules (
    digest text PRIMARY KEY,
    body bytea NOT NULL
);
CREATE TABLE IF NOT EXISTS postern_audit (
    id bigserial PRIMARY KEY,
    at bigint NOT NULL,
    who text NOT NULL,
    action text NOT NULL,
    kind text NOT NULL,
    version bigint NOT NULL,
    note text NOT NULL
);
";

impl PgStore {
    /// Connects and makes the tables if they are missing.
    pub async fn connect(url: &str) -> anyhow::Result<PgStore> {
        let client = PgStore::connection(url).await?;
        let writer = PgStore::connection(url).await?;
        // Two instances starting at once may race on CREATE TABLE IF NOT EXISTS.
        client.execute("SELECT pg_advisory_lock(7106)", &[]).await?;
        let made = client.batch_execute(SCHEMA).await;
        client.execute("SELECT pg_advisory_unlock(7106)", &[]).await?;
        made?;
        Ok(PgStore { client, writer: Mutex::new(writer) })
    }

    async fn connection(url: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL: {e}"))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                eprintln!("posternctl: PostgreSQL connection lost: {e}");
            }
        });
        Ok(client)
    }

    fn row(kind: Lane, row: &tokio_postgres::Row) -> anyhow::Result<Version> {
        let number: i64 = row.try_get(0)?;
        let hash: String = row.try_get(1)?;
        let body: Vec<u8> = row.try_get(2)?;
        let file =
            SnapshotFile::open_envelope(&body).map_err(|e| anyhow::anyhow!("{} v{number}: {e}", kind.as_str()))?;
        anyhow::ensure!(file.hash == hash, "{} v{number}: stored hash differs", kind.as_str());
        Ok(Version { number: u64::try_from(number)?, hash, sig: file.sig, bytes: body.into() })
    }

    async fn head(&self, kind: Lane) -> anyhow::Result<Option<Version>> {
        PgStore::head_on(&self.client, kind).await
    }

    async fn head_on(client: &tokio_postgres::Client, kind: Lane) -> anyhow::Result<Option<Version>> {
        let rows = client
            .query(
                "SELECT version, hash, body FROM postern_versions WHERE kind = $1 ORDER BY version DESC LIMIT 1",
                &[&kind.as_str()],
            )
            .await?;
        rows.first().map(|r| PgStore::row(kind, r)).transpose()
    }

    async fn get(&self, kind: Lane, number: u64) -> anyhow::Result<Option<Version>> {
        let n = i64::try_from(number)?;
        let rows = self
            .client
            .query(
                "SELECT version, hash, body FROM postern_versions WHERE kind = $1 AND version = $2",
                &[&kind.as_str(), &n],
            )
            .await?;
        rows.first().map(|r| PgStore::row(kind, r)).transpose()
    }

    async fn publish(&self, change: &Change<'_>, signer: Option<&Signer>) -> anyhow::Result<(Version, bool)> {
        let Change { kind, content, who, action, note } = *change;
        let hash = postern_model::content_hash(content.get().as_bytes());
        // One transaction: lock the lane, read its head, append, audit.
        let client = self.writer.lock().await;
        client.batch_execute("BEGIN").await?;
        let result = async {
            let lane = if kind == Lane::Snapshot { 1i64 } else { 2 };
            client.execute("SELECT pg_advisory_xact_lock(7107, $1::int)", &[&(lane as i32)]).await?;
            let head = PgStore::head_on(&client, kind).await?;
            if let Some(h) = head.as_ref().filter(|h| reusable(kind, h, &hash, signer)) {
                return Ok::<_, anyhow::Error>((h.clone(), false));
            }
            let v = seal(kind, head.map_or(0, |h| h.number) + 1, content, signer)?;
            let n = i64::try_from(v.number)?;
            client
                .execute(
                    "INSERT INTO postern_versions (kind, version, hash, body) VALUES ($1, $2, $3, $4)",
                    &[&kind.as_str(), &n, &v.hash, &&v.bytes[..]],
                )
                .await?;
            let at = i64::try_from(unix_now())?;
            client
                .execute(
                    "INSERT INTO postern_audit (at, who, action, kind, version, note) VALUES ($1, $2, $3, $4, $5, $6)",
                    &[&at, &who, &action, &kind.as_str(), &n, &note],
                )
                .await?;
            Ok((v, true))
        }
        .await;
        match result {
            Ok(v) => {
                client.batch_execute("COMMIT").await?;
                Ok(v)
            }
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                Err(e)
            }
        }
    }

    async fn put_module(&self, hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
        anyhow::ensure!(is_hex_digest(hex), "bad module digest {hex:?}");
        self.client
            .execute(
                "INSERT INTO postern_modules (digest, body) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&hex, &bytes],
            )
            .await?;
        Ok(())
    }

    async fn module(&self, hex: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let rows = self.client.query("SELECT body FROM postern_modules WHERE digest = $1", &[&hex]).await?;
        Ok(rows.first().map(|r| r.try_get(0)).transpose()?)
    }

    async fn audit(&self) -> anyhow::Result<Vec<AuditEntry>> {
        let rows = self
            .client
            .query("SELECT at, who, action, kind, version, note FROM postern_audit ORDER BY id", &[])
            .await?;
        rows.iter()
            .map(|r| {
                let kind: String = r.try_get(3)?;
                Ok(AuditEntry {
                    at: u64::try_from(r.try_get::<_, i64>(0)?)?,
                    who: r.try_get(1)?,
                    action: r.try_get(2)?,
                    kind: if kind == "credentials" { Lane::Credentials } else { Lane::Snapshot },
                    version: u64::try_from(r.try_get::<_, i64>(4)?)?,
                    note: r.try_get(5)?,
                })
            })
            .collect()
    }
}
