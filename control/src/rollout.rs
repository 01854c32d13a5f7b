//! Staged rollout of a snapshot: canary nodes, then 10 % of the fleet, then every node,
//! with a dwell at each stage. During a dwell the changed routes' 5xx rate and p99 on
//! nodes running the new version are compared with the same routes on nodes still
//! running the old one (or, once every node has it, with nothing: an absolute 5xx check);
//! a regression, or a node refusing the new version, reverts the change.
//!
//! This module is the decision logic only — which nodes are in a stage, how reports add
//! up, what counts as a regression; `serve` holds the state, delivers versions and
//! publishes the revert.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use postern_model::report::{LATENCY_BOUNDS_US, LATENCY_BUCKETS, RouteCounts};
use serde::Serialize;

/// How rollouts run.
#[derive(Debug, Clone)]
pub struct RolloutSettings {
    /// Time at each stage once its nodes run the new version; zero delivers every
    /// snapshot to every node at once.
    pub dwell: Duration,
    /// Nodes in the canary stage when no node declares itself a canary.
    pub canary_nodes: usize,
    /// Share of the fleet in the second stage.
    pub second_stage: f64,
    /// Responses a route needs on a side before its rate or p99 is compared.
    pub min_requests: u64,
    /// A route's 5xx rate on the new version may exceed the old one's by this much.
    pub max_5xx_increase: f64,
    /// A route's p99 on the new version may be this many times the old one's...
    pub p99_factor: f64,
    /// ...or this much slower, whichever is more.
    pub p99_slack: Duration,
}

impl Default for RolloutSettings {
    fn default() -> Self {
        RolloutSettings {
            dwell: Duration::from_secs(60),
            canary_nodes: 1,
            second_stage: 0.10,
            min_requests: 50,
            max_5xx_increase: 0.02,
            p99_factor: 2.0,
            p99_slack: Duration::from_millis(20),
        }
    }
}

/// Counts summed over a window.
#[derive(Debug, Clone, Default)]
pub struct Window {
    /// Responses.
    pub n: u64,
    /// 5xx responses.
    pub e5: u64,
    /// Responses per latency bucket.
    pub h: [u64; LATENCY_BUCKETS],
}

impl Window {
    /// Adds a report difference.
    pub fn add(&mut self, d: &RouteCounts) {
        self.n += d.n;
        self.e5 += d.e5;
        for (a, b) in self.h.iter_mut().zip(&d.h) {
            *a += b;
        }
    }

    /// Share of 5xx responses.
    pub fn rate_5xx(&self) -> f64 {
        if self.n == 0 { 0.0 } else { self.e5 as f64 / self.n as f64 }
    }

    /// The 99th percentile, interpolated within its bucket (the overflow bucket counts
    /// as twice the last bound).
    pub fn p99(&self) -> Duration {
        let total: u64 = self.h.iter().sum();
        if total == 0 {
            return Duration::ZERO;
        }
        let rank = (total as f64 * 0.99).ceil() as u64;
        let mut below = 0u64;
        for (i, &c) in self.h.iter().enumerate() {
            if below + c >= rank && c > 0 {
                let lo = if i == 0 { 0 } else { LATENCY_BOUNDS_US.get(i - 1).copied().unwrap_or(0) };
                let last = LATENCY_BOUNDS_US.last().copied().unwrap_or(0);
                let hi = LATENCY_BOUNDS_US.get(i).copied().unwrap_or(last * 2);
                let frac = (rank - below) as f64 / c as f64;
                return Duration::from_micros(lo + ((hi - lo) as f64 * frac) as u64);
            }
            below += c;
        }
        Duration::ZERO
    }
}

/// Where a rollout is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Waiting for the stage's nodes to run the new version.
    Delivering,
    /// Comparing.
    Dwelling,
}

/// A rollout in progress.
#[derive(Debug)]
pub struct Rollout {
    /// The version every node ran before.
    pub from: u64,
    /// The version being rolled out.
    pub to: u64,
    /// Who published it.
    pub who: String,
    /// Routes compared (added or changed, or using a changed cluster); empty: every route.
    pub routes: Vec<String>,
    /// Node counts of the stages, smallest first, the last being the whole fleet.
    pub stages: Vec<usize>,
    /// Index into `stages`.
    pub stage: usize,
    /// Nodes given the new version.
    pub members: BTreeSet<String>,
    /// Delivering or dwelling, and since when.
    pub phase: (Phase, Instant),
    /// Per route: old side, new side.
    pub windows: BTreeMap<String, [Window; 2]>,
}

/// What the caller must do after a tick.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Nothing changed.
    Wait,
    /// The stage's members changed: wake the nodes' long polls.
    Deliver,
    /// Every stage passed.
    Done,
    /// Publish the old contents again, for this reason.
    Revert(String),
}

/// A live node as a rollout sees it.
#[derive(Debug, Clone)]
pub struct NodeView {
    /// Its name.
    pub name: String,
    /// It asked to be a canary.
    pub canary: bool,
    /// The snapshot version it runs.
    pub running: u64,
    /// The version it last refused, and why.
    pub refused: Option<(u64, String)>,
}

/// Node counts of the stages for a fleet of `fleet` nodes with `canaries` declared
/// canaries; consecutive equal stages are one.
pub fn stages(fleet: usize, canaries: usize, s: &RolloutSettings) -> Vec<usize> {
    let fleet = fleet.max(1);
    let first = if canaries > 0 { canaries } else { s.canary_nodes.max(1) }.min(fleet);
    let second = ((fleet as f64 * s.second_stage).ceil() as usize).clamp(first, fleet);
    let mut out = vec![first, second, fleet];
    out.dedup();
    out
}

/// The first `count` nodes in stage order: declared canaries, then by name.
pub fn pick(nodes: &[NodeView], count: usize) -> BTreeSet<String> {
    let mut order: Vec<&NodeView> = nodes.iter().collect();
    order.sort_by(|a, b| b.canary.cmp(&a.canary).then_with(|| a.name.cmp(&b.name)));
    order.into_iter().take(count).map(|n| n.name.clone()).collect()
}

impl Rollout {
    /// Starts a rollout of `to` over `from` on the live `nodes`.
    pub fn start(from: u64, to: u64, who: &str, routes: Vec<String>, nodes: &[NodeView], s: &RolloutSettings) -> Self {
        let canaries = nodes.iter().filter(|n| n.canary).count();
        let stages = stages(nodes.len(), canaries, s);
        let members = pick(nodes, stages.first().copied().unwrap_or(1));
        Rollout {
            from,
            to,
            who: who.to_owned(),
            routes,
            stages,
            stage: 0,
            members,
            phase: (Phase::Delivering, Instant::now()),
            windows: BTreeMap::new(),
        }
    }

    /// The version node `name` should run.
    pub fn target(&self, name: &str) -> u64 {
        if self.members.contains(name) { self.to } else { self.from }
    }

    /// Whether route `id` is compared.
    pub fn watches(&self, id: &str) -> bool {
        self.routes.is_empty() || self.routes.iter().any(|r| r == id)
    }

    /// Adds one node's report difference for route `id`, made while it ran `version`.
    pub fn observe(&mut self, id: &str, version: u64, d: &RouteCounts) {
        if self.phase.0 != Phase::Dwelling || !self.watches(id) {
            return;
        }
        let side = if version == self.to {
            1
        } else if version == self.from {
            0
        } else {
            return;
        };
        if let Some(w) = self.windows.entry(id.to_owned()).or_default().get_mut(side) {
            w.add(d);
        }
    }

    /// The first regression among the compared routes, as a sentence.
    pub fn regression(&self, s: &RolloutSettings) -> Option<String> {
        for (id, [old, new]) in &self.windows {
            if new.n < s.min_requests {
                continue;
            }
            let base = if old.n >= s.min_requests { old.rate_5xx() } else { 0.0 };
            if new.rate_5xx() - base > s.max_5xx_increase {
                return Some(format!(
                    "route {id}: 5xx {:.1} % on v{} ({} responses) against {:.1} % on v{} ({} responses)",
                    new.rate_5xx() * 100.0,
                    self.to,
                    new.n,
                    old.rate_5xx() * 100.0,
                    self.from,
                    old.n
                ));
            }
            if old.n >= s.min_requests {
                let (p_new, p_old) = (new.p99(), old.p99());
                let allowed = p_old.mul_f64(s.p99_factor).max(p_old + s.p99_slack);
                if p_new > allowed {
                    return Some(format!(
                        "route {id}: p99 {} ms on v{} against {} ms on v{}",
                        p_new.as_millis(),
                        self.to,
                        p_old.as_millis(),
                        self.from
                    ));
                }
            }
        }
        None
    }

    /// Moves the rollout on, given the live nodes now.
    pub fn tick(&mut self, nodes: &[NodeView], s: &RolloutSettings) -> Step {
        if let Some((n, why)) = nodes
            .iter()
            .filter(|n| self.members.contains(&n.name))
            .find_map(|n| n.refused.as_ref().filter(|(v, _)| *v == self.to).map(|(_, why)| (n, why)))
        {
            return Step::Revert(format!("node {} refused v{}: {why}", n.name, self.to));
        }
        // Members that left the fleet are dropped; at the last stage, nodes that joined
        // are added.
        let live: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        let before = self.members.len();
        self.members.retain(|m| live.contains(m.as_str()));
        let last = self.stage + 1 >= self.stages.len();
        if last {
            self.members.extend(nodes.iter().map(|n| n.name.clone()));
        }
        let mut step = if self.members.len() != before { Step::Deliver } else { Step::Wait };
        if self.members.is_empty() {
            // Every member left: pick the stage again from who is here.
            let want = self.stages.get(self.stage).copied().unwrap_or(1);
            self.members = pick(nodes, want);
            self.phase = (Phase::Delivering, Instant::now());
            return Step::Deliver;
        }
        match self.phase.0 {
            Phase::Delivering => {
                let arrived = nodes.iter().filter(|n| self.members.contains(&n.name)).all(|n| n.running == self.to);
                if arrived {
                    self.phase = (Phase::Dwelling, Instant::now());
                    self.windows.clear();
                }
            }
            Phase::Dwelling => {
                if let Some(why) = self.regression(s) {
                    return Step::Revert(why);
                }
                if self.phase.1.elapsed() >= s.dwell {
                    if last {
                        return Step::Done;
                    }
                    self.stage += 1;
                    let want = self.stages.get(self.stage).copied().unwrap_or(nodes.len());
                    let more = pick(nodes, nodes.len());
                    // Keep the current members and add the next ones in stage order.
                    for n in more {
                        if self.members.len() >= want {
                            break;
                        }
                        self.members.insert(n);
                    }
                    self.phase = (Phase::Delivering, Instant::now());
                    step = Step::Deliver;
                }
            }
        }
        step
    }

    /// A summary for `status`.
    pub fn describe(&self) -> serde_json::Value {
        let stage_name = match (self.stage, self.stages.len()) {
            (i, n) if i + 1 == n => "all".to_owned(),
            (0, _) => "canary".to_owned(),
            _ => "second".to_owned(),
        };
        let windows: BTreeMap<&String, serde_json::Value> = self
            .windows
            .iter()
            .map(|(id, [old, new])| {
                (
                    id,
                    serde_json::json!({
                        "old": {"responses": old.n, "rate_5xx": old.rate_5xx(), "p99_ms": old.p99().as_secs_f64() * 1e3},
                        "new": {"responses": new.n, "rate_5xx": new.rate_5xx(), "p99_ms": new.p99().as_secs_f64() * 1e3},
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "from": self.from,
            "to": self.to,
            "by": self.who,
            "stage": stage_name,
            "stage_nodes": self.stages,
            "members": self.members,
            "phase": self.phase.0,
            "phase_s": self.phase.1.elapsed().as_secs_f64(),
            "routes": self.routes,
            "compared": windows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize, running: u64) -> Vec<NodeView> {
        (0..n).map(|i| NodeView { name: format!("n{i:02}"), canary: false, running, refused: None }).collect()
    }

    fn counts(n: u64, e5: u64, bucket: usize) -> RouteCounts {
        let mut h = vec![0; LATENCY_BUCKETS];
        h[bucket] = n;
        RouteCounts { n, e5, h }
    }

    #[test]
    fn stages_grow_from_canary_to_the_whole_fleet() {
        let s = RolloutSettings::default();
        assert_eq!(stages(3, 0, &s), vec![1, 3]);
        assert_eq!(stages(16, 0, &s), vec![1, 2, 16]);
        assert_eq!(stages(100, 0, &s), vec![1, 10, 100]);
        assert_eq!(stages(100, 3, &s), vec![3, 10, 100]);
        assert_eq!(stages(1, 0, &s), vec![1]);
        let mut fleet = nodes(4, 1);
        fleet[2].canary = true;
        assert_eq!(pick(&fleet, 2), BTreeSet::from(["n02".to_owned(), "n00".to_owned()]));
    }

    #[test]
    fn a_clean_rollout_walks_every_stage() {
        let s = RolloutSettings { dwell: Duration::ZERO, ..RolloutSettings::default() };
        let mut fleet = nodes(16, 1);
        let mut r = Rollout::start(1, 2, "alice", vec!["a".into()], &fleet, &s);
        assert_eq!(r.members.len(), 1);
        assert_eq!(r.target("n00"), 2);
        assert_eq!(r.target("n01"), 1);
        let mut seen = Vec::new();
        for _ in 0..20 {
            for n in &mut fleet {
                n.running = r.target(&n.name);
            }
            match r.tick(&fleet, &s) {
                Step::Done => break,
                Step::Revert(why) => panic!("reverted: {why}"),
                _ => seen.push(r.members.len()),
            }
        }
        seen.dedup();
        assert_eq!(seen, vec![1, 2, 16]);
    }

    #[test]
    fn more_5xx_on_the_new_version_reverts() {
        let s = RolloutSettings { dwell: Duration::from_secs(600), min_requests: 20, ..RolloutSettings::default() };
        let mut fleet = nodes(3, 1);
        let mut r = Rollout::start(1, 2, "alice", vec!["a".into()], &fleet, &s);
        fleet[0].running = 2;
        assert_eq!(r.tick(&fleet, &s), Step::Wait);
        assert_eq!(r.phase.0, Phase::Dwelling);
        r.observe("a", 1, &counts(100, 1, 2));
        r.observe("a", 2, &counts(10, 5, 2));
        // Too few responses on the new side to judge.
        assert_eq!(r.tick(&fleet, &s), Step::Wait);
        // Other routes are not compared.
        r.observe("b", 2, &counts(100, 100, 2));
        assert_eq!(r.tick(&fleet, &s), Step::Wait);
        r.observe("a", 2, &counts(30, 10, 2));
        match r.tick(&fleet, &s) {
            Step::Revert(why) => assert!(why.starts_with("route a: 5xx 37.5 % on v2"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_slower_p99_reverts_and_a_similar_one_does_not() {
        let s = RolloutSettings { dwell: Duration::from_secs(600), min_requests: 20, ..RolloutSettings::default() };
        let mut fleet = nodes(3, 1);
        let mut r = Rollout::start(1, 2, "alice", Vec::new(), &fleet, &s);
        fleet[0].running = 2;
        r.tick(&fleet, &s);
        r.observe("a", 1, &counts(100, 0, 4)); // 500 µs – 1 ms
        r.observe("a", 2, &counts(100, 0, 5)); // 1 – 2.5 ms: slower, within the slack
        assert_eq!(r.tick(&fleet, &s), Step::Wait);
        r.observe("a", 2, &counts(100, 0, 10)); // 50 – 100 ms
        match r.tick(&fleet, &s) {
            Step::Revert(why) => assert!(why.contains("p99"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refusing_member_reverts() {
        let s = RolloutSettings::default();
        let mut fleet = nodes(3, 1);
        let mut r = Rollout::start(1, 2, "alice", Vec::new(), &fleet, &s);
        fleet[0].refused = Some((2, "bad module".into()));
        assert!(matches!(r.tick(&fleet, &s), Step::Revert(why) if why.contains("bad module")));
    }

    #[test]
    fn p99_is_interpolated_inside_its_bucket() {
        let mut w = Window::default();
        w.add(&counts(99, 0, 0));
        w.add(&counts(1, 0, 8)); // 10–25 ms
        assert_eq!(w.p99(), Duration::from_micros(50));
        w.add(&counts(10, 0, 8));
        assert!(w.p99() > Duration::from_millis(10) && w.p99() <= Duration::from_millis(25), "{:?}", w.p99());
    }
}
