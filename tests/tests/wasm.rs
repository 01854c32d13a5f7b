//! Wasm filter modules that import WASI files or sockets are refused when the snapshot is
//! built (by the compiler and by the node), and `posternctl filter run` tests a build in the
//! real sandbox. The hostile filters themselves are in `hostile.rs`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::wasm_fixture::{fixture, route};
use postern_e2e::{Repo, add_filter, filter_wasm, get, platform};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_importing_files_or_sockets_are_refused() {
    // At compile time, with the file and field named.
    for name in ["wasi-fs", "wasi-sockets"] {
        let repo = Repo::new();
        platform(&repo, &[("e", "127.0.0.1:9")]);
        add_filter(&repo, "t", name, &filter_wasm(name), "{}");
        repo.write("teams/t/routes.yaml", &format!("routes:\n{}", route("r", "/r", name, "")));
        let out = repo.compile(&repo.path().join("snapshot.json"));
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        let iface = if name == "wasi-fs" { "wasi:filesystem" } else { "wasi:sockets" };
        assert!(err.contains(&format!("teams/t/filters/{name}.yaml: module: module sha256:")), "{err}");
        assert!(err.contains("imports ") && err.contains(iface), "{err}");
    }

    // At the node, when a snapshot that got past the compiler references one: refused,
    // the old snapshot keeps serving.
    let f = fixture();
    let snap = f.repo.path().join("out/snapshot.json");
    let text = std::fs::read_to_string(&snap).unwrap();
    let fs = filter_wasm("wasi-fs");
    let digest = postern_e2e::file_digest(&fs);
    std::fs::copy(&fs, f.repo.path().join(format!("out/modules/{}.wasm", digest.trim_start_matches("sha256:"))))
        .unwrap();
    let good = postern_e2e::file_digest(&filter_wasm("well-behaved"));
    let (file, mut snapshot) = postern_model::SnapshotFile::open(text.as_bytes()).unwrap();
    for r in &mut snapshot.routes {
        for f in &mut r.filters {
            if f.config["module"] == good.as_str() {
                f.config["module"] = serde_json::Value::String(digest.clone());
            }
        }
    }
    let sealed = postern_model::SnapshotFile::seal(file.version + 1, &snapshot).unwrap();
    std::fs::write(&snap, serde_json::to_vec(&sealed).unwrap()).unwrap();
    f.node.proc.signal(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f.node.log().contains("wasi:filesystem/types") {
        assert!(Instant::now() < deadline, "not refused:\n{}", f.node.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.node.version().await, 1);
    assert_eq!(get(&f.node.url("/good"), &[]).await.status, StatusCode::OK);
}

#[test]
fn posternctl_filter_run_tests_a_build_in_the_real_sandbox_and_refuses_what_the_node_refuses() {
    let run = |name: &str, extra: &[&str]| {
        std::process::Command::new(postern_e2e::bin("posternctl"))
            .args(["filter", "run"])
            .arg(filter_wasm(name))
            .args(extra)
            .output()
            .unwrap()
    };
    // The platform's maximum deadline rather than the default 5 ms: these runs check
    // decisions, and a debug build's first call on a busy host (the neighbouring test
    // compiles modules on both cores meanwhile) can take longer.
    let limits = r#"{"deadline_ms": 50}"#;
    let out = run("well-behaved", &["--path", "/x?y=1", "-H", "x-in: 1", "--limits", limits]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["decision"], "continue");
    assert_eq!(v["phases"][0]["set_headers"][0], serde_json::json!(["x-well-behaved", "yes"]));
    assert!(v["phases"][0]["fuel"].as_u64().unwrap() > 0);

    let out = run("loop-forever", &["--limits", r#"{"fuel": 1000000, "deadline_ms": 50}"#]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["outcome"], "fuel_exhausted");

    let cfg = r#"{"secret":"s"}"#;
    let out = run("hmac-verifier", &["--config", cfg, "--limits", limits, "--method", "POST", "--path", "/hook"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["decision"], "respond");
    assert_eq!(v["phases"][0]["status"], 401);

    // What the node refuses, `filter run` refuses too, naming the same rule.
    let out = run("huge-header", &["--limits", r#"{"memory_bytes": 67108864, "fuel": 100000000, "deadline_ms": 50}"#]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["outcome"], "bad_output");
    assert_eq!(v["phases"][0]["rule"], "header_count");
    for name in ["x-auth-subject", "x_auth_subject", "X.Auth.Tenant", "content-length"] {
        let cfg = format!(r#"{{"{name}": "admin"}}"#);
        let out = run("header-spoofer", &["--config", &cfg, "--limits", limits]);
        assert_eq!(out.status.code(), Some(1), "{name}: {}", String::from_utf8_lossy(&out.stdout));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["phases"][0]["outcome"], "bad_output", "{name}: {v}");
        assert_eq!(v["phases"][0]["rule"], "reserved_header", "{name}: {v}");
        assert_eq!(v["ok"], false);
        // The header injector checks its config with the same rules, at init.
        let cfg = format!(r#"{{"set": {{"{}": "admin"}}}}"#, name.to_ascii_lowercase());
        let out = run("header-injector", &["--config", &cfg, "--limits", limits]);
        assert_eq!(out.status.code(), Some(1), "{name}: {}", String::from_utf8_lossy(&out.stdout));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["phases"][0]["outcome"], "config_refused", "{name}: {v}");
        assert!(v["phases"][0]["error"].as_str().unwrap().contains("is a header the gateway owns"), "{name}: {v}");
    }

    // A path edit is refused under the platform's path policy, as the node refuses it.
    let out = run("header-spoofer", &["--config", r#"{":path": "/a/../admin"}"#, "--limits", limits]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["outcome"], "bad_output", "{v}");
    assert_eq!(v["phases"][0]["rule"], "path_canonical", "{v}");
    assert_eq!(v["phases"].as_array().unwrap().len(), 1, "{v}");

    // With a response, the response phase runs after the request phase, judged by the
    // node's rules: a forged response header is refused, naming its rule...
    let cfg = r#"{"response:transfer-encoding": "chunked"}"#;
    let out = run("header-spoofer", &["--config", cfg, "--limits", limits, "--response-status", "201"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["phase"], "request", "{v}");
    assert_eq!(v["phases"][0]["decision"], "continue", "{v}");
    assert_eq!(v["phases"][1]["phase"], "response", "{v}");
    assert_eq!(v["phases"][1]["outcome"], "bad_output", "{v}");
    assert_eq!(v["phases"][1]["rule"], "reserved_header", "{v}");
    assert_eq!(v["phases"][1]["answer"]["set_headers"][0], serde_json::json!(["transfer-encoding", "chunked"]));
    assert_eq!(v["ok"], false);
    // ...an allowed one is reported with the edits...
    let cfg = r#"{"response:x-team": "payments"}"#;
    let out =
        run("header-spoofer", &["--config", cfg, "--limits", limits, "--response-header", "content-type: text/plain"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][1]["phase"], "response", "{v}");
    assert_eq!(v["phases"][1]["decision"], "continue", "{v}");
    assert_eq!(v["phases"][1]["set_headers"][0], serde_json::json!(["x-team", "payments"]), "{v}");
    assert_eq!(v["ok"], true);
    // ...and a request the filter answers itself gets no response phase.
    let cfg = r#"{"secret":"s"}"#;
    let out = run(
        "hmac-verifier",
        &["--config", cfg, "--limits", limits, "--method", "POST", "--path", "/hook", "--response-status", "200"],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["phases"][0]["decision"], "respond", "{v}");
    let out = run("well-behaved", &["--limits", limits, "--response-status", "99"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("response status 99 is not 100-599"));

    let out = run("well-behaved", &["--limits", r#"{"fuel": 1000000000000}"#]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("over the platform maximum"));
}
