//! The usage stream on Kafka: spooled windows go out split by caller
//! ([`Window::split`]), one message per part, keyed by the caller (`key:<id>` or
//! `app:<client_id>`), so one caller's usage stays on one partition and in order. Each
//! message carries CloudEvents headers (binary mode): `ce_id` is `node/seq/part`, the
//! identity the usage store applies exactly once.
//!
//! The producer is librdkafka's idempotent one (`acks=all`): a send is acknowledged
//! only once every part of every window is in the log, and only then does the shipper
//! free the windows. A broker that is slow or away fails the send after
//! [`DELIVERY_TIMEOUT`]; the windows stay in the spool and go again (the store drops
//! what arrives twice).
//!
//! Gaps: a window Kafka acknowledged can still fail to reach the store (a topic past
//! its retention while the quota service was down, a lost broker). With a control
//! plane, the sink asks it every `missing_poll` (30 s by default) which of this node's numbers the store
//! lacks, and hands a run to the shipper for a re-send once two asks in a row saw it
//! (parts of one window travel on several partitions, so a number can be missing for a
//! moment without being lost).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use postern_model::usage::Window;
use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};

use crate::{HttpSink, Sink, SinkError};

/// How long a send waits for every part to be acknowledged before it fails (and the
/// windows go again).
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(20);

/// Kafka settings for the usage stream.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The topic.
    pub topic: String,
    /// Further librdkafka settings (`security.protocol`, `sasl.*`, …), applied last.
    pub options: Vec<(String, String)>,
    /// How often the control plane is asked for missing windows.
    pub missing_poll: Duration,
}

/// What the deliveries of the current send came to.
#[derive(Debug, Default)]
struct Outcome {
    /// The send they belong to; reports of an earlier, abandoned send are ignored.
    send: usize,
    delivered: usize,
    failed: Option<KafkaError>,
}

struct Deliveries(Mutex<Outcome>);

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, send: usize) {
        let mut o = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if o.send != send {
            return;
        }
        match result {
            Ok(_) => o.delivered += 1,
            Err((e, _)) => {
                if o.failed.is_none() {
                    o.failed = Some(e.clone());
                }
            }
        }
    }
}

/// Sends windows to Kafka.
pub struct KafkaSink {
    producer: BaseProducer<Deliveries>,
    settings: KafkaSettings,
    node: String,
    topic: String,
    sends: usize,
    /// Asks the control plane for missing windows, when there is one.
    control: Option<HttpSink>,
    last_poll: Option<Instant>,
    /// The runs the last ask named.
    suspect: Vec<(u64, u64)>,
    /// Signs each part (`postern_signature`), when the node has a key.
    signer: Option<std::sync::Arc<postern_model::sign::Signer>>,
}

impl KafkaSink {
    /// An idempotent producer for `node`; `control` asks for missing windows.
    pub fn new(settings: &KafkaSettings, node: &str, control: Option<HttpSink>) -> Result<KafkaSink, KafkaError> {
        Ok(KafkaSink {
            producer: producer(settings, node)?,
            settings: settings.clone(),
            node: node.to_owned(),
            topic: settings.topic.clone(),
            sends: 0,
            control,
            last_poll: None,
            suspect: Vec::new(),
            signer: None,
        })
    }

    /// Signs every part with the node's own key (`--usage-signing-key`).
    pub fn signed(mut self, signer: Option<std::sync::Arc<postern_model::sign::Signer>>) -> KafkaSink {
        self.signer = signer;
        self
    }

    /// A producer in a fatal state, or whose producer id the broker no longer takes
    /// (fenced, an unknown id or epoch, a sequence out of order: idempotence's failures,
    /// seen after a broker stalled past the delivery timeout), is replaced by one with a
    /// new id. The windows it failed are still in the spool, and the store drops any it
    /// delivered after all.
    fn renew_if_broken(&mut self, code: Option<RDKafkaErrorCode>) {
        use RDKafkaErrorCode as C;
        let fatal = self.producer.client().fatal_error();
        let fenced = matches!(
            code,
            Some(
                C::ProducerFenced
                    | C::InvalidProducerEpoch
                    | C::UnknownProducerId
                    | C::OutOfOrderSequenceNumber
                    | C::InvalidProducerIdMapping
                    | C::Fatal
            )
        );
        if fatal.is_none() && !fenced {
            return;
        }
        tracing::warn!(?code, ?fatal, "the Kafka producer's id is no longer good; starting a new producer");
        match producer(&self.settings, &self.node) {
            Ok(p) => self.producer = p,
            Err(e) => tracing::error!(error = %e, "cannot start a new Kafka producer"),
        }
    }

    /// Queues one part, waiting while librdkafka's queue is full.
    fn produce(&self, part: &Window, send: usize) -> Result<(), (Option<RDKafkaErrorCode>, SinkError)> {
        let payload = serde_json::to_vec(part).map_err(|e| (None, SinkError::Encode(e)))?;
        let key = part.caller_key().unwrap_or_else(|| format!("node:{}", part.node));
        let id = format!("{}/{}/{}", part.node, part.seq, part.part);
        let source = format!("postern:node:{}", part.node);
        let signature = self.signer.as_ref().map(|signer| crate::sign_usage(signer, &part.node, &payload));
        let headers = OwnedHeaders::new_with_capacity(6)
            .insert(Header { key: "ce_specversion", value: Some("1.0") })
            .insert(Header { key: "ce_id", value: Some(id.as_str()) })
            .insert(Header { key: "ce_source", value: Some(source.as_str()) })
            .insert(Header { key: "ce_type", value: Some(CE_TYPE) })
            .insert(Header { key: "content-type", value: Some("application/json") })
            .insert(Header { key: postern_model::usage::STREAM_SIGNATURE_HEADER, value: signature.as_deref() });
        let mut record =
            BaseRecord::with_opaque_to(&self.topic, send).key(key.as_bytes()).payload(&payload[..]).headers(headers);
        let deadline = Instant::now() + DELIVERY_TIMEOUT;
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    record = back;
                    self.producer.poll(Duration::from_millis(20));
                }
                Err((e, _)) => return Err((e.rdkafka_error_code(), SinkError::Produce { id, source: e })),
            }
        }
    }

    /// The runs two asks in a row found missing (at most every `missing_poll`).
    fn confirmed_missing(&mut self) -> Vec<(u64, u64)> {
        let Some(control) = self.control.as_mut() else { return Vec::new() };
        if self.last_poll.is_some_and(|t| t.elapsed() < self.settings.missing_poll) {
            return Vec::new();
        }
        self.last_poll = Some(Instant::now());
        let now = match control.missing() {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "cannot ask the control plane for missing usage windows");
                return Vec::new();
            }
        };
        let confirmed = overlap(&self.suspect, &now);
        self.suspect = now;
        confirmed
    }
}

/// librdkafka's idempotent producer (`acks=all`) for `node`.
fn producer(settings: &KafkaSettings, node: &str) -> Result<BaseProducer<Deliveries>, KafkaError> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &settings.brokers)
        .set("client.id", format!("postern-{node}"))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("message.timeout.ms", DELIVERY_TIMEOUT.as_millis().to_string());
    for (k, v) in &settings.options {
        config.set(k, v);
    }
    config.create_with_context(Deliveries(Mutex::new(Outcome::default())))
}

/// Access-log lines to their own topic (`--access-log-kafka-topic`), on the usage
/// stream's brokers: best effort, not idempotent. A line is handed to librdkafka's own
/// queue without waiting; a full queue or a failed delivery loses the line and counts it
/// (the file keeps every line written).
pub struct KafkaLines {
    producer: BaseProducer<LineDeliveries>,
    topic: String,
    undelivered: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// Counts lines librdkafka could not deliver.
struct LineDeliveries(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl ClientContext for LineDeliveries {}

impl ProducerContext for LineDeliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if result.is_err() {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl KafkaLines {
    /// A producer for `topic` on the usage stream's brokers.
    pub fn new(settings: &KafkaSettings, topic: &str, node: &str) -> Result<KafkaLines, KafkaError> {
        let undelivered = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &settings.brokers)
            .set("client.id", format!("postern-{node}-log"))
            .set("acks", "1")
            .set("linger.ms", "50")
            .set("compression.type", "lz4")
            .set("queue.buffering.max.messages", "100000")
            .set("message.timeout.ms", DELIVERY_TIMEOUT.as_millis().to_string());
        for (k, v) in &settings.options {
            config.set(k, v);
        }
        let producer = config.create_with_context(LineDeliveries(undelivered.clone()))?;
        Ok(KafkaLines { producer, topic: topic.to_owned(), undelivered })
    }
}

impl KafkaLines {
    /// Hands one line to librdkafka's queue, keyed by `key`, without waiting.
    pub fn send(&mut self, key: &str, line: &[u8]) -> Result<(), KafkaError> {
        self.producer.send(BaseRecord::to(&self.topic).key(key).payload(line)).map_err(|(e, _)| e)
    }

    /// Serves librdkafka's delivery reports.
    pub fn poll(&mut self) {
        self.producer.poll(Duration::ZERO);
    }

    /// Waits up to `timeout` for queued lines to leave.
    pub fn flush(&mut self, timeout: Duration) {
        let _ = self.producer.flush(timeout);
    }

    /// Lines queued so far that could not be delivered.
    pub fn undelivered(&self) -> u64 {
        self.undelivered.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The CloudEvents `type` of a usage window part.
pub const CE_TYPE: &str = "postern.usage.window";

/// The numbers in both lists of inclusive runs.
fn overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(af, at) in a {
        for &(bf, bt) in b {
            let (f, t) = (af.max(bf), at.min(bt));
            if f <= t {
                out.push((f, t));
            }
        }
    }
    out
}

impl Sink for KafkaSink {
    fn send(&mut self, windows: &[(u64, Vec<u8>)]) -> Result<Vec<(u64, u64)>, SinkError> {
        if let Err((code, e)) = self.send_all(windows) {
            self.renew_if_broken(code);
            return Err(e);
        }
        Ok(self.confirmed_missing())
    }

    fn poll_missing(&mut self) -> Vec<(u64, u64)> {
        self.confirmed_missing()
    }

    /// Counters go to the control plane (`--control`); without one they stay on the
    /// node (in `counters.json` and `/readyz`) and the reconciler waits for them.
    fn report(&mut self, counters: &postern_model::usage::NodeCounters) -> Result<(), SinkError> {
        match self.control.as_mut() {
            Some(control) => control.put_counters(counters),
            None => Err(SinkError::NoControl),
        }
    }
}

impl KafkaSink {
    /// Produces every part of `windows` and waits until each is acknowledged; else the
    /// error, with librdkafka's code when it has one.
    fn send_all(&mut self, windows: &[(u64, Vec<u8>)]) -> Result<(), (Option<RDKafkaErrorCode>, SinkError)> {
        self.sends += 1;
        let send = self.sends;
        *self.producer.context().0.lock().unwrap_or_else(|p| p.into_inner()) = Outcome { send, ..Outcome::default() };
        let mut parts = 0;
        for (seq, raw) in windows {
            let w: Window =
                serde_json::from_slice(raw).map_err(|source| (None, SinkError::Spooled { seq: *seq, source }))?;
            for part in w.split() {
                self.produce(&part, send)?;
                parts += 1;
            }
        }
        let deadline = Instant::now() + DELIVERY_TIMEOUT + Duration::from_secs(5);
        loop {
            self.producer.poll(Duration::from_millis(5));
            let o = self.producer.context().0.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = &o.failed {
                return Err((e.rdkafka_error_code(), SinkError::Delivery(e.clone())));
            }
            if o.delivered >= parts {
                break;
            }
            drop(o);
            if Instant::now() > deadline {
                return Err((None, SinkError::Unacknowledged { secs: DELIVERY_TIMEOUT.as_secs() }));
            }
        }
        Ok(())
    }
}

impl Drop for KafkaSink {
    fn drop(&mut self) {
        // Whatever is still queued goes out now; the spool has it anyway.
        let _ = self.producer.flush(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_confirmed_where_two_asks_overlap() {
        assert_eq!(overlap(&[(3, 9), (20, 20)], &[(5, 12), (20, 21)]), vec![(5, 9), (20, 20)]);
        assert_eq!(overlap(&[], &[(1, 2)]), Vec::<(u64, u64)>::new());
    }
}
