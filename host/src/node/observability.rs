//! The observability subsystem: the access log (a file, and optionally a Kafka topic on
//! the usage stream's brokers) and the trace exporter, built from their own settings.
//! The node's metrics are rendered by [`crate::node::exposition`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use postern_observe::{AccessLog, LineRefused, LineSink, LogSettings, TraceSettings, Tracer};

use crate::node::args::Args;

/// Access log and trace settings.
#[derive(Debug, Clone)]
pub struct ObserveSettings {
    access_log: Option<AccessLogSettings>,
    traces: Option<TraceExport>,
}

#[derive(Debug, Clone)]
struct AccessLogSettings {
    path: PathBuf,
    sample: f64,
    max_bytes: u64,
    keep: u32,
    anonymous_errors_per_s: u32,
    /// The topic, the brokers, their librdkafka settings and the settings file.
    kafka: Option<(String, String, Vec<String>, Option<std::path::PathBuf>)>,
}

#[derive(Debug, Clone)]
struct TraceExport {
    endpoint: String,
    sample: f64,
}

/// The access log and the tracer, once started.
pub struct Observability {
    /// The access log, if one was asked for.
    pub access_log: Option<Arc<AccessLog>>,
    /// The trace exporter, if one was asked for.
    pub tracer: Option<Arc<Tracer>>,
}

impl ObserveSettings {
    /// The settings the command line gives.
    pub fn from_args(args: &Args) -> ObserveSettings {
        let access_log = args.access_log.as_ref().map(|path| AccessLogSettings {
            path: path.clone(),
            sample: args.access_log_sample,
            anonymous_errors_per_s: args.access_log_anonymous_errors_per_s,
            max_bytes: args.access_log_max_size,
            keep: args.access_log_keep,
            kafka: args.access_log_kafka_topic.clone().zip(args.usage_kafka.clone()).map(|(topic, brokers)| {
                (topic, brokers, args.usage_kafka_option.clone(), args.usage_kafka_options_file.clone())
            }),
        });
        let traces =
            args.otlp_endpoint.as_ref().map(|e| TraceExport { endpoint: e.clone(), sample: args.trace_sample });
        ObserveSettings { access_log, traces }
    }

    /// Opens the access log and starts the exporter, for the node `node_id`.
    pub fn start(self, node_id: &str) -> anyhow::Result<Observability> {
        let access_log = self.access_log.map(|s| s.start(node_id)).transpose()?;
        let tracer = self.traces.map(|t| t.start(node_id)).transpose()?;
        Ok(Observability { access_log, tracer })
    }
}

impl AccessLogSettings {
    fn start(self, node_id: &str) -> anyhow::Result<Arc<AccessLog>> {
        let mut settings = LogSettings::new(self.path.clone());
        settings.success_per_10k = LogSettings::rate(self.sample)?;
        settings.max_bytes = self.max_bytes;
        settings.keep = self.keep;
        settings.anonymous_errors_per_s = self.anonymous_errors_per_s;
        let topic = self.kafka.as_ref().map(|k| k.0.clone());
        let sink: Option<Box<dyn LineSink>> = match self.kafka {
            Some((topic, brokers, options, file)) => {
                let settings = postern_usage::kafka::KafkaSettings {
                    brokers,
                    topic: topic.clone(),
                    options: crate::node::usage::kafka_options(&options, file.as_deref())?,
                    missing_poll: Duration::from_secs(30),
                };
                let lines = postern_usage::kafka::KafkaLines::new(&settings, &topic, node_id)
                    .context("the access log's Kafka topic")?;
                Some(Box::new(KafkaLineSink(lines)))
            }
            None => None,
        };
        let log = AccessLog::start(settings, sink)
            .with_context(|| format!("cannot open the access log {}", self.path.display()))?;
        tracing::info!(path = %self.path.display(), sample = self.sample, kafka = ?topic, "access log on");
        Ok(log)
    }
}

impl TraceExport {
    fn start(self, node_id: &str) -> anyhow::Result<Arc<Tracer>> {
        let mut settings = TraceSettings::new(&self.endpoint, node_id);
        settings.success_per_10k = LogSettings::rate(self.sample)?;
        let tracer = Tracer::start(settings).map_err(|e| anyhow::anyhow!("--otlp-endpoint {}: {e}", self.endpoint))?;
        tracing::info!(endpoint = %self.endpoint, sample = self.sample, "traces exported");
        Ok(tracer)
    }
}

/// Access-log lines to their Kafka topic: the usage stream's line producer as the
/// access log's sink.
struct KafkaLineSink(postern_usage::kafka::KafkaLines);

impl LineSink for KafkaLineSink {
    fn send(&mut self, key: &str, line: &[u8]) -> Result<(), LineRefused> {
        self.0.send(key, line).map_err(|e| LineRefused(Box::new(e)))
    }

    fn poll(&mut self) {
        self.0.poll();
    }

    fn flush(&mut self, timeout: Duration) {
        self.0.flush(timeout);
    }

    fn undelivered(&self) -> u64 {
        self.0.undelivered()
    }
}
