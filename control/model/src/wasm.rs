//! A Wasm filter's attachment to a route, as the snapshot carries it: which module, its
//! limits (set in the filter's manifest, capped by the platform maxima), its failure and
//! quarantine policies, and its own config. The compiler writes it; a node's runtime
//! reads it.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What happens to the request when the filter fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Answer 503 `filter_failed`; nothing is forwarded.
    #[default]
    FailClosed,
    /// Skip the filter (counted) and go on.
    FailOpen,
}

/// Quarantine thresholds: within one window of `window_secs`, at least `min_calls`
/// calls of which `failure_percent` or more failed put the filter aside for
/// `quarantine_secs` on this route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuarantinePolicy {
    /// Window length.
    pub window_secs: u64,
    /// Calls needed in a window before judging.
    pub min_calls: u64,
    /// Failure rate that quarantines.
    pub failure_percent: u64,
    /// How long the quarantine lasts.
    pub quarantine_secs: u64,
}

impl Default for QuarantinePolicy {
    fn default() -> Self {
        QuarantinePolicy { window_secs: 10, min_calls: 20, failure_percent: 50, quarantine_secs: 30 }
    }
}

/// How a route attaches a Wasm filter (the `config` of a `wasm` filter spec).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attachment {
    /// The filter's name, for logs and metrics.
    pub name: String,
    /// Module digest, `sha256:<hex>`.
    pub module: String,
    /// Limits (already capped by the platform maxima when compiled).
    #[serde(default)]
    pub limits: Limits,
    /// Failure policy.
    #[serde(default)]
    pub failure: FailurePolicy,
    /// Run the response phase too.
    #[serde(default)]
    pub response_phase: bool,
    /// The filter's own config, handed to it with each call's context.
    #[serde(default)]
    pub config: serde_json::Value,
    /// Quarantine thresholds.
    #[serde(default)]
    pub quarantine: QuarantinePolicy,
}

/// The bytes a filter gets as its config: the attachment's JSON, or nothing.
pub fn config_bytes(config: &serde_json::Value) -> Arc<[u8]> {
    match config {
        serde_json::Value::Null => Arc::from(&b""[..]),
        v => Arc::from(serde_json::to_vec(v).unwrap_or_default()),
    }
}

/// The limits one filter attachment runs under, per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Fuel (roughly, Wasm instructions) per call.
    pub fuel: u64,
    /// Linear memory, in bytes.
    pub memory_bytes: u64,
    /// Wall-clock deadline per call, in milliseconds (epoch interruption).
    pub deadline_ms: u64,
    /// Host calls (log, counter, clock, config) per call.
    pub host_calls: u32,
    /// Headers a decision may set, append or remove.
    pub max_headers: usize,
    /// Bytes of header names and values a decision may carry.
    pub max_header_bytes: usize,
    /// Bytes of a reply body.
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 5_000_000,
            memory_bytes: 16 << 20,
            deadline_ms: 5,
            host_calls: 1_000,
            max_headers: 64,
            max_header_bytes: 16 * 1024,
            max_body_bytes: 64 * 1024,
        }
    }
}

impl Limits {
    /// The platform maxima: no manifest may ask for more.
    pub const MAXIMA: Limits = Limits {
        fuel: 100_000_000,
        memory_bytes: 64 << 20,
        deadline_ms: 50,
        host_calls: 10_000,
        max_headers: 256,
        max_header_bytes: 64 * 1024,
        max_body_bytes: 1 << 20,
    };

    /// Every limit that is over `maxima`, by name.
    pub fn over(&self, maxima: &Limits) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, v: u64, max: u64| {
            if v > max {
                out.push(format!("{name} {v} is over the platform maximum of {max}"));
            }
            if v == 0 {
                out.push(format!("{name} must be more than 0"));
            }
        };
        check("fuel", self.fuel, maxima.fuel);
        check("memory_bytes", self.memory_bytes, maxima.memory_bytes);
        check("deadline_ms", self.deadline_ms, maxima.deadline_ms);
        check("host_calls", u64::from(self.host_calls), u64::from(maxima.host_calls));
        check("max_headers", self.max_headers as u64, maxima.max_headers as u64);
        check("max_header_bytes", self.max_header_bytes as u64, maxima.max_header_bytes as u64);
        check("max_body_bytes", self.max_body_bytes as u64, maxima.max_body_bytes as u64);
        out
    }

    /// The deadline as a duration: CPU time of the thread running the call.
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }

    /// How long a call on the idle pool may take in wall time, from its request's first
    /// start (queue wait included): four times the deadline and 50 ms more (70 ms for the
    /// default 5 ms, 250 ms at the maximum). Past it the node was too busy to give the
    /// filter its CPU time, and the call is `overloaded`, never the filter's failure.
    pub fn wall_backstop(&self) -> Duration {
        self.deadline().checked_mul(4).and_then(|d| d.checked_add(Duration::from_millis(50))).unwrap_or(Duration::MAX)
    }
}

impl crate::Snapshot {
    /// The hex SHA-256 of every Wasm module the snapshot's routes attach, each once, in
    /// the order the routes name them: what a node must have before it builds them.
    pub fn module_digests(&self) -> Vec<&str> {
        #[derive(Deserialize)]
        struct ModuleRef<'a> {
            #[serde(borrow)]
            module: &'a str,
        }
        let mut out: Vec<&str> = Vec::new();
        let specs = self.routes.iter().flat_map(|r| &r.filters).filter(|f| f.kind == "wasm");
        for spec in specs {
            let Ok(m) = ModuleRef::deserialize(&spec.config) else { continue };
            if let Some(hex) = m.module.strip_prefix("sha256:")
                && hex.len() == 64
                && hex.bytes().all(|b| b.is_ascii_hexdigit())
                && !out.contains(&hex)
            {
                out.push(hex);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fit_the_maxima_and_excess_is_named() {
        assert!(Limits::default().over(&Limits::MAXIMA).is_empty());
        let l = Limits { fuel: 1 << 40, deadline_ms: 0, ..Limits::default() };
        let over = l.over(&Limits::MAXIMA);
        assert_eq!(over.len(), 2, "{over:?}");
        assert!(over[0].starts_with("fuel 1099511627776 is over"));
    }

    #[test]
    fn an_attachment_reads_with_its_defaults() {
        let a: Attachment = serde_json::from_str(r#"{"name":"f","module":"sha256:ab"}"#).unwrap();
        assert_eq!(a.limits, Limits::default());
        assert_eq!(a.failure, FailurePolicy::FailClosed);
        assert_eq!(a.quarantine, QuarantinePolicy::default());
        assert!(config_bytes(&a.config).is_empty());
        assert_eq!(&*config_bytes(&serde_json::json!({"k": 1})), br#"{"k":1}"#);
        assert!(serde_json::from_str::<Attachment>(r#"{"name":"f","module":"m","extra":1}"#).is_err());
    }

    #[test]
    fn module_digests_are_found_once_each() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let wasm =
            |hex: &str| serde_json::json!({"kind": "wasm", "config": {"name": "f", "module": format!("sha256:{hex}")}});
        let route = |filters: serde_json::Value| {
            serde_json::json!({
                "id": "t/r", "team": "t", "pool": "public", "hosts": ["a"], "methods": [], "path": "/",
                "path_kind": "Prefix", "version": null, "backends": [{"cluster": "c", "weight": 1}],
                "split_header": null, "timeouts": {"connect_ms": 1, "response_ms": 1}, "max_body_bytes": 1,
                "rewrite": null, "filters": filters, "deprecation": null, "public": true,
                "buffer_body": false, "auth": null, "rate_limit": null
            })
        };
        let mut snapshot: crate::Snapshot = serde_json::from_value(serde_json::json!({
            "schema": crate::SCHEMA_VERSION, "clusters": {}, "plans": {},
            "routes": [route(serde_json::json!([wasm(&a), wasm(&b)])), route(serde_json::json!([wasm(&a)]))]
        }))
        .unwrap();
        assert_eq!(snapshot.module_digests(), vec![a.as_str(), b.as_str()]);
        snapshot.routes[0].filters[0].config["module"] = "sha256:xyz".into();
        snapshot.routes[1].filters.clear();
        assert_eq!(snapshot.module_digests(), vec![b.as_str()]);
    }
}
