//! The usage subsystem: where a node's metered calls are spooled and where they are
//! shipped (the control plane's intake or a Kafka topic), built from its own settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::node::args::Args;
use crate::node::control::ControlLink;

/// Usage settings: metering is on when a spool, a control plane or a Kafka stream is
/// given.
#[derive(Debug, Clone)]
pub struct UsageSettings {
    /// The spool directory (default: `usage-spool` beside the snapshot).
    pub dir: PathBuf,
    /// The spool's size cap in bytes.
    pub spool_max: u64,
    /// The usage stream on Kafka, if it goes there rather than to the control plane.
    pub kafka: Option<KafkaStream>,
    /// The node's own key, which signs what it ships.
    pub signing_key: Option<PathBuf>,
}

/// The usage stream's Kafka settings.
#[derive(Debug, Clone)]
pub struct KafkaStream {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The topic.
    pub topic: String,
    /// Further librdkafka settings, `key=value`, from the command line (no secret).
    pub options: Vec<String>,
    /// A file of more settings, where secrets go.
    pub options_file: Option<std::path::PathBuf>,
    /// How often the control plane is asked for missing windows.
    pub missing_poll: Duration,
}

impl KafkaStream {
    /// The librdkafka settings: the command line's, then the file's.
    pub fn options(&self) -> Result<Vec<(String, String)>, postern_model::usage::KafkaOptionError> {
        kafka_options(&self.options, self.options_file.as_deref())
    }
}

/// The librdkafka settings of the command line (a secret among them refused) and then of
/// the settings file.
pub fn kafka_options(
    options: &[String],
    file: Option<&Path>,
) -> Result<Vec<(String, String)>, postern_model::usage::KafkaOptionError> {
    let mut all = postern_model::usage::kafka_options(options)?;
    if let Some(f) = file {
        all.extend(postern_model::usage::kafka_options_file(f)?);
    }
    Ok(all)
}

/// The node's usage signing key: a regular file of at most 4 KiB, `ed25519-seed:<hex>`.
fn signing_key(path: &Path) -> anyhow::Result<postern_model::sign::Signer> {
    let bytes = postern_model::disk::read_regular(path, 4096)
        .with_context(|| format!("--usage-signing-key {}", path.display()))?;
    let text = String::from_utf8(bytes).with_context(|| format!("--usage-signing-key {}", path.display()))?;
    postern_model::sign::Signer::parse(&text).with_context(|| format!("--usage-signing-key {}", path.display()))
}

impl UsageSettings {
    /// The settings the command line gives; `None` when usage is not metered.
    pub fn from_args(args: &Args, snapshot_dir: &Path) -> Option<UsageSettings> {
        if args.usage_spool.is_none() && args.control.is_none() && args.usage_kafka.is_none() {
            return None;
        }
        Some(UsageSettings {
            dir: args.usage_spool.clone().unwrap_or_else(|| snapshot_dir.join("usage-spool")),
            spool_max: args.usage_spool_max,
            kafka: args.usage_kafka.as_ref().map(|brokers| KafkaStream {
                brokers: brokers.clone(),
                topic: args.usage_kafka_topic.clone(),
                options: args.usage_kafka_option.clone(),
                options_file: args.usage_kafka_options_file.clone(),
                missing_poll: Duration::from_secs(args.usage_kafka_missing_poll_s.max(1)),
            }),
            signing_key: args.usage_signing_key.clone(),
        })
    }

    /// The node id the spool was written for: its windows are numbered for that node.
    pub fn spool_owner(&self) -> anyhow::Result<Option<String>> {
        postern_usage::Spool::owner(&self.dir).context("the usage spool")
    }

    /// Opens the spool and starts the threads that close windows and ship them.
    pub fn start(self, node_id: &str, link: Option<&ControlLink>) -> anyhow::Result<Arc<postern_usage::Usage>> {
        let signer = match &self.signing_key {
            Some(path) => Some(Arc::new(signing_key(path)?)),
            None => None,
        };
        let http = match link {
            Some(l) => Some(
                postern_usage::HttpSink::new(&l.url, &l.token, l.ca.as_deref(), node_id)
                    .context("the usage shipper")?
                    .signed(signer.clone()),
            ),
            None => None,
        };
        let sink: Option<Box<dyn postern_usage::Sink>> = match &self.kafka {
            Some(k) => {
                let settings = postern_usage::kafka::KafkaSettings {
                    brokers: k.brokers.clone(),
                    topic: k.topic.clone(),
                    options: k.options()?,
                    missing_poll: k.missing_poll,
                };
                Some(Box::new(
                    postern_usage::kafka::KafkaSink::new(&settings, node_id, http)
                        .context("the usage stream (Kafka)")?
                        .signed(signer.clone()),
                ))
            }
            None => http.map(|h| Box::new(h) as Box<dyn postern_usage::Sink>),
        };
        let settings = postern_usage::Settings {
            node: node_id.to_owned(),
            dir: self.dir.clone(),
            limits: postern_usage::SpoolLimits::with_cap(self.spool_max),
        };
        let usage = postern_usage::Usage::start(settings, sink).context("cannot start usage metering")?;
        let to = self.kafka.as_ref().map(|k| format!("kafka {}", k.brokers)).or_else(|| link.map(|l| l.url.clone()));
        tracing::info!(node = %node_id, spool = %self.dir.display(), shipped_to = ?to, "usage metered");
        Ok(usage)
    }
}
