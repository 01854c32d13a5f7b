//! `hmac-verifier`: verifies partner webhooks signed with HMAC-SHA256.
//!
//! Config:
//!
//! ```json
//! {"secret": "whsec_...", "max_skew_seconds": 300, "require_body_signature": false}
//! ```
//!
//! **Request phase** (every request): the partner sends
//!
//! - `x-timestamp: <unix seconds>` and
//! - `x-signature: sha256=<hex>`, the HMAC-SHA256, keyed with `secret`, of
//!   `<x-timestamp>.<method>.<path>` (the path without the query, as received).
//!
//! **Body phase** (only on routes that buffer the body): if the request has
//! `x-signature-body: sha256=<hex>`, it must be the HMAC-SHA256 of
//! `<x-timestamp>.<body bytes>`. Without that header the body is not checked, unless
//! `require_body_signature` is `true`.
//!
//! A missing or wrong signature or timestamp is answered with 401
//! `{"code":"invalid_signature"}` (the reason is logged at warn level, never the
//! secret) and counted in `invalid_signature`; a good one is counted in
//! `valid_signature`. Signatures are compared in constant time.
//!
//! **Clock skew is not checked.** The gateway grants no wall clock (only a
//! monotonic one), so this filter cannot tell how old `x-timestamp` is:
//! `max_skew_seconds` is accepted for forward compatibility and ignored. The
//! timestamp is still signed, so it cannot be changed without the secret, but a
//! captured request can be replayed. Enforce a replay window elsewhere (for example
//! in the backend, which has a clock) until the host offers wall time.
//!
//! The config is parsed and the key schedule made once per attachment, in `init`. An
//! invalid config (no `secret`, unknown keys) is refused when the gateway builds its
//! snapshot; where `init` did not run, it fails every request with 500
//! `{"code":"filter_misconfigured"}`: a verifier must never fail open.
#![no_std]

use hmac::{Hmac, Mac};
use postern_filter_sdk::prelude::*;
use postern_filter_sdk::serde_json::json;
use serde::Deserialize;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The filter.
pub struct HmacVerifier;

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The shared HMAC-SHA256 key.
    pub secret: String,
    /// Accepted and ignored: the gateway grants no wall clock (see the crate docs).
    #[serde(default)]
    pub max_skew_seconds: Option<u64>,
    /// Whether the body phase rejects requests without `x-signature-body`.
    #[serde(default)]
    pub require_body_signature: bool,
}

/// The config, with the HMAC key schedule made from its secret.
pub struct Prepared {
    cfg: Config,
    mac: HmacSha256,
}

/// Parses and checks a config, and keys the MAC.
pub fn prepare(bytes: &[u8]) -> Result<Prepared, String> {
    let cfg: Config = parse_config_json(bytes)?;
    if cfg.secret.is_empty() {
        return Err("invalid config: secret is empty".to_owned());
    }
    let mac = HmacSha256::new_from_slice(cfg.secret.as_bytes()).map_err(|_| "invalid config: secret".to_owned())?;
    Ok(Prepared { cfg, mac })
}

/// The config, prepared once per attachment (in `init`, when the gateway builds its
/// snapshot).
static CONFIG: ParsedConfig<Prepared> = ParsedConfig::new(prepare);

/// Runs `f` with the prepared config; a bad one is logged and answered with 500.
fn with_config(f: impl FnOnce(&Prepared) -> Decision) -> Decision {
    CONFIG.with(|p| match p {
        Ok(p) => f(p),
        Err(e) => {
            log::error(e);
            misconfigured()
        }
    })
}

fn misconfigured() -> Decision {
    Decision::respond(500).json(json!({"code": "filter_misconfigured"}))
}

fn reject(reason: &str) -> Decision {
    log::warn(format!("invalid webhook signature: {reason}"));
    counter_add("invalid_signature", 1);
    Decision::respond(401).json(json!({"code": "invalid_signature"}))
}

/// The `x-timestamp` header, if it is unix seconds (digits only).
fn timestamp(req: &Request) -> Result<&str, &'static str> {
    match req.header_str("x-timestamp") {
        None => Err("missing x-timestamp"),
        Some(ts) if !ts.is_empty() && ts.len() <= 20 && ts.bytes().all(|b| b.is_ascii_digit()) => Ok(ts),
        Some(_) => Err("x-timestamp is not unix seconds"),
    }
}

/// Decodes `sha256=<64 hex digits>` into the 32-byte MAC.
pub fn parse_signature(value: &[u8]) -> Option<[u8; 32]> {
    let hex = value.strip_prefix(b"sha256=")?;
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Whether `signature` is the HMAC-SHA256 of the concatenated `parts` under the key
/// `keyed` was made with, compared in constant time.
fn verify(keyed: &HmacSha256, parts: &[&[u8]], signature: &[u8; 32]) -> bool {
    let mut mac = keyed.clone();
    for part in parts {
        mac.update(part);
    }
    mac.verify_slice(signature).is_ok()
}

impl Filter for HmacVerifier {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(req: &Request, _cx: &Context) -> Decision {
        with_config(|p| check_head(req, p))
    }

    fn on_request_body(req: &Request, body: &[u8], _cx: &Context) -> Decision {
        with_config(|p| check_body(req, body, p))
    }
}

/// The request phase: the signature of the timestamp, method and path.
fn check_head(req: &Request, p: &Prepared) -> Decision {
    let ts = match timestamp(req) {
        Ok(ts) => ts,
        Err(reason) => return reject(reason),
    };
    let Some(sig) = req.header("x-signature") else {
        return reject("missing x-signature");
    };
    let Some(sig) = parse_signature(sig) else {
        return reject("x-signature is not sha256=<64 hex digits>");
    };
    let message: [&[u8]; 5] = [ts.as_bytes(), b".", req.method.as_bytes(), b".", req.path.as_bytes()];
    if !verify(&p.mac, &message, &sig) {
        return reject("x-signature does not match");
    }
    counter_add("valid_signature", 1);
    Decision::forward()
}

/// The body phase: the signature of the timestamp and body, if there is one.
fn check_body(req: &Request, body: &[u8], p: &Prepared) -> Decision {
    let Some(sig) = req.header("x-signature-body") else {
        if p.cfg.require_body_signature {
            return reject("missing x-signature-body");
        }
        return Decision::forward();
    };
    let ts = match timestamp(req) {
        Ok(ts) => ts,
        Err(reason) => return reject(reason),
    };
    let Some(sig) = parse_signature(sig) else {
        return reject("x-signature-body is not sha256=<64 hex digits>");
    };
    if !verify(&p.mac, &[ts.as_bytes(), b".", body], &sig) {
        return reject("x-signature-body does not match");
    }
    counter_add("valid_body_signature", 1);
    Decision::forward()
}

export_filter!(HmacVerifier);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing::{self, RequestBuilder};
    use postern_filter_sdk::{Level, Reply};

    const SECRET: &str = "whsec_test";
    // Computed independently (Python's hmac module) so a bug on both sides of the
    // comparison cannot hide.
    const HEAD_SIG: &str = "fffbb574f23662114ef96a2d5fca4f3c667629299deec3a726d37ecf086fc1c9";
    const BODY: &[u8] = br#"{"event":"paid"}"#;
    const BODY_SIG: &str = "1171ae5d1d5dea8494c9c1a1bc01b7e8c959e1d8938fa4b1f463e0362c33513d";

    fn configure() {
        testing::set_config(format!(r#"{{"secret": "{SECRET}", "max_skew_seconds": 300}}"#));
    }

    fn webhook() -> RequestBuilder {
        testing::request("POST", "/hooks/partner").header("x-timestamp", "1700000000")
    }

    fn sign(message: &[u8]) -> String {
        let mut mac = HmacSha256::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(message);
        let bytes = mac.finalize().into_bytes();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256={hex}")
    }

    fn assert_rejected(d: &Decision) {
        let reply: &Reply = d.reply().expect("rejected");
        assert_eq!(reply.status, 401);
        assert_eq!(reply.body_json(), Some(json!({"code": "invalid_signature"})));
        assert_eq!(reply.header_str("content-type"), Some("application/json"));
    }

    #[test]
    fn valid_signature_forwards() {
        configure();
        let req = webhook().header("x-signature", format!("sha256={HEAD_SIG}"));
        let d = HmacVerifier::on_request(&req, &testing::context());
        assert!(d.is_forward());
        assert_eq!(testing::counter("valid_signature"), 1);
        assert_eq!(testing::counter("invalid_signature"), 0);
    }

    #[test]
    fn uppercase_hex_is_accepted() {
        configure();
        let req = webhook().header("x-signature", format!("sha256={}", HEAD_SIG.to_uppercase()));
        assert!(HmacVerifier::on_request(&req, &testing::context()).is_forward());
    }

    #[test]
    fn test_signer_matches_reference_vector() {
        assert_eq!(sign(b"1700000000.POST./hooks/partner"), format!("sha256={HEAD_SIG}"));
    }

    #[test]
    fn missing_or_bad_signatures_are_rejected() {
        configure();
        let good = format!("sha256={HEAD_SIG}");
        let cases: Vec<(&str, RequestBuilder)> = vec![
            ("missing signature", webhook()),
            ("missing timestamp", testing::request("POST", "/hooks/partner").header("x-signature", &good)),
            (
                "non-numeric timestamp",
                testing::request("POST", "/hooks/partner")
                    .header("x-timestamp", "yesterday")
                    .header("x-signature", &good),
            ),
            (
                "other timestamp",
                testing::request("POST", "/hooks/partner")
                    .header("x-timestamp", "1700000001")
                    .header("x-signature", &good),
            ),
            (
                "other path",
                testing::request("POST", "/hooks/other")
                    .header("x-timestamp", "1700000000")
                    .header("x-signature", &good),
            ),
            (
                "other method",
                testing::request("PUT", "/hooks/partner")
                    .header("x-timestamp", "1700000000")
                    .header("x-signature", &good),
            ),
            ("no prefix", webhook().header("x-signature", HEAD_SIG)),
            ("sha1 prefix", webhook().header("x-signature", format!("sha1={HEAD_SIG}"))),
            ("short", webhook().header("x-signature", &good[..good.len() - 2])),
            ("not hex", webhook().header("x-signature", format!("sha256={}", "zz".repeat(32)))),
            ("flipped bit", webhook().header("x-signature", format!("sha256=0{}", &HEAD_SIG[1..]))),
        ];
        let n = cases.len() as u64;
        for (what, req) in cases {
            let d = HmacVerifier::on_request(&req, &testing::context());
            assert!(!d.is_forward(), "{what}");
            assert_rejected(&d);
        }
        assert_eq!(testing::counter("invalid_signature"), n);
        assert!(testing::logged(Level::Warn, "invalid webhook signature"));
        assert!(!testing::logs().iter().any(|(_, m)| m.contains(SECRET)));
    }

    #[test]
    fn wrong_secret_is_rejected() {
        testing::set_config(r#"{"secret": "another"}"#);
        let req = webhook().header("x-signature", format!("sha256={HEAD_SIG}"));
        assert_rejected(&HmacVerifier::on_request(&req, &testing::context()));
    }

    #[test]
    fn body_signature_is_checked_when_present() {
        configure();
        let req = webhook().header("x-signature-body", format!("sha256={BODY_SIG}"));
        assert!(HmacVerifier::on_request_body(&req, BODY, &testing::context()).is_forward());
        assert_eq!(testing::counter("valid_body_signature"), 1);

        let tampered = HmacVerifier::on_request_body(&req, br#"{"event":"refunded"}"#, &testing::context());
        assert_rejected(&tampered);

        let signed_here = webhook().header("x-signature-body", sign(b"1700000000.{}"));
        assert!(HmacVerifier::on_request_body(&signed_here, b"{}", &testing::context()).is_forward());
    }

    #[test]
    fn body_signature_is_optional_unless_required() {
        configure();
        assert!(HmacVerifier::on_request_body(&webhook(), BODY, &testing::context()).is_forward());

        testing::set_config(format!(r#"{{"secret": "{SECRET}", "require_body_signature": true}}"#));
        assert_rejected(&HmacVerifier::on_request_body(&webhook(), BODY, &testing::context()));
    }

    #[test]
    fn misconfiguration_fails_closed() {
        for bad in ["", "{}", r#"{"secret": ""}"#, r#"{"secret": "s", "extra": 1}"#, "nope"] {
            testing::reset();
            testing::set_config(bad);
            let req = webhook().header("x-signature", format!("sha256={HEAD_SIG}"));
            let d = HmacVerifier::on_request(&req, &testing::context());
            assert_eq!(d.status(), Some(500), "{bad:?}");
            assert_eq!(d.reply().and_then(|r| r.body_json()), Some(json!({"code": "filter_misconfigured"})));
            assert!(testing::logged(Level::Error, "config"), "{bad:?}");
            assert_eq!(HmacVerifier::on_request_body(&req, BODY, &testing::context()).status(), Some(500));
        }
    }
}
