//! A filter written the way a team starts one: `posternctl filter new` from each
//! template, the crate's own `cargo test`, `posternctl filter build` (the component for
//! wasm32-wasip2, its digest, size and samples in the sandbox), `filter run` showing
//! what it logged and counted, and `filter approve` recording the approval.
//!
//! The crates' dependencies build once into `target/filters-new` (and
//! `target/filters-new-native` for the tests), shared by the three templates and kept
//! between runs.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use postern_e2e::bin;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{}", out.status, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn posternctl(dir: &Path) -> Command {
    let mut c = Command::new(bin("posternctl"));
    c.current_dir(dir);
    c
}

#[test]
fn each_template_makes_a_crate_that_tests_builds_and_passes_its_samples() {
    let work = tempfile::tempdir().unwrap();
    let root = repo_root();
    let target = root.join("target/filters-new");
    let native = root.join("target/filters-new-native");
    for (name, template) in [("api-version-guard", "reply"), ("team-header", "header"), ("tenant-gate", "allowlist")] {
        // Outside the repository: the SDK is found where posternctl was built from.
        let made = run_ok(posternctl(work.path()).args(["filter", "new", name, "--template", template]));
        assert!(made.contains(&format!("created filter {name} in {name}")), "{made}");
        let dir = work.path().join(name);
        for f in ["Cargo.toml", "Cargo.lock", ".cargo/config.toml", "src/lib.rs", &format!("{name}.yaml")] {
            assert!(dir.join(f).exists(), "{name}: no {f}");
        }
        let tests =
            Command::new("cargo").arg("test").current_dir(&dir).env("CARGO_TARGET_DIR", &native).output().unwrap();
        assert!(tests.status.success(), "{name}: cargo test failed:\n{}", text(&tests));
        let passed = text(&tests);
        assert!(
            passed.contains("test result: ok. 3 passed") || passed.contains("test result: ok. 4 passed"),
            "{passed}"
        );

        let built = run_ok(posternctl(&dir).args(["filter", "build"]).env("CARGO_TARGET_DIR", &target));
        let wasm = dir.join(format!("{}.wasm", name.replace('-', "_")));
        let digest = postern_e2e::file_digest(&wasm);
        assert!(built.contains(&format!("  digest   {digest}")), "{built}");
        assert!(built.contains("  imports  postern:filter/host@0.3.0"), "{built}");
        assert!(built.contains("  verdict  ok"), "{built}");
        let size = std::fs::metadata(&wasm).unwrap().len();
        assert!(built.contains(&format!("({size} bytes, ")), "{built}");
    }

    let guard = work.path().join("api-version-guard");
    let built = run_ok(
        posternctl(work.path())
            .args(["filter", "build", "--manifest-path", "api-version-guard/Cargo.toml"])
            .env("CARGO_TARGET_DIR", &target),
    );
    assert!(built.contains("\"an old client gets 426\": ok: respond 426"), "{built}");
    assert!(built.contains("log info client version 2.0 is below 2.1"), "{built}");
    assert!(built.contains("\"a current client goes on, marked\": ok: continue"), "{built}");

    // `filter run` shows what the filter logged and counted beside its decision.
    let ran = run_ok(posternctl(&guard).args([
        "filter",
        "run",
        "api_version_guard.wasm",
        "--config",
        r#"{"header": "x-client-version", "minimum": "2.1"}"#,
        "-H",
        "x-client-version: 1.9",
    ]));
    let v: serde_json::Value = serde_json::from_str(&ran).unwrap();
    let phase = &v["phases"][0];
    assert_eq!(phase["status"], 426, "{ran}");
    assert_eq!(phase["logs"][0]["level"], "info", "{ran}");
    assert_eq!(phase["logs"][0]["message"], "client version 1.9 is below 2.1", "{ran}");
    assert_eq!(phase["counters"]["too_old"], 1, "{ran}");
    assert!(phase["memory_bytes"].as_u64().unwrap() >= 65536, "{ran}");
    let body: serde_json::Value = serde_json::from_str(phase["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["code"], "client_too_old");
    assert_eq!(body["request_id"], v["request_id"], "the problem names the request's id: {ran}");

    // A sample that no longer holds fails the build's review, naming it.
    let manifest = guard.join("api-version-guard.yaml");
    let yaml = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, yaml.replacen("status: 426", "status: 400", 1)).unwrap();
    let out = posternctl(&guard).args(["filter", "build"]).env("CARGO_TARGET_DIR", &target).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("\"an old client gets 426\": expected respond 400, got respond 426"), "{}", text(&out));
    std::fs::write(&manifest, yaml).unwrap();

    // The platform approves it into a registry, and says what the next version changes.
    let approvals = work.path().join("config/platform/filters.yaml");
    let approve = |reviewer: &str| {
        run_ok(posternctl(&guard).args([
            "filter",
            "approve",
            "api_version_guard.wasm",
            "--team",
            "echo",
            "--reviewer",
            reviewer,
            "--approvals",
            approvals.to_str().unwrap(),
        ]))
    };
    let first = approve("alice");
    assert!(first.contains("first approved version of api-version-guard for team echo"), "{first}");
    let registry = std::fs::read_to_string(&approvals).unwrap();
    let digest = postern_e2e::file_digest(&guard.join("api_version_guard.wasm"));
    assert!(registry.contains(&format!("\"digest\":\"{digest}\"")), "{registry}");
    assert!(registry.contains("\"reviewer\":\"alice\""), "{registry}");

    // A new version: a longer detail in the reply.
    let lib = guard.join("src/lib.rs");
    let src = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(&lib, src.replace("or later\"", "or later; see the changelog\"")).unwrap();
    run_ok(posternctl(&guard).args(["filter", "build"]).env("CARGO_TARGET_DIR", &target));
    let second = approve("bob");
    assert!(second.contains(&format!("replaces {digest} (approved by alice at ")), "{second}");
    assert!(second.contains("  imports  unchanged"), "{second}");
    assert!(second.contains("  fuel     \"an old client gets 426\": "), "{second}");
    assert!(second.contains("approved api-version-guard (sha256:"), "{second}");
}
