//! The node's settings: its command line (`postern --help`).

use std::net::SocketAddr;
use std::path::PathBuf;

/// Node settings (command line).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "postern", version, about = "Postern API gateway (data plane)", args_override_self = true)]
pub struct Args {
    /// Snapshot file to serve (written by `posternctl compile`); reloaded on SIGHUP and
    /// when it changes.
    #[arg(long)]
    pub snapshot: PathBuf,
    /// Public pool listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub public: SocketAddr,
    /// Partner pool listener.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub partner: SocketAddr,
    /// Admin listener: health, metrics, the running snapshot and, on a metering node,
    /// its spooled usage windows, with no authentication. A loopback address unless
    /// `--admin-beyond-loopback` says otherwise.
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// Let `--admin` be an address other hosts reach (a scraper on another host): the
    /// admin listener has no authentication, so only on a network only operators reach.
    #[arg(long)]
    pub admin_beyond_loopback: bool,
    /// Connections each listener holds that the kernel has completed and the node has
    /// not yet accepted (capped by `net.core.somaxconn`). When this queue is full the
    /// kernel drops new handshakes and their clients wait a second or more to retry.
    #[arg(long, default_value_t = postern_model::net::BACKLOG)]
    pub listen_backlog: u32,
    /// PEM certificate chain: serve both pools over TLS (ALPN h2, http/1.1).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate chain the node presents to backends of clusters with `tls:`
    /// (mutual TLS), so they know the identity headers came from a gateway.
    #[arg(long, requires = "upstream_key")]
    pub upstream_cert: Option<PathBuf>,
    /// PEM private key for `--upstream-cert`.
    #[arg(long, requires = "upstream_cert")]
    pub upstream_key: Option<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Write the bound ports as JSON here once listening (for tests and scripts).
    #[arg(long)]
    pub ports_file: Option<PathBuf>,
    /// How often to check the snapshot file for changes, in milliseconds, where the
    /// system cannot report changes (otherwise they are read at once, and checked once a
    /// minute besides).
    #[arg(long, default_value_t = 1000)]
    pub watch_interval_ms: u64,
    /// Credential state (API key hashes, signing keys, apps, deny list) written by
    /// `posternctl compile`; reloaded when it changes (default: `credentials.json` beside
    /// the snapshot). Without it every authenticated route refuses its callers.
    #[arg(long)]
    pub credentials: Option<PathBuf>,
    /// Directory of compiled Wasm filter code, keyed by module and engine version
    /// (default: `wasm-cache` beside the snapshot file).
    #[arg(long)]
    pub wasm_cache: Option<PathBuf>,
    /// Wasm filter instances that may run at once.
    #[arg(long, default_value_t = 256)]
    pub wasm_instances: u32,
    /// CPU milliseconds a Wasm filter's `init` may take at snapshot build (default: the
    /// platform's deadline maximum, 50). Raise it only for a node run under a profiler
    /// such as valgrind, where everything runs tens of times slower.
    #[arg(long, value_name = "MS")]
    pub wasm_init_deadline_ms: Option<u64>,
    /// How a Wasm sandbox's memory is made fresh after each call: `copy` (restore the
    /// module's first 128 KiB in place, no system call), `scan` (the kernel reports the
    /// pages the call dirtied and only those are restored; Linux ≥ 6.7) or `decommit`
    /// (the kernel drops the pages; the next call faults in what it touches). Every way
    /// gives each call a fresh memory; which is cheapest depends on the host.
    #[arg(long, value_name = "HOW", default_value = "copy")]
    pub wasm_reset: postern_wasm::Reset,
    /// Redis for fleet-wide rate limits (`redis://host:port`; repeat, or separate with
    /// commas, for the seed nodes of a cluster). A URL with a password belongs in
    /// POSTERN_RATELIMIT_REDIS, not on the command line, where every process list shows
    /// it. Without it the node enforces every limit alone.
    #[arg(long = "ratelimit-redis", env = "POSTERN_RATELIMIT_REDIS", hide_env_values = true, value_delimiter = ',')]
    pub ratelimit_redis: Vec<String>,
    /// The `--ratelimit-redis` URLs are a Redis Cluster.
    #[arg(long)]
    pub ratelimit_cluster: bool,
    /// Prefix of the keys the fleet's rate sync writes.
    #[arg(long, default_value = "postern:rl:")]
    pub ratelimit_prefix: String,
    /// How often to sync rate limits with the fleet, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub ratelimit_sync_ms: u64,
    /// This node's name in the fleet (default: host name, process id and a random tag).
    #[arg(long)]
    pub node_id: Option<String>,
    /// Control plane to receive snapshots and credentials from (`http://host:port`). The
    /// snapshot file is still where the node boots from when the control plane is away.
    #[arg(long)]
    pub control: Option<String>,
    /// Bearer token (role `node`) for `--control`, from POSTERN_CONTROL_TOKEN (the
    /// command line shows in process lists; prefer the environment or a file).
    #[arg(long, env = "POSTERN_CONTROL_TOKEN", hide_env_values = true)]
    pub control_token: Option<String>,
    /// A file holding the bearer token for `--control` (its first line).
    #[arg(long, conflicts_with = "control_token")]
    pub control_token_file: Option<PathBuf>,
    /// This node is a canary: staged rollouts give it new snapshots first.
    #[arg(long)]
    pub control_canary: bool,
    /// How often to report the routes a rollout compares, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub control_report_ms: u64,
    /// The control plane's public signing key(s): a file of `ed25519:<hex>` lines (its
    /// `signing.pub`). Required with `--control` and `--credentials-dir`; once given,
    /// every snapshot, credentials version and delta, from the network or from disk, must
    /// be signed by one of them.
    #[arg(long, value_name = "FILE")]
    pub control_key: Option<PathBuf>,
    /// CA certificates (PEM) the certificate of an `https://` control plane is checked
    /// against.
    #[arg(long, value_name = "FILE")]
    pub control_ca: Option<PathBuf>,
    /// A directory (a shared volume or a mounted bucket) where the control plane writes
    /// its signed credentials (`posternctl serve --publish-dir`): polled as the second
    /// revocation path, for when the control plane's streams are down.
    #[arg(long, value_name = "DIR", requires = "control_key")]
    pub credentials_dir: Option<PathBuf>,
    /// How often to read `--credentials-dir`, in seconds.
    #[arg(long, default_value_t = postern_model::protocol::DROP_POLL_S)]
    pub credentials_dir_poll_s: u64,
    /// Addresses or CIDR ranges of the hops in front of this node (load balancers) whose
    /// `X-Forwarded-For` and `X-Forwarded-Proto` are kept: the client is the rightmost
    /// address in it that is not a trusted hop. From any other peer, every client-address
    /// header is replaced by the peer's address. Repeat, or separate with commas.
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    pub trusted_hops: Vec<String>,
    /// Usage spool: closed usage windows wait here, on local disk, until the control
    /// plane has applied them (default: `usage-spool` beside the snapshot). Usage is
    /// metered when this is given or `--control` is: the spool's windows are shipped to
    /// the control plane's intake. The spool keeps its node's id: restarted without
    /// `--node-id`, the node takes the spool's.
    #[arg(long, value_name = "DIR")]
    pub usage_spool: Option<PathBuf>,
    /// The spool's size cap (`1GiB`, `64MiB`, `512KiB` or bytes): a full spool refuses
    /// new windows (logged, counted, shown in `/readyz`) and keeps them in memory until
    /// acknowledged windows make room; nothing spooled is dropped.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub usage_spool_max: u64,
    /// Ship usage windows to Kafka (`host:port,...`) instead of the control plane's
    /// intake: one message per window and caller, keyed by the caller, with the idempotent
    /// producer; a window leaves the spool's unacknowledged part only once Kafka has every
    /// part of it. With `--control` too, the node asks the control plane for windows the
    /// usage store lacks and sends them again.
    #[arg(long, value_name = "BROKERS")]
    pub usage_kafka: Option<String>,
    /// The usage topic.
    #[arg(long, default_value = postern_model::usage::KAFKA_TOPIC, value_name = "TOPIC")]
    pub usage_kafka_topic: String,
    /// A librdkafka setting for the producer (`security.protocol=SSL`, `sasl.username=…`);
    /// repeat for more.
    #[arg(long, value_name = "KEY=VALUE")]
    pub usage_kafka_option: Vec<String>,
    /// More librdkafka settings, one `key=value` a line: where secrets go
    /// (`sasl.password`, `ssl.key.password`…), which `--usage-kafka-option` refuses, since
    /// every process of the host can read a command line.
    #[arg(long, value_name = "FILE")]
    pub usage_kafka_options_file: Option<std::path::PathBuf>,
    /// This node's own Ed25519 key (`ed25519-seed:<hex>`, as `posternctl signing-key new`
    /// writes it): every batch of usage windows to the intake and every part on the usage
    /// stream is signed with it, so no other process can speak for this node where the
    /// control plane knows its public key (`posternctl serve --usage-node-keys`).
    #[arg(long, value_name = "FILE")]
    pub usage_signing_key: Option<std::path::PathBuf>,
    /// How often, in seconds, a node on Kafka asks the control plane which of its
    /// windows the usage store lacks (a run is sent again once two asks in a row name it).
    #[arg(long, default_value_t = 30, value_name = "S")]
    pub usage_kafka_missing_poll_s: u64,
    /// How long to let in-flight requests finish on shutdown, in seconds.
    #[arg(long, default_value_t = 10)]
    pub drain_seconds: u64,
    /// Open client connections a pool's listener holds at most; more are closed at accept.
    #[arg(long, default_value_t = 20_000)]
    pub max_connections: usize,
    /// Open client connections one source address holds at most, per listener.
    #[arg(long, default_value_t = 1_000)]
    pub max_connections_per_ip: u32,
    /// From accept to the first request head (protocol sniff and TLS handshake included),
    /// in seconds; a connection that sends none in time is closed.
    #[arg(long, default_value_t = 10)]
    pub handshake_timeout_s: u64,
    /// A connection with no request in flight and no bytes moving either way for this
    /// long is closed (HTTP/2 with GOAWAY), in seconds. It also bounds a body stalled in
    /// either direction. HTTP/1 waits at most 10 s between requests (its header timeout).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout_s: u64,
    /// The send bound: a connection whose client has taken nothing of an answer it was
    /// sent for this long (a zero HTTP/2 window, a full socket) is closed and the backend
    /// requests of its streams cancelled, in seconds (nginx `send_timeout`).
    #[arg(long, default_value_t = 10)]
    pub downstream_idle_timeout_s: u64,
    /// Once a cluster holds half its cap or more, one client connection may hold at most
    /// this percentage of the cap (503 `client_share_exceeded` past it). Connections
    /// from `--trusted-hops` have no share.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub client_share_percent: u8,
    /// The same for all the connections of one source address on a listener.
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub address_share_percent: u8,
    /// The node sheds requests by priority (sheddable first, then free, then standard)
    /// while its CPU is at this percentage of its cores or more, measured each 250 ms
    /// over the last second; 0 never sheds on CPU (clusters still shed on their own
    /// overload).
    #[arg(long, default_value_t = 75)]
    pub shed_cpu: u32,
    /// Requests the node serves at once, from arrival to the response head (its
    /// admission budget; 0: none); past it, 503 node_overloaded.
    #[arg(long, default_value_t = 20_000)]
    pub max_in_flight: u32,
    /// Answers the node compresses at once (routes with `compress:`; each encoder holds
    /// up to about 1 MiB for as long as its stream lasts; 0: none); past it, an answer
    /// goes out as the backend sent it, counted in
    /// `postern_compression_skipped_total{reason="node_cap"}`.
    #[arg(long, default_value_t = 256, value_name = "STREAMS")]
    pub max_compressing_streams: u32,
    /// The percentage of `--max-in-flight` kept for the partner pool: the public pool
    /// may hold only the rest.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub partner_share: u32,
    /// Write JSON access logs to this file: one line for every server error, every client
    /// error (4xx) of an authenticated caller, the first client errors of each second of
    /// anonymous callers (`--access-log-anonymous-errors-per-s`), and a share of
    /// successes (`--access-log-sample`), by a thread of their
    /// own behind a bounded queue (when it is full a line is dropped and counted; a
    /// request never waits). Lines name the caller by key id or client_id, never by a
    /// credential.
    #[arg(long, value_name = "FILE")]
    pub access_log: Option<PathBuf>,
    /// The share of successful requests logged, from 0 to 1 (the same requests are the
    /// sampled ones for traces).
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION", value_parser = parse_fraction)]
    pub access_log_sample: f64,
    /// Client errors (4xx) of callers who did not authenticate logged per second, the
    /// first of each second (0: none); the rest are counted in
    /// `postern_access_log_dropped_total{reason="anonymous_client_error"}`. Anyone can
    /// send bad requests as fast as the node answers them: without this bound one client
    /// rolls the access log away in minutes.
    #[arg(long, default_value_t = 20, value_name = "LINES")]
    pub access_log_anonymous_errors_per_s: u32,
    /// The access log is rotated once it would pass this size (`FILE.1` is the newest).
    #[arg(long, default_value = "100MiB", value_parser = parse_size)]
    pub access_log_max_size: u64,
    /// Rotated access logs kept.
    #[arg(long, default_value_t = 5)]
    pub access_log_keep: u32,
    /// Also send each access-log line to this Kafka topic on the `--usage-kafka`
    /// brokers, keyed by the caller (best effort: the file keeps every line).
    #[arg(long, value_name = "TOPIC", requires_all = ["usage_kafka", "access_log"])]
    pub access_log_kafka_topic: Option<String>,
    /// Export OpenTelemetry traces (OTLP over HTTP/protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (the traces path is added when none is given): a server
    /// span per request with spans for auth, each filter and the upstream call, for
    /// every server error, every request of a caller under `posternctl trace`, and a
    /// share of the rest (`--trace-sample`). Built and sent by a thread of their own
    /// behind a bounded queue; a request never waits.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// The share of requests traced, from 0 to 1, decided on the same random ids as the
    /// access log's sample (a sampled success has both a log line and a trace).
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION", value_parser = parse_fraction)]
    pub trace_sample: f64,
}

/// A value on the command line that does not parse.
#[derive(Debug, thiserror::Error)]
enum ArgError {
    #[error("{0:?} is not a number")]
    NotNumber(String),
    #[error(transparent)]
    Fraction(#[from] postern_observe::FractionError),
    #[error("{0:?} is not a size (1GiB, 64MiB, 512KiB, bytes)")]
    Size(String),
    #[error("{0:?}: sizes are in KiB, MiB or GiB")]
    Unit(String),
    #[error("{0:?} is out of range")]
    Range(String),
}

/// An admin listener other hosts could reach, not asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--admin {0}: the admin listener (metrics, /readyz, /snapshot, /usage/windows) has no authentication and binds a loopback address; add --admin-beyond-loopback to serve it on a network only operators reach"
)]
pub struct AdminBeyondLoopback(pub SocketAddr);

impl Args {
    /// Refuses an admin listener on an address other than loopback unless
    /// `--admin-beyond-loopback` asks for it.
    pub fn check_admin(&self) -> Result<(), AdminBeyondLoopback> {
        if self.admin.ip().is_loopback() || self.admin_beyond_loopback {
            Ok(())
        } else {
            Err(AdminBeyondLoopback(self.admin))
        }
    }

    /// Refuses a secret given on the command line, where every process of the host can
    /// read it: a Redis URL with a password (it belongs in POSTERN_RATELIMIT_REDIS), an
    /// exporter or control URL carrying a credential.
    pub fn check_secrets(&self) -> Result<(), postern_model::secrets::OnCommandLine> {
        use postern_model::secrets::{OnCommandLine, in_url, on_command_line};
        let redis = self.ratelimit_redis.iter().map(|u| ("--ratelimit-redis", u.as_str(), "POSTERN_RATELIMIT_REDIS"));
        let others = [("--control", self.control.as_deref()), ("--otlp-endpoint", self.otlp_endpoint.as_deref())]
            .into_iter()
            .filter_map(|(flag, url)| {
                Some((flag, url?, "a URL without credentials (tokens go in their own flags' environment or files)"))
            });
        for (flag, url, instead) in redis.chain(others) {
            if let Some(what) = in_url(url)
                && on_command_line(flag)
            {
                return Err(OnCommandLine { flag, what, instead });
            }
        }
        Ok(())
    }
}

/// A fraction from 0 to 1.
fn parse_fraction(s: &str) -> Result<f64, ArgError> {
    let f: f64 = s.trim().parse().map_err(|_| ArgError::NotNumber(s.to_owned()))?;
    Ok(postern_observe::LogSettings::rate(f).map(|_| f)?)
}

/// A size: bytes, or a number with `KiB`, `MiB` or `GiB`.
fn parse_size(s: &str) -> Result<u64, ArgError> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().map_err(|_| ArgError::Size(s.to_owned()))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" | "K" | "k" => 10,
        "MiB" | "M" => 20,
        "GiB" | "G" => 30,
        u => return Err(ArgError::Unit(u.to_owned())),
    };
    n.checked_mul(1 << shift).filter(|&b| b > 0).ok_or_else(|| ArgError::Range(s.to_owned()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser as _;

    #[test]
    fn the_admin_listener_stays_on_loopback_unless_asked() {
        let args =
            |extra: &[&str]| Args::try_parse_from([&["postern", "--snapshot", "s.json"], extra].concat()).unwrap();
        assert_eq!(args(&[]).check_admin(), Ok(()));
        assert_eq!(args(&["--admin", "[::1]:9901"]).check_admin(), Ok(()));
        assert_eq!(args(&["--admin", "127.0.0.2:0"]).check_admin(), Ok(()));
        for exposed in ["0.0.0.0:9901", "10.0.0.5:9901", "[::]:9901"] {
            let addr: SocketAddr = exposed.parse().unwrap();
            assert_eq!(args(&["--admin", exposed]).check_admin(), Err(AdminBeyondLoopback(addr)));
            assert_eq!(args(&["--admin", exposed, "--admin-beyond-loopback"]).check_admin(), Ok(()));
        }
    }
}
