//! The config repository's file formats (YAML), close to the Kubernetes Gateway API's
//! `HTTPRoute` where it fits.
//!
//! ```text
//! platform/clusters.yaml    clusters: {name: {endpoints: [host:port], owner: team}}
//! platform/ownership.yaml   owners: [{host: api.example.com | "*", pathPrefix: /v1/orders, team: orders}]
//! platform/gateway.yaml   paths: {encodedSlash, backslash, semicolon, emptySegments} (reject | ...)
//! platform/plans.yaml       scopes: [..], products: [..], plans: {name: {products: [..]}}
//! platform/auth.yaml        JWT settings, signing keys, apps, deny list (the credential state)
//! platform/keys.jsonl       API key records (hashes only), one JSON object per line
//! teams/<team>/*.yaml       routes: [RouteDoc]
//! teams/<team>/filters/<name>.yaml   a filter manifest: module, limits, samples
//! teams/<team>/samples/*.yaml        samples: saved requests and the route each must reach
//! teams/<team>/openapi/*.{yaml,yml,json}   OpenAPI 3.0/3.1 documents routes validate against
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use postern_model::Pool;
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// Parses YAML text into `T`; on error, the field path (empty for the document itself)
/// and the message without the path the YAML error repeats.
pub fn parse_yaml<T: DeserializeOwned>(text: &str) -> Result<T, (String, String)> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        let msg = e.into_inner().to_string();
        // The YAML error repeats the enclosing path ("routes[0]: ..."); drop it.
        let msg = match msg.split_once(": ") {
            Some((head, rest)) if field.starts_with(head) && !head.contains(' ') => rest.to_owned(),
            _ => msg,
        };
        (field, msg)
    })
}

/// Parses a duration like `250ms`, `90s`, `15m` or `24h`: the one duration parser, for
/// the repository's files, the CLI's flags and the key service's requests.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    humantime::parse_duration(s).map_err(|source| DurationError { text: s.to_owned(), source })
}

/// A text that is not a duration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{text:?} is not a duration like 250ms, 90s, 15m or 24h: {source}")]
pub struct DurationError {
    /// The text as given.
    pub text: String,
    /// Why it does not parse.
    pub source: humantime::DurationError,
}

/// `platform/clusters.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClustersDoc {
    /// Clusters by name.
    pub clusters: BTreeMap<String, ClusterDoc>,
}

/// One cluster.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterDoc {
    /// `host:port` endpoints.
    pub endpoints: Vec<String>,
    /// Owning team; a route may use a cluster its team owns or one with no owner.
    #[serde(default)]
    pub owner: Option<String>,
    /// Requests in flight to the cluster at most (default 1024, at most 65536).
    #[serde(default, rename = "maxConnections")]
    pub max_connections: Option<u32>,
    /// The cluster's circuit breaker on each node (every field has a default).
    #[serde(default)]
    pub breaker: BreakerDoc,
    /// How much each node may retry to the cluster (every field has a default).
    #[serde(default, rename = "retryBudget")]
    pub retry_budget: RetryBudgetDoc,
    /// The cluster's routes shed by priority while its requests in flight are at least
    /// this percentage of `maxConnections` (default 80, 10 to 100).
    #[serde(default, rename = "shedAtPercent")]
    pub shed_at_percent: Option<u8>,
    /// `http1` (default) or `http2` (h2 over TLS with `tls:`, else h2c).
    #[serde(default)]
    pub protocol: Option<String>,
    /// TLS to the cluster's hosts.
    #[serde(default)]
    pub tls: Option<ClusterTlsDoc>,
    /// When a single host is ejected (every field has a default).
    #[serde(default)]
    pub outlier: OutlierDoc,
}

/// `outlier:` of a cluster.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OutlierDoc {
    /// Failures in a row that eject a host (default 5, 1 to 1000).
    #[serde(default)]
    pub consecutive_failures: Option<u32>,
    /// The first ejection's length (default 30s, 1s to 1h).
    #[serde(default)]
    pub eject_for: Option<String>,
    /// The longest ejection (default 5m, 1s to 1h).
    #[serde(default)]
    pub max_eject_for: Option<String>,
    /// The most of the hosts out at once (default 50, 0 to 100; 0: never eject).
    #[serde(default)]
    pub max_ejected_percent: Option<u8>,
}

/// `tls:` of a cluster.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClusterTlsDoc {
    /// The CA file (PEM), relative to the repository's root.
    pub ca: String,
    /// The name the hosts' certificates must carry (default: the endpoint's host).
    #[serde(default)]
    pub server_name: Option<String>,
}

/// `retryBudget:` of a cluster.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RetryBudgetDoc {
    /// The sliding window requests and retries are counted over (default 10s, 1s to 5m).
    #[serde(default)]
    pub window: Option<String>,
    /// Retries may be this percentage of the requests (default 10, 0 to 100).
    #[serde(default)]
    pub percent: Option<u8>,
    /// ...or this many in the window, whichever is more (default 10, 0 to 100000).
    #[serde(default)]
    pub min_retries: Option<u32>,
}

/// `retry:` of a route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RetryDoc {
    /// Methods that may be retried (default GET, HEAD, OPTIONS, PUT, DELETE; `[]` for none).
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// The service honours `Idempotency-Key`, so a POST carrying one may be retried.
    #[serde(default)]
    pub idempotency_key: bool,
}

/// `breaker:` of a cluster.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BreakerDoc {
    /// The sliding window failures are judged over (default 10s, 1s to 5m).
    #[serde(default)]
    pub window: Option<String>,
    /// Requests in the window before it may open (default 100, 1 to 1000000).
    #[serde(default)]
    pub min_requests: Option<u32>,
    /// It opens when more than this percentage failed (default 50, 1 to 99).
    #[serde(default)]
    pub failure_percent: Option<u8>,
    /// How long it stays open before probing (default 10s, 100ms to 5m).
    #[serde(default)]
    pub open_for: Option<String>,
    /// The percentage let through as probes while half-open (default 5, 1 to 100).
    #[serde(default)]
    pub probe_percent: Option<u8>,
}

/// `platform/gateway.yaml`: settings of the data plane that every route shares.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayDoc {
    /// How request paths are made canonical before routing; every default refuses what
    /// backends read differently (`encodedSlash`, `backslash`, `semicolon`, `emptySegments`).
    #[serde(default)]
    pub paths: postern_model::path::PathPolicy,
    /// Callers that never join a canary (`keys`, `apps`, `plans`): on a weighted split
    /// they always get the route's first backend.
    #[serde(default, rename = "neverCanary")]
    pub never_canary: postern_model::NeverCanary,
}

/// `platform/ownership.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnershipDoc {
    /// Who owns which host and path prefix.
    pub owners: Vec<OwnerDoc>,
}

/// One ownership claim.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OwnerDoc {
    /// Hostname, `*.suffix`, or `*` for every host.
    pub host: String,
    /// Path prefix (whole segments).
    pub path_prefix: String,
    /// Owning team.
    pub team: String,
}

/// A team's routes file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutesDoc {
    /// The routes.
    pub routes: Vec<RouteDoc>,
}

/// One route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteDoc {
    /// Name, unique within the team.
    pub name: String,
    /// Listener pool (`public` by default).
    #[serde(default = "default_pool")]
    pub pool: Pool,
    /// Hostnames; empty means any host.
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// What the route matches.
    #[serde(rename = "match")]
    pub matches: MatchDoc,
    /// Backends with weights.
    pub backend_refs: Vec<BackendRefDoc>,
    /// Header whose value keys a weighted split, so one caller always sees one backend.
    #[serde(default)]
    pub sticky_header: Option<String>,
    /// Timeouts; required (no route may wait forever).
    pub timeouts: TimeoutsDoc,
    /// Request body limit in bytes (64 KiB by default).
    #[serde(default)]
    pub max_body_bytes: Option<u64>,
    /// Path rewrite.
    #[serde(default)]
    pub rewrite: Option<RewriteDoc>,
    /// Request header edits.
    #[serde(default)]
    pub request_headers: Option<serde_json::Value>,
    /// Response header edits.
    #[serde(default)]
    pub response_headers: Option<serde_json::Value>,
    /// Deprecation / sunset.
    #[serde(default)]
    pub deprecation: Option<DeprecationDoc>,
    /// Served without credentials (a route is either public or has `auth`).
    #[serde(default)]
    pub public: bool,
    /// Who may call the route: accepted credentials, required scopes, API product.
    #[serde(default)]
    pub auth: Option<AuthDoc>,
    /// Rate-limit class and cost; limits themselves come from the caller's plan.
    #[serde(default)]
    pub rate_limit: Option<RouteRateDoc>,
    /// Buffer the request body (maxBodyBytes at most 1 MiB) so filters see it.
    #[serde(default)]
    pub buffer_body: bool,
    /// Which requests may be retried on another host of the cluster.
    #[serde(default)]
    pub retry: RetryDoc,
    /// The class of every request on the route under overload, whatever the caller's
    /// plan (`critical`, `standard`, `free`, `sheddable`).
    #[serde(default)]
    pub priority: Option<String>,
    /// Wasm filters, run in order after the built-in ones.
    #[serde(default)]
    pub wasm_filters: Vec<WasmAttachDoc>,
    /// Check requests against an operation of the team's OpenAPI document.
    #[serde(default)]
    pub validate: Option<ValidateDoc>,
    /// REST→gRPC transcoding to the route's backend (a cluster with `protocol: http2`).
    #[serde(default)]
    pub grpc: Option<GrpcDoc>,
    /// Compress answers by the client's `Accept-Encoding`: `true`, or
    /// `{ minBytes: N }` (answers declaring fewer bytes are sent as they are; 1024 by
    /// default).
    #[serde(default)]
    pub compress: Option<CompressDoc>,
}

/// `grpc:` of a route: the service its requests are transcoded to.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GrpcDoc {
    /// A file in `teams/<team>/proto/`: `.proto` source (compiled with its imports from
    /// that folder), or a descriptor set (`protoc --descriptor_set_out
    /// --include_imports`, `buf build -o`; any other extension).
    pub proto: String,
    /// The fully qualified service: `orders.v1.Orders`.
    pub service: String,
}

/// `compress:` of a route.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum CompressDoc {
    /// `true` (defaults) or `false` (off).
    On(bool),
    /// With a threshold.
    With(CompressOptsDoc),
}

/// `compress: { minBytes }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CompressOptsDoc {
    /// The smallest answer compressed (by its `Content-Length`), 0 to 1 MiB.
    #[serde(default)]
    pub min_bytes: Option<u64>,
}

/// `validate:` of a route: the OpenAPI operation its requests must satisfy.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ValidateDoc {
    /// A file name in `teams/<team>/openapi/` (`orders.yaml`).
    pub openapi: String,
    /// The operation's `operationId`.
    pub operation_id: String,
    /// Caps on a JSON body (defaults where absent).
    #[serde(default)]
    pub json: Option<JsonLimitsDoc>,
}

/// `validate.json:` of a route; each field defaults to `JsonLimits::default()`'s.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct JsonLimitsDoc {
    /// Deepest nesting of arrays and objects (default 32, 1 to 128).
    #[serde(default)]
    pub max_depth: Option<u32>,
    /// Longest string or key in bytes, unescaped (default 64 KiB, 1 to 1 MiB).
    #[serde(default)]
    pub max_string_bytes: Option<u32>,
    /// Most characters in a number (default 32, 1 to 1024).
    #[serde(default)]
    pub max_number_chars: Option<u32>,
}

/// A Wasm filter attached to a route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WasmAttachDoc {
    /// The filter's name: its manifest is `teams/<team>/filters/<name>.yaml`.
    pub name: String,
    /// The filter's own config (any YAML; handed to it as JSON).
    #[serde(default)]
    pub config: serde_json::Value,
    /// `fail_closed` (default) or `fail_open`.
    #[serde(default)]
    pub failure: postern_model::wasm::FailurePolicy,
    /// Also run the filter on the response head.
    #[serde(default)]
    pub response_phase: bool,
    /// When the filter is put aside on this route for failing too often (defaults where
    /// absent).
    #[serde(default)]
    pub quarantine: QuarantineDoc,
}

/// A Wasm attachment's quarantine thresholds: within one window of `windowSecs`, at
/// least `minCalls` calls of which `failurePercent` or more failed put the filter aside
/// for `forSecs` on the route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct QuarantineDoc {
    /// Failure rate that quarantines, 1 to 100.
    pub failure_percent: u64,
    /// Calls needed in a window before judging, 1 to 1,000,000.
    pub min_calls: u64,
    /// Window length, 1 to 3,600 s.
    pub window_secs: u64,
    /// How long the quarantine lasts, 1 to 3,600 s.
    pub for_secs: u64,
}

impl Default for QuarantineDoc {
    fn default() -> Self {
        let p = postern_model::wasm::QuarantinePolicy::default();
        QuarantineDoc {
            failure_percent: p.failure_percent,
            min_calls: p.min_calls,
            window_secs: p.window_secs,
            for_secs: p.quarantine_secs,
        }
    }
}

impl QuarantineDoc {
    /// The node's policy, or the field out of range and its bounds.
    pub fn policy(&self) -> Result<postern_model::wasm::QuarantinePolicy, (&'static str, String)> {
        let check = |field, v: u64, max: u64| {
            if (1..=max).contains(&v) { Ok(v) } else { Err((field, format!("{v} is out of range: 1 to {max}"))) }
        };
        Ok(postern_model::wasm::QuarantinePolicy {
            failure_percent: check("failurePercent", self.failure_percent, 100)?,
            min_calls: check("minCalls", self.min_calls, 1_000_000)?,
            window_secs: check("windowSecs", self.window_secs, 3600)?,
            quarantine_secs: check("forSecs", self.for_secs, 3600)?,
        })
    }
}

/// A filter manifest, `teams/<team>/filters/<name>.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterManifestDoc {
    /// The component file, relative to the manifest.
    pub module: String,
    /// Limits (defaults where absent); each at most the platform maximum.
    #[serde(default)]
    pub limits: postern_model::wasm::Limits,
    /// Sample cases run in the real sandbox at every compile: a request and the decision
    /// the filter must make.
    #[serde(default)]
    pub samples: Vec<FilterSampleDoc>,
}

/// A request as a sample gives it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleRequestDoc {
    /// Method (default GET).
    #[serde(default = "get")]
    pub method: String,
    /// Host (default: any host).
    #[serde(default)]
    pub host: Option<String>,
    /// Path, optionally with `?query`.
    pub path: String,
    /// Headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Body (filters' body phase).
    #[serde(default)]
    pub body: Option<String>,
    /// Listener pool (default public).
    #[serde(default)]
    pub pool: Option<Pool>,
}

fn get() -> String {
    "GET".to_owned()
}

/// One filter sample case.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSampleDoc {
    /// What it shows.
    pub name: String,
    /// The filter's config for this case.
    #[serde(default)]
    pub config: serde_json::Value,
    /// The request.
    pub request: SampleRequestDoc,
    /// The backend's response: the response phase runs on it when the request phases
    /// forward the request.
    #[serde(default)]
    pub response: Option<SampleResponseDoc>,
    /// The decision of the last phase that ran: the response phase's when it ran.
    pub expect: FilterExpectDoc,
}

/// A backend's response head as a filter sample gives it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleResponseDoc {
    /// Status (default 200).
    #[serde(default = "ok_status")]
    pub status: u16,
    /// Headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

fn ok_status() -> u16 {
    200
}

/// The decision a filter sample expects of the last phase that ran.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FilterExpectDoc {
    /// `continue` (the response phase's edits are a `continue` too), `respond` or `failed`.
    pub decision: String,
    /// The answer's status, for `respond`.
    #[serde(default)]
    pub status: Option<u16>,
    /// Headers set on the request (on the response, when the response phase ran), for
    /// `continue` (each must be set to this value).
    #[serde(default)]
    pub set_headers: BTreeMap<String, String>,
    /// The rewritten path, for `continue`.
    #[serde(default)]
    pub path: Option<String>,
}

/// `teams/<team>/samples/*.yaml`: saved requests.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplesDoc {
    /// The samples.
    pub samples: Vec<RouteSampleDoc>,
}

/// A saved request and where it must go.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSampleDoc {
    /// What it shows.
    pub name: String,
    /// The request.
    pub request: SampleRequestDoc,
    /// Where it must go.
    pub expect: RouteExpectDoc,
}

/// Where a saved request must go: a route (its name in this team, or `team/name`), or
/// nowhere (`status: 404`, 405 for a known path with another method, or 400 for a path
/// the platform's path policy refuses).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteExpectDoc {
    /// The route.
    #[serde(default)]
    pub route: Option<String>,
    /// 400, 404 or 405.
    #[serde(default)]
    pub status: Option<u16>,
}

/// `platform/filters.yaml`: the review registry.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReviewDoc {
    /// Approved module digests.
    #[serde(default)]
    pub approved: Vec<ApprovedDoc>,
}

/// One approved module. `posternctl filter approve` also records what it reviewed
/// (`at`, `size`, `imports`, `fuel`), so the review of the version that replaces it can
/// say what changed.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovedDoc {
    /// `sha256:<hex>` of the component.
    pub digest: String,
    /// Filter name.
    pub filter: String,
    /// Team allowed to attach it.
    pub team: String,
    /// Who reviewed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reviewer: Option<String>,
    /// When it was approved (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// The component's size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The interfaces it imports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub imports: Vec<String>,
    /// The most fuel a call of each of its manifest's sample cases burned, by case.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fuel: BTreeMap<String, u64>,
}

/// `platform/plans.yaml`: the platform's scopes, API products and plans.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlansDoc {
    /// Every scope a route may require.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// Every API product.
    #[serde(default)]
    pub products: Vec<String>,
    /// Plans by name.
    #[serde(default)]
    pub plans: BTreeMap<String, PlanDoc>,
}

/// One plan.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(rename_all = "camelCase")]
pub struct PlanDoc {
    /// The API products the plan includes.
    pub products: Vec<String>,
    /// Per-caller limit on each route class.
    #[serde(default)]
    pub rate_limit: Option<RateDoc>,
    /// Ceiling per OAuth app across its users.
    #[serde(default)]
    pub app_rate_limit: Option<RateDoc>,
    /// What the plan's limits do when the fleet-wide sync is lost: `open` (default: each
    /// node goes on with its last share) or `closed` (refuse with 503).
    #[serde(default)]
    pub on_sync_loss: SyncLossDoc,
    /// Calls per period, per caller and product.
    #[serde(default)]
    pub quota: Option<QuotaDoc>,
    /// The class of its callers' requests under overload (`critical`, `standard` (the
    /// default), `free`, `sheddable`).
    #[serde(default)]
    pub priority: Option<String>,
}

/// `quota` of a plan: `{ monthly: N, mode: hard | overage, anchor: … }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaDoc {
    /// Billable calls per period.
    pub monthly: u64,
    /// `hard` (refuse past it) or `overage` (bill past it).
    pub mode: postern_model::QuotaMode,
    /// `utc-month` (the default), `day-N` (a month from billing day N, 1 to 28), or
    /// `every-<duration>` (fixed periods, e.g. `every-60s`, for trials and tests).
    #[serde(default)]
    pub anchor: Option<String>,
}

impl QuotaDoc {
    /// The anchor, parsed and checked.
    pub fn anchor(&self) -> Result<postern_model::usage::Anchor, AnchorDocError> {
        use postern_model::usage::Anchor;
        let a = match self.anchor.as_deref().unwrap_or("utc-month") {
            "utc-month" => Anchor::UtcMonth,
            s if s.starts_with("day-") => {
                Anchor::BillingDay(s[4..].parse().map_err(|_| AnchorDocError::Day(s.to_owned()))?)
            }
            s if s.starts_with("every-") => {
                let d =
                    parse_duration(&s[6..]).map_err(|source| AnchorDocError::Every { text: s.to_owned(), source })?;
                Anchor::EverySeconds(d.as_secs())
            }
            s => return Err(AnchorDocError::Unknown(s.to_owned())),
        };
        a.check()?;
        Ok(a)
    }
}

/// Why a quota's `anchor` was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnchorDocError {
    /// `day-N` with N not a number.
    #[error("{0:?}: day-N takes a day 1 to 28")]
    Day(String),
    /// `every-<duration>` with no duration.
    #[error("{text:?}: {source}")]
    Every {
        /// The anchor as given.
        text: String,
        /// Why the duration does not parse.
        source: DurationError,
    },
    /// None of the forms.
    #[error("{0:?}: give utc-month, day-N or every-<duration>")]
    Unknown(String),
    /// A day or period out of range.
    #[error(transparent)]
    Check(#[from] postern_model::usage::AnchorError),
}

/// `onSyncLoss` of a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncLossDoc {
    /// Go on with the last shares.
    #[default]
    Open,
    /// Refuse the plan's callers until the sync is back.
    Closed,
}

/// A rate: `rps` a second, bursts up to `burst`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateDoc {
    /// Sustained requests a second.
    pub rps: u64,
    /// Largest burst (defaults to `rps`).
    #[serde(default)]
    pub burst: Option<u64>,
}

/// A route's rate-limit class and cost.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRateDoc {
    /// Routes of one class share a caller's bucket (`default` if unset).
    #[serde(default)]
    pub class: Option<String>,
    /// Tokens one request takes (1 if unset).
    #[serde(default)]
    pub cost: Option<u32>,
}

/// A route's authentication and authorisation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthDoc {
    /// `apiKey`, `jwt` or both.
    pub methods: Vec<AuthMethodDoc>,
    /// Scopes the caller must hold (all of them).
    #[serde(default)]
    pub scopes: Vec<String>,
    /// The API product the route belongs to.
    pub product: String,
}

/// A credential kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum AuthMethodDoc {
    /// `x-api-key`.
    ApiKey,
    /// `Authorization: Bearer <JWT>`.
    Jwt,
}

fn default_pool() -> Pool {
    Pool::Public
}

/// Route match conditions.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchDoc {
    /// Path pattern.
    pub path: PathDoc,
    /// Methods; empty means any.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Version header condition.
    #[serde(default)]
    pub version: Option<VersionDoc>,
}

/// Path match.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathDoc {
    /// `Exact` or `PathPrefix`.
    #[serde(rename = "type", default = "default_path_type")]
    pub kind: PathType,
    /// The pattern.
    pub value: String,
}

fn default_path_type() -> PathType {
    PathType::PathPrefix
}

/// Gateway API path match types.
#[derive(Debug, Clone, Copy, Deserialize)]
pub enum PathType {
    /// Whole path.
    Exact,
    /// Leading segments.
    PathPrefix,
}

/// Version header condition.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionDoc {
    /// Header name.
    pub header: String,
    /// Required value.
    pub value: String,
}

/// A backend reference.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendRefDoc {
    /// Cluster name.
    pub name: String,
    /// Weight (1 by default).
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// Timeouts as durations (`250ms`, `2s`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsDoc {
    /// TCP connect.
    pub connect: String,
    /// Until the backend's response headers.
    pub response: String,
    /// The longest a body may send nothing (default: the node's idle timeout, 60 s;
    /// 1s to 5m).
    #[serde(default, rename = "bodyIdle")]
    pub body_idle: Option<String>,
    /// The longest a body may take in all (default 5m; 1s to 1h).
    #[serde(default, rename = "bodyTotal")]
    pub body_total: Option<String>,
}

/// Path rewrite (one of the two).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RewriteDoc {
    /// Replace the matched prefix.
    #[serde(default)]
    pub replace_prefix_match: Option<String>,
    /// Replace the whole path.
    #[serde(default)]
    pub replace_full_path: Option<String>,
}

/// Deprecation metadata; dates are RFC 3339.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeprecationDoc {
    /// Deprecated since.
    #[serde(default)]
    pub since: Option<String>,
    /// Stops working at.
    #[serde(default)]
    pub sunset: Option<String>,
    /// Documentation link.
    #[serde(default)]
    pub link: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert!(parse_duration("soon").is_err());
    }
}
