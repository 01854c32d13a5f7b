//! A filter module checked as the platform reviews it, and its approval: `posternctl
//! filter build` (build the crate for wasm32-wasip2, then review it) and `posternctl
//! filter approve` (review, then record the approval in the platform's
//! `platform/filters.yaml`).
//!
//! A review loads the component in the gateway's runtime (which refuses a module built
//! for another world or importing anything not granted), checks its size and its
//! manifest's limits against the platform maxima, and runs each of the manifest's
//! sample cases in the sandbox under those limits: its decision, and per call its fuel
//! and memory high-water mark against the limits, with what it logged.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use postern_model::wasm::Limits;
use postern_wasm::{Runtime, RuntimeConfig};

use crate::config::{ApprovedDoc, FilterManifestDoc, ReviewDoc};
use crate::filter_cost::thousands;

/// One sample case run in the sandbox.
#[derive(Debug, Clone)]
pub struct SampleRun {
    /// The case's name.
    pub name: String,
    /// Why its decision is not the one expected, if it is not.
    pub mismatch: Option<String>,
    /// The most fuel one of its calls (phases) burned.
    pub fuel: u64,
    /// The highest memory high-water mark of its calls, in bytes.
    pub memory: u64,
    /// The report of every phase ([`crate::filter_run::run`]).
    pub report: serde_json::Value,
}

/// What a review found.
#[derive(Debug, Clone)]
pub struct Review {
    /// The filter's name (its manifest's file name).
    pub filter: String,
    /// The manifest.
    pub manifest: PathBuf,
    /// The component.
    pub module: PathBuf,
    /// `sha256:<hex>` of the component.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
    /// What it imports (empty when the runtime refused it).
    pub imports: Vec<String>,
    /// The manifest's limits.
    pub limits: Limits,
    /// Its sample cases, run.
    pub samples: Vec<SampleRun>,
    /// What refuses it: each a sentence.
    pub problems: Vec<String>,
    /// What a reviewer should know but does not refuse it.
    pub warnings: Vec<String>,
}

/// The manifest of a module: `path` itself if it is one (`.yaml`), else the `.yaml`
/// beside the module whose `module:` names it.
pub fn manifest_of(path: &Path) -> anyhow::Result<(PathBuf, FilterManifestDoc)> {
    let read = |p: &Path| -> anyhow::Result<FilterManifestDoc> {
        let text = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?;
        serde_yaml_ng::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
    };
    if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
        return Ok((path.to_path_buf(), read(path)?));
    }
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or_default();
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "yaml")
            && let Ok(doc) = read(&p)
            && doc.module == file
        {
            found.push((p, doc));
        }
    }
    anyhow::ensure!(
        found.len() == 1,
        "{} manifests beside {} name it (`module: {file}`); give the manifest (.yaml) instead",
        found.len(),
        path.display()
    );
    Ok(found.remove(0))
}

/// Reviews the module a manifest names (relative to the manifest).
pub fn review(manifest_path: &Path, manifest: &FilterManifestDoc) -> anyhow::Result<Review> {
    let filter = manifest_path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_owned();
    let module = manifest_path.parent().unwrap_or(Path::new(".")).join(&manifest.module);
    let bytes = postern_model::disk::read_untrusted(&module, postern_model::disk::MODULE_FILE_CAP)
        .map_err(|e| anyhow::anyhow!("cannot read {} (at most {} MiB): {e}", module.display(), 32))?;
    let mut r = Review {
        filter,
        manifest: manifest_path.to_path_buf(),
        module,
        digest: postern_model::content_hash(&bytes),
        size: bytes.len() as u64,
        imports: Vec::new(),
        limits: manifest.limits,
        samples: Vec::new(),
        problems: Vec::new(),
        warnings: Vec::new(),
    };
    let over = manifest.limits.over(&Limits::MAXIMA);
    if !over.is_empty() {
        r.problems.push(format!("limits over the platform maxima: {}", over.join("; ")));
    }
    let runtime = Runtime::new(&RuntimeConfig { max_instances: 4, ..Default::default() })?;
    let m = match runtime.load(&bytes, None) {
        Ok(m) => m,
        Err(e) => {
            r.problems.push(format!("the runtime refuses it: {e}"));
            return Ok(r);
        }
    };
    r.imports = m.imports.clone();
    if manifest.samples.is_empty() {
        r.warnings.push("the manifest has no samples: nothing shows what it does, or what it costs".to_owned());
    }
    let paths = postern_model::path::PathPolicy::default();
    for case in &manifest.samples {
        let req = crate::filter_run::sample_request(case);
        let report = crate::filter_run::run_loaded(&runtime, &m, &case.config, manifest.limits, &req, &paths)?;
        let phases = report["phases"].as_array().cloned().unwrap_or_default();
        let most = |key: &str| phases.iter().filter_map(|p| p[key].as_u64()).max().unwrap_or(0);
        let run = SampleRun {
            name: case.name.clone(),
            mismatch: crate::filter_run::sample_mismatch(&case.expect, &report),
            fuel: most("fuel"),
            memory: most("memory_bytes"),
            report,
        };
        if let Some(why) = &run.mismatch {
            r.problems.push(format!("sample {:?}: {why}", run.name));
        }
        r.warnings.extend(headroom(&run, &manifest.limits));
        r.samples.push(run);
    }
    Ok(r)
}

/// What a reviewer should know of a sample's cost: little headroom under the limits, or
/// calls longer than a worker's slice (which then run on the idle pool, at the lowest
/// priority, after a first try stopped at the slice).
fn headroom(s: &SampleRun, limits: &Limits) -> Vec<String> {
    let mut out = Vec::new();
    if s.fuel > limits.fuel / 2 {
        out.push(format!(
            "sample {:?} burns {} of its {} fuel",
            s.name,
            share(s.fuel, limits.fuel),
            thousands(limits.fuel)
        ));
    }
    if s.memory > limits.memory_bytes / 2 {
        out.push(format!("sample {:?} uses {} of its memory limit", s.name, share(s.memory, limits.memory_bytes)));
    }
    if s.fuel > postern_wasm::runtime::SLICE_FUEL {
        out.push(format!(
            "sample {:?} burns more than a worker's slice ({} fuel): such calls run again on the idle pool, at the \
             lowest priority",
            s.name,
            thousands(postern_wasm::runtime::SLICE_FUEL)
        ));
    }
    out
}

/// `part` as a share of `whole`: `0.2 %`.
fn share(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".to_owned();
    }
    format!("{:.1} %", part as f64 * 100.0 / whole as f64)
}

/// The review as people read it: the module, what it imports, and each sample's decision
/// and cost against the limits.
pub fn summary(r: &Review) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "filter {} ({})", r.filter, r.manifest.display());
    let _ = writeln!(out, "  module   {} ({} bytes, {:.1} KiB)", r.module.display(), r.size, r.size as f64 / 1024.0);
    let _ = writeln!(out, "  digest   {}", r.digest);
    let imports = if r.imports.is_empty() { "-".to_owned() } else { r.imports.join(", ") };
    let _ = writeln!(out, "  imports  {imports}");
    let l = &r.limits;
    let _ = writeln!(
        out,
        "  limits   fuel {}, memory {} KiB, deadline {} ms, {} host calls",
        thousands(l.fuel),
        l.memory_bytes / 1024,
        l.deadline_ms,
        l.host_calls
    );
    if !r.samples.is_empty() {
        let _ = writeln!(out, "  samples  ({} in the sandbox, under these limits)", r.samples.len());
    }
    for s in &r.samples {
        let verdict = match &s.mismatch {
            None => "ok".to_owned(),
            Some(why) => format!("FAILED: {why}"),
        };
        let last = s.report["phases"].as_array().and_then(|p| p.last()).cloned().unwrap_or_default();
        let decision = match last["decision"].as_str() {
            Some("respond") => format!("respond {}", last["status"]),
            Some("failed") => format!("failed ({})", last["outcome"].as_str().unwrap_or("?")),
            Some(d) => d.to_owned(),
            None => "-".to_owned(),
        };
        let _ = writeln!(out, "    {:?}: {verdict}: {decision}", s.name);
        let _ = writeln!(
            out,
            "      fuel {} ({} of the limit), memory {} KiB ({})",
            thousands(s.fuel),
            share(s.fuel, l.fuel),
            s.memory / 1024,
            share(s.memory, l.memory_bytes)
        );
        for phase in s.report["phases"].as_array().into_iter().flatten() {
            for log in phase["logs"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    out,
                    "      log {} {}",
                    log["level"].as_str().unwrap_or("?"),
                    log["message"].as_str().unwrap_or_default()
                );
            }
        }
    }
    for w in &r.warnings {
        let _ = writeln!(out, "  warning  {w}");
    }
    if r.problems.is_empty() {
        let _ = writeln!(out, "  verdict  ok");
    } else {
        let _ = writeln!(out, "  verdict  refused:");
        for p in &r.problems {
            let _ = writeln!(out, "    - {p}");
        }
    }
    out
}

/// Builds the filter crate in `dir` for wasm32-wasip2 (release, from `dir` so that its
/// `.cargo/config.toml` applies) and copies the component beside its manifest, as the
/// manifest names it; returns the manifest's path and the manifest.
pub fn build(dir: &Path) -> anyhow::Result<(PathBuf, FilterManifestDoc)> {
    let cargo_toml = dir.join("Cargo.toml");
    anyhow::ensure!(
        cargo_toml.exists(),
        "{}: no Cargo.toml (give the filter crate's folder with --dir)",
        dir.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2", "--message-format", "json-render-diagnostics"])
        .current_dir(dir)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run cargo: {e}"))?;
    anyhow::ensure!(out.status.success(), "cargo build failed ({})", out.status);
    // The cdylib's `.wasm`, from cargo's own account of what it built.
    let mut built = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "cdylib"))
        {
            built = msg["filenames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str())
                .find(|f| f.ends_with(".wasm"))
                .map(PathBuf::from);
        }
    }
    let built = built.ok_or_else(|| anyhow::anyhow!("cargo built no .wasm component (is crate-type cdylib?)"))?;
    let manifests: Vec<(PathBuf, FilterManifestDoc)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter_map(|p| manifest_of(&p).ok())
        .collect();
    let [(manifest_path, manifest)] = <[_; 1]>::try_from(manifests).map_err(|found: Vec<_>| {
        anyhow::anyhow!("{} filter manifests (.yaml) in {}: keep one beside Cargo.toml", found.len(), dir.display())
    })?;
    let dest = dir.join(&manifest.module);
    std::fs::copy(&built, &dest)
        .map_err(|e| anyhow::anyhow!("cannot copy {} to {}: {e}", built.display(), dest.display()))?;
    Ok((manifest_path, manifest))
}

/// Where a module sits in a config repository: `(repository, team)` when its path is
/// `<repo>/teams/<team>/filters/<file>`.
pub fn repo_and_team(module: &Path) -> Option<(PathBuf, String)> {
    let abs = std::fs::canonicalize(module).ok()?;
    let filters = abs.parent()?;
    let team_dir = filters.parent()?;
    let teams = team_dir.parent()?;
    (filters.file_name()? == "filters" && teams.file_name()? == "teams")
        .then(|| Some((teams.parent()?.to_path_buf(), team_dir.file_name()?.to_str()?.to_owned())))?
}

/// What changed against the approved version `old` replaces, in lines.
pub fn diff(old: &ApprovedDoc, r: &Review) -> Vec<String> {
    let mut lines = vec![format!(
        "replaces {} (approved by {}{})",
        old.digest,
        old.reviewer.as_deref().unwrap_or("?"),
        old.at.as_deref().map(|t| format!(" at {t}")).unwrap_or_default()
    )];
    if old.size.is_none() && old.imports.is_empty() && old.fuel.is_empty() {
        lines.push("  no review record of it (approved by hand): nothing to compare".to_owned());
        return lines;
    }
    if let Some(size) = old.size {
        let delta = r.size as i64 - size as i64;
        lines.push(format!("  size     {} -> {} bytes ({delta:+})", size, r.size));
    }
    let added: Vec<&String> = r.imports.iter().filter(|i| !old.imports.contains(i)).collect();
    let removed: Vec<&String> = old.imports.iter().filter(|i| !r.imports.contains(i)).collect();
    if added.is_empty() && removed.is_empty() {
        lines.push("  imports  unchanged".to_owned());
    }
    for i in added {
        lines.push(format!("  imports  + {i}"));
    }
    for i in removed {
        lines.push(format!("  imports  - {i}"));
    }
    for s in &r.samples {
        match old.fuel.get(&s.name) {
            Some(was) => {
                let change = (s.fuel as f64 - *was as f64) * 100.0 / (*was).max(1) as f64;
                lines.push(format!(
                    "  fuel     {:?}: {} -> {} ({change:+.1} %)",
                    s.name,
                    thousands(*was),
                    thousands(s.fuel)
                ));
            }
            None => lines.push(format!("  fuel     {:?}: new sample, {}", s.name, thousands(s.fuel))),
        }
    }
    for name in old.fuel.keys().filter(|n| !r.samples.iter().any(|s| &s.name == *n)) {
        lines.push(format!("  sample   {name:?} removed"));
    }
    lines
}

/// Records the approval of the reviewed module for `team` by `reviewer` in the review
/// registry at `file` (made if missing): a new entry, or the same digest's entry
/// updated. Earlier versions stay approved (a rollback may need them). Returns the entry
/// it replaces (the latest approval of the same filter and team with another digest).
pub fn approve(file: &Path, r: &Review, team: &str, reviewer: &str, at: String) -> anyhow::Result<Option<ApprovedDoc>> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => anyhow::bail!("cannot read {}: {e}", file.display()),
    };
    let mut doc: ReviewDoc = if text.trim().is_empty() {
        ReviewDoc::default()
    } else {
        serde_yaml_ng::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?
    };
    let replaced =
        doc.approved.iter().rev().find(|a| a.team == team && a.filter == r.filter && a.digest != r.digest).cloned();
    let entry = ApprovedDoc {
        digest: r.digest.clone(),
        filter: r.filter.clone(),
        team: team.to_owned(),
        reviewer: Some(reviewer.to_owned()),
        at: Some(at),
        size: Some(r.size),
        imports: r.imports.clone(),
        fuel: r.samples.iter().map(|s| (s.name.clone(), s.fuel)).collect(),
    };
    doc.approved.retain(|a| !(a.digest == entry.digest && a.team == team && a.filter == entry.filter));
    doc.approved.push(entry);
    // The comments above `approved:` stay; each entry is one line (a YAML flow map).
    let head: String = text.lines().take_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    let mut out = if head.is_empty() {
        "# Filter modules the platform approved, by digest, per team (posternctl filter approve).\n".to_owned()
    } else {
        head
    };
    out.push_str("approved:\n");
    for a in &doc.approved {
        let _ = writeln!(out, "  - {}", serde_json::to_string(a)?);
    }
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    postern_model::disk::write_atomic(file, out.as_bytes())?;
    Ok(replaced)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn review(digest: &str, size: u64, fuel: u64) -> Review {
        Review {
            filter: "guard".into(),
            manifest: "guard.yaml".into(),
            module: "guard.wasm".into(),
            digest: digest.into(),
            size,
            imports: vec!["postern:filter/host@0.3.0".into()],
            limits: Limits::default(),
            samples: vec![SampleRun {
                name: "old client".into(),
                mismatch: None,
                fuel,
                memory: 65536,
                report: serde_json::Value::Null,
            }],
            problems: vec![],
            warnings: vec![],
        }
    }

    #[test]
    fn an_approval_is_recorded_and_the_next_one_says_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("platform/filters.yaml");
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, "# reviewed modules\napproved:\n  - { digest: \"sha256:aa\", filter: other, team: t }\n")
            .unwrap();
        assert!(approve(&file, &review("sha256:01", 1000, 2000), "t", "alice", "T1".into()).unwrap().is_none());
        // The same digest again: updated, not repeated.
        assert!(approve(&file, &review("sha256:01", 1000, 2000), "t", "bob", "T2".into()).unwrap().is_none());
        let new = review("sha256:02", 1100, 2200);
        let old = approve(&file, &new, "t", "carol", "T3".into()).unwrap().unwrap();
        assert_eq!((old.digest.as_str(), old.reviewer.as_deref()), ("sha256:01", Some("bob")));
        let lines = diff(&old, &new);
        assert_eq!(lines[0], "replaces sha256:01 (approved by bob at T2)");
        assert!(lines.contains(&"  size     1000 -> 1100 bytes (+100)".to_owned()), "{lines:?}");
        assert!(lines.contains(&"  imports  unchanged".to_owned()), "{lines:?}");
        assert!(lines.contains(&"  fuel     \"old client\": 2,000 -> 2,200 (+10.0 %)".to_owned()), "{lines:?}");
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.starts_with("# reviewed modules\napproved:\n"), "{text}");
        let doc: ReviewDoc = serde_yaml_ng::from_str(&text).unwrap();
        let digests: Vec<&str> = doc.approved.iter().map(|a| a.digest.as_str()).collect();
        assert_eq!(digests, ["sha256:aa", "sha256:01", "sha256:02"]);
        // A hand-written approval has nothing to compare.
        let lines = diff(&doc.approved[0], &new);
        assert!(lines[1].contains("approved by hand"), "{lines:?}");
    }

    #[test]
    fn a_sample_near_its_limits_is_pointed_out() {
        let limits = Limits { fuel: 10_000_000, memory_bytes: 1 << 20, ..Limits::default() };
        let mut s = review("sha256:01", 1, 2000).samples.remove(0);
        assert!(headroom(&s, &limits).is_empty());
        (s.fuel, s.memory) = (8_000_000, 768 << 10);
        let w = headroom(&s, &limits);
        assert_eq!(w.len(), 3, "{w:?}");
        assert_eq!(w[0], "sample \"old client\" burns 80.0 % of its 10,000,000 fuel");
        assert_eq!(w[1], "sample \"old client\" uses 75.0 % of its memory limit");
        assert!(w[2].contains("more than a worker's slice (7,000,000 fuel)"), "{w:?}");
    }

    #[test]
    fn thousands_and_shares_read_well() {
        assert_eq!(thousands(1_000_000), "1,000,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(share(2410, 1_000_000), "0.2 %");
    }
}
