//! `posternctl usage`: a `GET /v1/usage` answer as a table or a per-minute chart, and
//! the `--last` range.

use std::collections::BTreeMap;

use super::params::{parse_time, rfc3339};
use super::queries::MAX_ROWS;

/// A `GET /v1/usage` answer as a table, for `posternctl usage`.
pub fn table(v: &serde_json::Value) -> String {
    let rows = v["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    let timed = v["by"].as_str() != Some("route");
    let mut head = vec!["CALLER", "ROUTE", "PRODUCT"];
    if timed {
        head.push("AT");
    }
    head.extend(["CALLS", "BILLABLE", "2XX", "3XX", "4XX", "5XX", "P50 MS", "P99 MS"]);
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|h| (*h).to_owned()).collect()];
    let n = |x: &serde_json::Value| x.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
    let f = |x: &serde_json::Value| x.as_f64().map_or_else(|| "-".to_owned(), |n| format!("{n:.1}"));
    for r in rows {
        let mut line = vec![
            format!("{} ({})", r["caller"].as_str().unwrap_or("?"), r["kind"].as_str().unwrap_or("?")),
            r["route"].as_str().unwrap_or("?").to_owned(),
            r["product"].as_str().unwrap_or("?").to_owned(),
        ];
        if timed {
            line.push(r["at"].as_str().unwrap_or("-").to_owned());
        }
        line.extend([
            n(&r["calls"]),
            n(&r["billable"]),
            n(&r["status"]["2xx"]),
            n(&r["status"]["3xx"]),
            n(&r["status"]["4xx"]),
            n(&r["status"]["5xx"]),
            f(&r["latency_ms"]["p50"]),
            f(&r["latency_ms"]["p99"]),
        ]);
        lines.push(line);
    }
    let widths: Vec<usize> =
        (0..head.len()).map(|i| lines.iter().map(|l| l.get(i).map_or(0, String::len)).max().unwrap_or(0)).collect();
    let mut out = format!(
        "usage from {} to {}, by {}\n",
        v["from"].as_str().unwrap_or("?"),
        v["to"].as_str().unwrap_or("?"),
        v["by"].as_str().unwrap_or("?")
    );
    for l in &lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if rows.is_empty() {
        out.push_str("(no calls in this range)\n");
    }
    if v["truncated"].as_bool() == Some(true) {
        out.push_str(&format!("(the first {MAX_ROWS} rows: narrow the range or name a key)\n"));
    }
    out
}

/// The most characters a [`chart`] line takes: a longer range folds consecutive minutes
/// into one character.
pub const CHART_WIDTH: u64 = 120;

/// `posternctl usage --last`: a whole number and one unit, `s`, `m`, `h` or `d` (`90s`,
/// `30m`, `1h`, `2d`), as seconds.
pub fn parse_last(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a duration like 90s, 30m, 1h or 2d (a whole number and one of s, m, h, d)");
    let digits = match s.chars().last() {
        Some(u @ ('s' | 'm' | 'h' | 'd')) => s.strip_suffix(u).unwrap_or_default(),
        _ => return Err(bad()),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    // A narrower form of the one duration grammar: read by the one parser.
    let too_long = || format!("{s:?} is longer than any range the usage store holds");
    let secs = crate::config::parse_duration(s).map_err(|_| too_long())?.as_secs();
    if secs == 0 {
        return Err(format!("{s:?} is an empty range: give more than zero"));
    }
    Ok(secs)
}

/// One caller and route in a [`chart`].
struct ChartBlock {
    calls: u64,
    s4: u64,
    s5: u64,
    p99: f64,
    /// Calls per character.
    spark: Vec<u64>,
    /// Per character: 0 no errors, 1 some 4xx, 2 some 5xx.
    errors: Vec<u8>,
}

/// A `GET /v1/usage?by=minute` answer as a plain-text chart, for `posternctl usage
/// --chart`: per caller and route, a header with the totals, a sparkline of calls per
/// minute over the whole range (scaled to the block's largest count; a blank for none),
/// a line marking the minutes with 5xx (`!`) or else 4xx (`x`), and the times of the
/// first and last characters. Minutes without a row count as none; a range over
/// [`CHART_WIDTH`] minutes folds consecutive minutes into one character.
pub fn chart(v: &serde_json::Value) -> String {
    const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    const PAD: &str = "          ";
    let (from_s, to_s) = (v["from"].as_str().unwrap_or("?"), v["to"].as_str().unwrap_or("?"));
    let (Some(from), Some(to)) = (parse_time(from_s), parse_time(to_s)) else {
        return format!("usage from {from_s} to {to_s}: not a range of RFC 3339 times\n");
    };
    // The rows are the minutes starting at or after `from` and before `to`.
    let first = from.div_ceil(60).saturating_mul(60);
    let minutes = to.saturating_sub(first).div_ceil(60);
    let per = minutes.div_ceil(CHART_WIDTH).max(1);
    let width = minutes.div_ceil(per);
    let mut out = match per {
        1 => format!("usage from {from_s} to {to_s}, one character a minute\n"),
        _ => format!("usage from {from_s} to {to_s}, one character per {per} minutes\n"),
    };
    let rows = v["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    let mut blocks: BTreeMap<(&str, &str, &str), ChartBlock> = BTreeMap::new();
    for r in rows {
        let key = (
            r["caller"].as_str().unwrap_or("?"),
            r["kind"].as_str().unwrap_or("?"),
            r["route"].as_str().unwrap_or("?"),
        );
        let b = blocks.entry(key).or_insert_with(|| ChartBlock {
            calls: 0,
            s4: 0,
            s5: 0,
            p99: 0.0,
            spark: vec![0; usize::try_from(width).unwrap_or(0)],
            errors: vec![0; usize::try_from(width).unwrap_or(0)],
        });
        let calls = r["calls"].as_u64().unwrap_or(0);
        let s4 = r["status"]["4xx"].as_u64().unwrap_or(0);
        let s5 = r["status"]["5xx"].as_u64().unwrap_or(0);
        b.calls += calls;
        b.s4 += s4;
        b.s5 += s5;
        b.p99 = b.p99.max(r["latency_ms"]["p99"].as_f64().unwrap_or(0.0));
        let Some(at) = r["at"].as_str().and_then(parse_time).filter(|&t| t >= first && t < to) else {
            continue;
        };
        let i = usize::try_from((at - first) / 60 / per).unwrap_or(usize::MAX);
        if let (Some(n), Some(e)) = (b.spark.get_mut(i), b.errors.get_mut(i)) {
            *n += calls;
            *e = (*e).max(if s5 > 0 {
                2
            } else if s4 > 0 {
                1
            } else {
                0
            });
        }
    }
    if !blocks.is_empty() && width > 0 {
        out.push_str("errors: ! some 5xx, x some 4xx, · neither\n");
    }
    let label = |t: u64, dated: bool| {
        let s = rfc3339(t);
        let label = if dated { s.get(5..16) } else { s.get(11..16) };
        label.map_or(s.clone(), |l| l.replace('T', " "))
    };
    let last = first.saturating_add((width.saturating_sub(1)).saturating_mul(per * 60));
    let dated = rfc3339(first).get(..10) != rfc3339(last).get(..10);
    let (left, right) = (label(first, dated), label(last, dated));
    let axis = if width <= 1 {
        left
    } else {
        let gap = usize::try_from(width).unwrap_or(0).saturating_sub(left.len() + right.len()).max(1);
        format!("{left}{}{right}", " ".repeat(gap))
    };
    for ((caller, kind, route), b) in &blocks {
        out.push_str(&format!(
            "\n{caller} ({kind})  {route}  calls {}, 4xx {}, 5xx {}, p99 max {:.1} ms\n",
            b.calls, b.s4, b.s5, b.p99
        ));
        if width == 0 {
            continue;
        }
        let max = b.spark.iter().copied().max().unwrap_or(0);
        let spark: String = b
            .spark
            .iter()
            .map(|&n| match (u128::from(n) * 8).div_ceil(u128::from(max).max(1)) {
                0 => ' ',
                l => LEVELS[usize::try_from(l.min(8) - 1).unwrap_or(7)],
            })
            .collect();
        let errors: String = b
            .errors
            .iter()
            .map(|e| match e {
                2 => '!',
                1 => 'x',
                _ => '·',
            })
            .collect();
        let unit = if per == 1 { "a minute".to_owned() } else { format!("per {per} minutes") };
        out.push_str(&format!("  calls   {spark}  max {max} {unit}\n"));
        out.push_str(&format!("  errors  {errors}\n"));
        out.push_str(&format!("{PAD}{axis}\n"));
    }
    if rows.is_empty() {
        out.push_str("(no calls in this range)\n");
    } else if width == 0 {
        out.push_str("(the range holds no whole minute)\n");
    }
    if v["truncated"].as_bool() == Some(true) {
        out.push_str(&format!("(the first {MAX_ROWS} rows: narrow the range or name a key)\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-12-01T00:00:00Z.
    const DEC: u64 = 1_796_083_200;

    /// A `GET /v1/usage?by=minute` row, as the control plane answers it.
    fn minute_row(caller: &str, kind: &str, at: u64, ok: u64, s4: u64, s5: u64, p99: f64) -> serde_json::Value {
        serde_json::json!({
            "caller": caller, "kind": kind, "route": "search/query", "product": "search",
            "at": rfc3339(at), "calls": ok + s4 + s5, "billable": ok,
            "status": {"1xx": 0, "2xx": ok, "3xx": 0, "4xx": s4, "5xx": s5},
            "latency_ms": {"mean": 1.0, "p50": 1.0, "p99": p99},
        })
    }

    #[test]
    fn last_takes_a_whole_number_and_one_unit() {
        assert_eq!(parse_last("90s"), Ok(90));
        assert_eq!(parse_last("30m"), Ok(1800));
        assert_eq!(parse_last("1h"), Ok(3600));
        assert_eq!(parse_last("2d"), Ok(172_800));
        for bad in ["", "h", "1", "1w", "1H", "1.5h", "-1h", "+1h", "1h30m", " 1h", "1 h", "1hh", "één"] {
            let e = parse_last(bad).unwrap_err();
            assert!(e.contains("not a duration like 90s, 30m, 1h or 2d"), "{bad:?}: {e}");
        }
        assert!(parse_last("0m").unwrap_err().contains("empty range"));
        assert!(parse_last("99999999999999999999d").unwrap_err().contains("longer than"));
        assert!(parse_last("999999999999999999d").unwrap_err().contains("longer than"));
    }

    #[test]
    fn a_chart_shows_each_caller_and_route_per_minute() {
        // From mid-minute: the rows start at the next whole minute (00:00), and the range
        // holds 12 minutes. k1 has a spike at 00:06, 5xx at 00:02, 4xx at 00:07, nothing
        // at 00:04 and after 00:09.
        let m = |i: u64| DEC + 60 * i;
        let rows = vec![
            minute_row("k1", "key", m(0), 10, 0, 0, 12.0),
            minute_row("k1", "key", m(1), 20, 0, 0, 12.0),
            minute_row("k1", "key", m(2), 8, 0, 2, 40.0),
            minute_row("k1", "key", m(3), 11, 0, 0, 12.0),
            minute_row("k1", "key", m(5), 45, 0, 0, 12.0),
            minute_row("k1", "key", m(6), 120, 0, 0, 180.5),
            minute_row("k1", "key", m(7), 7, 3, 0, 12.0),
            minute_row("k1", "key", m(8), 10, 0, 0, 12.0),
            minute_row("k1", "key", m(9), 10, 0, 0, 12.0),
            minute_row("portal", "app", m(3), 2, 1, 1, 950.0),
            minute_row("portal", "app", m(9), 8, 0, 0, 20.0),
        ];
        let v = serde_json::json!({
            "from": "2026-11-30T23:59:30Z", "to": "2026-12-01T00:11:30Z", "by": "minute",
            "truncated": false, "rows": rows,
        });
        let text = chart(&v);
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "usage from 2026-11-30T23:59:30Z to 2026-12-01T00:11:30Z, one character a minute",
                "errors: ! some 5xx, x some 4xx, · neither",
                "",
                "k1 (key)  search/query  calls 246, 4xx 3, 5xx 2, p99 max 180.5 ms",
                "  calls   ▁▂▁▁ ▃█▁▁▁    max 120 a minute",
                "  errors  ··!····x····",
                "          00:00  00:11",
                "",
                "portal (app)  search/query  calls 12, 4xx 1, 5xx 1, p99 max 950.0 ms",
                "  calls      ▄     █    max 8 a minute",
                "  errors  ···!········",
                "          00:00  00:11",
            ],
            "{text}"
        );
    }

    #[test]
    fn a_chart_of_more_than_120_minutes_folds_them() {
        // 180 minutes from 23:00 the day before: two minutes a character, 90 characters.
        let start = DEC - 3600;
        let mut rows: Vec<serde_json::Value> = (0..180)
            .map(|i| match i {
                100 => minute_row("k1", "key", start + 60 * i, 31, 0, 0, 12.0),
                101 => minute_row("k1", "key", start + 60 * i, 0, 0, 1, 400.0),
                151 => minute_row("k1", "key", start + 60 * i, 0, 1, 0, 12.0),
                _ => minute_row("k1", "key", start + 60 * i, 1, 0, 0, 12.0),
            })
            .collect();
        // Outside the range: counted in the totals, not drawn.
        rows.push(minute_row("k1", "key", start + 60 * 180, 5, 0, 0, 12.0));
        let v = serde_json::json!({
            "from": rfc3339(start), "to": rfc3339(start + 180 * 60), "by": "minute", "truncated": true, "rows": rows,
        });
        let text = chart(&v);
        let spark = format!("{}█{}", "▁".repeat(50), "▁".repeat(39));
        let errors = format!("{}!{}x{}", "·".repeat(50), "·".repeat(24), "·".repeat(14));
        let axis = format!("11-30 23:00{}12-01 01:58", " ".repeat(90 - 22));
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "usage from 2026-11-30T23:00:00Z to 2026-12-01T02:00:00Z, one character per 2 minutes",
                "errors: ! some 5xx, x some 4xx, · neither",
                "",
                "k1 (key)  search/query  calls 215, 4xx 1, 5xx 1, p99 max 400.0 ms",
                &format!("  calls   {spark}  max 32 per 2 minutes"),
                &format!("  errors  {errors}"),
                &format!("          {axis}"),
                "(the first 10000 rows: narrow the range or name a key)",
            ],
            "{text}"
        );
        assert_eq!(spark.chars().count(), 90);
        assert_eq!(errors.chars().count(), 90);
        assert_eq!(axis.len(), 90);
    }

    #[test]
    fn a_chart_says_when_there_is_nothing_to_draw() {
        let v = serde_json::json!({
            "from": "2026-12-01T00:00:00Z", "to": "2026-12-01T01:00:00Z", "by": "minute", "rows": [],
        });
        assert_eq!(
            chart(&v),
            "usage from 2026-12-01T00:00:00Z to 2026-12-01T01:00:00Z, one character a minute\n\
             (no calls in this range)\n"
        );
        let v = serde_json::json!({"error": "no"});
        assert_eq!(chart(&v), "usage from ? to ?: not a range of RFC 3339 times\n");
        // A range within one minute holds no minute's row.
        let v = serde_json::json!({
            "from": "2026-12-01T00:00:10Z", "to": "2026-12-01T00:00:50Z", "by": "minute",
            "rows": [minute_row("k1", "key", DEC, 1, 0, 0, 1.0)],
        });
        assert_eq!(chart(&v).lines().last(), Some("(the range holds no whole minute)"));
    }
}
