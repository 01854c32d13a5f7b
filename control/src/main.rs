//! `posternctl`: the control plane's command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use postern_model::apikey::KeyEnv;
use postern_model::credentials::{Alg, Credentials, Priority};
use postern_model::disk::unix_now;
use posternctl::compile::RepoError;
use posternctl::config::parse_duration;
use posternctl::credentials::{CREDENTIALS_FILE, publish_credentials};
use posternctl::keys::{self, parse_alg, parse_priority};
use posternctl::{out, outln};

/// mimalloc, as in the node: compiling a large key table makes many small allocations.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "posternctl", version, about = "Postern control plane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
        /// The usage store (SQLite) nodes' windows are applied to; default
        /// `<store>/usage.db` for a directory store, none for PostgreSQL (the intake then
        /// answers 503 and nodes keep their windows spooled).
        #[arg(long, value_name = "FILE")]
        usage_db: Option<PathBuf>,
        /// Post quota events (a caller passed 80 % or 100 % of its plan's quota) to this
        /// http:// URL, as CloudEvents JSON; retried until taken (a 2xx answer).
        #[arg(long, value_name = "URL")]
        quota_webhook: Option<String>,
        /// Also consume nodes' usage windows from Kafka (`host:port,...`; nodes started
        /// with the same --usage-kafka write them there), as a consumer group; the topic
        /// is made if it is missing.
        #[arg(long, value_name = "BROKERS")]
        usage_kafka: Option<String>,
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
struct TraceWhich {
    /// An API key, by id.
    #[arg(long)]
    key: Option<String>,
    /// An OAuth app, by `client_id`.
    #[arg(long)]
    app: Option<String>,
}

#[derive(Subcommand)]
enum SigningKeyCommand {
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
/// `posternctl usage reconcile|export`.
#[derive(Subcommand)]
enum UsageAction {
    /// Check a billing period (every node's windows, no number missing, the period over)
    /// and mark it final; prints what keeps it from being final.
    Reconcile {
        #[command(flatten)]
        control: ControlArgs,
        /// The period, YYYY-MM.
        #[arg(long)]
        period: String,
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
struct UsageQuery {
    /// One caller: an API key's id or an OAuth app's client_id.
    #[arg(long)]
    key: Option<String>,
    /// One API product.
    #[arg(long)]
    product: Option<String>,
    /// From (Unix seconds, YYYY-MM-DD or RFC 3339; default: the month's start).
    #[arg(long)]
    from: Option<String>,
    /// To, exclusive (default: now).
    #[arg(long)]
    to: Option<String>,
    /// The range ending now: a whole number and s, m, h or d (90s, 30m, 1h, 2d).
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = posternctl::usage::parse_last,
        conflicts_with_all = ["from", "to"]
    )]
    last: Option<u64>,
    /// Rows per route over the range, or per minute or day.
    #[arg(long, default_value = "route", value_parser = ["route", "minute", "day"])]
    by: String,
    /// Calls per minute as a text chart per caller and route, with 4xx and 5xx minutes
    /// marked (asks for minutes whatever --by says).
    #[arg(long)]
    chart: bool,
    /// Print the answer's JSON instead of a table or chart.
    #[arg(long)]
    json: bool,
}

/// [`ControlArgs`] beside subcommands that bring their own: the token is checked when
/// used, not by the parser.
#[derive(Args)]
struct UsageControlArgs {
    /// Control plane URL.
    #[arg(long, default_value = "http://127.0.0.1:9400")]
    control: String,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    control_ca: Option<PathBuf>,
}

impl UsageControlArgs {
    fn required(self) -> anyhow::Result<ControlArgs> {
        let Some(token) = self.token else {
            anyhow::bail!("the control plane needs a token: --token or POSTERN_TOKEN");
        };
        Ok(ControlArgs { control: self.control, token, control_ca: self.control_ca })
    }
}

#[derive(Args)]
struct ControlArgs {
    /// Control plane URL.
    #[arg(long, default_value = "http://127.0.0.1:9400")]
    control: String,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    token: String,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    control_ca: Option<PathBuf>,
}

/// A control plane to send a change to instead of editing a repository.
#[derive(Args)]
struct Remote {
    /// Control plane URL: make the change through its key service.
    #[arg(long)]
    control: Option<String>,
    /// Admin token (or POSTERN_TOKEN).
    #[arg(long, env = "POSTERN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificates (PEM) an `https://` control plane's certificate is checked against.
    #[arg(long, env = "POSTERN_CONTROL_CA")]
    control_ca: Option<PathBuf>,
}

impl Remote {
    /// POSTs `body` to `path`; returns the answer, or the control plane's errors.
    fn post(&self, path: &str, body: &impl serde::Serialize) -> anyhow::Result<Option<serde_json::Value>> {
        let Some(base) = &self.control else { return Ok(None) };
        let body = serde_json::to_value(body)?;
        let token =
            self.token.as_deref().ok_or_else(|| anyhow::anyhow!("--control needs --token (or POSTERN_TOKEN)"))?;
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let (status, bytes) = runtime()?.block_on(posternctl::serve::request_with(
            http::Method::POST.as_str(),
            &url,
            token,
            self.control_ca.as_deref(),
            Some(body),
        ))?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            let errors =
                v["errors"].as_array().map(|e| e.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join("\n  "));
            let why = errors.filter(|e| !e.is_empty()).or_else(|| v["error"].as_str().map(str::to_owned));
            anyhow::bail!("control plane answered {status}: {}", why.unwrap_or_default());
        }
        Ok(Some(v))
    }
}

/// Says which nodes run a fast-lane change.
fn report_acks(v: &serde_json::Value) {
    let c = &v["credentials"];
    let names = |k: &str| c[k].as_array().map(|a| a.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", "));
    eprintln!(
        "credentials v{} applied on {} node(s){}",
        c["version"],
        c["acked"].as_array().map_or(0, Vec::len),
        names("stale").filter(|s| !s.is_empty()).map(|s| format!("; stale: {s}")).unwrap_or_default()
    );
}

#[derive(Subcommand)]
enum KeyCommand {
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
        /// Priority class: critical, standard, free or sheddable.
        #[arg(long, default_value = "standard", value_parser = parse_priority)]
        priority: Priority,
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
struct RevokeWhich {
    /// The key's id.
    #[arg(long)]
    id: Option<String>,
    /// The raw key; `-` reads it from stdin (keeps it out of shell history).
    #[arg(long, value_name = "RAW_KEY")]
    key: Option<String>,
}

#[derive(Subcommand)]
enum TokenCommand {
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
struct DenyWhich {
    /// One token's `jti`.
    #[arg(long)]
    jti: Option<String>,
    /// A user: every token with this `sub` issued before now.
    #[arg(long)]
    sub: Option<String>,
    /// An app: every token with this `client_id` issued before now.
    #[arg(long)]
    client_id: Option<String>,
}

#[derive(Subcommand)]
enum FilterCommand {
    /// Run a filter component on one request in the real sandbox and print the decision
    /// and its cost as JSON (exit 1 if the filter failed).
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
    },
    /// What each Wasm filter on a route costs on a node: calls by outcome, fuel and
    /// duration percentiles, refused answers by rule, quarantines and reruns, read from
    /// the node's admin endpoint.
    Cost {
        /// The route, `team/name`.
        #[arg(long)]
        route: String,
        /// The node's admin listener.
        #[arg(long, default_value = "http://127.0.0.1:9901")]
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

/// The admin endpoint's metrics page.
fn node_metrics(admin: &str) -> anyhow::Result<String> {
    let url = format!("{}/metrics", admin.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with("GET", &url, "", None, None))?;
    anyhow::ensure!(status.is_success(), "{url}: {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn filter_cost(route: &str, admin: &str, window: Option<std::time::Duration>, as_json: bool) -> anyhow::Result<bool> {
    use posternctl::filter_cost;
    let first = filter_cost::costs(&node_metrics(admin)?, route);
    let costs = match window {
        None => first,
        Some(w) => {
            std::thread::sleep(w);
            filter_cost::window(&filter_cost::costs(&node_metrics(admin)?, route), &first)
        }
    };
    let window_s = window.map(|w| w.as_secs());
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&filter_cost::json(route, window_s, &costs))?);
    } else {
        outln!("{}", filter_cost::table(route, window_s, &costs).trim_end());
    }
    Ok(true)
}

fn filter_run(command: FilterCommand) -> anyhow::Result<bool> {
    let (module, config, limits, method, path, headers, body) = match command {
        FilterCommand::Run { module, config, limits, method, path, headers, body } => {
            (module, config, limits, method, path, headers, body)
        }
        FilterCommand::Cost { route, admin, window, json } => return filter_cost(&route, &admin, window, json),
    };
    let config: serde_json::Value = serde_json::from_str(&config).map_err(|e| anyhow::anyhow!("--config: {e}"))?;
    let limits: postern_model::wasm::Limits =
        serde_json::from_str(&limits).map_err(|e| anyhow::anyhow!("--limits: {e}"))?;
    let headers = headers
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| anyhow::anyhow!("--header {h:?}: use 'name: value'"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let req = posternctl::filter_run::RunRequest { method, path, headers, body: body.map(String::into_bytes) };
    let report = posternctl::filter_run::run(&module, &config, limits, &req)?;
    outln!("{}", serde_json::to_string_pretty(&report)?);
    Ok(report["ok"] == true)
}

fn print_credential_errors(errors: &[String]) {
    eprintln!("{} error(s) in the credentials:", errors.len());
    for e in errors {
        eprintln!("  {e}");
    }
}

/// `credentials.json` beside the snapshot.
fn credentials_out(out: &Path) -> anyhow::Result<PathBuf> {
    if out.file_name().is_some_and(|n| n == CREDENTIALS_FILE) {
        anyhow::bail!("-o {}: that name is taken by the credentials file; name the snapshot otherwise", out.display());
    }
    Ok(out.parent().unwrap_or(Path::new(".")).join(CREDENTIALS_FILE))
}

/// The snapshot and the credential state of `repo`, or the exit code after printing
/// every error.
fn compile_all(repo: &Path) -> Result<(posternctl::compile::Compiled, Credentials), ExitCode> {
    posternctl::compile::compile_repo(repo).map_err(|e| {
        match e {
            RepoError::Rejected(rejected) => eprint!("{rejected}"),
            RepoError::Credentials(errors) => print_credential_errors(&errors),
        }
        ExitCode::from(1)
    })
}

fn compile(repo: &Path, out: &Path, version: Option<u64>) -> ExitCode {
    let (compiled, creds) = match compile_all(repo) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let publish = || -> anyhow::Result<()> {
        let creds_out = credentials_out(out)?;
        let file = posternctl::publish(&compiled, out, version)?;
        outln!(
            "snapshot v{} {} with {} routes and {} clusters written to {}",
            file.version,
            file.hash,
            compiled.snapshot.routes.len(),
            compiled.snapshot.clusters.len(),
            out.display()
        );
        let file = publish_credentials(&creds, &creds_out)?;
        outln!(
            "credentials v{} {} with {} keys, {} signing keys written to {}",
            file.version,
            file.hash,
            creds.keys.len(),
            creds.signing_keys.len(),
            creds_out.display()
        );
        Ok(())
    };
    match publish() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn validate(repo: &Path) -> ExitCode {
    let (compiled, creds) = match compile_all(repo) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let s = &compiled.snapshot;
    outln!(
        "ok: {} routes, {} clusters, {} filter modules; {} keys, {} signing keys, {} apps",
        s.routes.len(),
        s.clusters.len(),
        compiled.modules.len(),
        creds.keys.len(),
        creds.signing_keys.len(),
        creds.apps.len()
    );
    ExitCode::SUCCESS
}

fn key(command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::New { repo, remote, id, app, tenant, plan, scopes, priority, test } => {
            let body = posternctl::keyservice::CreateBody {
                id: id.clone(),
                app: app.clone(),
                tenant: tenant.clone(),
                plan: plan.clone(),
                scopes: scopes.clone(),
                priority,
                test,
            };
            if let Some(v) = remote.post("/v1/keys", &body)? {
                outln!("{}", v["key"].as_str().unwrap_or_default());
                report_acks(&v);
                eprintln!("key {id:?} created. The raw key above is shown only this once; only its hash is kept.");
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let env = if test { KeyEnv::Test } else { KeyEnv::Live };
            let spec = keys::NewKey { id, app, tenant, plan, scopes, priority, env };
            let raw = keys::new_key(&repo, &spec)?;
            outln!("{raw}");
            eprintln!(
                "key {:?} added to {}. The raw key above is shown only this once: give it to its owner now; \
                 only its hash is kept.",
                spec.id,
                repo.join(posternctl::credentials::KEYS_FILE).display()
            );
        }
        KeyCommand::Rotate { repo, remote, id, new_id, overlap, test } => {
            let body = posternctl::keyservice::RotateBody {
                new_id: new_id.clone(),
                overlap: Some(format!("{}s", overlap.as_secs())),
                test,
            };
            if let Some(v) = remote.post(&format!("/v1/keys/{id}/rotate"), &body)? {
                outln!("{}", v["key"].as_str().unwrap_or_default());
                report_acks(&v);
                eprintln!("key {new_id:?} replaces {id:?}. The raw key above is shown only this once.");
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let env = if test { KeyEnv::Test } else { KeyEnv::Live };
            let rotated = keys::rotate_key(&repo, &id, &new_id, overlap, env, unix_now())?;
            outln!("{}", rotated.raw_key);
            let until = std::time::UNIX_EPOCH + Duration::from_secs(rotated.old_expires_at);
            eprintln!(
                "key {new_id:?} replaces {id:?}, which keeps working until {}. The raw key above is shown only \
                 this once.",
                humantime::format_rfc3339_seconds(until)
            );
        }
        KeyCommand::Revoke { repo, remote, which } => {
            let raw;
            let by = match (&which.id, &which.key) {
                (Some(id), _) => keys::RevokeBy::Id(id),
                (None, Some(k)) if k == "-" => {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line)?;
                    raw = line;
                    keys::RevokeBy::RawKey(&raw)
                }
                (None, Some(k)) => keys::RevokeBy::RawKey(k),
                (None, None) => anyhow::bail!("give --id or --key"),
            };
            let body = match by {
                keys::RevokeBy::Id(id) => posternctl::keyservice::RevokeBody { id: Some(id.to_owned()), key: None },
                keys::RevokeBy::RawKey(k) => {
                    posternctl::keyservice::RevokeBody { id: None, key: Some(k.trim().to_owned()) }
                }
            };
            if let Some(v) = remote.post("/v1/keys/revoke", &body)? {
                outln!("revoked key {}", v["id"]);
                report_acks(&v);
                return Ok(());
            }
            let revoked = keys::revoke_key(&repo.unwrap_or_default(), by)?;
            if revoked.already {
                outln!("key {:?} was already revoked", revoked.id);
            } else {
                outln!("revoked key {:?}", revoked.id);
            }
        }
    }
    Ok(())
}

fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::Keygen { kid, issuer, alg, private_out, public_out } => {
            let pair = keys::keygen(alg)?;
            let yaml = keys::signing_key_yaml(&kid, alg, &issuer, &pair.public_pem)?;
            keys::write_private_key(&private_out, &pair.private_pem)?;
            if let Some(path) = &public_out {
                posternctl::write_atomic(path, pair.public_pem.as_bytes())?;
            }
            out!("{yaml}");
            eprintln!(
                "private key written to {} (keep it secret); paste the record above under signing_keys: in \
                 platform/auth.yaml",
                private_out.display()
            );
        }
        TokenCommand::Mint { key, kid, issuer, audience, sub, client_id, scope, ttl, alg, jti } => {
            let pem =
                std::fs::read_to_string(&key).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", key.display()))?;
            let req = keys::MintRequest {
                alg,
                kid: &kid,
                issuer: &issuer,
                audience: &audience,
                sub: &sub,
                client_id: &client_id,
                scope: scope.as_deref(),
                ttl,
                jti: jti.as_deref(),
                now: unix_now(),
            };
            outln!("{}", keys::mint(&pem, &req)?);
        }
        TokenCommand::Revoke { repo, remote, which } => {
            let body = posternctl::keyservice::DenyBody { jti: which.jti, sub: which.sub, client_id: which.client_id };
            if let Some(v) = remote.post("/v1/deny", &body)? {
                outln!("{}", v["deny"]);
                report_acks(&v);
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let plans = posternctl::compile::compile(&repo).map_err(|e| anyhow::anyhow!("{e}"))?.snapshot.plans;
            let v = posternctl::keyservice::apply(&repo, &plans, posternctl::keyservice::Op::Deny(body))
                .map_err(|e| anyhow::anyhow!("refused:\n  {}", e.join("\n  ")))?
                .answer;
            outln!("{}", v["deny"]);
            eprintln!(
                "added to {}; compile or publish to apply it",
                repo.join(posternctl::credentials::DENY_FILE).display()
            );
        }
    }
    Ok(())
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Compile { repo, out, version } => compile(&repo, &out, version),
        Command::Filter { command } => match filter_run(command) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        },
        Command::Validate { repo } => validate(&repo),
        Command::Plan { repo, against } => plan(&repo, &against),
        Command::Key { command } => report(key(command)),
        Command::Token { command } => report(token(command)),
        Command::Serve {
            repo,
            store,
            tokens,
            listen,
            dwell,
            canary_nodes,
            rollout_min_requests,
            rollout_max_5xx_increase,
            rollout_p99_slack,
            signing_key,
            tls_cert,
            tls_key,
            publish_dir,
            usage_db,
            quota_webhook,
            usage_kafka,
            usage_kafka_topic,
            usage_kafka_group,
            usage_kafka_partitions,
            usage_kafka_replication,
            usage_kafka_option,
        } => {
            let options = match postern_model::usage::kafka_options(&usage_kafka_option) {
                Ok(o) => o,
                Err(e) => return report(Err(anyhow::anyhow!(e))),
            };
            let usage_kafka = usage_kafka.map(|brokers| posternctl::serve::UsageKafka {
                brokers,
                topic: usage_kafka_topic,
                group: usage_kafka_group,
                partitions: usage_kafka_partitions,
                replication: usage_kafka_replication,
                options,
            });
            let rollout = posternctl::rollout::RolloutSettings {
                dwell,
                canary_nodes,
                min_requests: rollout_min_requests,
                max_5xx_increase: rollout_max_5xx_increase,
                p99_slack: rollout_p99_slack,
                ..Default::default()
            };
            let tls = tls_cert.zip(tls_key);
            let usage_db = usage_db
                .or_else(|| (!posternctl::store::is_postgres(&store)).then(|| Path::new(&store).join("usage.db")));
            let settings = posternctl::serve::ServeSettings {
                repo,
                listen,
                tokens,
                rollout,
                tls,
                publish_dir,
                usage_db,
                quota_webhook,
                usage_kafka,
            };
            report(serve(settings, &store, signing_key.as_deref()))
        }
        Command::SigningKey { command } => report(signing_key(command)),
        Command::Publish { control, wait_acks, wait } => {
            report(call_served(&control, &format!("/v1/publish?wait_acks={wait_acks}&wait={wait}")))
        }
        Command::Rollback { control, to, wait } => {
            report(call_served(&control, &format!("/v1/rollback?to={to}&wait={wait}")))
        }
        Command::Status { control, wait } => report(status(&control, Duration::from_secs(wait))),
        Command::Trace { control, which, duration, off, wait_acks } => {
            report(trace(&control, which, if off { Duration::ZERO } else { duration }, wait_acks))
        }
        Command::Usage { action: Some(UsageAction::Reconcile { control, period }), .. } => {
            report(call(&control, "POST", &format!("/v1/usage/reconcile?period={period}")))
        }
        Command::Usage { action: Some(UsageAction::Export { control, period }), .. } => {
            report(usage_export(&control, &period))
        }
        Command::Usage { action: None, control, query } => {
            report(control.required().and_then(|control| usage(&control, query)))
        }
    }
}

/// `GET <control><path>`: the answer's body, or an error with the control plane's reason.
fn get_ok(control: &ControlArgs, path: &str) -> anyhow::Result<bytes::Bytes> {
    let url = format!("{}{path}", control.control.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with(
        "GET",
        &url,
        &control.token,
        control.control_ca.as_deref(),
        None,
    ))?;
    if !status.is_success() {
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        anyhow::bail!(
            "control plane answered {status}: {}",
            v["error"].as_str().unwrap_or(&String::from_utf8_lossy(&body))
        );
    }
    Ok(body)
}

/// `posternctl trace`: sets (or ends) one caller's debug-trace flag; says until when, then
/// the control plane's answer (the credentials version, and the nodes that run it).
fn trace(control: &ControlArgs, which: TraceWhich, duration: Duration, wait_acks: u64) -> anyhow::Result<()> {
    let body = serde_json::json!({"key": which.key, "app": which.app, "for_s": duration.as_secs()});
    let url = format!("{}/v1/trace?wait_acks={wait_acks}", control.control.trim_end_matches('/'));
    let (status, bytes) = runtime()?.block_on(posternctl::serve::request_with(
        "POST",
        &url,
        &control.token,
        control.control_ca.as_deref(),
        Some(body),
    ))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    anyhow::ensure!(
        status.is_success(),
        "control plane answered {status}: {}",
        v["error"].as_str().unwrap_or(&String::from_utf8_lossy(&bytes))
    );
    let until = std::time::UNIX_EPOCH + Duration::from_secs(v["until"].as_u64().unwrap_or(0));
    let who = format!("{} {}", v["kind"].as_str().unwrap_or("?"), v["caller"].as_str().unwrap_or("?"));
    if duration.is_zero() {
        outln!("tracing of {who} is off");
    } else {
        outln!("tracing every request of {who} until {}", humantime::format_rfc3339_seconds(until));
    }
    outln!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `posternctl usage export`: a final period's billing lines, as the control plane gives them.
fn usage_export(control: &ControlArgs, period: &str) -> anyhow::Result<()> {
    let body = get_ok(control, &format!("/v1/usage/export?period={period}"))?;
    out!("{}", String::from_utf8_lossy(&body));
    Ok(())
}

/// `posternctl usage`: the control plane's usage rows as a table, a chart (`--chart`) or
/// the answer's JSON (`--json`, which wins over `--chart`).
fn usage(control: &ControlArgs, q: UsageQuery) -> anyhow::Result<()> {
    let chart = q.chart && !q.json;
    let by = if chart { "minute" } else { q.by.as_str() };
    let (from, to) = match q.last {
        Some(seconds) => {
            let now = unix_now();
            (Some(now.saturating_sub(seconds).to_string()), Some(now.to_string()))
        }
        None => (q.from, q.to),
    };
    let mut query = format!("by={by}");
    for (name, v) in [("key", q.key), ("product", q.product), ("from", from), ("to", to)] {
        if let Some(v) = v {
            query.push_str(&format!("&{name}={}", posternctl::usage::query_escape(&v)));
        }
    }
    let body = get_ok(control, &format!("{}?{query}", postern_model::protocol::USAGE_PATH))?;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    if q.json {
        outln!("{}", serde_json::to_string_pretty(&v)?);
    } else if chart {
        out!("{}", posternctl::usage::chart(&v));
    } else {
        out!("{}", posternctl::usage::table(&v));
    }
    Ok(())
}

fn plan(repo: &Path, against: &Path) -> ExitCode {
    let old = match std::fs::read(against)
        .map_err(|e| e.to_string())
        .and_then(|b| postern_model::SnapshotFile::open(&b).map(|(_, s)| s).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}: {e}", against.display());
            return ExitCode::from(2);
        }
    };
    match posternctl::compile::compile(repo) {
        Ok(new) => {
            out!("{}", posternctl::plan::render(&posternctl::plan::diff(&old, &new.snapshot)));
            ExitCode::SUCCESS
        }
        Err(rejected) => {
            eprint!("{rejected}");
            ExitCode::from(1)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

fn serve(settings: posternctl::serve::ServeSettings, store: &str, key: Option<&Path>) -> anyhow::Result<()> {
    let signer = match key {
        Some(path) => posternctl::keys::read_signer(path)?,
        None if !posternctl::store::is_postgres(store) => posternctl::keys::store_signer(Path::new(store))?,
        None => anyhow::bail!(
            "a PostgreSQL store is shared by several instances: give each the same --signing-key \
             (`posternctl signing-key new FILE` makes one)"
        ),
    };
    eprintln!("posternctl serve: signing versions with {}", signer.public());
    runtime()?.block_on(async {
        let store = posternctl::store::Store::open(store, Some(std::sync::Arc::new(signer))).await?;
        posternctl::serve::serve(settings, store).await
    })
}

fn signing_key(command: SigningKeyCommand) -> anyhow::Result<()> {
    match command {
        SigningKeyCommand::New { out } => {
            let signer = postern_model::sign::Signer::generate()?;
            posternctl::keys::write_private_key(&out, &signer.to_text())?;
            outln!("{}", signer.public());
        }
        SigningKeyCommand::Public { key } => outln!("{}", posternctl::keys::read_signer(&key)?.public()),
    }
    Ok(())
}

/// One request to the control plane; prints the answer (its summary line first).
fn call(control: &ControlArgs, method: &str, path: &str) -> anyhow::Result<()> {
    print_answer(ask(control, method, path)?)
}

/// One request to the control plane: its status and JSON answer.
fn ask(control: &ControlArgs, method: &str, path: &str) -> anyhow::Result<(http::StatusCode, serde_json::Value)> {
    let url = format!("{}{path}", control.control.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with(
        method,
        &url,
        &control.token,
        control.control_ca.as_deref(),
        None,
    ))?;
    Ok((status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null)))
}

fn print_answer((status, v): (http::StatusCode, serde_json::Value)) -> anyhow::Result<()> {
    if let Some(summary) = v["summary"].as_str() {
        outln!("{summary}");
    }
    outln!("{}", serde_json::to_string_pretty(&v)?);
    anyhow::ensure!(status.is_success(), "control plane answered {status}");
    Ok(())
}

/// A publish or a rollback that waits for nodes to serve it: fails when one refused it
/// or did not serve it in time.
fn call_served(control: &ControlArgs, path: &str) -> anyhow::Result<()> {
    let (status, v) = ask(control, "POST", path)?;
    let served = v["snapshot"]["served"].clone();
    print_answer((status, v))?;
    anyhow::ensure!(
        served.is_null() || served["complete"] == true,
        "not served everywhere it should be: behind {}, refused {}",
        served["behind"],
        served["refused"]
    );
    Ok(())
}

/// `posternctl status`, after waiting (up to `wait`) for the fleet to settle: no rollout
/// in progress and every live node on the head.
fn status(control: &ControlArgs, wait: Duration) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let (code, v) = ask(control, "GET", "/v1/status")?;
        let settled = v["rollout"].is_null() && v["laggards"].as_array().is_some_and(Vec::is_empty);
        if wait.is_zero() || !code.is_success() || settled {
            return print_answer((code, v));
        }
        if std::time::Instant::now() >= deadline {
            print_answer((code, v))?;
            anyhow::bail!("the fleet did not settle within {} s", wait.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
