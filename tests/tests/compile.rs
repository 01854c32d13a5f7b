//! `posternctl compile` on a broken repository: non-zero exit, every error named by file,
//! field and owner, and the previous snapshot left untouched. Filter sample cases run at
//! compile time here, apart from the hostile-filter tests, whose deadlines they would
//! compete with for the CPU.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use postern_e2e::wasm_fixture::route;
use postern_e2e::{Repo, add_filter, filter_wasm, platform};

#[test]
fn compile_errors_name_file_field_and_owner() {
    let repo = Repo::new();
    platform(&repo, &[("a", "127.0.0.1:9")]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: ok\n    public: true\n    match: { path: { value: /ok } }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let before = std::fs::read(&snap).unwrap();

    repo.write(
        "teams/t/more.yaml",
        r#"routes:
  - name: slow
    public: true
    match: { path: { value: /slow } }
    backendRefs: [{ name: nowhere }]
    timeouts: { connect: 1s, response: 45s }
"#,
    );
    repo.write(
        "teams/u/routes.yaml",
        "routes:\n  - name: x\n    public: true\n    match: { path: { value: /ok } }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n    colour: blue\n",
    );
    let out = repo.compile(&snap);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "teams/t/more.yaml: routes[0].timeouts.response: 45s is over the platform maximum of 30s (owner: t)"
        ),
        "{err}"
    );
    assert!(
        err.contains("teams/t/more.yaml: routes[0].backendRefs[0].name: unknown cluster \"nowhere\" (owner: t)"),
        "{err}"
    );
    assert!(err.contains("teams/u/routes.yaml: routes[0].colour: unknown field `colour`"), "{err}");
    assert!(err.contains("at line 7 column 5 (owner: u)"), "{err}");
    assert_eq!(std::fs::read(&snap).unwrap(), before, "a rejected change must not touch the published snapshot");
}

#[test]
fn the_example_config_compiles() {
    let out = tempfile::tempdir().unwrap();
    let repo = out.path().join("config");
    postern_e2e::prepare_example_config(&repo, &[]);
    let snap = out.path().join("snapshot.json");
    let o = std::process::Command::new(postern_e2e::bin("posternctl"))
        .arg("compile")
        .arg(&repo)
        .arg("-o")
        .arg(&snap)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&snap).unwrap()).unwrap();
    let routes = v["content"]["routes"].as_array().unwrap();
    let teams: std::collections::BTreeSet<&str> = routes.iter().filter_map(|r| r["team"].as_str()).collect();
    assert!(routes.len() >= 8 && teams.len() >= 3, "{} routes, teams {teams:?}", routes.len());
    assert!(routes.iter().any(|r| r["path"] == "/v1/echo" && r["pool"] == "public"));
}

#[test]
fn a_filter_failing_its_own_sample_cases_is_refused_at_compile() {
    let repo = Repo::new();
    platform(&repo, &[("e", "127.0.0.1:9")]);
    add_filter(&repo, "t", "hmac-verifier", &filter_wasm("hmac-verifier"), "{}");
    add_filter(&repo, "t", "header-injector", &filter_wasm("header-injector"), "{}");
    repo.write(
        "teams/t/routes.yaml",
        &format!(
            "routes:\n{}{}",
            route("hook", "/hook", "hmac-verifier", ", config: { secret: s }"),
            route("tagged", "/tagged", "header-injector", "")
        ),
    );
    // Samples that hold: an unsigned webhook is refused, the injector sets its header.
    let manifest = |name: &str, samples: &str| {
        repo.write(&format!("teams/t/filters/{name}.yaml"), &format!("module: {name}.wasm\nsamples:\n{samples}"));
    };
    manifest(
        "hmac-verifier",
        "  - name: unsigned webhook\n    config: { secret: s }\n    request: { method: POST, path: /hook }\n    expect: { decision: respond, status: 401 }\n",
    );
    manifest(
        "header-injector",
        "  - name: sets the team\n    config: { set: { x-team: payments } }\n    request: { path: /tagged }\n    expect: { decision: continue, setHeaders: { x-team: payments } }\n",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);

    // Samples that no longer hold are refused, each named with its file and case.
    manifest(
        "hmac-verifier",
        "  - name: unsigned webhook passes\n    config: { secret: s }\n    request: { method: POST, path: /hook }\n    expect: { decision: continue }\n",
    );
    manifest(
        "header-injector",
        "  - name: sets the team\n    config: { set: { x-team: billing } }\n    request: { path: /tagged }\n    expect: { decision: continue, setHeaders: { x-team: payments } }\n",
    );
    let out = repo.compile(&snap);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "teams/t/filters/hmac-verifier.yaml: samples[0]: \"unsigned webhook passes\": expected continue, got respond 401 (owner: t)"
        ),
        "{err}"
    );
    assert!(
        err.contains(
            "teams/t/filters/header-injector.yaml: samples[0]: \"sets the team\": expected header x-team set to \"payments\", it was set to \"billing\" (owner: t)"
        ),
        "{err}"
    );
}

#[test]
fn a_filter_sample_runs_the_response_phase_on_its_response() {
    let repo = Repo::new();
    platform(&repo, &[("e", "127.0.0.1:9")]);
    add_filter(&repo, "t", "header-spoofer", &filter_wasm("header-spoofer"), "{}");
    repo.write("teams/t/routes.yaml", &format!("routes:\n{}", route("s", "/s", "header-spoofer", "")));
    let manifest = |samples: &str| {
        repo.write("teams/t/filters/header-spoofer.yaml", &format!("module: header-spoofer.wasm\nsamples:\n{samples}"));
    };
    let snap = repo.path().join("snapshot.json");
    // What the node does with the response: a header the gateway allows is set, a forged
    // framing header is refused.
    manifest(
        "  - name: tags the response\n    config: { 'response:x-team': payments }\n    request: { path: /s }\n    response: { status: 200, headers: { content-type: text/plain } }\n    expect: { decision: continue, setHeaders: { x-team: payments } }\n  - name: forged framing\n    config: { 'response:transfer-encoding': chunked }\n    request: { path: /s }\n    response: { status: 200 }\n    expect: { decision: failed }\n",
    );
    repo.compile_ok(&snap);
    let before = std::fs::read(&snap).unwrap();

    // A sample expecting the forged response edit to pass is refused, naming the rule.
    manifest(
        "  - name: forged framing passes\n    config: { 'response:transfer-encoding': chunked }\n    request: { path: /s }\n    response: { status: 200 }\n    expect: { decision: continue, setHeaders: { transfer-encoding: chunked } }\n",
    );
    let out = repo.compile(&snap);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "teams/t/filters/header-spoofer.yaml: samples[0]: \"forged framing passes\": expected continue, got failed \
             (bad_output: the answer breaks the rule reserved_header) in the response phase (owner: t)"
        ),
        "{err}"
    );
    assert_eq!(std::fs::read(&snap).unwrap(), before, "a refused sample must not touch the published snapshot");
}

#[test]
fn a_config_its_filter_refuses_is_refused_at_compile_with_the_filters_reason() {
    let repo = Repo::new();
    platform(&repo, &[("e", "127.0.0.1:9")]);
    add_filter(&repo, "t", "header-injector", &filter_wasm("header-injector"), "{}");
    let routes = |config: &str| {
        repo.write(
            "teams/t/routes.yaml",
            &format!("routes:\n{}", route("tagged", "/tagged", "header-injector", config)),
        );
    };
    let snap = repo.path().join("snapshot.json");
    routes(", config: { set: { x-team: payments } }");
    repo.compile_ok(&snap);
    let before = std::fs::read(&snap).unwrap();

    // The filter's `init` refuses the config: the route is refused, not every request.
    routes(", config: { set: { X-Team: payments } }");
    let out = repo.compile(&snap);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "teams/t/routes.yaml: routes[0].wasmFilters[0].config: filter header-injector: the filter refused its \
             config: invalid config: set: \"X-Team\" is not a lowercase header name (owner: t)"
        ),
        "{err}"
    );
    assert_eq!(std::fs::read(&snap).unwrap(), before, "a refused config must not touch the published snapshot");
}

/// Runs `posternctl compile` on `repo`; fails the test if it has not ended within a
/// generous hang guard (a compile that reads a FIFO or `/dev/zero` would never end).
fn compile_guarded(repo: &Repo) -> (Option<i32>, String) {
    use std::process::{Command, Stdio};
    let snap = repo.path().join("snapshot.json");
    let mut child = Command::new(postern_e2e::bin("posternctl"))
        .arg("compile")
        .arg(repo.path())
        .arg("-o")
        .arg(&snap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > guard {
            let _ = child.kill();
            let _ = child.wait();
            panic!("posternctl compile still running after 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_teams_proto_imports_only_its_own_regular_files() {
    const PROTO: &str = "syntax = \"proto3\";\npackage t.v1;\nIMPORT\nimport \"google/api/annotations.proto\";\n\
        message Get { string id = 1; }\n\
        service Things { rpc GetThing(Get) returns (Get) { option (google.api.http) = { get: \"/t/v1/things/{id}\" }; } }\n";
    let repo = Repo::new();
    platform(&repo, &[("a", "127.0.0.1:9")]);
    repo.write("platform/clusters.yaml", "clusters:\n  a: { endpoints: [\"127.0.0.1:9\"], protocol: http2 }\n");
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: g\n    public: true\n    match: { path: { type: PathPrefix, value: /t } }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n    grpc: { proto: things.proto, service: t.v1.Things }\n",
    );
    for f in ["annotations.proto", "http.proto"] {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/config/teams/orders/proto/google/api")
            .join(f);
        repo.write(&format!("teams/t/proto/google/api/{f}"), &std::fs::read_to_string(from).unwrap());
    }
    repo.write("teams/t/proto/things.proto", &PROTO.replace("IMPORT", ""));
    let (code, err) = compile_guarded(&repo);
    assert_eq!(code, Some(0), "{err}");

    // A FIFO no one writes to: a blocking open would hang the compile (and a publish
    // holding its lock) for ever.
    let fifo = repo.path().join("teams/t/proto/fifo.proto");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    // A file elsewhere on the host, reached by a way out of the folder.
    repo.write("secret.proto", "syntax = \"proto3\";\n");
    std::os::unix::fs::symlink(repo.path().join("secret.proto"), repo.path().join("teams/t/proto/link.proto")).unwrap();
    for (import, why) in [
        ("/dev/zero", "an absolute path (imports are relative to teams/t/proto/)"),
        ("../../x.proto", "'..' or '.' in a path (imports stay inside teams/t/proto/)"),
        ("fifo.proto", "not a regular file, refused"),
        ("link.proto", "a symbolic link out of teams/t/proto/"),
    ] {
        repo.write("teams/t/proto/things.proto", &PROTO.replace("IMPORT", &format!("import \"{import}\";")));
        let (code, err) = compile_guarded(&repo);
        assert_eq!(code, Some(1), "{err}");
        let want = format!("teams/t/proto/things.proto: does not compile: \"{import}\" refused: {why} (owner: t)");
        assert!(err.contains(&want), "{import}: want {want:?} in\n{err}");
    }
    // The team's YAML files are read by the same rules: a FIFO among them is refused.
    std::fs::remove_file(&fifo).unwrap();
    repo.write("teams/t/proto/things.proto", &PROTO.replace("IMPORT", ""));
    let made = std::process::Command::new("mkfifo").arg(repo.path().join("teams/t/more.yaml")).status().unwrap();
    assert!(made.success());
    let (code, err) = compile_guarded(&repo);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("teams/t/more.yaml: cannot read: not a regular file, refused"), "{err}");
}
