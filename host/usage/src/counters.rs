//! The node's own count of each billing period (a UTC month): per (kind, caller,
//! product), calls by status class, counted from every window as it is spooled, so the
//! reconciler can compare what the usage store applied with what the node answered.
//!
//! Kept in `counters.json` beside the spool, written whole and renamed before the
//! windows it counted can be shipped (the spool's lock is held across both), with
//! `through`, the last number counted. At start the spool's records past `through` are
//! counted again, so a crash neither misses nor double-counts a window. A period is
//! complete once every window before its end is spooled; it is then reported once (again
//! when the store later asks for windows the spool no longer holds).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use postern_model::usage::{CallerKind, CounterRow, MAX_UNAVAILABLE, NodeCounters, Window, month_period};
use serde::{Deserialize, Serialize};

/// Periods kept at most (the oldest go first).
const KEEP_PERIODS: usize = 4;

type Key = (CallerKind, String, String);

/// One period's counts.
#[derive(Debug, Clone, Default)]
struct Period {
    /// The last number spooled once the period was complete on this node.
    complete: Option<u64>,
    /// The report of it as now was taken by the control plane.
    reported: bool,
    rows: BTreeMap<Key, [u64; 5]>,
}

impl Period {
    fn counter_rows(&self) -> Vec<CounterRow> {
        self.rows
            .iter()
            .map(|((kind, caller, product), status)| CounterRow {
                kind: *kind,
                caller: caller.clone(),
                product: product.clone(),
                status: *status,
            })
            .collect()
    }
}

/// `counters.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    through: u64,
    #[serde(default)]
    unavailable: Vec<(u64, u64)>,
    #[serde(default)]
    periods: Vec<FilePeriod>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePeriod {
    period: String,
    #[serde(default)]
    complete: Option<u64>,
    #[serde(default)]
    reported: bool,
    rows: Vec<CounterRow>,
}

/// The node's per-period counters.
#[derive(Debug)]
pub struct Counters {
    path: PathBuf,
    node: String,
    /// The last window number counted.
    through: u64,
    /// By period name (`YYYY-MM` sorts in time order).
    periods: BTreeMap<String, Period>,
    unavailable: Vec<(u64, u64)>,
    /// Changed since the last save.
    dirty: bool,
}

impl Counters {
    /// Reads `counters.json` in `dir`; a file that cannot be read as counters (it is
    /// written whole and renamed, so it is not torn) is kept as `counters.json.bad` and
    /// counting starts over from what the spool still holds.
    pub fn load(dir: &Path, node: &str) -> std::io::Result<Counters> {
        let path = dir.join("counters.json");
        let mut c = Counters {
            path: path.clone(),
            node: node.to_owned(),
            through: 0,
            periods: BTreeMap::new(),
            unavailable: Vec::new(),
            dirty: false,
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(c),
            Err(e) => return Err(e),
        };
        let file: File = match serde_json::from_slice(&bytes) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "usage counters unreadable, kept as counters.json.bad; counting again from the spool");
                std::fs::rename(&path, path.with_extension("json.bad"))?;
                return Ok(c);
            }
        };
        c.through = file.through;
        c.unavailable = file.unavailable;
        for p in file.periods {
            let rows = p.rows.into_iter().map(|r| ((r.kind, r.caller, r.product), r.status)).collect();
            c.periods.insert(p.period, Period { complete: p.complete, reported: p.reported, rows });
        }
        Ok(c)
    }

    /// The last window number counted.
    pub fn through(&self) -> u64 {
        self.through
    }

    /// Counts a spooled window, once: a number at or below [`Counters::through`] was
    /// counted before.
    pub fn count(&mut self, w: &Window) {
        if w.seq <= self.through {
            return;
        }
        self.through = w.seq;
        self.dirty = true;
        if w.rows.is_empty() {
            return;
        }
        let (name, _, _) = month_period(w.start);
        let period = self.periods.entry(name).or_default();
        if period.complete.take().is_some() {
            // Not expected (a period completes once nothing before its end is left to
            // spool), but if it happens the report must include this window.
            tracing::warn!(
                seq = w.seq,
                start = w.start,
                "usage window of a period already complete: it is reported again"
            );
            period.reported = false;
        }
        for r in &w.rows {
            let counts = period.rows.entry((r.kind, r.caller.clone(), r.product.clone())).or_default();
            for (c, n) in counts.iter_mut().zip(r.status) {
                *c = c.saturating_add(n);
            }
        }
        while self.periods.len() > KEEP_PERIODS {
            if let Some((name, p)) = self.periods.pop_first()
                && !p.reported
            {
                tracing::warn!(period = %name, "usage counters of an old period dropped before the control plane took them");
            }
        }
    }

    /// Marks complete every period that ends at or before Unix second `t`: call when
    /// every window before `t` is spooled.
    pub fn complete_before(&mut self, t: u64) {
        for (name, p) in &mut self.periods {
            let ended = postern_model::usage::parse_month(name).is_some_and(|(_, end)| end <= t);
            if ended && p.complete.is_none() {
                p.complete = Some(self.through);
                p.reported = false;
                self.dirty = true;
                tracing::info!(period = %name, through = self.through, "usage period complete on this node");
            }
        }
    }

    /// Records that numbers `from..=to` were asked for again and are no longer in the
    /// spool: every complete period is reported again with the run.
    pub fn unavailable(&mut self, from: u64, to: u64) {
        if self.unavailable.iter().any(|&(f, t)| f <= from && to <= t) {
            return;
        }
        self.unavailable.push((from, to));
        self.unavailable.sort_unstable();
        if self.unavailable.len() > MAX_UNAVAILABLE {
            self.unavailable.remove(0);
        }
        for p in self.periods.values_mut() {
            p.reported = false;
        }
        self.dirty = true;
    }

    fn report_of(&self, name: &str, p: &Period) -> Option<NodeCounters> {
        Some(NodeCounters {
            node: self.node.clone(),
            period: name.to_owned(),
            through: p.complete?,
            rows: p.counter_rows(),
            unavailable: self.unavailable.clone(),
        })
    }

    /// Reports of complete periods the control plane has not taken yet.
    pub fn due(&self) -> Vec<NodeCounters> {
        self.periods.iter().filter(|(_, p)| !p.reported).filter_map(|(name, p)| self.report_of(name, p)).collect()
    }

    /// Records that the control plane took `sent`; a period that changed since stays due.
    pub fn reported(&mut self, sent: &NodeCounters) {
        let same = self.periods.get(&sent.period).and_then(|p| self.report_of(&sent.period, p)).as_ref() == Some(sent);
        if let Some(p) = self.periods.get_mut(&sent.period).filter(|_| same) {
            p.reported = true;
            self.dirty = true;
        }
    }

    /// Writes `counters.json` if anything changed (whole, synced, renamed).
    pub fn save(&mut self) -> Result<(), postern_model::disk::DiskError> {
        if !self.dirty {
            return Ok(());
        }
        let file = File {
            through: self.through,
            unavailable: self.unavailable.clone(),
            periods: self
                .periods
                .iter()
                .map(|(name, p)| FilePeriod {
                    period: name.clone(),
                    complete: p.complete,
                    reported: p.reported,
                    rows: p.counter_rows(),
                })
                .collect(),
        };
        let bytes = serde_json::to_vec(&file).unwrap_or_default();
        postern_model::disk::write_atomic(&self.path, &bytes)?;
        self.dirty = false;
        Ok(())
    }

    /// For `/readyz`: the last number counted and each period's calls and state.
    pub fn state(&self) -> serde_json::Value {
        let periods: Vec<serde_json::Value> = self
            .periods
            .iter()
            .map(|(name, p)| {
                serde_json::json!({
                    "period": name,
                    "calls": p.rows.values().flatten().fold(0u64, |a, &n| a.saturating_add(n)),
                    "complete": p.complete.is_some(),
                    "reported": p.reported,
                })
            })
            .collect();
        serde_json::json!({ "through": self.through, "periods": periods, "unavailable": self.unavailable.len() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postern_model::usage::{LATENCY_BUCKETS, Row};

    /// 2026-12-01T00:00:00Z.
    const DEC: u64 = 1_796_083_200;

    fn window(seq: u64, start: u64, caller: &str, ok: u64) -> Window {
        let mut latency = vec![0; LATENCY_BUCKETS];
        latency[0] = ok;
        let row = Row {
            caller: caller.into(),
            kind: CallerKind::Key,
            product: "search".into(),
            route: "t/r".into(),
            status: [0, ok, 0, 0, 0],
            latency,
            latency_us: 0,
        };
        Window::new("n".into(), seq, start, false, vec![row])
    }

    #[test]
    fn each_number_counts_once_and_a_period_is_due_once_complete() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Counters::load(dir.path(), "n").unwrap();
        c.count(&window(1, DEC - 20, "a", 2));
        c.count(&window(2, DEC - 10, "b", 3));
        c.count(&window(2, DEC - 10, "b", 3));
        c.count(&window(3, DEC, "a", 1));
        assert_eq!(c.through(), 3);
        assert!(c.due().is_empty(), "nothing is complete yet");
        c.complete_before(DEC);
        let due = c.due();
        assert_eq!(due.len(), 1, "{due:?}");
        let nov = &due[0];
        assert_eq!((nov.period.as_str(), nov.through, nov.calls()), ("2026-11", 3, 5));
        assert_eq!(nov.rows.iter().map(|r| r.caller.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(nov.check(), Ok(()));
        c.reported(nov);
        assert!(c.due().is_empty());
        // A run the store asked for that the spool no longer holds: reported again.
        c.unavailable(2, 2);
        let again = c.due();
        assert_eq!((again.len(), again[0].unavailable.clone()), (1, vec![(2, 2)]));
        // A report taken before the change does not clear the changed one.
        c.reported(nov);
        assert_eq!(c.due().len(), 1);
    }

    #[test]
    fn counters_survive_a_restart_and_a_torn_file_is_kept_aside() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Counters::load(dir.path(), "n").unwrap();
        c.count(&window(1, DEC - 20, "a", 2));
        c.complete_before(DEC);
        c.save().unwrap();
        let mut again = Counters::load(dir.path(), "n").unwrap();
        assert_eq!((again.through(), again.due().len()), (1, 1));
        again.count(&window(1, DEC - 20, "a", 2));
        assert_eq!(again.due()[0].calls(), 2, "a number counted before a restart is not counted again");
        std::fs::write(dir.path().join("counters.json"), b"{\"through\": 3, ").unwrap();
        let fresh = Counters::load(dir.path(), "n").unwrap();
        assert_eq!(fresh.through(), 0);
        assert!(dir.path().join("counters.json.bad").exists());
    }

    #[test]
    fn only_the_last_periods_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Counters::load(dir.path(), "n").unwrap();
        let mut t = DEC;
        for seq in 1..=6 {
            c.count(&window(seq, t, "a", 1));
            t += 32 * 86_400;
        }
        assert_eq!(c.periods.len(), KEEP_PERIODS);
        assert_eq!(c.periods.keys().next().map(String::as_str), Some("2027-02"));
    }
}
