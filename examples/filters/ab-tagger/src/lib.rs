//! `ab-tagger`: assigns each caller to an experiment arm, stably, and tells the
//! backend which.
//!
//! Config (`key_header` defaults to `x-auth-client-id`, the verified caller's app that
//! the gateway sets on authenticated routes):
//!
//! ```json
//! {"key_header": "x-auth-client-id", "experiment": "checkout", "arms": ["a", "b"]}
//! ```
//!
//! The arm is picked by a stable hash of `experiment ‖ 0x00 ‖ key`, where `key` is
//! the value of `key_header`: 64-bit FNV-1a, then the MurmurHash3 finalizer (FNV's
//! low bits depend only on the low bits of the input bytes, so taken raw, two arms
//! would split on a parity bit and every experiment would split alike), then mapped
//! onto the arms by its high bits. The same caller always gets the same arm (no
//! randomness, no state), and different experiments split callers independently. The
//! filter sets the request header `x-experiment: <experiment>=<arm>` (replacing any
//! the client sent) and adds 1 to the counter `arm_<arm>`.
//!
//! A request without the key header is not assigned: any client-sent `x-experiment`
//! is removed and `no_key` is counted. The config is parsed once per attachment, in
//! `init`, and an invalid one is refused when the gateway builds its snapshot. Where
//! `init` did not run, tagging being no security control, a bad config fails open: the
//! request is forwarded untagged (client `x-experiment` removed), an error is logged
//! and `misconfigured` is counted.
#![no_std]

use postern_filter_sdk::prelude::*;
use serde::Deserialize;

/// The filter.
pub struct AbTagger;

fn default_key_header() -> String {
    "x-auth-client-id".to_owned()
}

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The request header whose value identifies the caller.
    #[serde(default = "default_key_header")]
    pub key_header: String,
    /// The experiment's name, as the backend will see it.
    pub experiment: String,
    /// The arms, at least one.
    pub arms: Vec<String>,
}

/// Names that are safe in a header value and a metric name.
fn valid_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Parses and checks a config.
pub fn parse_config(bytes: &[u8]) -> Result<Config, String> {
    let cfg: Config = parse_config_json(bytes)?;
    if !valid_label(&cfg.experiment) {
        return Err(format!("invalid config: experiment {:?} must be 1-64 of [A-Za-z0-9._-]", cfg.experiment));
    }
    if cfg.arms.is_empty() {
        return Err("invalid config: arms is empty".to_owned());
    }
    if let Some(arm) = cfg.arms.iter().find(|a| !valid_label(a)) {
        return Err(format!("invalid config: arm {arm:?} must be 1-64 of [A-Za-z0-9._-]"));
    }
    if cfg.key_header.is_empty() {
        return Err("invalid config: key_header is empty".to_owned());
    }
    Ok(cfg)
}

/// 64-bit FNV-1a.
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for part in parts {
        for &b in *part {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hash
}

/// MurmurHash3's 64-bit finalizer: every input bit affects every output bit.
pub fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The arm `key` is assigned to in `experiment`. `arms` must not be empty.
pub fn assign<'a>(experiment: &str, arms: &'a [String], key: &[u8]) -> &'a str {
    let hash = fmix64(fnv1a64(&[experiment.as_bytes(), &[0], key]));
    // Multiply-shift onto 0..len: the product's high 64 bits are below len.
    let index = ((u128::from(hash) * arms.len() as u128) >> 64) as usize;
    &arms[index]
}

/// The config, parsed once per attachment (in `init`, when the gateway builds its
/// snapshot).
static CONFIG: ParsedConfig<Config> = ParsedConfig::new(parse_config);

impl Filter for AbTagger {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(req: &Request, _cx: &Context) -> Decision {
        CONFIG.with(|cfg| match cfg {
            Ok(cfg) => tag(cfg, req),
            Err(e) => {
                log::error(e);
                counter_add("misconfigured", 1);
                Decision::forward().remove_header("x-experiment")
            }
        })
    }
}

/// Assigns the caller to an arm and tags the request with it.
fn tag(cfg: &Config, req: &Request) -> Decision {
    let key = match req.header(&cfg.key_header) {
        Some(key) if !key.is_empty() => key,
        _ => {
            counter_add("no_key", 1);
            return Decision::forward().remove_header("x-experiment");
        }
    };
    let arm = assign(&cfg.experiment, &cfg.arms, key);
    counter_add(&format!("arm_{arm}"), 1);
    Decision::forward().set_header("x-experiment", format!("{}={arm}", cfg.experiment))
}

export_filter!(AbTagger);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::{Level, testing};

    const CONFIG: &str = r#"{"key_header": "x-auth-client-id", "experiment": "checkout", "arms": ["a", "b"]}"#;

    fn tag(key: Option<&str>) -> Decision {
        let mut req = testing::request("POST", "/checkout").header("x-experiment", "checkout=spoofed");
        if let Some(key) = key {
            req = req.header("x-auth-client-id", key);
        }
        AbTagger::on_request(&req, &testing::context())
    }

    fn arm_of(d: &Decision) -> String {
        let v = d.edits().and_then(|e| e.set_value_str("x-experiment")).expect("tagged");
        v.strip_prefix("checkout=").expect("experiment prefix").to_owned()
    }

    #[test]
    fn fnv1a64_reference_vectors() {
        assert_eq!(fnv1a64(&[b""]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(&[b"foobar"]), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a64(&[b"foo", b"bar"]), fnv1a64(&[b"foobar"]));
    }

    #[test]
    fn same_key_same_arm_and_counted() {
        testing::set_config(CONFIG);
        let first = arm_of(&tag(Some("key-123")));
        for _ in 0..10 {
            assert_eq!(arm_of(&tag(Some("key-123"))), first);
        }
        assert!(first == "a" || first == "b");
        assert_eq!(testing::counter(&format!("arm_{first}")), 11);
    }

    #[test]
    fn keys_spread_over_the_arms() {
        let arms: Vec<String> = vec!["a".into(), "b".into(), "c".into()];
        let mut counts = [0u32; 3];
        for i in 0..3000 {
            let arm = assign("checkout", &arms, format!("key-{i}").as_bytes());
            counts[arms.iter().position(|a| a == arm).unwrap()] += 1;
        }
        for c in counts {
            assert!((850..=1150).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn experiments_split_independently() {
        let arms: Vec<String> = vec!["a".into(), "b".into()];
        let differ = (0..200)
            .filter(|i| {
                let key = format!("key-{i}");
                assign("checkout", &arms, key.as_bytes()) != assign("search", &arms, key.as_bytes())
            })
            .count();
        assert!((50..=150).contains(&differ), "{differ}");
    }

    #[test]
    fn no_key_is_not_assigned_and_spoofing_is_removed() {
        testing::set_config(CONFIG);
        for d in [tag(None), tag(Some(""))] {
            let e = d.edits().expect("forwarded");
            assert!(e.is_removed("x-experiment"));
            assert!(e.set_headers.is_empty());
        }
        assert_eq!(testing::counter("no_key"), 2);
    }

    #[test]
    fn key_header_defaults_to_x_api_key() {
        testing::set_config(r#"{"experiment": "checkout", "arms": ["only"]}"#);
        assert_eq!(arm_of(&tag(Some("k"))), "only");
        assert_eq!(testing::counter("arm_only"), 1);
    }

    #[test]
    fn other_key_header() {
        testing::set_config(r#"{"key_header": "x-user", "experiment": "checkout", "arms": ["a"]}"#);
        let req = testing::request("GET", "/").header("x-user", "u1");
        assert_eq!(arm_of(&AbTagger::on_request(&req, &testing::context())), "a");
    }

    #[test]
    fn bad_config_fails_open_untagged() {
        for bad in [
            "",
            r#"{"experiment": "checkout", "arms": []}"#,
            r#"{"experiment": "check out", "arms": ["a"]}"#,
            r#"{"experiment": "checkout", "arms": ["a=b"]}"#,
            r#"{"experiment": "checkout"}"#,
        ] {
            testing::reset();
            testing::set_config(bad);
            let d = tag(Some("k"));
            let e = d.edits().expect("forwarded");
            assert!(e.is_removed("x-experiment"), "{bad:?}");
            assert!(e.set_headers.is_empty(), "{bad:?}");
            assert_eq!(testing::counter("misconfigured"), 1, "{bad:?}");
            assert!(testing::logged(Level::Error, "config"), "{bad:?}");
        }
    }
}
