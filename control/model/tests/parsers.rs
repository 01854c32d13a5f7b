//! Property tests for the parsers of what crosses the planes: the API-key shape check,
//! the snapshot and credential envelopes and the credentials delta. No input panics and
//! random input is refused; a good value passes; any change to a sealed file or a key is
//! refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use postern_model::apikey::{self, KeyEnv};
use postern_model::credentials::{Credentials, DeltaDoc};
use postern_model::{SCHEMA_VERSION, Snapshot, SnapshotFile};
use proptest::prelude::*;

fn empty() -> Snapshot {
    Snapshot {
        schema: SCHEMA_VERSION,
        clusters: Default::default(),
        routes: Vec::new(),
        plans: Default::default(),
        paths: Default::default(),
        never_canary: Default::default(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_are_not_a_key(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        // A key's prefix and checksum cannot come by chance.
        prop_assert!(apikey::check_shape(&bytes).is_err(), "{:?}", bytes);
    }

    #[test]
    fn a_key_with_any_one_character_changed_is_refused(live in any::<bool>(), at in 0usize..64, to in any::<u8>()) {
        let key = apikey::generate(if live { KeyEnv::Live } else { KeyEnv::Test }).unwrap();
        prop_assert!(apikey::check_shape(key.as_bytes()).is_ok());
        let mut bad = key.into_bytes();
        let at = at % bad.len();
        prop_assume!(bad[at] != to);
        bad[at] = to;
        prop_assert!(apikey::check_shape(&bad).is_err());
    }

    #[test]
    fn random_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(SnapshotFile::open(&bytes).is_err());
        prop_assert!(SnapshotFile::open_envelope(&bytes).is_err());
        prop_assert!(Credentials::open(&bytes).is_err());
        // Not a delta at all, or one that does not parse.
        prop_assert!(!matches!(DeltaDoc::parse(&bytes), Some(Ok(_))));
    }

    #[test]
    fn json_shaped_envelopes_with_random_hashes_and_contents_are_refused(
        version in any::<u64>(),
        hash in "[a-z0-9:]{0,80}",
        content in "[ -~]{0,200}",
    ) {
        // A hash no content was hashed to: refused, whatever the content.
        let text = format!("{{\"version\":{version},\"hash\":\"{hash}\",\"content\":{content}}}");
        prop_assert!(SnapshotFile::open(text.as_bytes()).is_err(), "{}", text);
        prop_assert!(Credentials::open(text.as_bytes()).is_err(), "{}", text);
        // Random text is not a delta's base, version and changes.
        let delta = format!("{{\"delta\":{content}}}");
        prop_assert!(matches!(DeltaDoc::parse(delta.as_bytes()), Some(Err(_))), "{}", delta);
    }

    #[test]
    fn a_sealed_snapshot_with_any_byte_changed_is_refused_or_unchanged(at in any::<usize>(), to in any::<u8>()) {
        let file = SnapshotFile::seal(7, &empty()).unwrap();
        let bytes = serde_json::to_vec(&file).unwrap();
        prop_assert!(SnapshotFile::open(&bytes).is_ok());
        let mut bad = bytes.clone();
        let at = at % bad.len();
        prop_assume!(bad[at] != to);
        bad[at] = to;
        // A change is either refused or (whitespace, say) leaves the same hash and content;
        // it never yields other contents. (The version number is outside the hash: only a
        // signature over the whole envelope covers it, docs/security.md class 9.)
        if let Ok((f, s)) = SnapshotFile::open(&bad) {
            prop_assert_eq!(f.hash, file.hash);
            prop_assert_eq!(f.content.get(), file.content.get());
            prop_assert_eq!(s, empty());
        }
    }
}

#[test]
fn a_delta_makes_the_whole_version_only_when_it_carries_every_difference() {
    use postern_model::credentials::{ApiKey, App, CredentialsDelta, KeyStatus, TraceFlag};
    use postern_model::usage::CallerKind;
    let key = |id: &str, sha: &str, status: KeyStatus| ApiKey {
        id: id.into(),
        sha256: sha.into(),
        app: "a".into(),
        tenant: "t".into(),
        plan: "p".into(),
        scopes: vec![],
        priority: None,
        status,
        successor: None,
        expires_at: None,
    };
    let mut base = Credentials::empty();
    base.keys = vec![key("k1", &"1".repeat(64), KeyStatus::Active)];
    let mut whole = base.clone();
    whole.keys[0].status = KeyStatus::Revoked;
    whole.keys.insert(0, key("k2", &"2".repeat(64), KeyStatus::Active));
    let delta = CredentialsDelta {
        keys: vec![key("k1", &"1".repeat(64), KeyStatus::Revoked), key("k2", &"2".repeat(64), KeyStatus::Active)],
        ..CredentialsDelta::between(1, 2)
    };
    assert!(base.with_delta(&delta).same_state(&whole), "order does not matter");
    // A debug-trace flag replaces the caller's earlier one, whatever its expiry.
    let flag = |until| TraceFlag { caller: "k1".into(), kind: CallerKind::Key, until };
    let traced =
        whole.with_delta(&CredentialsDelta { debug_trace: vec![flag(500)], ..CredentialsDelta::between(2, 3) });
    assert!(!traced.same_state(&whole), "a flag is part of the state");
    let off = traced.with_delta(&CredentialsDelta { debug_trace: vec![flag(100)], ..CredentialsDelta::between(3, 4) });
    assert_eq!(off.debug_trace, vec![flag(100)]);
    // A difference the delta does not carry (an app) means it is not the whole version.
    whole.apps.insert("new".into(), App { plan: "p".into(), tenant: None, priority: None, issuer: None });
    assert!(!base.with_delta(&delta).same_state(&whole));
}
