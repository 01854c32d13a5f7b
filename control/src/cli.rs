//! `posternctl`'s command line: its commands, their flags and arguments (clap). A module
//! of the binary, read by `main.rs`, which runs them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use postern_model::credentials::{Alg, Priority};
use posternctl::config::parse_duration;
use posternctl::keys::{parse_alg, parse_priority};

#[derive(Parser)]
#[command(name = "posternctl", version, about = "Postern control plane")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Compile a config repository into a snapshot file, and its credential state
    /// (platform/auth.yaml, platform/keys.jsonl) into credentials.json beside it.
    Compile {
        /// The config repository (platform/ and teams/).
        repo: PathBuf,
        /// Where to write the snapshot.
        #[arg(short, long)]
        out: PathBuf,
        /// Snapshot number (default: the previous one in `out`, plus one if changed).
        #[arg(long)]
        version: Option<u64>,
    },
    /// Check a config repository (snapshot and credentials) without writing anything.
    Validate {
        /// The config repository.
        repo: PathBuf,
    },
    /// Show what publishing the repository would change against a snapshot (routes
    /// added, changed and removed per team; clusters and plans), without writing anything.
    Plan {
        /// The config repository.
        repo: PathBuf,
        /// The snapshot running now (e.g. a node's snapshot.json).
        #[arg(long)]
        against: PathBuf,
    },
    /// Work with Wasm filters.
    Filter {
        #[command(subcommand)]
        command: FilterCommand,
    },
    /// Manage API keys in a config repository (platform/keys.jsonl).
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// JWT signing keys and tokens, for development and tests.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Serve the control plane: publish versions from the repository into the store and
    /// deliver them to nodes.
    Serve {
        /// The config repository.
        repo: PathBuf,
        /// Version store: a directory (embedded) or a postgres:// URL (one with a password
        /// belongs in POSTERN_STORE, not in the process list).
        #[arg(long, env = "POSTERN_STORE", hide_env_values = true)]
        store: String,
        /// Admin tokens (JSON list of {name, role, sha256}).
        #[arg(long)]
        tokens: PathBuf,
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:9400")]
        listen: std::net::SocketAddr,
        /// Time at each rollout stage (canary, 10 %, all) once its nodes run the new
        /// snapshot; 0s delivers every snapshot to every node at once.
        #[arg(long, default_value = "60s", value_parser = parse_duration)]
        dwell: std::time::Duration,
        /// Canary nodes, when no node declares itself one (`postern --control-canary`).
        #[arg(long, default_value_t = 1)]
        canary_nodes: usize,
        /// Responses a changed route needs on a side before it is compared.
        #[arg(long, default_value_t = 50)]
        rollout_min_requests: u64,
        /// Largest rise of a changed route's 5xx rate on the new version (0.02 = 2 points).
        #[arg(long, default_value_t = 0.02)]
        rollout_max_5xx_increase: f64,
        /// A changed route's p99 on the new version may be 2× the old one's or this much
        /// slower, whichever is more.
        #[arg(long, default_value = "20ms", value_parser = parse_duration)]
        rollout_p99_slack: std::time::Duration,
        /// The Ed25519 key every version is signed with (`posternctl signing-key new`);
        /// default: `<store>/signing.key`, made on first start, for a directory store.
        #[arg(long)]
        signing_key: Option<PathBuf>,
        /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The certificate's private key (PEM).
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Also write every credentials version, signed, to `<DIR>/credentials.json`: the
        /// second revocation path nodes poll (`postern --credentials-dir`).
        #[arg(long, value_name = "DIR")]
        publish_dir: Option<PathBuf>,
        /// The usage store nodes' windows are applied to: a SQLite file, or a PostgreSQL
        /// database (`postgres://…`); default `<store>/usage.db` for a directory store,
        /// and the store's own database for a PostgreSQL store. A URL with a password
        /// belongs in POSTERN_USAGE_DB: on the command line it is refused.
        #[arg(long, value_name = "FILE|URL", env = "POSTERN_USAGE_DB", hide_env_values = true)]
        usage_db: Option<String>,
        /// Post quota events (a caller passed 80 % or 100 % of its plan's quota) to this
        /// http:// URL, as CloudEvents JSON; retried until taken (a 2xx answer). A URL with
        /// a credential (a password, a `token=` or `sig=` parameter) belongs in
        /// POSTERN_QUOTA_WEBHOOK: on the command line it is refused.
        #[arg(long, value_name = "URL", env = "POSTERN_QUOTA_WEBHOOK", hide_env_values = true)]
        quota_webhook: Option<String>,
        /// The certificates (PEM) an https:// quota webhook is trusted by; there is no
        /// implicit trust store, so an https:// webhook without them is refused at start.
        #[arg(long, value_name = "FILE", env = "POSTERN_QUOTA_WEBHOOK_CA", requires = "quota_webhook")]
        quota_webhook_ca: Option<PathBuf>,
        /// Sign each quota event with the secret in FILE (`whsec_<base64>`, or its bytes as
        /// they are), as Standard Webhooks do: headers `webhook-id`, `webhook-timestamp` and
        /// `webhook-signature: v1,<base64 of HMAC-SHA256 over "id.timestamp.body">`.
        #[arg(long, value_name = "FILE", env = "POSTERN_QUOTA_WEBHOOK_SECRET_FILE", requires = "quota_webhook")]
        quota_webhook_secret_file: Option<PathBuf>,
        /// Also consume nodes' usage windows from Kafka (`host:port,...`; nodes started
        /// with the same --usage-kafka write them there), as a consumer group; the topic
        /// is made if it is missing.
        #[arg(long, value_name = "BROKERS")]
        usage_kafka: Option<String>,
        /// The nodes' usage keys: a JSON object of node id → its public key
        /// (`ed25519:<hex>`, as `posternctl signing-key new` prints it for the key the node
        /// is started with, `postern --usage-signing-key`), or a list of two during a key
        /// change. Once given, the intake and the Kafka consumer take a node's usage only
        /// signed by its key (refused by rule `usage_signature` otherwise, counted per node).
        #[arg(long, value_name = "FILE")]
        usage_node_keys: Option<PathBuf>,
        /// The usage topic.
        #[arg(long, default_value = postern_model::usage::KAFKA_TOPIC, value_name = "TOPIC")]
        usage_kafka_topic: String,
        /// The consumer group (every quota service instance of a fleet joins it).
        #[arg(long, default_value = "postern-usage", value_name = "GROUP")]
        usage_kafka_group: String,
        /// Partitions of the topic, when it is made here.
        #[arg(long, default_value_t = 12, value_name = "N")]
        usage_kafka_partitions: i32,
        /// Replication factor of the topic, when it is made here.
        #[arg(long, default_value_t = 1, value_name = "N")]
        usage_kafka_replication: i32,
        /// A librdkafka setting for the consumer (`security.protocol=SSL`, `sasl.username=…`);
        /// repeat for more.
        #[arg(long, value_name = "KEY=VALUE")]
        usage_kafka_option: Vec<String>,
        /// More librdkafka settings, one `key=value` a line: where secrets go
        /// (`sasl.password`…), which `--usage-kafka-option` refuses.
        #[arg(long, value_name = "FILE")]
        usage_kafka_options_file: Option<PathBuf>,
    },
    /// Usage per key, route and time, from the control plane's usage store; `reconcile`
    /// and `export` close a billing period.
    ///
    /// `posternctl usage --key demo-partner --by route --last 1h` prints the last hour's
    /// rows per route; `--chart` draws calls per minute instead, one sparkline per caller
    /// and route with the minutes that had 4xx or 5xx marked below it, so a spike shows
    /// without reading numbers.
    #[command(args_conflicts_with_subcommands = true)]
    Usage {
        #[command(subcommand)]
        action: Option<UsageAction>,
        #[command(flatten)]
        control: UsageControlArgs,
        #[command(flatten)]
        query: UsageQuery,
    },
    /// The control plane's signing key.
    SigningKey {
        #[command(subcommand)]
        command: SigningKeyCommand,
    },
    /// Compile the repository on the control plane and publish what changed.
    Publish {
        #[command(flatten)]
        control: ControlArgs,
        /// Wait up to this many seconds for every live node to apply new credentials.
        #[arg(long, default_value_t = 0)]
        wait_acks: u64,
        /// Wait up to this many seconds (at most 60) until the first stage's nodes serve
        /// a new snapshot, and fail if they do not; 0 answers once it is published.
        #[arg(long, default_value_t = 60)]
        wait: u64,
    },
    /// Publish an earlier snapshot's contents as a new version, to every node at once.
    Rollback {
        #[command(flatten)]
        control: ControlArgs,
        /// The version whose contents to publish again.
        #[arg(long)]
        to: u64,
        /// Wait up to this many seconds (at most 60) until every live node serves it, and
        /// fail if one does not; 0 answers once it is published.
        #[arg(long, default_value_t = 60)]
        wait: u64,
    },
    /// Each published route's response timeout beside the p99.9 of its metered answers
    /// (from the usage store), with advice where the timeout is 10x that or more; a team's
    /// token sees its own routes.
    Routes {
        #[command(flatten)]
        control: ControlArgs,
        /// Only the routes with advice.
        #[arg(long)]
        advice: bool,
        /// How far back the answers are looked at: 90s, 30m, 1h, 7d.
        #[arg(long, default_value = "7d")]
        last: String,
        /// The answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Which nodes run which version.
    Status {
        #[command(flatten)]
        control: ControlArgs,
        /// Wait up to this many seconds until no rollout is in progress and every live
        /// node runs the head, then show the status; fail if the fleet does not settle.
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
    /// Trace every request of one API key or OAuth app for a while, on every node (a
    /// fast-lane change; the flag carries its expiry, so tracing turns itself off).
    Trace {
        #[command(flatten)]
        control: ControlArgs,
        #[command(flatten)]
        which: TraceWhich,
        /// For how long (e.g. 1h, 15m); at most a week.
        #[arg(long = "for", default_value = "1h", value_parser = parse_duration, conflicts_with = "off")]
        duration: Duration,
        /// End the caller's tracing now.
        #[arg(long)]
        off: bool,
        /// Wait up to this many seconds for every live node to run it.
        #[arg(long, default_value_t = 5)]
        wait_acks: u64,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub(crate) struct TraceWhich {
    /// An API key, by id.
    #[arg(long)]
    pub(crate) key: Option<String>,
    /// An OAuth app, by `client_id`.
    #[arg(long)]
    pub(crate) app: Option<String>,
}

#[derive(Subcommand)]
pub(crate) enum SigningKeyCommand {
    /// Make a new key (written with mode 0600); prints the public key nodes pin
    /// (`postern --control-key`).
    New {
        /// Where to write it.
        out: PathBuf,
    },
    /// Print a key's public half.
    Public {
        /// The private key file.
        key: PathBuf,
    },
}

/// How to reach a serving control plane.
/// `posternctl usage reconcile|lift|export`.
#[derive(Subcommand)]
pub(crate) enum UsageAction {
    /// Check a billing period (every node's windows, no number missing, the period over)
    /// and mark it final; prints what keeps it from being final.
    Reconcile {
        #[command(flatten)]
        control: ControlArgs,
        /// The period, YYYY-MM.
        #[arg(long)]
        period: String,
    },
    /// Lift a caller's over-quota flags (an audited platform decision): its calls are
    /// served again on every node within seconds; its use stays counted.
    Lift {
        #[command(flatten)]
        control: ControlArgs,
        /// The API key id.
        #[arg(long, conflicts_with = "app", required_unless_present = "app")]
        key: Option<String>,
        /// The OAuth app's client_id.
        #[arg(long)]
        app: Option<String>,
        /// Only on this product (every product by default).
        #[arg(long)]
        product: Option<String>,
    },
    /// Retire a node from the usage stream (an audited platform decision): its windows
    /// numbered past `--after` (by default the last it sent) are refused, and no billing
    /// period waits for its counts or missing windows again. Without --node: list the
    /// retired nodes.
    Retire {
        #[command(flatten)]
        control: ControlArgs,
        /// The node's id.
        #[arg(long)]
        node: Option<String>,
        /// Its last window that counts (default: the last the usage store applied).
        #[arg(long, requires = "node")]
        after: Option<u64>,
    },
    /// Windows that came for a period already final are held, never added on their own:
    /// list them, or (an audited platform decision) apply them to the period's totals,
    /// reopening it for the next reconcile, or discard them.
    Held {
        #[command(flatten)]
        control: ControlArgs,
        /// Apply the period's held windows (YYYY-MM).
        #[arg(long, value_name = "PERIOD", conflicts_with = "discard")]
        apply: Option<String>,
        /// Discard the period's held windows (YYYY-MM).
        #[arg(long, value_name = "PERIOD")]
        discard: Option<String>,
    },
    /// A final period's billing lines: one JSON line per caller and product.
    Export {
        #[command(flatten)]
        control: ControlArgs,
        /// The period, YYYY-MM.
        #[arg(long)]
        period: String,
    },
}

/// `posternctl usage`: which rows, and how to print them.
#[derive(Args)]
pub(crate) struct UsageQuery {
    /// One caller: an API key's id or an OAuth app's client_id.
    #[arg(long)]
    pub(crate) key: Option<String>,
    /// One API product.
    #[arg(long)]
    pub(crate) product: Option<String>,
    /// From (Unix seconds, YYYY-MM-DD or RFC 3339; default: the month's start).
    #[arg(long)]
    pub(crate) from: Option<String>,
    /// To, exclusive (default: now).
    #[arg(long)]
    pub(crate) to: Option<String>,
    /// The range ending now: a whole number and s, m, h or d (90s, 30m, 1h, 2d).
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = posternctl::usage::parse_last,
        conflicts_with_all = ["from", "to"]
    )]
    pub(crate) last: Option<u64>,
    /// Rows per route over the range, or per minute or day.
    #[arg(long, default_value = "route", value_parser = ["route", "minute", "day"])]
    pub(crate) by: String,
    /// Calls per minute as a text chart per caller and route, with 4xx and 5xx minutes
    /// marked (asks for minutes whatever --by says).
    #[arg(long)]
    pub(crate) chart: bool,
    /// Print the answer's JSON instead of a table or chart.
    #[arg(long)]
    pub(crate) json: bool,
}

/// [`ControlArgs`] beside subcommands that bring their own: the token is checked when
/// used, not by the parser.
#[derive(Args)]
pub(crate) struct UsageControlArgs {
    /// Control plane URL.
    #[arg(long, default_value = "http://127.0.0.1:9400")]
    pub(crate) control: String,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    pub(crate) control_ca: Option<PathBuf>,
}

impl UsageControlArgs {
    pub(crate) fn required(self) -> anyhow::Result<ControlArgs> {
        let Some(token) = self.token else {
            anyhow::bail!("the control plane needs a token: --token or POSTERN_TOKEN");
        };
        Ok(ControlArgs { control: self.control, token, control_ca: self.control_ca })
    }
}

#[derive(Args)]
pub(crate) struct ControlArgs {
    /// Control plane URL.
    #[arg(long, default_value = "http://127.0.0.1:9400")]
    pub(crate) control: String,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    pub(crate) token: String,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    pub(crate) control_ca: Option<PathBuf>,
}

/// A control plane to send a change to instead of editing a repository.
#[derive(Args)]
pub(crate) struct Remote {
    /// Control plane URL: make the change through its key service.
    #[arg(long)]
    pub(crate) control: Option<String>,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    pub(crate) control_ca: Option<PathBuf>,
}

#[derive(Subcommand)]
pub(crate) enum KeyCommand {
    /// Create an API key: append its hash to platform/keys.jsonl and print the raw key,
    /// once, on stdout. With --control, the control plane's key service does it and
    /// answers once every live node can use the key.
    New {
        /// The config repository (or --control).
        #[arg(required_unless_present = "control")]
        repo: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
        /// Key id (not secret; sent to backends as x-auth-key-id).
        #[arg(long)]
        id: String,
        /// The app the key belongs to.
        #[arg(long)]
        app: String,
        /// The tenant that owns the app.
        #[arg(long)]
        tenant: String,
        /// The plan (must be defined in the repository; checked by compile and validate).
        #[arg(long)]
        plan: String,
        /// A granted scope (repeatable).
        #[arg(long = "scope", value_name = "SCOPE")]
        scopes: Vec<String>,
        /// The key's own priority class (critical, standard, free or sheddable), above
        /// its plan's and below a route's; without it, the plan's.
        #[arg(long, value_parser = parse_priority)]
        priority: Option<Priority>,
        /// Make an ak_test_ key instead of ak_live_.
        #[arg(long)]
        test: bool,
    },
    /// Replace a key with a new one (same app, tenant, plan, scopes and priority); the old
    /// key keeps working for the overlap. Prints the new raw key, once, on stdout.
    Rotate {
        /// The config repository (or --control).
        #[arg(required_unless_present = "control")]
        repo: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
        /// The key to replace.
        #[arg(long, value_name = "OLD")]
        id: String,
        /// The new key's id.
        #[arg(long, value_name = "NEW")]
        new_id: String,
        /// How long the old key keeps working (e.g. 24h, 15m, 90s).
        #[arg(long, default_value = "24h", value_parser = parse_duration)]
        overlap: Duration,
        /// Make the new key an ak_test_ key instead of ak_live_.
        #[arg(long)]
        test: bool,
    },
    /// Revoke a key, by id or by the raw key (e.g. one reported leaked).
    Revoke {
        /// The config repository (or --control).
        #[arg(required_unless_present = "control")]
        repo: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
        #[command(flatten)]
        which: RevokeWhich,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub(crate) struct RevokeWhich {
    /// The key's id.
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// The raw key; `-` reads it from stdin (keeps it out of shell history).
    #[arg(long, value_name = "RAW_KEY")]
    pub(crate) key: Option<String>,
}

#[derive(Subcommand)]
pub(crate) enum TokenCommand {
    /// Generate a signing key pair: write the private key PEM to a new file (mode 0600) and
    /// print the signing-key record to paste under `signing_keys:` in platform/auth.yaml.
    /// ES256 makes a P-256 key, RS256 a 2048-bit RSA key.
    Keygen {
        /// Key id (the tokens' `kid` header).
        #[arg(long)]
        kid: String,
        /// The issuer (`iss`) whose tokens the key signs.
        #[arg(long)]
        issuer: String,
        /// ES256 or RS256.
        #[arg(long, default_value = "ES256", value_parser = parse_alg)]
        alg: Alg,
        /// Where to write the private key (PKCS#8 PEM); never overwritten.
        #[arg(long, value_name = "FILE")]
        private_out: PathBuf,
        /// Also write the public key (SPKI PEM) here, e.g. for `public_key_file:`.
        #[arg(long, value_name = "FILE")]
        public_out: Option<PathBuf>,
    },
    /// Sign an access token with a private key and print it. DEVELOPMENT ONLY: production
    /// tokens come from the identity provider, and the private key must not sit on a
    /// developer machine.
    Mint {
        /// The private key (PKCS#8 PEM, as written by `token keygen`).
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// Key id (`kid` header).
        #[arg(long)]
        kid: String,
        /// `iss`.
        #[arg(long)]
        issuer: String,
        /// `aud`.
        #[arg(long)]
        audience: String,
        /// `sub`: the user.
        #[arg(long)]
        sub: String,
        /// `client_id`: the OAuth app.
        #[arg(long)]
        client_id: String,
        /// `scope`: space-separated scopes.
        #[arg(long)]
        scope: Option<String>,
        /// Lifetime (e.g. 15m); the gateway refuses tokens living longer than
        /// jwt.max_lifetime_s (default 1h).
        #[arg(long, default_value = "15m", value_parser = parse_duration)]
        ttl: Duration,
        /// ES256 or RS256 (the key's algorithm).
        #[arg(long, default_value = "ES256", value_parser = parse_alg)]
        alg: Alg,
        /// `jti` (default: 16 random bytes, hex).
        #[arg(long)]
        jti: Option<String>,
    },
    /// Revoke tokens: one (by jti), or every token of a user (sub) or an app (client_id)
    /// issued before now. Appends to platform/deny.jsonl, or with --control goes through
    /// the control plane and answers once every live node applies it.
    Revoke {
        /// The config repository (or --control).
        #[arg(required_unless_present = "control")]
        repo: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
        #[command(flatten)]
        which: DenyWhich,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub(crate) struct DenyWhich {
    /// One token's `jti`.
    #[arg(long)]
    pub(crate) jti: Option<String>,
    /// A user: every token with this `sub` issued before now.
    #[arg(long)]
    pub(crate) sub: Option<String>,
    /// An app: every token with this `client_id` issued before now.
    #[arg(long)]
    pub(crate) client_id: Option<String>,
}

#[derive(Subcommand)]
pub(crate) enum FilterCommand {
    /// Make a new filter crate that builds and tests as it is: a typed config checked in
    /// `init`, unit tests, the stack setting, and a manifest with sample cases.
    New {
        /// The filter's name (lowercase letters, digits and '-'): the crate's, the
        /// manifest's and what routes attach.
        name: String,
        /// What it starts as.
        #[arg(long, value_enum, default_value = "header")]
        template: posternctl::filter_new::Template,
        /// Where to make it (default: ./<name>).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The filter SDK (the gateway repository's filter-sdk/guest); default: the one
        /// of the repository around the current folder, else of the one posternctl was
        /// built from.
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// Build a filter crate for wasm32-wasip2 (release, with its .cargo/config.toml), copy
    /// the component beside its manifest, and review it: digest, size, imports, and its
    /// sample cases run in the sandbox with their cost (exit 1 if one fails).
    Build {
        /// The crate's folder.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The crate's Cargo.toml, instead of its folder.
        #[arg(long, conflicts_with = "dir")]
        manifest_path: Option<PathBuf>,
    },
    /// Review a filter module for the platform and record its approval in the review
    /// registry (platform/filters.yaml): the runtime's checks (world, imports), its size,
    /// and its manifest's samples run in the sandbox with their fuel and memory against
    /// the manifest's limits, and what changed against the approved version it replaces.
    /// Nothing is recorded if the review refuses it (exit 1).
    Approve {
        /// The module (`.wasm`, with its manifest beside it) or its manifest (`.yaml`),
        /// e.g. teams/<team>/filters/<name>.wasm in a config repository.
        module: PathBuf,
        /// The team that may attach it (default: the team folder it sits in).
        #[arg(long)]
        team: Option<String>,
        /// Who reviewed it.
        #[arg(long)]
        reviewer: String,
        /// The review registry (default: platform/filters.yaml of the config repository
        /// the module sits in).
        #[arg(long)]
        approvals: Option<PathBuf>,
    },
    /// Run a filter component on one request in the real sandbox and print, per phase, the
    /// decision, its cost (fuel, memory high-water mark, time) and what the filter logged
    /// and counted, as JSON (exit 1 if the filter failed).
    Run {
        /// The component (`.wasm`).
        module: PathBuf,
        /// The filter's config, as JSON.
        #[arg(long, default_value = "null")]
        config: String,
        /// Limits, as JSON (e.g. `{"fuel": 1000000}`); defaults for the rest.
        #[arg(long, default_value = "{}")]
        limits: String,
        /// Method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// Path, optionally with `?query`.
        #[arg(long, default_value = "/")]
        path: String,
        /// A header, `name: value` (repeatable).
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
        /// A body: also runs the body phase.
        #[arg(long)]
        body: Option<String>,
        /// The backend's response status: also runs the response phase (when the request
        /// phases forward the request).
        #[arg(long)]
        response_status: Option<u16>,
        /// A header of the backend's response, `name: value` (repeatable; runs the response
        /// phase, status 200 unless `--response-status` says otherwise).
        #[arg(long = "response-header")]
        response_headers: Vec<String>,
    },
    /// What each Wasm filter on a route costs on the node `--admin` names: calls by
    /// outcome, fuel and time percentiles with exact means and maxima, refused answers by
    /// rule, quarantines and reruns, read from the node's admin endpoint.
    Cost {
        /// The route, `team/name`.
        #[arg(long)]
        route: String,
        /// The admin listener of the node to read (each node counts its own calls), e.g.
        /// http://127.0.0.1:9901 for the demo's node-a.
        #[arg(long)]
        admin: String,
        /// Over this window (read twice, this far apart, e.g. 30s); default: since the
        /// node started.
        #[arg(long, value_parser = parse_duration)]
        window: Option<std::time::Duration>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}
