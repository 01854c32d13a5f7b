//! `posternctl plan`: what a change does before it is published — routes added, changed
//! and removed per team, and platform changes (clusters, plans), against the snapshot
//! running now.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use postern_model::Snapshot;

/// What happens to one route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    /// New.
    Added,
    /// Different.
    Changed,
    /// Gone.
    Removed,
}

impl Change {
    fn sign(self) -> char {
        match self {
            Change::Added => '+',
            Change::Changed => '~',
            Change::Removed => '-',
        }
    }
}

/// What a change does: changes by owner (`platform`, or a team) then id.
pub type Diff = BTreeMap<String, Vec<(Change, String)>>;

fn diff_maps<T: PartialEq>(
    out: &mut Diff,
    owner: impl Fn(&str) -> String,
    old: &BTreeMap<String, &T>,
    new: &BTreeMap<String, &T>,
) {
    for (id, n) in new {
        match old.get(id) {
            None => out.entry(owner(id)).or_default().push((Change::Added, id.clone())),
            Some(o) if *o != *n => out.entry(owner(id)).or_default().push((Change::Changed, id.clone())),
            Some(_) => {}
        }
    }
    for id in old.keys().filter(|id| !new.contains_key(*id)) {
        out.entry(owner(id)).or_default().push((Change::Removed, id.clone()));
    }
}

fn routes(s: &Snapshot) -> BTreeMap<String, &postern_model::Route> {
    s.routes.iter().map(|r| (r.id.clone(), r)).collect()
}

fn named<'a, T>(kind: &str, m: &'a BTreeMap<String, T>) -> BTreeMap<String, &'a T> {
    m.iter().map(|(k, v)| (format!("{kind} {k}"), v)).collect()
}

/// The changes from `old` to `new`.
pub fn diff(old: &Snapshot, new: &Snapshot) -> Diff {
    let mut out = Diff::new();
    let teams: BTreeMap<String, String> =
        old.routes.iter().chain(&new.routes).map(|r| (r.id.clone(), r.team.clone())).collect();
    diff_maps(&mut out, |id| teams.get(id).cloned().unwrap_or_default(), &routes(old), &routes(new));
    let platform = |_: &str| "platform".to_owned();
    diff_maps(&mut out, platform, &named("cluster", &old.clusters), &named("cluster", &new.clusters));
    diff_maps(&mut out, platform, &named("plan", &old.plans), &named("plan", &new.plans));
    for changes in out.values_mut() {
        changes.sort();
    }
    out
}

/// The routes a staged rollout compares: routes added or changed, and routes of the new
/// snapshot sending to a cluster that changed. Empty when only plans changed, which
/// means every route.
pub fn changed_routes(old: &Snapshot, new: &Snapshot) -> Vec<String> {
    let old_routes = routes(old);
    let changed_cluster = |c: &str| old.clusters.get(c) != new.clusters.get(c);
    let mut out: Vec<String> = new
        .routes
        .iter()
        .filter(|r| {
            old_routes.get(&r.id).is_none_or(|o| **o != **r) || r.backends.iter().any(|b| changed_cluster(&b.cluster))
        })
        .map(|r| r.id.clone())
        .collect();
    out.sort();
    out
}

/// The plan as text: one block per owner, one line per change.
pub fn render(plan: &Diff) -> String {
    if plan.is_empty() {
        return "no changes\n".to_owned();
    }
    let mut s = String::new();
    for (owner, changes) in plan {
        let _ = writeln!(s, "{owner}:");
        for (c, id) in changes {
            let _ = writeln!(s, "  {} {id}", c.sign());
        }
    }
    let count = |k: Change| plan.values().flatten().filter(|(c, _)| *c == k).count();
    let _ = writeln!(
        s,
        "{} added, {} changed, {} removed",
        count(Change::Added),
        count(Change::Changed),
        count(Change::Removed)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &std::path::Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap_or(root)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(p, text).unwrap_or_else(|e| panic!("{e}"));
    }

    fn route(name: &str, path: &str, response: &str) -> String {
        format!(
            "  - name: {name}\n    public: true\n    match: {{ path: {{ value: {path} }} }}\n    backendRefs: [{{ name: a }}]\n    timeouts: {{ connect: 1s, response: {response} }}\n"
        )
    }

    fn compiled(root: &std::path::Path) -> Snapshot {
        crate::compile::compile(root).unwrap_or_else(|e| panic!("{e}")).snapshot
    }

    #[test]
    fn a_plan_names_each_teams_added_changed_and_removed_routes_and_platform_changes() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = dir.path();
        write(root, "platform/clusters.yaml", "clusters:\n  a:\n    endpoints: [\"127.0.0.1:9\"]\n");
        write(
            root,
            "platform/ownership.yaml",
            "owners:\n  - { host: \"*\", pathPrefix: /o, team: orders }\n  - { host: \"*\", pathPrefix: /s, team: search }\n",
        );
        write(
            root,
            "teams/orders/routes.yaml",
            &format!("routes:\n{}{}", route("get", "/o/get", "2s"), route("old", "/o/old", "2s")),
        );
        write(root, "teams/search/routes.yaml", &format!("routes:\n{}", route("q", "/s/q", "2s")));
        let before = compiled(root);
        assert_eq!(render(&diff(&before, &before)), "no changes\n");

        write(
            root,
            "teams/orders/routes.yaml",
            &format!("routes:\n{}{}", route("get", "/o/get", "3s"), route("new", "/o/new", "2s")),
        );
        write(
            root,
            "platform/clusters.yaml",
            "clusters:\n  a:\n    endpoints: [\"127.0.0.1:9\"]\n  b:\n    endpoints: [\"127.0.0.1:10\"]\n",
        );
        let after = compiled(root);
        let text = render(&diff(&before, &after));
        assert_eq!(
            text,
            "orders:\n  + orders/new\n  ~ orders/get\n  - orders/old\nplatform:\n  + cluster b\n2 added, 1 changed, 1 removed\n",
            "{text}"
        );
        assert_eq!(changed_routes(&before, &after), vec!["orders/get".to_owned(), "orders/new".to_owned()]);
        // A cluster's endpoints changing puts every route sending to it under watch.
        write(
            root,
            "platform/clusters.yaml",
            "clusters:\n  a:\n    endpoints: [\"127.0.0.1:11\"]\n  b:\n    endpoints: [\"127.0.0.1:10\"]\n",
        );
        let moved = compiled(root);
        assert_eq!(
            changed_routes(&after, &moved),
            vec!["orders/get".to_owned(), "orders/new".to_owned(), "search/q".to_owned()]
        );
    }
}
