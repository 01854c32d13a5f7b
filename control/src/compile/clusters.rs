//! A cluster's protections and transport: its circuit breaker, retry budget, outlier
//! ejection and TLS, each field checked against its range.

use std::path::Path;

use super::context::Ctx;
use super::parse::{ranged, ranged_ms};

/// A cluster's `outlier:`, each field checked against its range.
pub(crate) fn compile_outlier(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::OutlierDoc,
    owner: Option<&str>,
) -> postern_model::OutlierSpec {
    let mut spec = postern_model::OutlierSpec::default();
    let at = |name: &str| format!("{field}.outlier.{name}");
    if let Some(n) =
        doc.consecutive_failures.and_then(|v| ranged(cx, file, at("consecutiveFailures"), v, (1, 1000), owner))
    {
        spec.consecutive = n;
    }
    if let Some(ms) =
        doc.eject_for.as_deref().and_then(|v| ranged_ms(cx, file, at("ejectFor"), v, (1_000, 3_600_000), owner))
    {
        spec.eject_ms = ms;
    }
    if let Some(ms) =
        doc.max_eject_for.as_deref().and_then(|v| ranged_ms(cx, file, at("maxEjectFor"), v, (1_000, 3_600_000), owner))
    {
        spec.max_eject_ms = ms;
    }
    if let Some(p) =
        doc.max_ejected_percent.and_then(|v| ranged(cx, file, at("maxEjectedPercent"), v.into(), (0, 100), owner))
    {
        spec.max_percent = u8::try_from(p).unwrap_or(50);
    }
    if spec.max_eject_ms < spec.eject_ms {
        cx.error(file, at("maxEjectFor"), "must be at least ejectFor", owner);
    }
    spec
}

/// A cluster's `tls:`: its CA file (inside the repository) read and checked, embedded.
pub(crate) fn cluster_tls(
    cx: &mut Ctx,
    root: &Path,
    file: &Path,
    field: &str,
    doc: &crate::config::ClusterTlsDoc,
    owner: Option<&str>,
) -> Option<postern_model::ClusterTls> {
    let at = format!("{field}.tls.ca");
    let rel = Path::new(&doc.ca);
    if rel.is_absolute() || rel.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        cx.error(file, at, "give a path inside the repository", owner);
        return None;
    }
    let pem = match std::fs::read(root.join(rel)) {
        Ok(pem) => pem,
        Err(e) => {
            cx.error(file, at, format!("cannot read {}: {e}", doc.ca), owner);
            return None;
        }
    };
    if let Err(e) = postern_model::tls::roots_pem(&pem, &doc.ca) {
        cx.error(file, at, format!("{:#}", anyhow::Error::from(e)), owner);
        return None;
    }
    if let Some(name) = &doc.server_name
        && rustls_pki_types::ServerName::try_from(name.as_str()).is_err()
    {
        cx.error(file, format!("{field}.tls.serverName"), format!("{name:?} is not a DNS name or IP address"), owner);
        return None;
    }
    Some(postern_model::ClusterTls {
        ca_pem: String::from_utf8_lossy(&pem).into_owned(),
        server_name: doc.server_name.clone(),
    })
}

/// A cluster's `breaker:`, each field checked against its range (errors name the field);
/// what is absent or refused keeps its default.
pub(crate) fn compile_breaker(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::BreakerDoc,
    owner: Option<&str>,
) -> postern_model::BreakerSpec {
    let mut spec = postern_model::BreakerSpec::default();
    let at = |name: &str| format!("{field}.breaker.{name}");
    if let Some(ms) = doc.window.as_deref().and_then(|v| ranged_ms(cx, file, at("window"), v, (1_000, 300_000), owner))
    {
        spec.window_ms = ms;
    }
    if let Some(ms) = doc.open_for.as_deref().and_then(|v| ranged_ms(cx, file, at("openFor"), v, (100, 300_000), owner))
    {
        spec.open_ms = ms;
    }
    if let Some(n) = doc.min_requests.and_then(|v| ranged(cx, file, at("minRequests"), v, (1, 1_000_000), owner)) {
        spec.min_requests = n;
    }
    let percent = |cx: &mut Ctx, name: &str, v: Option<u8>, min: u32, max: u32| {
        v.and_then(|v| ranged(cx, file, at(name), u32::from(v), (min, max), owner)).and_then(|n| u8::try_from(n).ok())
    };
    if let Some(p) = percent(cx, "failurePercent", doc.failure_percent, 1, 99) {
        spec.failure_percent = p;
    }
    if let Some(p) = percent(cx, "probePercent", doc.probe_percent, 1, 100) {
        spec.probe_percent = p;
    }
    spec
}

/// A cluster's `retryBudget:`, each field checked against its range.
pub(crate) fn compile_budget(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::RetryBudgetDoc,
    owner: Option<&str>,
) -> postern_model::RetryBudgetSpec {
    let mut spec = postern_model::RetryBudgetSpec::default();
    let at = |name: &str| format!("{field}.retryBudget.{name}");
    if let Some(ms) = doc.window.as_deref().and_then(|v| ranged_ms(cx, file, at("window"), v, (1_000, 300_000), owner))
    {
        spec.window_ms = ms;
    }
    if let Some(p) = doc.percent.and_then(|v| ranged(cx, file, at("percent"), u32::from(v), (0, 100), owner)) {
        spec.percent = u8::try_from(p).unwrap_or(spec.percent);
    }
    if let Some(n) = doc.min_retries.and_then(|v| ranged(cx, file, at("minRetries"), v, (0, 100_000), owner)) {
        spec.min_retries = n;
    }
    spec
}
