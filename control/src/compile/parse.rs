//! Values in the repository's documents: durations and numbers within their ranges,
//! priority classes, names, dates, header names.

use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use postern_model::{MAX_TIMEOUT_MS, Priority};

use super::context::Ctx;
use crate::config::{DurationError, parse_duration};

/// Why a text is not a timeout.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum TimeoutError {
    /// Not a duration.
    #[error(transparent)]
    Duration(#[from] DurationError),
    /// Zero.
    #[error("must be more than 0")]
    Zero,
    /// Over the platform's maximum.
    #[error("{0} is over the platform maximum of 30s")]
    OverMax(String),
}

pub(crate) fn parse_ms(s: &str) -> Result<u64, TimeoutError> {
    let d = parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err(TimeoutError::Zero);
    }
    if ms > MAX_TIMEOUT_MS {
        return Err(TimeoutError::OverMax(s.to_owned()));
    }
    Ok(ms)
}

/// A duration setting in milliseconds within `min..=max`; `None` (and an error naming
/// `field`) for one that is not a duration or out of range.
pub(crate) fn ranged_ms(
    cx: &mut Ctx,
    file: &Path,
    field: String,
    v: &str,
    (min, max): (u64, u64),
    owner: Option<&str>,
) -> Option<u32> {
    match parse_duration(v).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)) {
        Ok(ms) if (min..=max).contains(&ms) => u32::try_from(ms).ok(),
        Ok(_) => {
            let (lo, hi) = (Duration::from_millis(min), Duration::from_millis(max));
            let msg = format!(
                "{v} is out of range ({} to {})",
                humantime::format_duration(lo),
                humantime::format_duration(hi)
            );
            cx.error(file, field, msg, owner);
            None
        }
        Err(e) => {
            cx.error(file, field, e.to_string(), owner);
            None
        }
    }
}

/// A number setting within `min..=max`; `None` (and an error naming `field`) otherwise.
pub(crate) fn ranged(
    cx: &mut Ctx,
    file: &Path,
    field: String,
    v: u32,
    (min, max): (u32, u32),
    owner: Option<&str>,
) -> Option<u32> {
    if (min..=max).contains(&v) {
        return Some(v);
    }
    cx.error(file, field, format!("{v} is out of range ({min} to {max})"), owner);
    None
}

/// A priority class by name; `None` (and an error naming `field`) for an unknown one.
pub(crate) fn priority(cx: &mut Ctx, file: &Path, field: String, v: &str, owner: Option<&str>) -> Option<Priority> {
    let p = Priority::parse(v);
    if p.is_none() {
        let msg = format!("unknown priority class {v:?} (critical, standard, free or sheddable)");
        cx.error(file, field, msg, owner);
    }
    p
}

/// Why a text is not a date.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum DateError {
    /// Not RFC 3339.
    #[error("{text:?} is not an RFC 3339 date: {source}")]
    Format { text: String, source: humantime::TimestampError },
    /// Past what a timestamp holds.
    #[error("{0:?} is out of range")]
    Range(String),
}

pub(crate) fn parse_date(s: &str) -> Result<i64, DateError> {
    let t = humantime::parse_rfc3339_weak(s).map_err(|source| DateError::Format { text: s.to_owned(), source })?;
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
    i64::try_from(secs).map_err(|_| DateError::Range(s.to_owned()))
}

pub(crate) fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
}

/// Splits a path pattern into its segments (without validating them).
pub(crate) fn segments(p: &str) -> Vec<&str> {
    p.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect()
}

pub(crate) fn valid_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => {
            port.parse::<u16>().is_ok_and(|p| p != 0)
                && !host.is_empty()
                && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        }
        None => false,
    }
}

pub(crate) fn postern_router_header_ok(h: &str) -> Result<(), ()> {
    if !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_') {
        Ok(())
    } else {
        Err(())
    }
}
