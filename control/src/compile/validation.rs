//! A route's `validate:`: its team's OpenAPI operation as the model's validation,
//! checked against the route.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use postern_model::validate::{JsonLimits, MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, ParamIn, Validation};

use super::context::{Ctx, RouteAt};
use super::parse::{ranged, segments};
use crate::config::{JsonLimitsDoc, ValidateDoc};
use crate::openapi::{Spec, SpecError};

/// A route's `validate:`: its team's OpenAPI operation (each document loaded once per
/// compile) as the model's validation, checked against the route. `None` once refused
/// (the errors are reported; a document's own at its file and JSON pointer).
pub(crate) fn route_validation(cx: &mut Ctx, route: &RouteAt<'_>, doc: &ValidateDoc) -> Option<Validation> {
    let RouteAt { file, field, team, .. } = *route;
    let owner = Some(team);
    let at = |sub: &str| format!("{field}.validate{sub}");
    let limits = json_limits(cx, file, &at(".json"), doc.json.as_ref(), owner)?;
    let name = doc.openapi.as_str();
    let extension = Path::new(name).extension().and_then(|x| x.to_str());
    if name.contains(['/', '\\']) || name.contains("..") || !matches!(extension, Some("yaml" | "yml" | "json")) {
        let msg = format!("{name:?} is not a .yaml, .yml or .json file name in teams/{team}/openapi/");
        cx.error(file, at(".openapi"), msg, owner);
        return None;
    }
    let rel = format!("teams/{team}/openapi/{name}");
    let spec_path = cx.root.join(&rel);
    let spec = match cx.specs.get(&spec_path) {
        Some(cached) => cached.clone()?,
        None if !spec_path.is_file() => {
            cx.error(file, at(".openapi"), format!("no OpenAPI document {rel}"), owner);
            return None;
        }
        None => {
            let loaded = match Spec::load(&spec_path) {
                Ok(spec) => Some(Arc::new(spec)),
                Err(e) => {
                    spec_error(cx, &spec_path, e, owner);
                    None
                }
            };
            cx.specs.insert(spec_path.clone(), loaded.clone());
            loaded?
        }
    };
    let id = doc.operation_id.as_str();
    let op = match spec.operation(id, limits, &format!("{rel}#{id}")) {
        Ok(op) => op,
        Err(errors) => {
            for e in errors {
                if e.pointer == crate::openapi::OPERATIONS_POINTER {
                    cx.error(file, at(".operationId"), format!("{rel}: {}", e.message), owner);
                } else {
                    spec_error(cx, &spec_path, e, owner);
                }
            }
            return None;
        }
    };
    let before = cx.diags.len();
    let params: HashSet<&str> =
        segments(route.path).into_iter().filter_map(|s| s.strip_prefix('{')?.strip_suffix('}')).collect();
    for p in op.validation.parameters.iter().filter(|p| p.location == ParamIn::Path) {
        if !params.contains(p.name.as_str()) {
            let msg = format!(
                "path parameter {:?} of {rel}#{id} is not a {{{}}} segment of the route's path {}",
                p.name, p.name, route.path
            );
            cx.error(file, at(""), msg, owner);
        }
    }
    if !route.methods.is_empty() && !route.methods.iter().any(|m| m.eq_ignore_ascii_case(&op.method)) {
        let msg = format!(
            "operation {id} is {} {}, but the route matches only {}",
            op.method,
            op.path,
            route.methods.join(", ")
        );
        cx.error(file, at(""), msg, owner);
    }
    if op.validation.body.is_some() && route.max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
        cx.error(file, at(""), "validating a body needs maxBodyBytes of at most 1 MiB", owner);
    }
    if cx.diags.len() != before {
        return None;
    }
    // The node's own validators, built now: a schema it could not compile (a pattern
    // the linear-time engine refuses, a bad keyword value) is refused here, at its
    // place in the spec.
    if let Err(e) = postern_validate::Validator::build(&op.validation, route.path) {
        let pointer = match e.pointer.strip_prefix('#') {
            Some(in_spec) => in_spec.to_owned(),
            None => format!("#{id} {}{}", e.what, e.pointer),
        };
        let msg = format!("{}: {}", e.what, e.message);
        if cx.spec_errors.insert((spec_path.clone(), pointer.clone(), msg.clone())) {
            cx.error(&spec_path, pointer, msg, owner);
        }
        return None;
    }
    Some(op.validation)
}

/// An error in an OpenAPI document, at its file and JSON pointer; once per compile.
fn spec_error(cx: &mut Ctx, spec_path: &Path, e: SpecError, owner: Option<&str>) {
    if cx.spec_errors.insert((spec_path.to_path_buf(), e.pointer.clone(), e.message.clone())) {
        cx.error(spec_path, e.pointer, e.message, owner);
    }
}

/// `validate.json:`, each field within its platform bound (errors name `field.<name>`).
fn json_limits(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: Option<&JsonLimitsDoc>,
    owner: Option<&str>,
) -> Option<JsonLimits> {
    let mut limits = JsonLimits::default();
    let Some(doc) = doc else { return Some(limits) };
    let before = cx.diags.len();
    for (name, v, max, slot) in [
        ("maxDepth", doc.max_depth, MAX_JSON_DEPTH, &mut limits.max_depth),
        ("maxStringBytes", doc.max_string_bytes, 1 << 20, &mut limits.max_string_bytes),
        ("maxNumberChars", doc.max_number_chars, MAX_JSON_NUMBER_CHARS, &mut limits.max_number_chars),
    ] {
        if let Some(v) = v.and_then(|v| ranged(cx, file, format!("{field}.{name}"), v, (1, max), owner)) {
            *slot = v;
        }
    }
    (cx.diags.len() == before).then_some(limits)
}
