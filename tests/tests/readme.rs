//! README.md's tour, run as written against the demo (`examples/demo.sh`, the script
//! `make demo` runs), so the README cannot drift from what the product does.
//!
//! The demo listens on the fixed ports the README names (127.0.0.1:8080, 9400, …), so
//! this test fails at once, saying so, if something else (a demo left running) holds
//! them.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
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

/// The shell lines of README.md's tour (the code blocks between its tour markers).
fn tour(readme: &str) -> Vec<String> {
    let start = readme.find("<!-- tour:start -->").expect("README.md has a tour:start marker");
    let end = readme.find("<!-- tour:end -->").expect("README.md has a tour:end marker");
    let mut lines = Vec::new();
    let mut in_code = false;
    for line in readme[start..end].lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if in_code && !line.trim().is_empty() {
            lines.push(line.to_owned());
        }
    }
    lines
}

/// A line's command and its comment (after the last ` # `).
fn split_comment(line: &str) -> (&str, &str) {
    line.rsplit_once(" # ").map_or((line, ""), |(cmd, c)| (cmd.trim_end(), c.trim()))
}

/// The status a line's comment names first (`# 401 invalid_credentials`, `# 200: ...`).
fn expected_status(line: &str) -> Option<&str> {
    let comment = split_comment(line).1;
    let code = comment.get(..3)?;
    (code.bytes().all(|b| b.is_ascii_digit()) && !comment[3..].starts_with(|c: char| c.is_ascii_digit()))
        .then_some(code)
}

/// The line's last command is `grep`: it fails when what the comment promises is absent.
fn ends_in_grep(line: &str) -> bool {
    let cmd = split_comment(line).0;
    cmd.contains('|') && cmd.rsplit('|').next().is_some_and(|last| last.trim_start().starts_with("grep "))
}

/// What a tour line printed, and where it ran.
struct Ran<'a> {
    out: &'a str,
    err: &'a str,
    dir: &'a Path,
    vars: &'a BTreeMap<String, String>,
}

impl Ran<'_> {
    fn has(&self, s: &str) -> bool {
        self.out.to_ascii_lowercase().contains(&s.to_ascii_lowercase())
    }

    /// A response header's value (`curl -i`'s head; names ignore case).
    fn header(&self, name: &str) -> Option<&str> {
        let head = self.out.split("\r\n\r\n").next().unwrap_or("");
        head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// The answer's body, as JSON (Null when it is not).
    fn body(&self) -> serde_json::Value {
        let body = self.out.split_once("\r\n\r\n").map_or(self.out, |(_, b)| b);
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
    }

    /// The request headers the echo backend saw, as (name, value) pairs.
    fn seen_headers(&self) -> Vec<(String, String)> {
        let body = self.body();
        body["headers"]
            .as_array()
            .map(|hs| hs.iter().filter_map(|h| Some((h[0].as_str()?.to_owned(), h[1].as_str()?.to_owned()))).collect())
            .unwrap_or_default()
    }

    /// The first line printed (a posternctl summary).
    fn summary(&self) -> &str {
        self.out.lines().next().unwrap_or("")
    }

    /// No credential the tour exported appears in what was printed.
    fn no_credential(&self) -> bool {
        ["PARTNER_KEY", "FREE_KEY", "TOKEN", "NEW_KEY"]
            .iter()
            .filter_map(|k| self.vars.get(*k))
            .all(|secret| secret.len() < 8 || !self.out.contains(secret.as_str()))
    }
}

/// A claim a tour line's comment makes, beyond its status: `line` is a part of exactly
/// one tour line, `says` what must hold, `holds` checks it on what the line printed.
struct Claim {
    line: &'static str,
    says: &'static str,
    holds: fn(&Ran<'_>) -> bool,
}

fn claims() -> Vec<Claim> {
    vec![
        Claim {
            line: "/v1/echo/hello?x=1",
            says: "an x-request-id on the answer",
            holds: |r| r.header("x-request-id").is_some(),
        },
        Claim {
            line: "/v2/echo/hello ",
            says: "the backend sees /echo/hello",
            holds: |r| r.body()["path"] == "/echo/hello",
        },
        Claim {
            line: "$PARTNER_KEY\" http://127.0.0.1:8080/v1/orders/42",
            says: "the backend sees x-auth-* identity headers, never the key",
            holds: |r| r.seen_headers().iter().any(|(n, _)| n.starts_with("x-auth-")) && r.no_credential(),
        },
        Claim {
            line: "Bearer $TOKEN\" http://127.0.0.1:8080/v1/orders/42",
            says: "the backend sees alice as the subject, never the token",
            holds: |r| {
                r.seen_headers().iter().any(|(n, v)| n.starts_with("x-auth-") && v == "alice") && r.no_credential()
            },
        },
        Claim {
            line: "\"quantity\":0",
            says: "the errors name /items/0/quantity and /shipping/country",
            holds: |r| r.has("/items/0/quantity") && r.has("/shipping/country"),
        },
        Claim { line: "colour=red", says: "the error names colour", holds: |r| r.has("colour") },
        Claim {
            line: "accept-encoding: gzip",
            says: "content-encoding: gzip",
            holds: |r| r.has("content-encoding: gzip"),
        },
        Claim {
            line: "api-version: 2026-06-01",
            says: "served by orders-v2",
            holds: |r| r.body()["backend"] == "orders-v2",
        },
        Claim {
            line: "/v2/orders/1 |",
            says: "the backend and the A/B tag",
            holds: |r| r.has("\"backend\"") && r.has("x-experiment"),
        },
        Claim {
            line: "tenants/x?n=[1-7]",
            says: "403s (at most the burst's 5), then 429s to the end",
            holds: |r| {
                let codes: Vec<&str> = r.out.split_whitespace().collect();
                let allowed = codes.iter().take_while(|c| **c == "403").count();
                codes.len() == 7 && (1..=5).contains(&allowed) && codes[allowed..].iter().all(|c| *c == "429")
            },
        },
        Claim {
            line: "/v1/products/1",
            says: "Deprecation, Sunset and Link headers",
            holds: |r| ["deprecation", "sunset", "link"].iter().all(|h| r.header(h).is_some()),
        },
        Claim {
            line: "x-auth-subject: admin",
            says: "the backend never sees the spoofed identity",
            holds: |r| !r.seen_headers().is_empty() && !r.seen_headers().iter().any(|(n, _)| n.starts_with("x-auth-")),
        },
        Claim {
            line: "-X DELETE",
            says: "problem+json with Allow",
            holds: |r| r.header("allow").is_some() && r.header("content-type") == Some("application/problem+json"),
        },
        Claim {
            line: "/v1/echo/wasm |",
            says: "x-filter and x-demo headers",
            holds: |r| r.has("x-filter") && r.has("x-demo"),
        },
        Claim {
            line: "9901/snapshot ",
            says: "the running version and its hash",
            holds: |r| {
                serde_json::from_str::<serde_json::Value>(r.out)
                    .is_ok_and(|v| v["version"].is_u64() && v["hash"].is_string())
            },
        },
        Claim {
            line: "access.log",
            says: "a route_not_found line, no credential in it",
            holds: |r| r.has("\"code\":\"route_not_found\"") && r.no_credential(),
        },
        Claim {
            line: "2 of 2 nodes on v1",
            says: "2 of 2 nodes on v1",
            holds: |r| r.summary().starts_with("2 of 2 nodes on v1"),
        },
        Claim {
            line: "sed -i",
            says: "the route now sets postern-demo-v2",
            holds: |r| {
                std::fs::read_to_string(r.dir.join("demo-state/config/teams/echo/routes.yaml"))
                    .is_ok_and(|f| f.contains("value: postern-demo-v2 }"))
            },
        },
        Claim {
            line: "posternctl publish ",
            says: "v2 served by the canary node-a",
            holds: |r| r.summary().starts_with("v2 published: served by node-a (the first stage)"),
        },
        Claim {
            line: "behind: node-b",
            says: "node-a on v2, node-b not yet",
            holds: |r| r.summary().starts_with("1 of 2 nodes on v2; behind: node-b"),
        },
        Claim {
            line: "status --wait",
            says: "both nodes on v2 once the stages are done",
            holds: |r| r.summary().starts_with("2 of 2 nodes on v2") && r.has("\"rollout\": null"),
        },
        Claim {
            line: "rollback --to 1",
            says: "v3 with v1's contents, served by both nodes",
            holds: |r| r.summary() == "v3 (the contents of v1) published: served by every live node (node-a, node-b)",
        },
        Claim {
            line: "8180/v1/echo/hello | grep",
            says: "x-served-by: postern-demo, not -v2",
            holds: |r| {
                let lines: Vec<String> = r.out.lines().map(|l| l.trim().to_ascii_lowercase()).collect();
                !lines.is_empty() && lines.iter().all(|l| l == "x-served-by: postern-demo")
            },
        },
        Claim {
            line: "key revoke",
            says: "applied on both nodes, none stale",
            holds: |r| r.err.contains("applied on 2 node(s)") && !r.err.contains("stale"),
        },
        Claim {
            line: "posternctl trace",
            says: "tracing the key on both nodes until a time",
            holds: |r| {
                r.summary().starts_with("tracing every request of key demo-partner until ")
                    && r.has("\"acked\": [\n      \"node-a\",\n      \"node-b\"\n    ]")
            },
        },
        Claim {
            line: "posternctl compile",
            says: "a snapshot file",
            holds: |r| {
                std::fs::read(r.dir.join("demo-state/snapshot.json"))
                    .is_ok_and(|f| serde_json::from_slice::<serde_json::Value>(&f).is_ok())
            },
        },
        Claim {
            line: "--chart",
            says: "the key's routes with a chart",
            holds: |r| r.has("demo-partner") && r.out.lines().count() > 2,
        },
    ]
}

/// The values of `export NAME=value` lines.
fn exported(env: &str) -> BTreeMap<String, String> {
    env.lines()
        .filter_map(|l| l.trim().strip_prefix("export ")?.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
        .collect()
}

/// `NAME=$(...)`: a line that sets a variable for the lines after it.
fn assigned(line: &str) -> Option<&str> {
    let (name, rest) = line.split_once('=')?;
    (rest.starts_with("$(") && !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'))
        .then_some(name)
}

#[test]
fn every_command_of_the_readme_tour_works_as_written_against_the_demo() {
    for port in [8080, 8081, 8180, 8181, 9001, 9002, 9003, 9400, 9901, 9911] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "127.0.0.1:{port} is taken: stop the demo (or whatever holds it) before running this test"
        );
    }
    let root = repo_root();
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
    let status = child.wait().unwrap();
    assert!(status.success(), "the demo did not start:\n{progress}\n{printed}");
    assert!(progress.contains("==> control plane: posternctl serve on http://127.0.0.1:9400"), "{progress}");

    // What the user pastes: the `export` lines the demo printed.
    let exports: String =
        printed.lines().map(str::trim_start).filter(|l| l.starts_with("export ")).map(|l| format!("{l}\n")).collect();
    for name in ["PATH", "POSTERN_TOKEN", "PARTNER_KEY", "FREE_KEY", "TOKEN"] {
        assert!(exports.contains(&format!("export {name}=")), "the demo printed no {name}:\n{printed}");
    }
    let env_file = work.path().join("tour.env");
    std::fs::write(&env_file, &exports).unwrap();

    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = tour(&readme);
    assert!(lines.len() > 20, "the tour has {} lines", lines.len());
    for line in &lines {
        assert!(printed.contains(line.as_str()), "the demo does not print the README's line {line:?}");
    }
    // Every line is checked: by the status its comment names, by its closing grep, or by
    // a claim of `claims()` (each claim names exactly one line).
    let claims = claims();
    for c in &claims {
        let n = lines.iter().filter(|l| l.contains(c.line)).count();
        assert_eq!(n, 1, "the claim {:?} ({}) matches {n} tour lines", c.line, c.says);
    }
    for line in &lines {
        let checked = expected_status(line).is_some()
            || ends_in_grep(line)
            || assigned(line).is_some()
            || claims.iter().any(|c| line.contains(c.line));
        assert!(checked, "nothing checks what the tour line claims: {line:?}");
    }
    for line in &lines {
        // One shell per line, in the demo's folder, with what was exported so far.
        let script = match assigned(line) {
            Some(name) => format!(
                ". {env}\n{line}\nrc=$?\n[ -n \"${name}\" ] || {{ echo '{name} is empty' >&2; exit 3; }}\necho \"export {name}=${name}\" >> {env}\nexit $rc\n",
                env = env_file.display()
            ),
            None => {
                format!(". {env}\nout=$(\n{line}\n)\nrc=$?\nprintf '%s' \"$out\"\nexit $rc\n", env = env_file.display())
            }
        };
        let out = Command::new("bash").arg("-c").arg(&script).current_dir(work.path()).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "`{line}` failed ({}):\n{stdout}\n{stderr}", out.status);
        if let Some(code) = expected_status(line) {
            let got = stdout.lines().find(|l| l.starts_with("HTTP/")).unwrap_or("");
            assert!(
                got.split_whitespace().nth(1) == Some(code),
                "`{line}`: expected status {code}, got {got:?}:\n{stdout}"
            );
        }
        let vars = exported(&std::fs::read_to_string(&env_file).unwrap());
        let ran = Ran { out: &stdout, err: &stderr, dir: work.path(), vars: &vars };
        for c in claims.iter().filter(|c| line.contains(c.line)) {
            assert!((c.holds)(&ran), "`{line}`: expected {}, got:\n{stdout}\n{stderr}", c.says);
        }
    }
}

#[test]
fn tour_lines_and_their_expectations_are_read_as_meant() {
    let readme = "x\n<!-- tour:start -->\n```sh\ncurl -i http://a/b   # 401 invalid_credentials\n\nK=$(posternctl key new)   # answers\n```\ntext\n```sh\ncurl -s http://a   # 200: ok\n```\n<!-- tour:end -->\n```sh\nnot this\n```\n";
    let lines = tour(readme);
    assert_eq!(
        lines,
        [
            "curl -i http://a/b   # 401 invalid_credentials",
            "K=$(posternctl key new)   # answers",
            "curl -s http://a   # 200: ok"
        ]
    );
    assert_eq!(expected_status(&lines[0]), Some("401"));
    assert_eq!(expected_status(&lines[1]), None);
    assert_eq!(expected_status(&lines[2]), Some("200"));
    assert_eq!(expected_status("for i in 1; do x; done   # 4000 things"), None);
    assert_eq!(expected_status("curl -i http://a/x  # 403: two spaces"), Some("403"));
    assert!(ends_in_grep("curl -s http://a | grep -i x   # a claim"));
    assert!(!ends_in_grep("grep x log | tail -1   # the last"));
    assert!(!ends_in_grep("curl -s http://a   # grep | x"));
    assert_eq!(assigned(&lines[1]), Some("K"));
    assert_eq!(assigned(&lines[0]), None);
}
