//! The quota service's parts of `posternctl serve`: who is on which quota (from the
//! published plans and credentials), publishing over-quota flags on the credentials lane,
//! and the webhook that delivers quota events.
//!
//! The usage intake applies windows and their quota use in one transaction
//! ([`UsageStore::apply`]); nothing here is on its path. It wakes the flag publisher,
//! which compares the store's live flags with the credentials head and publishes a new
//! version when they differ (a delta when it only adds flags, so nodes have it in about a
//! second). The webhook sender drains undelivered events with retries on its own task.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use postern_model::credentials::{Credentials, CredentialsDelta, DeltaDoc, QuotaFlag};
use postern_model::disk::unix_now;

use super::state::{DELTAS_KEPT, QuotaService, Server};
use crate::store::{Change, Lane, Version};
use crate::usage::{QuotaEvent, Quotas, UsageStore};

/// How often flags are compared with the credentials head without a wake-up.
const FLAG_PASS: Duration = Duration::from_secs(5);
/// How often the webhook sender looks for events due.
const WEBHOOK_PASS: Duration = Duration::from_secs(1);
/// When the reconciler first runs after start, and how often after.
const RECONCILE_FIRST: Duration = Duration::from_secs(60);
const RECONCILE_EVERY: Duration = Duration::from_secs(3600);
/// The longest wait between two deliveries of one event.
const WEBHOOK_MAX_BACKOFF_S: u64 = 300;

impl QuotaService {
    /// A service posting events to `webhook`, if given.
    pub(super) fn new(webhook: Option<Arc<Webhook>>) -> QuotaService {
        QuotaService { webhook, ..QuotaService::default() }
    }
}

/// The quota webhook as the sender uses it: where, through which client (trusting only
/// the certificates given), and the secret each event is signed with.
#[derive(Debug)]
pub(super) struct Webhook {
    url: String,
    client: postern_model::tls::ControlClient,
    secret: Option<Vec<u8>>,
}

/// Bytes a webhook secret's file may hold at most.
const SECRET_FILE_MAX: u64 = 4096;
/// Bytes a webhook secret has at least.
const SECRET_MIN: usize = 16;

impl Webhook {
    /// Checks and opens the webhook's settings: an `http://` or `https://` URL, the
    /// certificates an `https://` one needs, and the secret's file.
    pub(super) fn open(w: &super::QuotaWebhook) -> anyhow::Result<Webhook> {
        let https = w.url.starts_with("https://");
        // The URL may carry a credential: errors name its scheme, never the URL.
        anyhow::ensure!(https || w.url.starts_with("http://"), "--quota-webhook: an http:// or https:// URL");
        anyhow::ensure!(
            !https || w.ca.is_some(),
            "--quota-webhook is https:// but no --quota-webhook-ca names the certificates to trust it by \
             (there is no implicit trust store)"
        );
        let client = postern_model::tls::client(w.ca.as_deref())?;
        let secret = w.secret_file.as_deref().map(read_secret).transpose()?;
        Ok(Webhook { url: w.url.clone(), client, secret })
    }
}

/// A webhook secret from its file: `whsec_<base64>` (Standard Webhooks' form) decoded, or
/// the file's bytes, trimmed; at least [`SECRET_MIN`] bytes.
fn read_secret(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("--quota-webhook-secret-file {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(SECRET_FILE_MAX + 1).read_to_end(&mut bytes)?;
    anyhow::ensure!(
        bytes.len() as u64 <= SECRET_FILE_MAX,
        "--quota-webhook-secret-file {}: over {SECRET_FILE_MAX} bytes",
        path.display()
    );
    let text = bytes.trim_ascii();
    let secret = match text.strip_prefix(b"whsec_") {
        Some(b64) => base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b64).map_err(|e| {
            anyhow::anyhow!("--quota-webhook-secret-file {}: whsec_ but not base64: {e}", path.display())
        })?,
        None => text.to_vec(),
    };
    anyhow::ensure!(
        secret.len() >= SECRET_MIN,
        "--quota-webhook-secret-file {}: a secret of at least {SECRET_MIN} bytes",
        path.display()
    );
    Ok(secret)
}

/// The Standard Webhooks signature of `body` sent as event `id` at Unix second `at`:
/// `v1,` and the base64 of HMAC-SHA256 over `id.at.body`.
pub(super) fn webhook_signature(secret: &[u8], id: &str, at: u64, body: &[u8]) -> String {
    let key = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, secret);
    let mut ctx = aws_lc_rs::hmac::Context::with_key(&key);
    ctx.update(format!("{id}.{at}.").as_bytes());
    ctx.update(body);
    let tag = ctx.sign();
    format!("v1,{}", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, tag.as_ref()))
}

impl Server {
    /// Who is on which quota, as the published plans and credentials say; rebuilt when
    /// either head moves.
    pub(super) async fn quotas(&self) -> Result<Arc<Quotas>, QuotaError> {
        let (s, c, _) = *self.heads.borrow();
        if let Ok(slot) = self.quota.quotas.lock()
            && let Some((at, q)) = slot.as_ref()
            && *at == (s, c)
        {
            return Ok(q.clone());
        }
        let snapshot = self.store.head(Lane::Snapshot).await.map_err(QuotaError::Store)?;
        let creds = self.store.head(Lane::Credentials).await.map_err(QuotaError::Store)?;
        let at = (snapshot.as_ref().map_or(0, |v| v.number), creds.as_ref().map_or(0, |v| v.number));
        let built = tokio::task::spawn_blocking(move || -> Result<Quotas, QuotaError> {
            let plans = match &snapshot {
                Some(v) => postern_model::SnapshotFile::open(&v.bytes)?.1.plans,
                None => return Ok(Quotas::default()),
            };
            let creds = match &creds {
                Some(v) => Credentials::open(&v.bytes)?.1,
                None => Credentials::empty(),
            };
            Ok(Quotas::new(&plans, &creds))
        })
        .await??;
        let built = Arc::new(built);
        if let Ok(mut slot) = self.quota.quotas.lock() {
            *slot = Some((at, built.clone()));
        }
        Ok(built)
    }

    /// Publishes the usage store's live over-quota flags on the credentials lane when the
    /// head carries others.
    pub(super) async fn publish_flags(&self) -> Result<(), QuotaError> {
        self.publish_flags_as("quota-service", "quota").await.map(|_| ())
    }

    /// [`Server::publish_flags`], audited as `who` doing `action`; the credentials version
    /// that carries the flags as they are now (a new one if they changed).
    pub(super) async fn publish_flags_as(&self, who: &str, action: &str) -> Result<u64, QuotaError> {
        let Some(usage) = self.usage.clone() else { return Ok(0) };
        let now = unix_now();
        let live = blocking(&usage, move |u| u.live_flags(now)).await?;
        let one = self.publishing.lock().await;
        // No credentials published yet: the first version takes the flags.
        let Some(base) = self.store.head(Lane::Credentials).await.map_err(QuotaError::Store)? else {
            return Ok(0);
        };
        let (_, was) = Credentials::open(&base.bytes)?;
        let mut held: Vec<QuotaFlag> = was.over_quota.iter().filter(|f| f.until > now).cloned().collect();
        held.sort();
        if held == live {
            return Ok(base.number);
        }
        let added: Vec<QuotaFlag> = live.iter().filter(|f| !was.over_quota.contains(f)).cloned().collect();
        let mut creds = was.clone();
        creds.over_quota = live;
        let content = serde_json::value::to_raw_value(&creds)?;
        let note =
            added.iter().map(|f| format!("{} {} on {}", f.kind.as_str(), f.caller, f.product)).collect::<Vec<_>>();
        let note = format!("over quota: {}", if note.is_empty() { "flags lifted".to_owned() } else { note.join(", ") });
        let change = Change { kind: Lane::Credentials, content: &content, who, action, note: &note };
        let (v, changed) = self.store.publish(&change).await.map_err(QuotaError::Store)?;
        if changed {
            let delta = CredentialsDelta { over_quota: added, ..CredentialsDelta::between(base.number, v.number) };
            self.offer_delta(&base, &v, delta, &was, &creds);
            say!("credentials v{}: {note}", v.number);
        }
        self.heads.send_modify(|h| h.1 = h.1.max(v.number));
        drop(one);
        Ok(v.number)
    }

    /// Keeps `delta` (from `base`, whose state is `was`, to `v`, whose state is `whole`)
    /// for nodes running `base`, when it makes exactly the whole version: taken against
    /// the version it was computed from and carrying every difference. Otherwise nodes
    /// get the whole version.
    pub(super) fn offer_delta(
        &self,
        base: &Version,
        v: &Version,
        delta: CredentialsDelta,
        was: &Credentials,
        whole: &Credentials,
    ) {
        let doc = match DeltaDoc::new(delta, self.store.signer()) {
            Ok(doc) => doc,
            Err(e) => {
                say!("credentials v{}: no delta: {e}", v.number);
                return;
            }
        };
        let exact = v.number == base.number + 1 && was.with_delta(&doc.delta).same_state(whole);
        if !exact {
            say!("credentials v{} goes whole (not as a delta of v{})", v.number, base.number);
            return;
        }
        if let (Ok(bytes), Ok(mut deltas)) = (serde_json::to_vec(&doc), self.deltas.lock()) {
            deltas.push_back((base.number, v.number, Bytes::from(bytes)));
            if deltas.len() > DELTAS_KEPT {
                deltas.pop_front();
            }
        }
    }

    /// Publishes flags after every applied batch, and every few seconds anyway (a flag
    /// another instance raised, a publish that failed).
    pub(super) async fn flag_loop(self: Arc<Self>) {
        loop {
            let _ = tokio::time::timeout(FLAG_PASS, self.quota.wake.notified()).await;
            if let Err(e) = self.publish_flags().await {
                say!("over-quota flags: {e}");
            }
        }
    }

    /// The reconciler's own schedule: a minute after start and then every hour, the
    /// last month is reconciled until it is final (once its grace has passed and every
    /// node's windows of it are in), and again whenever a late window reopened it. What
    /// still blocks it is logged; gaps are chased by the nodes meanwhile.
    pub(super) async fn reconcile_loop(self: Arc<Self>) {
        let Some(usage) = self.usage.clone() else { return };
        tokio::time::sleep(RECONCILE_FIRST).await;
        loop {
            let now = unix_now();
            let (_, month_start, _) = postern_model::usage::month_period(now);
            let (period, _, _) = postern_model::usage::month_period(month_start.saturating_sub(1));
            let p = period.clone();
            match blocking(&usage, move |u| if u.is_final(&p)? { Ok(None) } else { u.reconcile(&p, now) }).await {
                Ok(Some(r)) if r.is_final => {
                    say!("usage period {period} reconciled: final, {} billable", r.billable)
                }
                Ok(Some(r)) => {
                    say!("usage period {period} not final yet: {}", r.blocking.join("; "))
                }
                Ok(None) => {}
                Err(e) => say!("reconcile {period}: {e}"),
            }
            tokio::time::sleep(RECONCILE_EVERY).await;
        }
    }

    /// Posts every quota event not yet taken to the webhook, oldest first, each as one
    /// JSON document whose `id` a receiver dedupes on; a failed delivery is tried again
    /// with a backoff doubling to 5 minutes. Never on the intake's path.
    pub(super) async fn webhook_loop(self: Arc<Self>, hook: Arc<Webhook>) {
        let Some(usage) = self.usage.clone() else { return };
        loop {
            tokio::time::sleep(WEBHOOK_PASS).await;
            let now = unix_now();
            let due = match blocking(&usage, move |u| u.events(0, 100, Some(now))).await {
                Ok(d) => d,
                Err(e) => {
                    say!("quota webhook: {e}");
                    continue;
                }
            };
            for event in due {
                let result = deliver(&hook, &event).await;
                let ok = result.is_ok();
                if let Err(e) = &result {
                    say!("quota webhook: event {}: {e}", event.id);
                }
                let backoff = 1u64 << event.attempts.min(9);
                let next = now + backoff.min(WEBHOOK_MAX_BACKOFF_S);
                let id = event.id;
                if let Err(e) = blocking(&usage, move |u| u.delivered(id, ok, next)).await {
                    say!("quota webhook: {e}");
                }
                if !ok {
                    // The receiver is down: the rest waits for the next pass.
                    break;
                }
            }
        }
    }
}

/// The webhook's body: a CloudEvents-style envelope around the event.
fn envelope(event: &QuotaEvent) -> serde_json::Value {
    serde_json::json!({
        "specversion": "1.0",
        "id": format!("quota-{}", event.id),
        "source": "postern/quota",
        "type": format!("postern.{}", event.kind),
        "time": event.at,
        "data": event,
    })
}

async fn deliver(hook: &Webhook, event: &QuotaEvent) -> Result<(), QuotaError> {
    let body = Bytes::from(envelope(event).to_string());
    let mut req = Request::post(&hook.url).header(http::header::CONTENT_TYPE, "application/cloudevents+json");
    if let Some(secret) = &hook.secret {
        let (id, at) = (format!("quota-{}", event.id), unix_now());
        req = req
            .header("webhook-signature", webhook_signature(secret, &id, at, &body))
            .header("webhook-id", id)
            .header("webhook-timestamp", at.to_string());
    }
    let req = req.body(Full::new(body))?;
    let resp = tokio::time::timeout(Duration::from_secs(10), hook.client.request(req))
        .await
        .map_err(|_| QuotaError::Timeout)??;
    let status = resp.status();
    let _ = resp.into_body().collect().await;
    if status.is_success() { Ok(()) } else { Err(QuotaError::Answered(status.as_u16())) }
}

/// Why the quota service could not do a part of its work (it is tried again).
#[derive(Debug, thiserror::Error)]
pub(super) enum QuotaError {
    /// The control plane's store (its head or a publish).
    #[error("{0}")]
    Store(anyhow::Error),
    /// A published version does not open.
    #[error("{0}")]
    Sealed(#[from] postern_model::SnapshotError),
    /// A document does not serialise.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// The blocking task did not finish.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
    /// The usage store.
    #[error("usage store: {0}")]
    Usage(#[source] crate::usage::DbError),
    /// The usage store's workers.
    #[error("{0}")]
    Worker(#[from] crate::usage::WorkerError),
    /// The webhook's request cannot be built.
    #[error("{0}")]
    Request(#[from] http::Error),
    /// The webhook is not reached.
    #[error("{0}")]
    Send(#[from] hyper_util::client::legacy::Error),
    /// The webhook does not answer in time.
    #[error("no answer in 10 s")]
    Timeout,
    /// The webhook refuses the event.
    #[error("answered {0}")]
    Answered(u16),
}

async fn blocking<T: Send + 'static>(
    usage: &Arc<UsageStore>,
    f: impl FnOnce(&UsageStore) -> Result<T, crate::usage::DbError> + Send + 'static,
) -> Result<T, QuotaError> {
    let usage = usage.clone();
    match usage.run(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(QuotaError::Usage(e)),
        Err(e) => Err(QuotaError::Worker(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_signed_as_standard_webhooks_sign_them() {
        // The Standard Webhooks specification's own example.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n").unwrap();
        let secret = read_secret(&file).unwrap();
        let sig = webhook_signature(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // Too short, not base64, or too large a file: refused, naming the file.
        for bad in ["short", "whsec_%%%", &"x".repeat(5000)] {
            std::fs::write(&file, bad).unwrap();
            let e = read_secret(&file).unwrap_err().to_string();
            assert!(e.contains("--quota-webhook-secret-file"), "{e}");
        }
    }

    #[test]
    fn an_https_webhook_needs_the_certificates_to_trust() {
        let hook = |url: &str| super::super::QuotaWebhook { url: url.into(), ca: None, secret_file: None };
        let e = Webhook::open(&hook("https://hooks.example/quota?token=s3cret")).unwrap_err().to_string();
        assert!(e.contains("--quota-webhook-ca") && !e.contains("s3cret"), "{e}");
        assert!(Webhook::open(&hook("ftp://x")).is_err());
        assert!(Webhook::open(&hook("http://127.0.0.1:9/hook")).is_ok());
    }
}
