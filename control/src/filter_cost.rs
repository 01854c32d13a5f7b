//! `posternctl filter cost`: what each filter attached to a route costs — calls by
//! outcome, fuel, duration and CPU percentiles, refusals by rule, quarantines and reruns —
//! read from a node's admin endpoint (the `postern_filter_*` series of its `/metrics`),
//! since the node started or over a window (two reads, the difference between them).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// One sample of the Prometheus text format: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// The samples of a metrics page (comments and lines that do not parse are skipped).
fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.starts_with('#')).filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &inner[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                c => value.push(c),
                            },
                            c => value.push(c),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                c => key.push(c),
            }
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample { name, labels, value })
}

/// A cumulative histogram: `(upper bound, count at or below it)`, with its sum and its
/// largest observation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Histogram {
    /// Upper bounds (`le`) and cumulative counts, in increasing order.
    pub buckets: Vec<(f64, f64)>,
    /// The sum of the observations.
    pub sum: f64,
    /// The number of observations.
    pub count: f64,
    /// The largest observation (the node's `_max` gauge), when known: over a window, only
    /// when it rose within it.
    pub max: Option<f64>,
}

impl Histogram {
    /// The bucket the `q` quantile falls in, `(lower, upper bound)`, the upper bound no
    /// more than the largest observation; `None` without observations.
    pub fn bucket(&self, q: f64) -> Option<(f64, f64)> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut lo = 0.0_f64;
        for &(le, cum) in &self.buckets {
            if cum >= rank && cum > 0.0 {
                let hi = self.max.map_or(le, |m| le.min(m));
                return Some((lo.min(hi), hi));
            }
            lo = le;
        }
        Some((lo, self.max.unwrap_or(lo)))
    }

    /// The `q` quantile, interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does, and never above the largest observation; `None`
    /// without observations. An observation above the last finite bound reads as that
    /// bound (or the largest observation, when known).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let (mut lo, mut below) = (0.0, 0.0);
        let clamp = |v: f64| self.max.map_or(v, |m| v.min(m));
        for &(le, cum) in &self.buckets {
            if cum >= rank {
                if le.is_infinite() {
                    return Some(self.max.unwrap_or(lo));
                }
                let width = cum - below;
                return Some(clamp(if width > 0.0 { lo + (le - lo) * (rank - below) / width } else { le }));
            }
            (lo, below) = (le, cum);
        }
        Some(clamp(lo))
    }

    /// The mean, exact (the sum over the count).
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// How wide its finite buckets are at most, as a ratio of upper to lower bound past
    /// the first (`1.0905` for the fuel's eight to an octave).
    pub fn resolution(&self) -> Option<f64> {
        self.buckets
            .windows(2)
            .filter(|w| w[0].0 > 0.0 && w[1].0.is_finite())
            .map(|w| w[1].0 / w[0].0)
            .max_by(f64::total_cmp)
    }

    fn minus(&self, before: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, cum)| {
                let b = before.buckets.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c);
                (le, (cum - b).max(0.0))
            })
            .collect();
        // The largest of the window is known only if it is a new largest.
        let max = match (self.max, before.max) {
            (Some(a), Some(b)) if a > b => Some(a),
            (Some(a), None) => Some(a),
            _ => None,
        };
        Histogram { buckets, sum: (self.sum - before.sum).max(0.0), count: (self.count - before.count).max(0.0), max }
    }
}

/// What one filter on the route cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FilterCost {
    /// Calls by outcome (`ok`, `fuel_exhausted`, `deadline_exceeded`, `bad_output`, …).
    pub calls: BTreeMap<String, u64>,
    /// Answers refused, by the rule they broke.
    pub refusals: BTreeMap<String, u64>,
    /// Fuel per call.
    pub fuel: Histogram,
    /// Wall seconds per call, instantiation included.
    pub duration_seconds: Histogram,
    /// CPU seconds per call (what the deadline measures), from sampled calls.
    pub cpu_seconds: Histogram,
    /// Times the filter was put in quarantine.
    pub quarantines: u64,
    /// Calls stopped on a worker and run again on the idle pool.
    pub reruns: u64,
}

/// Every filter attached to `route` (`team/name`) in a metrics page, by filter name.
pub fn costs(metrics: &str, route: &str) -> BTreeMap<String, FilterCost> {
    let mut out: BTreeMap<String, FilterCost> = BTreeMap::new();
    for s in parse(metrics) {
        if !s.name.starts_with("postern_filter_") || s.label("route") != Some(route) {
            continue;
        }
        let Some(filter) = s.label("filter") else { continue };
        let f = out.entry(filter.to_owned()).or_default();
        let n = s.value.max(0.0) as u64;
        match s.name.as_str() {
            "postern_filter_calls_total" => {
                *f.calls.entry(s.label("outcome").unwrap_or("?").to_owned()).or_default() += n
            }
            "postern_filter_refusals_total" => {
                *f.refusals.entry(s.label("rule").unwrap_or("?").to_owned()).or_default() += n;
            }
            "postern_filter_quarantines_total" => f.quarantines += n,
            "postern_filter_reruns_total" => f.reruns += n,
            name => {
                let (h, part) = if let Some(part) = name.strip_prefix("postern_filter_fuel_") {
                    (&mut f.fuel, part)
                } else if let Some(part) = name.strip_prefix("postern_filter_duration_seconds_") {
                    (&mut f.duration_seconds, part)
                } else if let Some(part) = name.strip_prefix("postern_filter_cpu_seconds_") {
                    (&mut f.cpu_seconds, part)
                } else {
                    continue;
                };
                match part {
                    "bucket" => {
                        let le = match s.label("le") {
                            Some("+Inf") => f64::INFINITY,
                            Some(le) => le.parse().unwrap_or(f64::INFINITY),
                            None => continue,
                        };
                        h.buckets.push((le, s.value));
                    }
                    "sum" => h.sum = s.value,
                    "count" => h.count = s.value,
                    "max" => h.max = Some(s.value),
                    _ => {}
                }
            }
        }
    }
    for f in out.values_mut() {
        for h in [&mut f.fuel, &mut f.duration_seconds, &mut f.cpu_seconds] {
            h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }
    out
}

/// What happened between two reads: `after` less `before`.
pub fn window(
    after: &BTreeMap<String, FilterCost>,
    before: &BTreeMap<String, FilterCost>,
) -> BTreeMap<String, FilterCost> {
    let empty = FilterCost::default();
    let less = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| -> BTreeMap<String, u64> {
        a.iter().map(|(k, v)| (k.clone(), v.saturating_sub(b.get(k).copied().unwrap_or(0)))).collect()
    };
    after
        .iter()
        .map(|(name, a)| {
            let b = before.get(name).unwrap_or(&empty);
            let cost = FilterCost {
                calls: less(&a.calls, &b.calls),
                refusals: less(&a.refusals, &b.refusals),
                fuel: a.fuel.minus(&b.fuel),
                duration_seconds: a.duration_seconds.minus(&b.duration_seconds),
                cpu_seconds: a.cpu_seconds.minus(&b.cpu_seconds),
                quarantines: a.quarantines.saturating_sub(b.quarantines),
                reruns: a.reruns.saturating_sub(b.reruns),
            };
            (name.clone(), cost)
        })
        .collect()
}

/// The report as JSON: the node read (its admin URL) and per filter the counts, and of
/// fuel, duration and CPU time the p50/p90/p99 (interpolated, and the bucket each falls
/// in), the exact mean and the largest call.
pub fn json(node: &str, route: &str, window_s: Option<u64>, costs: &BTreeMap<String, FilterCost>) -> serde_json::Value {
    let ms = |h: &Histogram| Histogram {
        buckets: h.buckets.iter().map(|&(le, n)| (le * 1e3, n)).collect(),
        sum: h.sum * 1e3,
        count: h.count,
        max: h.max.map(|m| m * 1e3),
    };
    let pct = |h: &Histogram| {
        let range = |q| h.bucket(q).map(|(lo, hi)| [lo, hi]);
        serde_json::json!({
            "p50": h.quantile(0.5), "p90": h.quantile(0.9), "p99": h.quantile(0.99),
            "p50_bucket": range(0.5), "p90_bucket": range(0.9), "p99_bucket": range(0.99),
            "mean": h.mean(), "max": h.max, "count": h.count, "bucket_ratio": h.resolution(),
        })
    };
    let filters: serde_json::Map<String, serde_json::Value> = costs
        .iter()
        .map(|(name, c)| {
            let v = serde_json::json!({
                "calls": c.calls.values().sum::<u64>(),
                "outcomes": c.calls,
                "refusals": c.refusals,
                "fuel": pct(&c.fuel),
                "duration_ms": pct(&ms(&c.duration_seconds)),
                "cpu_ms": pct(&ms(&c.cpu_seconds)),
                "quarantines": c.quarantines,
                "reruns": c.reruns,
            });
            (name.clone(), v)
        })
        .collect();
    serde_json::json!({"node": node, "route": route, "window_s": window_s, "filters": filters})
}

/// `n` with thousands separators: `22,099`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `n` rounded, with thousands separators.
fn count(n: f64) -> String {
    thousands(n.max(0.0).round() as u64)
}

/// The fuel line: percentiles interpolated within buckets (saying how wide they are),
/// the exact mean and the largest call.
fn fuel_line(h: &Histogram) -> String {
    if h.count <= 0.0 {
        return "fuel      -".to_owned();
    }
    let mut parts: Vec<String> = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)]
        .iter()
        .map(|(name, q)| format!("{name} {}", h.quantile(*q).map_or("-".to_owned(), count)))
        .collect();
    parts.push(format!("mean {}", h.mean().map_or("-".to_owned(), count)));
    parts.push(format!("max {}", h.max.map_or("-".to_owned(), count)));
    let res = h
        .resolution()
        .map_or(String::new(), |r| format!("  (percentiles within buckets at most {:.1} % wide)", (r - 1.0) * 100.0));
    format!("fuel      {}{res}", parts.join("  "))
}

/// A time line in milliseconds: the bucket each percentile falls in (the node's time
/// buckets are coarse, so a range is what it knows), the exact mean and the longest call.
fn time_line(label: &str, h: &Histogram) -> String {
    if h.count <= 0.0 {
        return format!("{label:<9} -");
    }
    let ms = |v: f64| format!("{:.3}", v * 1e3);
    let mut parts: Vec<String> = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)]
        .iter()
        .map(|(name, q)| match h.bucket(*q) {
            Some((lo, hi)) if hi > lo => format!("{name} {}-{} ms", ms(lo), ms(hi)),
            Some((_, hi)) => format!("{name} {} ms", ms(hi)),
            None => format!("{name} -"),
        })
        .collect();
    parts.push(format!("mean {}", h.mean().map_or("-".to_owned(), |m| format!("{} ms", ms(m)))));
    parts.push(format!("max {}", h.max.map_or("-".to_owned(), |m| format!("{} ms", ms(m)))));
    format!("{label:<9} {}", parts.join("  "))
}

/// The report as a table, one block per filter, naming the node read (its admin URL).
pub fn table(node: &str, route: &str, window_s: Option<u64>, costs: &BTreeMap<String, FilterCost>) -> String {
    let mut out = String::new();
    let over = window_s.map_or("since the node started".to_owned(), |s| format!("over {s} s"));
    let _ = writeln!(out, "route {route} on the node at {node}, {over}");
    if costs.is_empty() {
        let _ = writeln!(out, "  no Wasm filter calls on this route (is it the right route, and has it had traffic?)");
    }
    for (name, c) in costs {
        let calls: u64 = c.calls.values().sum();
        let outcomes: Vec<String> = c.calls.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(
            out,
            "  filter {name}: {calls} calls ({})",
            if outcomes.is_empty() { "-".to_owned() } else { outcomes.join(", ") }
        );
        let _ = writeln!(out, "    {}", fuel_line(&c.fuel));
        let _ = writeln!(out, "    {}", time_line("duration", &c.duration_seconds));
        if c.cpu_seconds.count > 0.0 {
            let _ = writeln!(out, "    {}", time_line("cpu", &c.cpu_seconds));
        } else {
            let _ = writeln!(
                out,
                "    cpu       - (no call timed yet: the node times one call in 64 on each of its threads, and this filter \
                 had {calls})"
            );
        }
        let refusals: Vec<String> =
            c.refusals.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(
            out,
            "    quarantines {}  reruns on the idle pool {}  refused answers {}",
            c.quarantines,
            c.reruns,
            if refusals.is_empty() { "0".to_owned() } else { refusals.join(", ") }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const PAGE: &str = r#"# HELP postern_filter_calls_total Wasm filter calls by route, filter and outcome.
# TYPE postern_filter_calls_total counter
postern_filter_calls_total{route="echo/echo-v1",filter="header-injector",outcome="ok"} 90
postern_filter_calls_total{route="echo/echo-v1",filter="header-injector",outcome="deadline_exceeded"} 10
postern_filter_calls_total{route="orders/o",filter="ab-tagger",outcome="ok"} 5
postern_filter_refusals_total{route="echo/echo-v1",filter="header-injector",rule="reserved_header"} 3
postern_filter_fuel_bucket{route="echo/echo-v1",filter="header-injector",le="1000"} 50
postern_filter_fuel_bucket{route="echo/echo-v1",filter="header-injector",le="10000"} 100
postern_filter_fuel_bucket{route="echo/echo-v1",filter="header-injector",le="+Inf"} 100
postern_filter_fuel_sum{route="echo/echo-v1",filter="header-injector"} 123456
postern_filter_fuel_count{route="echo/echo-v1",filter="header-injector"} 100
postern_filter_fuel_max{route="echo/echo-v1",filter="header-injector"} 9000
postern_filter_duration_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="0.0001"} 99
postern_filter_duration_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="0.001"} 100
postern_filter_duration_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="+Inf"} 100
postern_filter_duration_seconds_sum{route="echo/echo-v1",filter="header-injector"} 0.005
postern_filter_duration_seconds_count{route="echo/echo-v1",filter="header-injector"} 100
postern_filter_duration_seconds_max{route="echo/echo-v1",filter="header-injector"} 0.0002
postern_filter_cpu_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="0.00001"} 2
postern_filter_cpu_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="0.000025"} 4
postern_filter_cpu_seconds_bucket{route="echo/echo-v1",filter="header-injector",le="+Inf"} 4
postern_filter_cpu_seconds_sum{route="echo/echo-v1",filter="header-injector"} 0.00005
postern_filter_cpu_seconds_count{route="echo/echo-v1",filter="header-injector"} 4
postern_filter_cpu_seconds_max{route="echo/echo-v1",filter="header-injector"} 0.00002
postern_filter_quarantines_total{route="echo/echo-v1",filter="header-injector"} 1
postern_filter_reruns_total{route="echo/echo-v1",filter="header-injector"} 2
postern_requests_total{route="echo/echo-v1",status="2xx"} 100
"#;

    #[test]
    fn a_route_s_filters_are_read_from_the_metrics() {
        let c = costs(PAGE, "echo/echo-v1");
        assert_eq!(c.keys().collect::<Vec<_>>(), ["header-injector"]);
        let h = &c["header-injector"];
        assert_eq!(h.calls["ok"], 90);
        assert_eq!(h.calls["deadline_exceeded"], 10);
        assert_eq!(h.refusals["reserved_header"], 3);
        assert_eq!((h.quarantines, h.reruns), (1, 2));
        assert_eq!(h.fuel.quantile(0.5), Some(1000.0));
        assert_eq!(h.fuel.quantile(0.75), Some(5500.0), "interpolated in its bucket");
        assert_eq!(h.duration_seconds.quantile(0.99), Some(0.0001));
        assert_eq!(h.cpu_seconds.quantile(0.5), Some(0.00001));
        assert_eq!(Histogram::default().quantile(0.5), None);
        assert!(costs(PAGE, "nope/none").is_empty());
        let mut no_cpu = c.clone();
        no_cpu.get_mut("header-injector").unwrap().cpu_seconds = Histogram::default();
        let text = table("n", "echo/echo-v1", None, &no_cpu);
        assert!(text.contains("cpu       - (no call timed yet: the node times one call in 64"), "{text}");
        assert_eq!(h.fuel.quantile(0.999), Some(9000.0), "never above the largest call");
        assert_eq!(h.fuel.mean(), Some(1234.56), "exact");
        let text = table("http://127.0.0.1:9901", "echo/echo-v1", None, &c);
        assert!(text.starts_with("route echo/echo-v1 on the node at http://127.0.0.1:9901, since"), "{text}");
        assert!(text.contains("filter header-injector: 100 calls (deadline_exceeded 10, ok 90)"), "{text}");
        assert!(text.contains("refused answers reserved_header 3"), "{text}");
        assert!(
            text.contains("    fuel      p50 1,000  p90 8,200  p99 9,000  mean 1,235  max 9,000  (percentiles within buckets at most 900.0 % wide)"),
            "{text}"
        );
        assert!(text.contains("    cpu       p50 0.000-0.010 ms  p90 0.010-0.020 ms  p99 0.010-0.020 ms"), "{text}");
        assert!(text.contains("max 0.020 ms"), "{text}");
        let v = json("http://127.0.0.1:9901", "echo/echo-v1", Some(10), &c);
        assert_eq!(v["filters"]["header-injector"]["fuel"]["max"], 9000.0);
        assert_eq!(v["filters"]["header-injector"]["calls"], 100);
        let p99 = v["filters"]["header-injector"]["duration_ms"]["p99"].as_f64().unwrap();
        assert!((p99 - 0.1).abs() < 1e-9, "{p99}");
        let cpu = v["filters"]["header-injector"]["cpu_ms"]["p50"].as_f64().unwrap();
        assert!((cpu - 0.01).abs() < 1e-9, "{cpu}");
    }

    #[test]
    fn a_window_is_the_difference_of_two_reads() {
        let before = costs(PAGE, "echo/echo-v1");
        let later =
            PAGE.replace("outcome=\"ok\"} 90", "outcome=\"ok\"} 190").replace("le=\"+Inf\"} 100", "le=\"+Inf\"} 200");
        let w = window(&costs(&later, "echo/echo-v1"), &before);
        let h = &w["header-injector"];
        assert_eq!(h.calls["ok"], 100);
        assert_eq!(h.calls["deadline_exceeded"], 0);
        assert_eq!(h.quarantines, 0);
        assert_eq!(h.fuel.buckets.last(), Some(&(f64::INFINITY, 100.0)));
        assert_eq!(h.fuel.max, None, "the window's largest call is known only if it is a new largest");
        let rose = later.replace("filter=\"header-injector\"} 9000", "filter=\"header-injector\"} 12000");
        let w = window(&costs(&rose, "echo/echo-v1"), &before);
        assert_eq!(w["header-injector"].fuel.max, Some(12000.0));
        let text = table("n", "echo/echo-v1", Some(2), &w);
        assert!(text.starts_with("route echo/echo-v1 on the node at n, over 2 s"), "{text}");
    }

    #[test]
    fn label_values_with_escapes_parse() {
        let s = parse_line(r#"m{a="x\"y",b="1\\2"} 3.5"#).unwrap();
        assert_eq!(s.labels, [("a".to_owned(), "x\"y".to_owned()), ("b".to_owned(), "1\\2".to_owned())]);
        assert_eq!(s.value, 3.5);
        assert_eq!(parse_line("plain 7").unwrap().value, 7.0);
        assert!(parse_line("broken{a=1} 2").is_none());
        assert!(parse_line("m{a=\"unterminated").is_none());
    }

    /// What the node records, read back: the p90 `filter cost` prints is within 10 % of
    /// the true p90 of the calls (nearest rank), however they spread.
    #[test]
    fn a_node_s_fuel_percentiles_are_within_ten_percent_of_the_truth() {
        use postern_wasm::{FilterStats, Outcome};
        let spreads: [&dyn Fn(u64) -> u64; 4] = [
            &|_| 2_410,                                   // every call alike
            &|i| if i % 5 == 0 { 22_099 } else { 2_410 }, // two kinds of request
            &|i| 1_500 + i * 97,                          // a ramp
            &|i| 3_000 + (i * i * 7919) % 2_000_000,      // scattered widely
        ];
        for (n, spread) in spreads.iter().enumerate() {
            let stats = FilterStats::default();
            let mut fuel: Vec<u64> = (0..500).map(spread).collect();
            for f in &fuel {
                stats.record(Outcome::Ok, *f, std::time::Duration::from_micros(10));
            }
            let mut page = String::new();
            stats.render(&mut page, "route=\"t/r\",filter=\"f\"");
            let h = &costs(&page, "t/r")["f"].fuel;
            fuel.sort_unstable();
            for q in [0.5, 0.9, 0.99] {
                let truth = fuel[((q * fuel.len() as f64).ceil() as usize).saturating_sub(1)] as f64;
                let got = h.quantile(q).unwrap();
                assert!((got - truth).abs() <= truth * 0.10, "spread {n}, p{q}: got {got}, true {truth}");
            }
            assert_eq!(h.max, Some(*fuel.last().unwrap() as f64), "spread {n}");
            assert!(h.resolution().unwrap() < 1.092, "spread {n}");
        }
    }
}
