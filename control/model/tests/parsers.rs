//! Property tests for the parsers of what crosses the planes: the API-key shape check,
//! the snapshot and credential envelopes and the credentials delta. No input panics; a
//! good value passes; any change to a sealed file or a key is refused.
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
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn key_shapes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = apikey::check_shape(&bytes);
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
    fn envelopes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = SnapshotFile::open(&bytes);
        let _ = SnapshotFile::open_envelope(&bytes);
        let _ = Credentials::open(&bytes);
        let _ = DeltaDoc::parse(&bytes);
    }

    #[test]
    fn json_shaped_envelopes_never_panic(version in any::<u64>(), hash in "[a-z0-9:]{0,80}", content in "[ -~]{0,200}") {
        let text = format!("{{\"version\":{version},\"hash\":\"{hash}\",\"content\":{content}}}");
        let _ = SnapshotFile::open(text.as_bytes());
        let _ = Credentials::open(text.as_bytes());
        let delta = format!("{{\"delta\":{content}}}");
        let _ = DeltaDoc::parse(delta.as_bytes());
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
