//! The node's metrics as Prometheus text, for `/metrics` on the admin listener: the
//! routes' counters ([`Metrics`]) and what the node's parts report (clusters, shedding,
//! authentication, the rate sync, usage, the access log, traces).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use postern_model::report::LATENCY_BOUNDS_US as BOUNDS_US;

use postern_wasm::FilterStats;

use crate::metrics::{BackendKey, DENIED, FilterKey, Histogram, Metrics, PROBLEM_CODES, RouteMetrics};

impl Histogram {
    pub(crate) fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            match BOUNDS_US.get(i) {
                Some(bound) => {
                    let le = *bound as f64 / 1e6;
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
                }
            }
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

impl Metrics {
    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let routes: Vec<(Arc<str>, Arc<RouteMetrics>)> = {
            let map = self.routes.lock().unwrap_or_else(|p| p.into_inner());
            map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let all: Vec<(String, &RouteMetrics)> = routes
            .iter()
            .map(|(k, v)| (escape(k), &**v))
            .chain(std::iter::once(("(none)".to_owned(), &self.unrouted)))
            .collect();

        render_route_counters(&mut out, &all);
        self.render_pools_and_plans(&mut out);
        render_route_latency(&mut out, &all);
        self.render_backends(&mut out);
        self.render_gateway_errors(&mut out);
        self.render_filters(&mut out);
        self.render_gauges(&mut out);
        out
    }

    /// Responses by listener pool and by plan, each by status class.
    fn render_pools_and_plans(&self, out: &mut String) {
        out.push_str("# HELP postern_pool_requests_total Responses by listener pool and status class.\n");
        out.push_str("# TYPE postern_pool_requests_total counter\n");
        for (pool, c) in ["public", "partner"].iter().zip(&self.pools) {
            for (class, n) in c.counted() {
                let _ = writeln!(out, "postern_pool_requests_total{{pool=\"{pool}\",status=\"{class}\"}} {n}");
            }
        }
        out.push_str("# HELP postern_plan_requests_total Responses to authenticated callers by plan and status class (16 plans at most; further ones are `other`).\n");
        out.push_str("# TYPE postern_plan_requests_total counter\n");
        let plans =
            self.plans.iter().filter_map(|p| p.name.get().map(|n| (escape(&String::from_utf8_lossy(n)), &p.classes)));
        for (plan, c) in plans.chain(std::iter::once(("other".to_owned(), &self.other_plans))) {
            for (class, n) in c.counted() {
                let _ = writeln!(out, "postern_plan_requests_total{{plan=\"{plan}\",status=\"{class}\"}} {n}");
            }
        }
    }

    /// Responses and their time on routes split across backends (none without such a route).
    fn render_backends(&self, out: &mut String) {
        let backends: Vec<(BackendKey, Arc<RouteMetrics>)> = {
            let map = self.backends.lock().unwrap_or_else(|p| p.into_inner());
            map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        if !backends.is_empty() {
            out.push_str("# HELP postern_backend_requests_total Responses on routes split across backends, by route, backend and status class.\n");
            out.push_str("# TYPE postern_backend_requests_total counter\n");
            for ((route, backend), m) in &backends {
                let (route, backend) = (escape(route), escape(backend));
                for (class, n) in m.by_class.counted() {
                    let _ = writeln!(
                        out,
                        "postern_backend_requests_total{{route=\"{route}\",backend=\"{backend}\",status=\"{class}\"}} {n}"
                    );
                }
            }
            out.push_str("# HELP postern_backend_request_duration_seconds Time from request to response head, by route and backend.\n");
            out.push_str("# TYPE postern_backend_request_duration_seconds histogram\n");
            for ((route, backend), m) in &backends {
                let labels = format!("route=\"{}\",backend=\"{}\"", escape(route), escape(backend));
                m.latency.render(out, "postern_backend_request_duration_seconds", &labels);
            }
        }
    }

    /// Responses the gateway made itself, by problem code.
    fn render_gateway_errors(&self, out: &mut String) {
        out.push_str("# HELP postern_gateway_errors_total Responses the gateway made itself, by code.\n");
        out.push_str("# TYPE postern_gateway_errors_total counter\n");
        for (code, c) in PROBLEM_CODES.iter().zip(self.problems.iter()) {
            let _ = writeln!(out, "postern_gateway_errors_total{{code=\"{code}\"}} {}", c.load(Ordering::Relaxed));
        }
    }

    /// Wasm filter calls, fuel and time by route and filter (none without a filter called).
    fn render_filters(&self, out: &mut String) {
        let filters: Vec<(FilterKey, Arc<FilterStats>)> = {
            let map = self.filters.lock().unwrap_or_else(|p| p.into_inner());
            map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        if !filters.is_empty() {
            out.push_str("# HELP postern_filter_calls_total Wasm filter calls by route, filter and outcome.\n");
            out.push_str("# TYPE postern_filter_calls_total counter\n");
            out.push_str("# HELP postern_filter_fuel Fuel used per Wasm filter call.\n");
            out.push_str("# TYPE postern_filter_fuel histogram\n");
            out.push_str("# HELP postern_filter_duration_seconds Wasm filter call time, instantiation included.\n");
            out.push_str("# TYPE postern_filter_duration_seconds histogram\n");
            out.push_str("# HELP postern_filter_fuel_max The most fuel one Wasm filter call used.\n");
            out.push_str("# TYPE postern_filter_fuel_max gauge\n");
            out.push_str("# HELP postern_filter_duration_seconds_max The longest Wasm filter call.\n");
            out.push_str("# TYPE postern_filter_duration_seconds_max gauge\n");
            out.push_str("# HELP postern_filter_cpu_seconds_max The most CPU time of a timed Wasm filter call.\n");
            out.push_str("# TYPE postern_filter_cpu_seconds_max gauge\n");
            for ((route, name), stats) in &filters {
                stats.render(out, &format!("route=\"{}\",filter=\"{}\"", escape(route), escape(name)));
            }
        }
    }

    /// The node's gauges and counters of snapshots, credential states, connections and files.
    fn render_gauges(&self, out: &mut String) {
        let gauges = [
            ("postern_snapshot_version", "gauge", "Version of the running snapshot.", &self.snapshot_version),
            ("postern_snapshot_reloads_total", "counter", "Snapshots applied.", &self.reloads_ok),
            ("postern_snapshot_reload_failures_total", "counter", "Snapshots refused.", &self.reloads_failed),
            ("postern_open_connections", "gauge", "Open client connections.", &self.connections),
            (
                "postern_connections_refused_total",
                "counter",
                "Client connections closed at accept (over a connection cap).",
                &self.connections_refused,
            ),
            (
                "postern_connections_timed_out_total",
                "counter",
                "Client connections closed for sending no request in time or idling.",
                &self.connections_timed_out,
            ),
            (
                "postern_connections_stalled_total",
                "counter",
                "Client connections closed because an answer waited on the client for the send bound.",
                &self.connections_stalled,
            ),
            (
                "postern_credentials_version",
                "gauge",
                "Version of the live credential state.",
                &self.credentials_version,
            ),
            ("postern_credentials_reloads_total", "counter", "Credential states applied.", &self.credentials_ok),
            (
                "postern_credentials_reload_failures_total",
                "counter",
                "Credential states refused.",
                &self.credentials_failed,
            ),
            (
                "postern_files_refused_total",
                "counter",
                "Files refused before reading: a symbolic link, not a regular file, or over its size cap.",
                &self.files_refused,
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}", v.load(Ordering::Relaxed));
        }
    }
}

/// Responses by route: by status class, 5xx by origin, refusals by status.
fn render_route_counters(out: &mut String, all: &[(String, &RouteMetrics)]) {
    out.push_str("# HELP postern_requests_total Responses sent, by route and status class.\n");
    out.push_str("# TYPE postern_requests_total counter\n");
    for (route, m) in all {
        for (class, n) in m.by_class.counted() {
            let _ = writeln!(out, "postern_requests_total{{route=\"{route}\",status=\"{class}\"}} {n}");
        }
    }
    out.push_str("# HELP postern_responses_5xx_total 5xx responses by route and origin: made by the gateway (or a filter) or by the backend.\n");
    out.push_str("# TYPE postern_responses_5xx_total counter\n");
    for (route, m) in all {
        let total = m.by_class.0[5].load(Ordering::Relaxed);
        let gateway = m.gateway_5xx.load(Ordering::Relaxed).min(total);
        let _ = writeln!(out, "postern_responses_5xx_total{{route=\"{route}\",origin=\"gateway\"}} {gateway}");
        let _ =
            writeln!(out, "postern_responses_5xx_total{{route=\"{route}\",origin=\"upstream\"}} {}", total - gateway);
    }
    out.push_str("# HELP postern_responses_denied_total Refusals by route: 401 (credentials), 403 (scope or plan) and 429 (rate or quota).\n");
    out.push_str("# TYPE postern_responses_denied_total counter\n");
    for (route, m) in all {
        for (status, c) in DENIED.iter().zip(&m.denied) {
            let _ = writeln!(
                out,
                "postern_responses_denied_total{{route=\"{route}\",status=\"{status}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
    }
}

/// Request time and added time by route.
fn render_route_latency(out: &mut String, all: &[(String, &RouteMetrics)]) {
    out.push_str("# HELP postern_request_duration_seconds Time from request to response head.\n");
    out.push_str("# TYPE postern_request_duration_seconds histogram\n");
    for (route, m) in all {
        m.latency.render(out, "postern_request_duration_seconds", &format!("route=\"{route}\""));
    }
    out.push_str("# HELP postern_added_latency_seconds Time the gateway added on top of the backend.\n");
    out.push_str("# TYPE postern_added_latency_seconds histogram\n");
    for (route, m) in all {
        m.added.render(out, "postern_added_latency_seconds", &format!("route=\"{route}\""));
    }
}

/// Authentication outcomes, by reason.
pub fn render_auth(out: &mut String, stats: &postern_builtin_filters::auth::AuthStats) {
    out.push_str("# HELP postern_auth_requests_total Authentication and authorisation outcomes, by reason.\n");
    out.push_str("# TYPE postern_auth_requests_total counter\n");
    for (reason, n) in stats.snapshot() {
        let _ = writeln!(out, "postern_auth_requests_total{{outcome=\"{}\"}} {n}", reason.as_str());
    }
}

/// Appends the fleet-wide rate sync's metrics.
pub fn render_ratesync(out: &mut String, s: &crate::node::ratesync::RateSync) {
    let synced = u64::from(s.state() == "synced");
    let rows: [(&str, &str, &str, u64); 9] = [
        (
            "postern_ratelimit_sync_total{outcome=\"ok\"}",
            "counter",
            "Rate syncs with the fleet, by outcome.",
            s.ok.load(Ordering::Relaxed),
        ),
        ("postern_ratelimit_sync_total{outcome=\"failed\"}", "", "", s.failed.load(Ordering::Relaxed)),
        (
            "postern_ratelimit_synced",
            "gauge",
            "1 while rate limits are synced with the fleet, 0 when lost or starting.",
            synced,
        ),
        (
            "postern_ratelimit_sync_keys",
            "gauge",
            "Keys reported by the last rate sync.",
            s.keys.load(Ordering::Relaxed),
        ),
        (
            "postern_ratelimit_sync_sent_bytes_total",
            "counter",
            "Bytes of rate-sync requests sent.",
            s.bytes_sent.load(Ordering::Relaxed),
        ),
        (
            "postern_ratelimit_sync_last_microseconds",
            "gauge",
            "Duration of the last successful rate sync.",
            s.last_us.load(Ordering::Relaxed),
        ),
        (
            "postern_ratelimit_fleet_nodes",
            "gauge",
            "Nodes that synced rate limits lately.",
            s.nodes.load(Ordering::Relaxed),
        ),
        ("postern_ratelimit_buckets", "gauge", "Rate-limit buckets held by this node.", s.limiter.len() as u64),
        (
            "postern_ratelimit_sync_deferred_total",
            "counter",
            "Syncs that left keys for the next one (more than one sync takes).",
            s.deferred.load(Ordering::Relaxed),
        ),
    ];
    write_rows(out, &rows);
}

/// Writes `(name, type, help, value)` rows; a row with no type continues the family above.
fn write_rows(out: &mut String, rows: &[(&str, &str, &str, u64)]) {
    for &(name, kind, help, v) in rows {
        if !kind.is_empty() {
            let base = name.split('{').next().unwrap_or(name);
            let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} {kind}");
        }
        let _ = writeln!(out, "{name} {v}");
    }
}

/// Usage metering's counters: what was spooled, shipped, refused and is waiting.
pub fn render_usage(out: &mut String, u: &postern_usage::Usage) {
    let s = &u.stats;
    let spool = u.spool_gauges();
    let rows: [(&str, &str, &str, u64); 13] = [
        (
            "postern_usage_windows_parked_total",
            "counter",
            "Usage windows the usage stream refused for good, set aside in the spool's parked/ folder.",
            s.parked.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_resent_total",
            "counter",
            "Usage windows sent again because the usage store never got them.",
            s.resent.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_unavailable_total",
            "counter",
            "Usage windows asked for again that the spool no longer held.",
            s.resend_unavailable.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_spooled_total",
            "counter",
            "Usage windows written to the spool.",
            s.spooled.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_shipped_total",
            "counter",
            "Usage windows the usage stream acknowledged.",
            s.shipped.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_recovered_total",
            "counter",
            "Usage windows rebuilt from the counts file after a crash.",
            s.recovered.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_rows_not_durable_total",
            "counter",
            "Usage rows counted in memory only (no free slot in the counts file): a kill -9 would lose their window's calls.",
            u.meter.not_durable(),
        ),
        (
            "postern_usage_spool_errors_total",
            "counter",
            "Failed spool writes (a full spool or disk): the windows wait in memory.",
            s.spool_errors.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_ship_errors_total",
            "counter",
            "Failed sends to the usage stream: the windows wait in the spool.",
            s.ship_errors.load(Ordering::Relaxed),
        ),
        (
            "postern_usage_windows_pending",
            "gauge",
            "Closed usage windows waiting in memory for the spool.",
            s.pending.load(Ordering::Relaxed),
        ),
        ("postern_usage_windows_unacked", "gauge", "Spooled usage windows not yet acknowledged.", spool.unacked),
        ("postern_usage_spool_bytes", "gauge", "Bytes of the usage spool's segments.", spool.bytes),
        ("postern_usage_spool_cap_bytes", "gauge", "The usage spool's size cap.", spool.cap),
    ];
    write_rows(out, &rows);
}

/// The busiest callers of the last closed usage window (10 s): a bounded top-K for
/// live operations; per-key history is the usage store's, never a metric label.
pub fn render_top_callers(out: &mut String, top: &[postern_usage::TopCaller]) {
    type Family = (&'static str, &'static str, fn(&postern_usage::TopCaller) -> u64);
    let families: [Family; 2] = [
        (
            "postern_top_caller_calls",
            "Calls of the busiest callers in the last closed 10 s usage window (at most 10 series).",
            |t| t.calls,
        ),
        ("postern_top_caller_5xx", "5xx answers of the busiest callers in the last closed usage window.", |t| t.errors),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (rank, t) in top.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{rank=\"{}\",kind=\"{}\",caller=\"{}\"}} {}",
                rank + 1,
                t.kind.as_str(),
                escape(&t.caller),
                value(t)
            );
        }
    }
}

/// Answers being compressed, the node's cap on them, and those sent uncompressed for it.
pub fn render_compression(out: &mut String, slots: &crate::request::compress::Slots) {
    let rows: [(&str, &str, &str, u64); 3] = [
        (
            "postern_compressing_streams",
            "gauge",
            "Answers being compressed now (each holds an encoder's window).",
            u64::from(slots.busy()),
        ),
        (
            "postern_compressing_streams_max",
            "gauge",
            "The node's cap on answers compressed at once (--max-compressing-streams).",
            u64::from(slots.cap()),
        ),
        (
            "postern_compression_skipped_total{reason=\"node_cap\"}",
            "counter",
            "Answers that would have been compressed, sent as the backend sent them: the node's cap was reached.",
            slots.refused.load(Ordering::Relaxed),
        ),
    ];
    write_rows(out, &rows);
}

/// The access log's counters: lines written, dropped at a full queue, lost.
pub fn render_access_log(out: &mut String, log: &postern_observe::AccessLog) {
    let s = &log.stats;
    let rows: [(&str, &str, &str, u64); 8] = [
        (
            "postern_access_log_lines_total{outcome=\"written\"}",
            "counter",
            "Access-log lines, by outcome: written to the file, dropped at a full queue (the request did not wait), or lost to a failed write.",
            s.written.load(Ordering::Relaxed),
        ),
        ("postern_access_log_lines_total{outcome=\"dropped\"}", "", "", s.dropped.load(Ordering::Relaxed)),
        ("postern_access_log_lines_total{outcome=\"failed\"}", "", "", s.failed.load(Ordering::Relaxed)),
        (
            "postern_access_log_rotations_total",
            "counter",
            "Access-log files rotated.",
            s.rotations.load(Ordering::Relaxed),
        ),
        (
            "postern_access_log_stream_total{outcome=\"sent\"}",
            "counter",
            "Access-log lines handed to the stream (Kafka), by outcome: sent, refused, or undelivered after all.",
            s.sent.load(Ordering::Relaxed),
        ),
        ("postern_access_log_stream_total{outcome=\"refused\"}", "", "", s.sink_failed.load(Ordering::Relaxed)),
        ("postern_access_log_stream_total{outcome=\"undelivered\"}", "", "", s.undelivered.load(Ordering::Relaxed)),
        (
            "postern_access_log_dropped_total{reason=\"anonymous_client_error\"}",
            "counter",
            "Requests the access log chose not to write, by reason: a client error of an anonymous caller past --access-log-anonymous-errors-per-s.",
            s.anonymous_sampled_out.load(Ordering::Relaxed),
        ),
    ];
    write_rows(out, &rows);
}

/// The tracer's health: traces queued and dropped, spans exported and lost.
pub fn render_traces(out: &mut String, tracer: &postern_observe::Tracer) {
    let s = &tracer.stats;
    let rows: [(&str, &str, &str, u64); 4] = [
        (
            "postern_traces_total{outcome=\"queued\"}",
            "counter",
            "Traces of requests, by outcome: queued for export, or dropped at a full queue (the request did not wait).",
            s.queued.load(Ordering::Relaxed),
        ),
        ("postern_traces_total{outcome=\"dropped\"}", "", "", s.dropped.load(Ordering::Relaxed)),
        (
            "postern_trace_spans_total{outcome=\"exported\"}",
            "counter",
            "Spans sent to the OTLP collector, by outcome: accepted, or lost to a failed export (collector down, refusing, or slow).",
            s.exported.load(Ordering::Relaxed),
        ),
        ("postern_trace_spans_total{outcome=\"failed\"}", "", "", s.failed.load(Ordering::Relaxed)),
    ];
    write_rows(out, &rows);
}

/// Each cluster's breaker and in-flight requests on this node (a series per cluster, a
/// bounded set: clusters come from the platform's config).
pub fn render_upstreams(out: &mut String, upstreams: &[Arc<crate::cluster::Upstream>]) {
    let now = std::time::Instant::now();
    let families: [(&str, &str, &str); 9] = [
        (
            "postern_upstream_breaker_open",
            "gauge",
            "1 while the cluster's circuit breaker refuses requests (open or probing).",
        ),
        ("postern_upstream_breaker_opened_total", "counter", "Times the cluster's circuit breaker opened."),
        (
            "postern_upstream_breaker_refused_total",
            "counter",
            "Requests the cluster's circuit breaker answered 503 circuit_open.",
        ),
        ("postern_upstream_in_flight", "gauge", "Requests in flight to the cluster."),
        ("postern_upstream_retries_total", "counter", "Requests sent once more to another host of the cluster."),
        ("postern_upstream_retries_denied_total", "counter", "Retries the cluster's spent retry budget refused."),
        (
            "postern_upstream_hosts_ejected",
            "gauge",
            "The cluster's hosts out after failing in a row (outlier ejection).",
        ),
        ("postern_upstream_ejections_total", "counter", "Times one of the cluster's hosts was ejected."),
        (
            "postern_upstream_connections",
            "gauge",
            "Connections open to the cluster's hosts (climbing: a slow backend holding the node's connections).",
        ),
    ];
    for (i, (name, kind, help)) in families.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for u in upstreams {
            let b = &u.breaker;
            let v = match i {
                0 => u64::from(b.state(now) != postern_protect::State::Closed),
                1 => b.opened(),
                2 => b.refused(),
                3 => u64::from(u.in_flight()),
                4 => u.budget.retried(),
                5 => u.budget.denied(),
                6 => u.hosts.ejected(now).0 as u64,
                7 => u.hosts.ejected(now).1,
                _ => u.open_connections(),
            };
            let _ = writeln!(out, "{name}{{cluster=\"{}\"}} {v}", escape(&u.name));
        }
    }
}

/// Priority shedding: the node's CPU, each ramp's level and the requests each shed by
/// class (series per signal, cluster and class: bounded by the platform's clusters).
pub fn render_shed(
    out: &mut String,
    node: &crate::cluster::shedding::NodeShed,
    admission: &crate::cluster::shedding::Admission,
    upstreams: &[Arc<crate::cluster::Upstream>],
) {
    let _ = writeln!(
        out,
        "# HELP postern_node_cpu_percent This process's CPU over the last second, in percent of its cores.\n# TYPE postern_node_cpu_percent gauge\npostern_node_cpu_percent {}",
        node.cpu_percent()
    );
    let _ = writeln!(
        out,
        "# HELP postern_shed_level How far a shedding ramp has gone (100 per class, sheddable first; 0: none shed).\n# TYPE postern_shed_level gauge\npostern_shed_level{{signal=\"cpu\"}} {}",
        node.cpu.level()
    );
    for u in upstreams {
        let _ = writeln!(
            out,
            "postern_shed_level{{signal=\"cluster\",cluster=\"{}\"}} {}",
            escape(&u.name),
            u.shed.level()
        );
    }
    let pools = ["partner", "public"];
    let _ = writeln!(
        out,
        "# HELP postern_admission_in_flight Requests being served, by pool (the node's admission budget).\n# TYPE postern_admission_in_flight gauge"
    );
    for (pool, (n, _)) in pools.iter().zip(admission.counts()) {
        let _ = writeln!(out, "postern_admission_in_flight{{pool=\"{pool}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP postern_admission_refused_total Requests refused 503 node_overloaded: the pool's share of the budget was full.\n# TYPE postern_admission_refused_total counter"
    );
    for (pool, (_, n)) in pools.iter().zip(admission.counts()) {
        let _ = writeln!(out, "postern_admission_refused_total{{pool=\"{pool}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP postern_shed_total Requests shed (503 shed), by signal and class.\n# TYPE postern_shed_total counter"
    );
    let classes = postern_model::Priority::ALL;
    for (p, n) in classes.iter().zip(node.cpu.shed()) {
        let _ = writeln!(out, "postern_shed_total{{signal=\"cpu\",class=\"{}\"}} {n}", p.as_str());
    }
    for u in upstreams {
        for (p, n) in classes.iter().zip(u.shed.shed()) {
            let _ = writeln!(
                out,
                "postern_shed_total{{signal=\"cluster\",cluster=\"{}\",class=\"{}\"}} {n}",
                escape(&u.name),
                p.as_str()
            );
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(40));
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_secs(60));
        let mut out = String::new();
        h.render(&mut out, "x", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.00005\"} 1"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.0005\"} 2"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 3"), "{out}");
    }

    #[test]
    fn origins_refusals_pools_and_a_bounded_set_of_plans() {
        let m = Metrics::default();
        let id: Arc<str> = Arc::from("team/r");
        let r = m.route(&id);
        for (status, by_gateway) in [(502, true), (503, false), (503, false), (401, true), (429, true), (200, false)] {
            r.count(status);
            r.count_origin(status, by_gateway);
        }
        m.count_pool(postern_model::Pool::Partner, 200);
        for i in 0..20 {
            m.count_plan(Some(&bytes::Bytes::from(format!("plan-{i}"))), 200);
        }
        m.count_plan(Some(&bytes::Bytes::from_static(b"plan-0")), 500);
        m.count_plan(None, 200);
        let text = m.render();
        for want in [
            "postern_responses_5xx_total{route=\"team/r\",origin=\"gateway\"} 1",
            "postern_responses_5xx_total{route=\"team/r\",origin=\"upstream\"} 2",
            "postern_responses_denied_total{route=\"team/r\",status=\"401\"} 1",
            "postern_responses_denied_total{route=\"team/r\",status=\"403\"} 0",
            "postern_responses_denied_total{route=\"team/r\",status=\"429\"} 1",
            "postern_pool_requests_total{pool=\"partner\",status=\"2xx\"} 1",
            "postern_plan_requests_total{plan=\"plan-0\",status=\"5xx\"} 1",
            "postern_plan_requests_total{plan=\"plan-15\",status=\"2xx\"} 1",
            "postern_plan_requests_total{plan=\"other\",status=\"2xx\"} 4",
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
        assert!(!text.contains("plan-16"), "sixteen plans at most");
    }

    #[test]
    fn route_counters_survive_lookups() {
        let m = Metrics::default();
        let id: Arc<str> = Arc::from("team/r");
        m.route(&id).count(200);
        m.route(&id).count(503);
        m.problem("route_not_found");
        let text = m.render();
        assert!(text.contains("postern_requests_total{route=\"team/r\",status=\"2xx\"} 1"), "{text}");
        assert!(text.contains("postern_requests_total{route=\"team/r\",status=\"5xx\"} 1"), "{text}");
        assert!(text.contains("postern_gateway_errors_total{code=\"route_not_found\"} 1"), "{text}");
    }
}
