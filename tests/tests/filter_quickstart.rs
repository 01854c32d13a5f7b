//! The filter quick start (`docs/filters.md`), run as written against the demo
//! (`examples/demo.sh`), as `readme.rs` runs the README's tour: a filter made by
//! `posternctl filter new`, tested, built, run, approved by `posternctl filter approve`,
//! attached to a new route and published answers on the demo's node-a, and its log line
//! there carries the request's id.
//!
//! The demo listens on the fixed ports the README names, so this test fails at once,
//! saying so, if something else (a demo left running) holds them.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use postern_e2e::bin;

/// The demo's processes, stopped when the test ends however it ends.
struct Demo {
    state: PathBuf,
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Ok(pids) = std::fs::read_to_string(self.state.join("pids")) {
            for pid in pids.split_whitespace() {
                let _ = Command::new("kill").arg(pid).status();
            }
        }
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The quick start's commands: each line of its code block between the markers, a
/// here-document (`<<'EOF'` to `EOF`) kept with the line that opens it.
fn commands(doc: &str) -> Vec<String> {
    let start = doc.find("<!-- quickstart:start -->").expect("docs/filters.md has a quickstart:start marker");
    let end = doc.find("<!-- quickstart:end -->").expect("docs/filters.md has a quickstart:end marker");
    let mut out: Vec<String> = Vec::new();
    let mut heredoc: Option<String> = None;
    for line in doc[start..end].lines().filter(|l| !l.starts_with("```") && !l.starts_with("<!--")) {
        if let Some(cmd) = heredoc.as_mut() {
            cmd.push('\n');
            cmd.push_str(line);
            if line == "EOF" {
                out.push(heredoc.take().unwrap());
            }
        } else if line.contains("<<'EOF'") {
            heredoc = Some(line.to_owned());
        } else if !line.trim().is_empty() {
            out.push(line.to_owned());
        }
    }
    assert!(heredoc.is_none(), "an unterminated here-document");
    out
}

/// A line's comment (after its first ` # `).
fn comment(cmd: &str) -> &str {
    let first = cmd.lines().next().unwrap_or("");
    first.split_once(" # ").map_or("", |(_, c)| c.trim())
}

/// What each line must show beyond succeeding: `(part of the line, what it must print)`.
fn claims() -> Vec<(&'static str, &'static [&'static str])> {
    vec![
        ("filter new", &["created filter api-version-guard in api-version-guard"]),
        ("cargo test", &["test result: ok. 4 passed"]),
        (
            "filter build",
            &[
                "  imports  postern:filter/host@0.3.0",
                "\"an old client gets 426\": ok: respond 426",
                "log info client version 2.0 is below 2.1",
                "  verdict  ok",
            ],
        ),
        (
            "filter run",
            &[
                "\"status\": 426",
                "\"message\": \"client version 1.9 is below 2.1\"",
                "\"too_old\": 1",
                "\"memory_bytes\"",
            ],
        ),
        ("filter approve", &["  verdict  ok", "first approved version of api-version-guard for team echo"]),
        ("posternctl publish", &["v2 published: served by node-a (the first stage)"]),
        ("filter cost", &["filter api-version-guard: 2 calls (ok 2)", "on the node at http://127.0.0.1:9901", "max "]),
    ]
}

#[test]
fn every_command_of_the_filter_quick_start_works_as_written_against_the_demo() {
    for port in [8080, 8081, 8180, 8181, 9001, 9002, 9003, 9400, 9901, 9911] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "127.0.0.1:{port} is taken: stop the demo (or whatever holds it) before running this test"
        );
    }
    let root = repo_root();
    let doc = std::fs::read_to_string(root.join("docs/filters.md")).unwrap();
    let cmds = commands(&doc);
    assert!(cmds.len() >= 10, "the quick start has {} commands", cmds.len());
    for (part, _) in claims() {
        assert_eq!(cmds.iter().filter(|c| c.contains(part)).count(), 1, "the claim on {part:?} names one command");
    }

    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("demo-state");
    let _demo = Demo { state: state.clone() };
    let bin_dir = bin("postern").parent().unwrap().to_path_buf();
    let filters = postern_e2e::filter_wasm("header-injector").parent().unwrap().to_path_buf();
    let mut child = Command::new("bash")
        .arg(root.join("examples/demo.sh"))
        .arg(&bin_dir)
        .current_dir(work.path())
        .env("DEMO_STATE", &state)
        .env("DEMO_DETACH", "1")
        .env("FILTERS_DIR", &filters)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("examples/demo.sh");
    let mut printed = String::new();
    child.stdout.take().unwrap().read_to_string(&mut printed).unwrap();
    let mut progress = String::new();
    child.stderr.take().unwrap().read_to_string(&mut progress).unwrap();
    assert!(child.wait().unwrap().success(), "the demo did not start:\n{progress}\n{printed}");
    let exports: String =
        printed.lines().map(str::trim_start).filter(|l| l.starts_with("export ")).map(|l| format!("{l}\n")).collect();
    let env_file = work.path().join("demo.env");
    std::fs::write(&env_file, &exports).unwrap();

    let claims = claims();
    let mut request_id = None;
    for cmd in &cmds {
        let script = format!(". {}\n{cmd}\n", env_file.display());
        let out = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(work.path())
            // The filter crate's dependencies build once, shared with the other runs.
            .env("CARGO_TARGET_DIR", root.join("target/filters-new"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "`{cmd}` failed ({}):\n{stdout}\n{stderr}", out.status);
        let said = comment(cmd);
        // `# 426 ...` / `# 200: ...`: the status curl printed.
        if let Some(code) = said.get(..3).filter(|c| c.bytes().all(|b| b.is_ascii_digit())) {
            let got = stdout.lines().find(|l| l.starts_with("HTTP/")).unwrap_or("");
            assert_eq!(got.split_whitespace().nth(1), Some(code), "`{cmd}`:\n{stdout}");
        }
        for (part, wants) in claims.iter().filter(|(p, _)| cmd.contains(p)) {
            for want in *wants {
                let all = format!("{stdout}{stderr}");
                assert!(all.contains(want), "`{part}`: expected {want:?} in:\n{all}");
            }
        }
        if cmd.contains("x-client-version: 1.9' http") {
            assert!(stdout.contains("application/problem+json"), "{stdout}");
            let body = stdout.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            assert_eq!(v["code"], "client_too_old", "{stdout}");
            let id = stdout
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("x-request-id:").map(|v| v.trim().to_owned()))
                .expect("an x-request-id on the answer");
            assert_eq!(v["request_id"], id.as_str(), "the problem names the request's id: {stdout}");
            request_id = Some(id);
        }
        if cmd.contains("x-client-version: 2.4' http") {
            let body = stdout.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            let seen = v["headers"].as_array().cloned().unwrap_or_default();
            assert!(
                seen.iter().any(|h| h[0] == "x-client-version-checked" && h[1] == "ok"),
                "the backend saw the filter's header: {stdout}"
            );
        }
        if cmd.starts_with("grep ") {
            let id = request_id.as_deref().expect("the 426 came first");
            let named = [format!("request_id={id}"), format!("request_id=\"{id}\"")];
            assert!(named.iter().any(|n| stdout.contains(n)), "the log line names the request id {id}:\n{stdout}");
            assert!(stdout.contains("api-version-guard@echo/echo-guarded"), "and the filter and route:\n{stdout}");
        }
    }
    assert!(request_id.is_some(), "the quick start reached the 426");

    // `filter cost` on the quick start's two calls: the mean and the largest are exact, so
    // the smaller call is 2 × mean − max; the percentiles it prints are within 10 % of the
    // true ones (p50: the smaller call; p90, p99: the larger).
    let out = Command::new(bin("posternctl"))
        .args(["filter", "cost", "--route", "echo/echo-guarded", "--admin", "http://127.0.0.1:9901", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fuel = &v["filters"]["api-version-guard"]["fuel"];
    let (mean, max) = (fuel["mean"].as_f64().unwrap(), fuel["max"].as_f64().unwrap());
    let min = 2.0 * mean - max;
    assert!(min > 0.0 && min < max, "two calls of different cost (the 426 formats its reply): {v}");
    for (q, truth) in [("p50", min), ("p90", max), ("p99", max)] {
        let got = fuel[q].as_f64().unwrap();
        assert!((got - truth).abs() <= 0.1 * truth, "{q}: printed {got}, true {truth}: {v}");
    }
    assert_eq!(v["node"], "http://127.0.0.1:9901");
    let registry = std::fs::read_to_string(state.join("config/platform/filters.yaml")).unwrap();
    assert!(
        registry.contains("\"filter\":\"api-version-guard\",\"team\":\"echo\",\"reviewer\":\"alice\""),
        "{registry}"
    );
}

#[test]
fn here_documents_stay_with_their_command() {
    let doc = "<!-- quickstart:start -->\n```sh\na   # one\ncat > f <<'EOF'   # two\nx: 1\n  y\nEOF\nb\n```\n<!-- quickstart:end -->\n";
    let c = commands(doc);
    assert_eq!(c, ["a   # one", "cat > f <<'EOF'   # two\nx: 1\n  y\nEOF", "b"]);
    assert_eq!(comment(&c[1]), "two");
}
