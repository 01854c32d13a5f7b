//! Secrets stay off command lines, where every process of the host reads them
//! (`/proc/<pid>/cmdline`): a node and a control plane given one as a flag refuse to
//! start, name the flag and where the secret belongs, and never echo it; the same
//! secret from the environment or a settings file is taken.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::control_plane::write_tokens;
use postern_e2e::{Echo, Node, Repo, bin, get, platform};

const SECRET: &str = "hunter2-not-for-ps";

/// Runs a command that must end by itself (a refusal at start), with a hang guard.
fn refused(cmd: &mut Command) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after 60 s: the secret was not refused");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success(), "started with a secret on its command line");
    out
}

fn says(out: &Output, flag: &str, instead: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(flag) && err.contains("/proc/*/cmdline") && err.contains(instead), "{err}");
    assert!(!err.contains(SECRET) && !String::from_utf8_lossy(&out.stdout).contains(SECRET), "echoed: {err}");
}

fn repo_with_route(echo: &Echo) -> (Repo, std::path::PathBuf) {
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: e\n    public: true\n    match: { path: { value: /e } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n",
    );
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    (repo, snap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_takes_secrets_from_its_environment_and_files_never_its_command_line() {
    let echo = Echo::start("e");
    let (repo, snap) = repo_with_route(&echo);
    let node = |extra: &[&str]| {
        let mut c = Command::new(bin("postern"));
        c.arg("--snapshot").arg(&snap);
        c.args(["--public", "127.0.0.1:0", "--partner", "127.0.0.1:0", "--admin", "127.0.0.1:0"]).args(extra);
        c
    };
    let spool = repo.path().join("spool");
    let spool = spool.to_str().unwrap();

    // A Kafka password as a flag, in either spelling.
    let option = format!("sasl.password={SECRET}");
    let kafka = ["--usage-kafka", "127.0.0.1:9", "--usage-spool", spool];
    let out = refused(node(&kafka).args(["--usage-kafka-option", &option]));
    says(&out, "--usage-kafka-option", "--usage-kafka-options-file");
    let out = refused(node(&kafka).arg(format!("--usage-kafka-option={option}")));
    says(&out, "--usage-kafka-option", "--usage-kafka-options-file");
    // A Redis URL with a password.
    let redis = format!("redis://:{SECRET}@127.0.0.1:6379");
    let out = refused(node(&[]).args(["--ratelimit-redis", &redis]));
    says(&out, "--ratelimit-redis", "POSTERN_RATELIMIT_REDIS");

    // The same secrets from a settings file and the environment: the node serves.
    let file = repo.path().join("kafka.properties");
    std::fs::write(&file, format!("# the stream's credentials\nsasl.username=node\n{option}\n")).unwrap();
    let served = Node::start_with_env(
        &snap,
        &[&kafka[..], &["--usage-kafka-options-file", file.to_str().unwrap()]].concat(),
        &[("POSTERN_RATELIMIT_REDIS", "redis://127.0.0.1:6379")],
    );
    assert_eq!(get(&served.url("/e"), &[]).await.status, StatusCode::OK);
    // A setting the file cannot hold is refused by name, its line never echoed.
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let out = refused(node(&kafka).args(["--usage-kafka-options-file", file.to_str().unwrap()]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kafka.properties: a line") && !err.contains(SECRET), "{err}");
}

#[test]
fn a_control_plane_takes_credentialed_urls_from_its_environment_never_its_command_line() {
    let echo = Echo::start("e");
    let (repo, _) = repo_with_route(&echo);
    let dir = tempfile::tempdir().unwrap();
    let tokens = write_tokens(dir.path());
    let store = dir.path().join("store");
    let serve = || {
        let mut c = Command::new(bin("posternctl"));
        c.arg("serve").arg(repo.path()).arg("--store").arg(&store).args(["--listen", "127.0.0.1:0", "--tokens"]);
        c.arg(&tokens).arg("--signing-key").arg(tokens.with_file_name("control.key"));
        c
    };
    let hook = format!("http://quota:{SECRET}@127.0.0.1:9/hook");
    let out = refused(serve().args(["--quota-webhook", &hook]));
    says(&out, "--quota-webhook", "POSTERN_QUOTA_WEBHOOK");
    let signed = format!("http://127.0.0.1:9/hook?sig={SECRET}");
    let out = refused(serve().arg(format!("--quota-webhook={signed}")));
    says(&out, "--quota-webhook", "POSTERN_QUOTA_WEBHOOK");
    let db = format!("postgres://postern:{SECRET}@127.0.0.1:5432/usage");
    let out = refused(serve().args(["--usage-db", &db]));
    says(&out, "--usage-db", "POSTERN_USAGE_DB");

    // An https:// webhook with no certificates to trust it by is refused at start (there
    // is no implicit trust store), naming the flag and not the URL's credential.
    let tls_hook = format!("https://127.0.0.1:9/hook?token={SECRET}");
    let out = refused(serve().env("POSTERN_QUOTA_WEBHOOK", &tls_hook));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--quota-webhook-ca") && !err.contains(SECRET), "{err}");

    // From the environment the same webhook is taken: the control plane starts.
    let mut child = serve().env("POSTERN_QUOTA_WEBHOOK", &hook).stdout(Stdio::piped()).spawn().expect("serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(running && line.trim().starts_with("127.0.0.1:"), "serve did not start: {line:?}");
}
