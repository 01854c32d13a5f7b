//! The usage stream's consumer: nodes with `--usage-kafka` write their windows, split
//! by caller, to a Kafka topic ([`postern_usage::kafka`]); the quota service reads it in
//! a consumer group and applies each batch of messages through the intake's own path
//! ([`Server::apply_usage`]: (node, seq, part) once, totals, quota use and flags in one
//! transaction). Offsets are committed only after the batch is applied, so a crash in
//! between delivers the batch again and the store drops what it already has.
//!
//! Who may write to the topic is Kafka's to decide (ACLs, SASL or mTLS, set with
//! `--usage-kafka-option`); every message is still checked as the intake checks a
//! window, and one that is not a window (or whose `ce_id` disagrees with its body) is
//! counted, logged and skipped: it cannot be applied however often it is read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use postern_model::usage::Window;
use rdkafka::Message as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Headers as _;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::state::{Server, StreamStats};
use crate::usage::ApplyError;

/// Messages applied in one transaction at most.
const BATCH: usize = 2000;
/// How long a batch waits for more messages once it has one.
const GATHER: Duration = Duration::from_millis(20);
/// The longest wait between two tries of a batch the store refused for now.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The quota service's Kafka settings (`posternctl serve --usage-kafka`).
#[derive(Debug, Clone)]
pub struct UsageKafka {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The topic nodes write to.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// Partitions of the topic when it has to be made.
    pub partitions: i32,
    /// Its replication factor then.
    pub replication: i32,
    /// Further librdkafka settings, applied last.
    pub options: Vec<(String, String)>,
}

impl StreamStats {
    pub(super) fn to_json(&self) -> serde_json::Value {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "kafka": self.running.load(Ordering::Relaxed),
            "consumed": n(&self.consumed),
            "batches": n(&self.batches),
            "applied": n(&self.applied),
            "duplicates": n(&self.duplicates),
            "rejected": n(&self.rejected),
            "last_error": *self.last_error.lock().unwrap_or_else(|p| p.into_inner()),
        })
    }

    fn failed(&self, e: String) {
        say!("usage stream: {e}");
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }
}

fn config(kafka: &UsageKafka) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &kafka.brokers);
    for (k, v) in &kafka.options {
        c.set(k, v);
    }
    c
}

/// Makes the topic if it is not there, and a consumer subscribed to it.
pub(super) async fn consumer(kafka: &UsageKafka) -> anyhow::Result<StreamConsumer> {
    let admin: AdminClient<DefaultClientContext> = config(kafka).create()?;
    let topic = NewTopic::new(&kafka.topic, kafka.partitions, TopicReplication::Fixed(kafka.replication));
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    match admin.create_topics([&topic], &opts).await {
        Ok(results) => {
            for r in results {
                match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((t, e)) => anyhow::bail!("usage stream: cannot make topic {t}: {e}"),
                }
            }
        }
        Err(e) => anyhow::bail!("usage stream at {}: {e}", kafka.brokers),
    }
    let consumer: StreamConsumer = config(kafka)
        .set("group.id", &kafka.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("client.id", "postern-quota-service")
        .create()?;
    consumer.subscribe(&[&kafka.topic])?;
    Ok(consumer)
}

/// One message, read: a checked window part, or why it is not one.
fn read(m: &rdkafka::message::BorrowedMessage<'_>, keys: &super::signed::UsageKeys) -> Result<Window, Unreadable> {
    let at = format!("{}[{}]@{}", m.topic(), m.partition(), m.offset());
    let unreadable = |why| Unreadable { at: at.clone(), why };
    let body = m.payload().ok_or_else(|| unreadable(Why::NoBody))?;
    let w: Window = serde_json::from_slice(body).map_err(|e| unreadable(Why::NotWindow(e)))?;
    w.check().map_err(|e| unreadable(Why::Refused(e)))?;
    let id = m.headers().and_then(|h| {
        h.iter().find(|h| h.key == "ce_id").and_then(|h| h.value).map(|v| String::from_utf8_lossy(v).into_owned())
    });
    let want = format!("{}/{}/{}", w.node, w.seq, w.part);
    match id {
        Some(id) if id == want => {}
        Some(id) => return Err(unreadable(Why::OtherId { id, want })),
        None => return Err(unreadable(Why::NoId)),
    }
    let sig = m
        .headers()
        .and_then(|h| h.iter().find(|h| h.key == postern_model::usage::STREAM_SIGNATURE_HEADER).and_then(|h| h.value));
    match keys.check(&w.node, body, sig) {
        Ok(()) => Ok(w),
        Err(why) => Err(unreadable(Why::Refused(postern_model::usage::WindowError::Invalid {
            node: w.node,
            seq: w.seq,
            rule: super::signed::RULE,
            why,
        }))),
    }
}

/// A message on the usage stream that is not a usage window part, and where it is.
#[derive(Debug, thiserror::Error)]
#[error("{at}: {why}")]
struct Unreadable {
    /// `topic[partition]@offset`.
    at: String,
    why: Why,
}

/// What is wrong with an [`Unreadable`] message.
#[derive(Debug, thiserror::Error)]
enum Why {
    #[error("no body")]
    NoBody,
    #[error("not a usage window: {0}")]
    NotWindow(serde_json::Error),
    #[error("{0}")]
    Refused(postern_model::usage::WindowError),
    #[error("ce_id {id} names another window than its body ({want})")]
    OtherId { id: String, want: String },
    #[error("no ce_id header")]
    NoId,
}

impl Server {
    /// Reads the usage stream for good: gathers up to [`BATCH`] messages, applies them in
    /// one transaction (again and again while the store refuses for now), then commits
    /// their offsets.
    pub(super) async fn consume_usage(self: Arc<Self>, consumer: StreamConsumer) {
        let Some(store) = self.usage.clone() else { return };
        self.stream.running.store(true, Ordering::Relaxed);
        loop {
            let mut windows = Vec::new();
            let mut offsets: BTreeMap<(String, i32), i64> = BTreeMap::new();
            let first = consumer.recv().await;
            let mut next = Some(first);
            while let Some(got) = next.take() {
                match got {
                    Ok(m) => {
                        self.stream.consumed.fetch_add(1, Ordering::Relaxed);
                        offsets.insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
                        match read(&m, &self.usage_keys) {
                            Ok(w) => windows.push(w),
                            Err(e) => {
                                self.stream.rejected.fetch_add(1, Ordering::Relaxed);
                                self.stream.failed(format!("skipped {e}"));
                                if let Why::Refused(refused) = e.why {
                                    // Counted for the node it names, as at the intake.
                                    let now = postern_model::disk::unix_now();
                                    if let Ok(Err(e)) = store.run(move |s| s.refused(&refused, now)).await {
                                        self.stream.failed(format!("usage store: {e}"));
                                    }
                                }
                            }
                        }
                    }
                    Err(e) => {
                        self.stream.failed(e.to_string());
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                if windows.len() < BATCH && !offsets.is_empty() {
                    next = tokio::time::timeout(GATHER, consumer.recv()).await.ok();
                }
            }
            if offsets.is_empty() {
                continue;
            }
            self.apply_stream_batch(&store, windows).await;
            let mut tpl = TopicPartitionList::new();
            for ((topic, partition), offset) in &offsets {
                if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
                    self.stream.failed(e.to_string());
                }
            }
            // Async: a commit that is lost only means the batch is read again, and the
            // store drops it.
            if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
                self.stream.failed(format!("commit: {e}"));
            }
        }
    }

    /// Applies one batch for good: a store that fails for now is tried again with a
    /// backoff; a part that conflicts with what the store has (a renumbering node) is
    /// refused alone, the rest applied.
    async fn apply_stream_batch(&self, store: &Arc<crate::usage::UsageStore>, windows: Vec<Window>) {
        if windows.is_empty() {
            return;
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.apply_usage(store.clone(), windows.clone()).await {
                Ok(ack) => {
                    self.stream.batches.fetch_add(1, Ordering::Relaxed);
                    self.stream.applied.fetch_add(ack.applied, Ordering::Relaxed);
                    self.stream.duplicates.fetch_add(ack.duplicates, Ordering::Relaxed);
                    return;
                }
                // A part the store will never take: find it alone below.
                Err(ApplyError::Conflict { .. } | ApplyError::Refused(_)) => break,
                Err(e) => {
                    self.stream.failed(e.to_string());
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        // One at a time, to refuse only the conflicting parts.
        for w in windows {
            let mut backoff = Duration::from_millis(100);
            loop {
                match self.apply_usage(store.clone(), vec![w.clone()]).await {
                    Ok(ack) => {
                        self.stream.applied.fetch_add(ack.applied, Ordering::Relaxed);
                        self.stream.duplicates.fetch_add(ack.duplicates, Ordering::Relaxed);
                        break;
                    }
                    Err(e @ (ApplyError::Conflict { .. } | ApplyError::Refused(_))) => {
                        self.stream.rejected.fetch_add(1, Ordering::Relaxed);
                        self.stream.failed(e.to_string());
                        break;
                    }
                    Err(e) => {
                        self.stream.failed(e.to_string());
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
        }
        self.stream.batches.fetch_add(1, Ordering::Relaxed);
    }
}
