//! README.md's tour, run as written against the demo (`examples/demo.sh`, the script
//! `make demo` runs), so the README cannot drift from what the product does.
//!
//! The demo listens on the fixed ports the README names (127.0.0.1:8080, 9400, …), so
//! this test fails at once, saying so, if something else (a demo left running) holds
//! them.
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

/// The status a line's comment names first (`# 401 invalid_credentials`, `# 200: ...`).
fn expected_status(line: &str) -> Option<&str> {
    let comment = line.rsplit_once("   # ").map(|(_, c)| c.trim_start())?;
    let code = comment.get(..3)?;
    (code.bytes().all(|b| b.is_ascii_digit()) && !comment[3..].starts_with(|c: char| c.is_ascii_digit()))
        .then_some(code)
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
        .env("DEMO_DWELL", "2s")
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
    for line in &lines {
        // One shell per line, in the demo's folder, with what was exported so far.
        let script = match assigned(line) {
            Some(name) => format!(
                ". {env}\n{line}\nrc=$?\necho \"export {name}=${name}\" >> {env}\nexit $rc\n",
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
    assert_eq!(assigned(&lines[1]), Some("K"));
    assert_eq!(assigned(&lines[0]), None);
}
