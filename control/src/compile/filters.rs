//! A route's Wasm filters: manifest, module, review, limits, the real runtime's checks,
//! and the manifest's sample cases run in the sandbox.

use std::path::Path;
use std::sync::Arc;

use postern_model::FilterSpec;

use super::context::Ctx;
use super::parse::valid_name;

/// Resolves a Wasm filter attachment: manifest, module, review, limits, and a check of
/// the component itself in the real runtime (world, imports), and the filter's own
/// check of its config (its `init`).
pub(crate) fn wasm_filter(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    team: &str,
    w: &crate::config::WasmAttachDoc,
) -> Option<FilterSpec> {
    let owner = Some(team);
    if !valid_name(&w.name) {
        cx.error(file, format!("{field}.name"), "filter names are lowercase letters, digits and '-'", owner);
        return None;
    }
    let quarantine = match w.quarantine.policy() {
        Ok(q) => q,
        Err((name, why)) => {
            cx.error(file, format!("{field}.quarantine.{name}"), why, owner);
            return None;
        }
    };
    let manifest_path = cx.root.join("teams").join(team).join("filters").join(format!("{}.yaml", w.name));
    if !manifest_path.exists() {
        let rel = manifest_path.strip_prefix(&cx.root).unwrap_or(&manifest_path).display().to_string();
        cx.error(file, format!("{field}.name"), format!("no filter manifest {rel}"), owner);
        return None;
    }
    let manifest: crate::config::FilterManifestDoc = cx.load(&manifest_path, owner)?;
    let over = manifest.limits.over(&postern_model::wasm::Limits::MAXIMA);
    if !over.is_empty() {
        cx.error(&manifest_path, "limits", over.join("; "), owner);
        return None;
    }
    // The module is a file of the team's own filters/ folder (read as one others can write).
    let module = std::path::Path::new(&manifest.module);
    if manifest.module.contains('\\') || !module.components().all(|c| matches!(c, std::path::Component::Normal(_))) {
        let msg =
            format!("{:?}: a file name inside teams/{team}/filters/ (no absolute path, '.' or '..')", manifest.module);
        cx.error(&manifest_path, "module", msg, owner);
        return None;
    }
    let module_path = manifest_path.parent().unwrap_or(&cx.root).join(module);
    let bytes = match postern_model::disk::read_untrusted(&module_path, postern_model::disk::MODULE_FILE_CAP) {
        Ok(b) => b,
        Err(e) => {
            cx.error(&manifest_path, "module", format!("cannot read {}: {e}", module_path.display()), owner);
            return None;
        }
    };
    let digest = postern_model::content_hash(&bytes);
    let approved = cx.review.iter().any(|a| a.digest == digest && a.team == team && a.filter == w.name);
    if !approved {
        cx.error(
            &manifest_path,
            "module",
            format!("module {digest} of filter {} is not approved for team {team} in platform/filters.yaml", w.name),
            owner,
        );
        return None;
    }
    let module = match cx.sandbox.load(&bytes, &digest) {
        Ok(m) => m,
        Err(e) => {
            cx.error(&manifest_path, "module", format!("module {digest}: {e}"), owner);
            return None;
        }
    };
    if cx.sampled.insert(manifest_path.clone()) {
        run_samples(cx, &manifest_path, team, &module, &manifest);
    }
    cx.modules.insert(digest.clone(), module_path);
    // The filter's own check of its config (`init`), as each node will run it.
    if let Err(e) = cx.sandbox.check_config(&module, &w.config, &manifest.limits) {
        cx.error(file, format!("{field}.config"), format!("filter {}: {e}", w.name), owner);
        return None;
    }
    let attachment = postern_model::wasm::Attachment {
        name: w.name.clone(),
        module: digest,
        limits: manifest.limits,
        failure: w.failure,
        response_phase: w.response_phase,
        config: w.config.clone(),
        quarantine,
    };
    match serde_json::to_value(&attachment) {
        Ok(config) => Some(FilterSpec { kind: "wasm".into(), config }),
        Err(e) => {
            cx.error(file, field, e.to_string(), owner);
            None
        }
    }
}

/// Runs a filter manifest's sample cases in the real sandbox, with the manifest's limits;
/// each case whose decision differs is an error naming it.
fn run_samples(
    cx: &mut Ctx,
    manifest_path: &Path,
    team: &str,
    module: &Arc<postern_wasm::Module>,
    manifest: &crate::config::FilterManifestDoc,
) {
    for (i, case) in manifest.samples.iter().enumerate() {
        let field = format!("samples[{i}]");
        let req = crate::filter_run::sample_request(case);
        let report = match cx.sandbox.run_sample(module, &case.config, manifest.limits, &req, &cx.paths) {
            Ok(r) => r,
            Err(e) => {
                cx.error(manifest_path, field, format!("{:?}: cannot run: {e:#}", case.name), Some(team));
                continue;
            }
        };
        if let Some(why) = crate::filter_run::sample_mismatch(&case.expect, &report) {
            cx.error(manifest_path, field, format!("{:?}: {why}", case.name), Some(team));
        }
    }
}
