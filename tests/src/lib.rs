//! Harness for Postern's end-to-end tests: starts real `postern`, `posternctl` and
//! `postern-echo` processes on 127.0.0.1 with ephemeral ports, writes config
//! repositories, and speaks HTTP to them. Every process is killed when its handle drops.
//!
//! The binaries are looked up next to the test executable's `deps/` folder, so run
//! `cargo build --bins` before the tests (`make test` does).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Path of a workspace binary built beside the running test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(path.exists(), "{} not found: run `cargo build --bins` first (make test does)", path.display());
    path
}

/// A child process killed on drop.
pub struct Proc {
    /// The child.
    pub child: Child,
}

impl Proc {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident set size and its peak, in KiB, from /proc.
    pub fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets the process's peak resident size (`VmHWM`) to its current one, so a later
    /// [`Self::rss_kib`] peak covers only what happened since (not start-up's).
    pub fn reset_peak_rss(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5");
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (by number) to the process.
    pub fn signal(&self, sig: i32) {
        let _ = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for_file(path: &Path, proc: &mut Proc, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && !s.is_empty()
        {
            return s;
        }
        assert!(proc.alive(), "{what} exited before it was ready");
        assert!(Instant::now() < deadline, "{what} did not start within 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running echo backend.
pub struct Echo {
    /// The process.
    pub proc: Proc,
    /// Its port on 127.0.0.1.
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Echo {
    /// Starts an echo backend that names itself `name`.
    pub fn start(name: &str) -> Echo {
        Echo::start_with(name, &[])
    }

    /// Starts an echo backend with extra flags (`--delay-ms`, `--tls-cert`...).
    pub fn start_with(name: &str, extra: &[&str]) -> Echo {
        let dir = tempfile::tempdir().expect("tempdir");
        let port_file = dir.path().join("port");
        let child = Command::new(bin("postern-echo"))
            .args(["--listen", "127.0.0.1:0", "--name", name, "--port-file"])
            .arg(&port_file)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn postern-echo");
        let mut proc = Proc { child };
        let port = wait_for_file(&port_file, &mut proc, "postern-echo").trim().parse().expect("port");
        Echo { proc, port, _dir: dir }
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// How many requests this backend has answered. Panics when the backend cannot say
    /// (no answer, another status, no number): a broken count endpoint must fail the
    /// test, never read as "nothing reached the backend".
    pub async fn count(&self) -> u64 {
        let r = get(&format!("http://{}/__echo/count", self.addr()), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "the echo's count endpoint answered {}: {:?}", r.status, r.body);
        r.json()["count"].as_u64().unwrap_or_else(|| {
            panic!("the echo's count endpoint gave no count: {:?}", String::from_utf8_lossy(&r.body))
        })
    }

    /// How many of them a gateway marked as its retry (`x-postern-retry`).
    pub async fn retried(&self) -> u64 {
        let r = get(&format!("http://{}/__echo/count", self.addr()), &[]).await;
        r.json()["retried"].as_u64().expect("the echo counts retries")
    }

    /// Makes every later answer wait `ms` more.
    pub async fn set_delay(&self, ms: u64) {
        let url = format!("http://{}/__echo/delay?ms={ms}", self.addr());
        let r = send(Method::PUT, &url, &[], Bytes::new()).await;
        assert_eq!(r.status, StatusCode::OK, "set delay: {:?}", r.body);
    }
}

/// A config repository in a temporary directory.
pub struct Repo {
    /// Its root.
    pub dir: tempfile::TempDir,
}

impl Default for Repo {
    fn default() -> Self {
        Self::new()
    }
}

impl Repo {
    /// An empty repository.
    pub fn new() -> Repo {
        Repo { dir: tempfile::tempdir().expect("tempdir") }
    }

    /// Writes `text` to `rel` (creating folders).
    pub fn write(&self, rel: &str, text: &str) -> &Repo {
        let p = self.dir.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
        self
    }

    /// Root path.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Runs `posternctl compile` into `out`.
    pub fn compile(&self, out: &Path) -> Output {
        ConfigDir(self.path()).compile(out)
    }
}

/// A config repository that is already on disk (`examples/config` copied by
/// [`prepare_example_config`]).
pub struct ConfigDir<'a>(pub &'a Path);

impl ConfigDir<'_> {
    /// Runs `posternctl compile` into `out`.
    pub fn compile(&self, out: &Path) -> Output {
        Command::new(bin("posternctl")).arg("compile").arg(self.0).arg("-o").arg(out).output().expect("posternctl")
    }

    /// Compiles into `out` and panics with the diagnostics if that fails.
    pub fn compile_ok(&self, out: &Path) {
        let o = self.compile(out);
        assert!(o.status.success(), "compile failed:\n{}", String::from_utf8_lossy(&o.stderr));
    }
}

impl Repo {
    /// Runs `posternctl compile` into `out` with extra flags.
    pub fn compile_with(&self, out: &Path, extra: &[&str]) -> Output {
        Command::new(bin("posternctl"))
            .arg("compile")
            .arg(self.path())
            .arg("-o")
            .arg(out)
            .args(extra)
            .output()
            .expect("posternctl")
    }

    /// Compiles into `out` and panics with the diagnostics if that fails.
    pub fn compile_ok(&self, out: &Path) {
        let o = self.compile(out);
        assert!(o.status.success(), "compile failed:\n{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// A running `postern` node.
pub struct Node {
    /// The process.
    pub proc: Proc,
    /// Public pool port.
    pub public: u16,
    /// Partner pool port.
    pub partner: u16,
    /// Admin port.
    pub admin: u16,
    /// Where it logs (stderr).
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Node {
    /// Starts `postern` on `snapshot` with ephemeral ports and extra flags.
    pub fn start(snapshot: &Path, extra: &[&str]) -> Node {
        Node::start_with_env(snapshot, extra, &[])
    }

    /// [`Node::start`] with environment variables set for the process.
    pub fn start_with_env(snapshot: &Path, extra: &[&str], env: &[(&str, &str)]) -> Node {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports = dir.path().join("ports.json");
        let log = dir.path().join("postern.log");
        let child = Command::new(bin("postern"))
            .arg("--snapshot")
            .arg(snapshot)
            .args(["--public", "127.0.0.1:0", "--partner", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--watch-interval-ms", "100", "--workers", "2"])
            .args(extra)
            .envs(env.iter().copied())
            .arg("--ports-file")
            .arg(&ports)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn postern");
        let mut proc = Proc { child };
        let text = wait_for_file(&ports, &mut proc, "postern");
        let v: serde_json::Value = serde_json::from_str(&text).expect("ports json");
        let port = |k: &str| u16::try_from(v[k].as_u64().expect("port")).expect("port");
        Node { public: port("public"), partner: port("partner"), admin: port("admin"), proc, log, _dir: dir }
    }

    /// URL on the public pool.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.public)
    }

    /// URL on the partner pool.
    pub fn partner_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.partner)
    }

    /// URL on the admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin)
    }

    /// The node's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The running snapshot version, from the admin listener.
    pub async fn version(&self) -> u64 {
        get(&self.admin_url("/snapshot"), &[]).await.json()["version"].as_u64().unwrap_or(0)
    }

    /// The value of one exact series of the admin listener's `/metrics` (`name`, or
    /// `name{labels}` as the node writes them). Panics when the node does not export it.
    pub async fn metric(&self, series: &str) -> u64 {
        let r = get(&self.admin_url("/metrics"), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "/metrics answered {}", r.status);
        let text = String::from_utf8_lossy(&r.body);
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("the node exports no series {series}:\n{text}"))
    }

    /// Waits until the node runs snapshot `version`.
    pub async fn wait_version(&self, version: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.version().await != version {
            assert!(Instant::now() < deadline, "node did not reach v{version}; log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A response, fully read.
#[derive(Debug)]
pub struct Resp {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
    /// HTTP version.
    pub version: http::Version,
}

impl Resp {
    /// The body as JSON (Null if it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// A header as a string.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// For echo answers: the value of a header the backend received.
    pub fn echoed(&self, name: &str) -> Option<String> {
        self.json()["headers"]
            .as_array()?
            .iter()
            .find(|h| h[0].as_str() == Some(name))
            .and_then(|h| h[1].as_str().map(str::to_owned))
    }

    /// For echo answers: which backend answered.
    pub fn backend(&self) -> String {
        self.json()["backend"].as_str().unwrap_or_default().to_owned()
    }
}

/// An HTTP/1.1 client with pooled keep-alive connections.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// An HTTP/2 (prior knowledge, h2c) client.
pub fn h2c_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).http2_only(true).build_http()
}

/// Sends a request with `client`.
pub async fn send_with(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Resp, hyper_util::client::legacy::Error> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(HeaderName::from_bytes(k.as_bytes()).expect("name"), HeaderValue::from_str(v).expect("value"));
    }
    let req = req.body(Full::new(body)).expect("request");
    let resp = client.request(req).await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    Ok(Resp { status: parts.status, headers: parts.headers, body, version: parts.version })
}

/// GET with a fresh client.
pub async fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    send_with(&client(), Method::GET, url, headers, Bytes::new()).await.expect("request failed")
}

/// Any method with a body, fresh client.
pub async fn send(method: Method, url: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Resp {
    send_with(&client(), method, url, headers, body.into()).await.expect("request failed")
}

/// Writes raw bytes on a new TCP connection and reads until the server closes it or
/// `timeout` passes.
pub async fn raw(port: u16, bytes: &[u8], timeout: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(timeout, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// The platform files every test repo needs: clusters and an ownership registry that
/// gives team `t` every path.
pub fn platform(repo: &Repo, clusters: &[(&str, &str)]) {
    let mut text = String::from("clusters:\n");
    for (name, addr) in clusters {
        text.push_str(&format!("  {name}:\n    endpoints: [\"{addr}\"]\n"));
    }
    repo.write("platform/clusters.yaml", &text);
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
}

/// A filter component built by `make filters` (`<target>/filters/wasm32-wasip2/release`).
pub fn filter_wasm(crate_name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let target = exe.parent().and_then(Path::parent).and_then(Path::parent).expect("target dir");
    let path = target.join("filters/wasm32-wasip2/release").join(format!("{}.wasm", crate_name.replace('-', "_")));
    assert!(path.exists(), "{} not found: run `make filters` first (make test does)", path.display());
    path
}

/// `sha256:<hex>` of a file.
pub fn file_digest(path: &Path) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(std::fs::read(path).expect("read"))))
}

/// Adds a Wasm filter to `team`'s directory: the module, its manifest (with `limits`
/// as YAML flow text, e.g. `{ fuel: 1000000 }`) and its approval in the review registry.
pub fn add_filter(repo: &Repo, team: &str, name: &str, wasm: &Path, limits: &str) {
    let dir = repo.path().join("teams").join(team).join("filters");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(wasm, dir.join(format!("{name}.wasm"))).expect("copy module");
    repo.write(&format!("teams/{team}/filters/{name}.yaml"), &format!("module: {name}.wasm\nlimits: {limits}\n"));
    let reg = repo.path().join("platform/filters.yaml");
    let mut text = std::fs::read_to_string(&reg).unwrap_or_else(|_| "approved:\n".to_owned());
    text.push_str(&format!(
        "  - {{ digest: \"{}\", filter: {name}, team: {team}, reviewer: platform }}\n",
        file_digest(wasm)
    ));
    std::fs::write(reg, text).expect("write registry");
}

/// Creates an API key in the config repository at `repo` with `posternctl key new` and
/// returns the raw key (shown once).
pub fn new_key(repo: &Path, id: &str, app: &str, tenant: &str, plan: &str, scopes: &[&str]) -> String {
    let mut cmd = Command::new(bin("posternctl"));
    cmd.args(["key", "new"]).arg(repo).args(["--id", id, "--app", app, "--tenant", tenant, "--plan", plan]);
    for s in scopes {
        cmd.args(["--scope", s]);
    }
    let out = cmd.output().expect("posternctl key new");
    assert!(out.status.success(), "key new: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8").trim().to_owned()
}

/// Copies `examples/config` to `dst`, puts the built example filter modules beside
/// their manifests with their approvals (what `make demo` does), and points the demo
/// clusters' fixed ports at `endpoints` (`127.0.0.1:9001` → `endpoints[0]`, ...).
pub fn prepare_example_config(dst: &Path, endpoints: &[String]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/config");
    copy_dir(&src, dst);
    let teams = dst.join("teams");
    let mut approvals = String::from("approved:\n");
    for team in std::fs::read_dir(&teams).expect("teams") {
        let team = team.expect("entry").path();
        let Ok(manifests) = std::fs::read_dir(team.join("filters")) else { continue };
        for m in manifests {
            let m = m.expect("entry").path();
            if m.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let name = m.file_stem().and_then(|s| s.to_str()).expect("name").to_owned();
            let wasm = filter_wasm(&name);
            std::fs::copy(&wasm, m.with_extension("wasm")).expect("copy module");
            let team_name = team.file_name().and_then(|s| s.to_str()).expect("team");
            approvals.push_str(&format!(
                "  - {{ digest: \"{}\", filter: {name}, team: {team_name}, reviewer: demo }}\n",
                file_digest(&wasm)
            ));
        }
    }
    std::fs::write(dst.join("platform/filters.yaml"), approvals).expect("write approvals");
    let clusters = dst.join("platform/clusters.yaml");
    let mut text = std::fs::read_to_string(&clusters).expect("clusters");
    for (i, e) in endpoints.iter().enumerate() {
        text = text.replace(&format!("127.0.0.1:{}", 9001 + i), e);
    }
    std::fs::write(clusters, text).expect("write clusters");
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("mkdir");
    for e in std::fs::read_dir(src).expect("read_dir") {
        let p = e.expect("entry").path();
        let to = dst.join(p.file_name().expect("name"));
        if p.is_dir() {
            copy_dir(&p, &to);
        } else {
            std::fs::copy(&p, &to).expect("copy");
        }
    }
}

/// A node with every hostile test filter on its own fail-closed route (`/h/<name>`), and
/// again on `/hammer/<name>` with a quarantine threshold no test reaches (so it runs on
/// every call), plus `/state` (keeps-state), `/good` (well-behaved, response phase too),
/// `/open/trap` (fail-open), `/resp/closed` and `/resp/open` (a trap in the response
/// phase, fail-closed and fail-open) and `/plain` (no filter), all to one echo backend.
pub mod wasm_fixture {
    use super::{Echo, Node, Repo, add_filter, filter_wasm, platform};

    /// (crate, limits, expected outcome in the problem detail: a refused answer names the
    /// rule it broke)
    pub const HOSTILE: &[(&str, &str, &str)] = &[
        ("loop-forever", "{ fuel: 5000000, deadline_ms: 50 }", "fuel_exhausted"),
        ("memory-bomb", "{ memory_bytes: 8388608, fuel: 100000000, deadline_ms: 50 }", "memory_limit"),
        ("deep-recursion", "{}", "stack_overflow"),
        ("trap", "{}", "trap"),
        ("guest-panic", "{}", "guest_panic"),
        ("std-panic", "{}", "guest_panic"),
        (
            "huge-header",
            "{ memory_bytes: 67108864, fuel: 100000000, deadline_ms: 50 }",
            "bad_output: its answer broke the rule header_count",
        ),
        (
            "huge-body",
            "{ memory_bytes: 67108864, fuel: 100000000, deadline_ms: 50 }",
            "bad_output: its answer broke the rule body_size",
        ),
        ("host-call-flood", "{ fuel: 100000000, deadline_ms: 50 }", "host_call_limit"),
    ];

    pub fn route(name: &str, path: &str, filter: &str, extra: &str) -> String {
        format!(
            "  - name: {name}\n    public: true\n    match: {{ path: {{ value: {path} }} }}\n    backendRefs: [{{ name: e }}]\n    timeouts: {{ connect: 1s, response: 5s }}\n    wasmFilters: [{{ name: {filter}{extra} }}]\n"
        )
    }

    pub struct Fixture {
        /// The node.
        pub node: Node,
        /// The backend.
        pub echo: Echo,
        /// The config repository.
        pub repo: Repo,
    }

    pub fn fixture() -> Fixture {
        let echo = Echo::start("e");
        let repo = Repo::new();
        platform(&repo, &[("e", &echo.addr())]);
        let mut routes = String::from("routes:\n");
        for (name, limits, _) in HOSTILE {
            add_filter(&repo, "t", name, &filter_wasm(name), limits);
            routes.push_str(&route(name, &format!("/h/{name}"), name, ""));
            routes.push_str(&route(
                &format!("hammer-{name}"),
                &format!("/hammer/{name}"),
                name,
                ", quarantine: { minCalls: 1000000 }",
            ));
        }
        add_filter(&repo, "t", "keeps-state", &filter_wasm("keeps-state"), "{}");
        add_filter(&repo, "t", "well-behaved", &filter_wasm("well-behaved"), "{}");
        routes.push_str(&route("state", "/state", "keeps-state", ""));
        routes.push_str(&route("good", "/good", "well-behaved", ", responsePhase: true"));
        routes.push_str(&route("open-trap", "/open/trap", "trap", ", failure: fail_open"));
        // The response phase under each failure policy: the filter traps only there.
        routes.push_str(&route("resp-closed", "/resp/closed", "trap", ", config: response, responsePhase: true"));
        routes.push_str(&route(
            "resp-open",
            "/resp/open",
            "trap",
            ", config: response, responsePhase: true, failure: fail_open",
        ));
        routes.push_str(&plain_route("plain", "/plain"));
        let node = start_node(&repo, &routes);
        Fixture { node, echo, repo }
    }

    /// A route without filters at `path` to the backend `e`.
    pub fn plain_route(name: &str, path: &str) -> String {
        format!(
            "  - name: {name}\n    public: true\n    match: {{ path: {{ value: {path} }} }}\n    backendRefs: [{{ name: e }}]\n    timeouts: {{ connect: 1s, response: 5s }}\n"
        )
    }

    /// Writes `routes` as team `t`'s, compiles the repository and starts a node on it.
    pub fn start_node(repo: &Repo, routes: &str) -> Node {
        repo.write("teams/t/routes.yaml", routes);
        let snap = repo.path().join("out/snapshot.json");
        std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
        repo.compile_ok(&snap);
        Node::start(&snap, &[])
    }
}

/// `posternctl serve` and its nodes, for the tests of a fleet.
pub mod control_plane {
    use std::io::{BufRead, BufReader};
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use sha2::Digest as _;

    use super::{Node, bin};

    /// Role `platform`.
    pub const PLATFORM_TOKEN: &str = "platform-secret-token";
    /// Role `node` (any node).
    pub const NODE_TOKEN: &str = "node-secret-token";
    /// Role `team:t`.
    pub const TEAM_T_TOKEN: &str = "team-t-secret-token";
    /// Role `team:x`.
    pub const TEAM_X_TOKEN: &str = "team-x-secret-token";

    /// A running `posternctl serve`.
    pub struct ControlPlane {
        /// The process.
        pub child: Child,
        /// Its URL.
        pub url: String,
        /// The CA its `https://` URL is checked against.
        pub ca: Option<std::path::PathBuf>,
    }

    impl Drop for ControlPlane {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Role `node:node-a`: speaks only for node `node-a`.
    pub const NODE_A_TOKEN: &str = "node-a-only-token";

    /// Writes the token list (every token above) and the control plane's signing key
    /// (`control.key`, `control.pub`) to `dir`; returns the token list's path.
    pub fn write_tokens(dir: &Path) -> std::path::PathBuf {
        let h = |t: &str| hex::encode(sha2::Sha256::digest(t.as_bytes()));
        let path = dir.join("tokens.json");
        let text = serde_json::json!([
            {"name": "alice", "role": "platform", "sha256": h(PLATFORM_TOKEN)},
            {"name": "nodes", "role": "node", "sha256": h(NODE_TOKEN)},
            {"name": "bob", "role": "team:t", "sha256": h(TEAM_T_TOKEN)},
            {"name": "carol", "role": "team:x", "sha256": h(TEAM_X_TOKEN)},
            {"name": "node-a", "role": "node:node-a", "sha256": h(NODE_A_TOKEN)},
        ]);
        std::fs::write(&path, text.to_string()).unwrap();
        // The control plane's signing key, beside the tokens; nodes pin its public half.
        let signer = postern_model::sign::Signer::generate().unwrap();
        std::fs::write(dir.join("control.key"), signer.to_text()).unwrap();
        std::fs::write(dir.join("control.pub"), format!("{}\n", signer.public())).unwrap();
        path
    }

    /// A PostgreSQL database of a test's own on 127.0.0.1:5432 (the machine's server),
    /// dropped when the value is.
    pub struct PgDb {
        /// `postgres://postgres@127.0.0.1:5432/<name>`.
        pub url: String,
        name: String,
    }

    impl PgDb {
        /// Creates a uniquely named database.
        pub fn create() -> PgDb {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
            let name = format!("postern_e2e_{}_{nanos}", std::process::id());
            psql(&format!("CREATE DATABASE {name}"));
            PgDb { url: format!("postgres://postgres@127.0.0.1:5432/{name}"), name }
        }
    }

    impl Drop for PgDb {
        fn drop(&mut self) {
            let _ = Command::new("psql")
                .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c"])
                .arg(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
                .output();
        }
    }

    fn psql(sql: &str) {
        let out =
            Command::new("psql").args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c", sql]).output();
        assert!(out.as_ref().is_ok_and(|o| o.status.success()), "psql {sql}: {out:?}");
    }

    /// Starts `posternctl serve` on an ephemeral port with the signing key beside `tokens`.
    pub fn serve(repo: &Path, store: &str, tokens: &Path, extra: &[&str]) -> ControlPlane {
        let mut child = Command::new(bin("posternctl"))
            .arg("serve")
            .arg(repo)
            .args(["--store", store])
            // An ephemeral port unless `extra` names one (a restart on the same port).
            .args(if extra.contains(&"--listen") { &[][..] } else { &["--listen", "127.0.0.1:0"][..] })
            .args(extra)
            .arg("--tokens")
            .arg(tokens)
            .arg("--signing-key")
            .arg(tokens.with_file_name("control.key"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("posternctl serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(!line.trim().is_empty(), "serve printed no address");
        ControlPlane { child, url: format!("http://{}", line.trim()), ca: None }
    }

    /// `serve` on HTTPS with a certificate for `localhost` (written to `dir`, which also
    /// holds the CA nodes and the CLI trust).
    pub fn serve_tls(repo: &Path, store: &str, tokens: &Path, dir: &Path, extra: &[&str]) -> ControlPlane {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (dir.join("cp.crt"), dir.join("cp.key"));
        std::fs::write(&cert, ck.cert.pem()).unwrap();
        std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
        let mut args = vec!["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
        args.extend_from_slice(extra);
        let mut cp = serve(repo, store, tokens, &args);
        let port = cp.url.rsplit(':').next().unwrap().to_owned();
        cp.url = format!("https://localhost:{port}");
        cp.ca = Some(cert);
        cp
    }

    /// Runs `posternctl <args>` against `cp` with the platform token; the answer's JSON.
    pub fn ctl(cp: &ControlPlane, args: &[&str]) -> serde_json::Value {
        let out = Command::new(bin("posternctl"))
            .args(args)
            .args(["--control", &cp.url, "--token", PLATFORM_TOKEN])
            .args(cp.ca.iter().flat_map(|ca| [std::ffi::OsStr::new("--control-ca"), ca.as_os_str()]))
            .output()
            .expect("posternctl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "posternctl {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
        // The JSON answer follows an optional summary line.
        let json = text.find('{').map(|i| &text[i..]).unwrap_or("null");
        serde_json::from_str(json).unwrap_or(serde_json::Value::Null)
    }

    /// A node of the control plane at `cp_url`, in `dir` (a folder of the test's work
    /// directory, whose `control.pub` it pins).
    pub fn start_node(cp_url: &str, dir: &Path, name: &str) -> Node {
        start_node_with(cp_url, dir, name, &[])
    }

    /// [`start_node`] with extra flags.
    pub fn start_node_with(cp_url: &str, dir: &Path, name: &str, extra: &[&str]) -> Node {
        std::fs::create_dir_all(dir).unwrap();
        let key = dir.parent().unwrap().join("control.pub");
        let mut args = vec![
            "--control",
            cp_url,
            "--control-token",
            NODE_TOKEN,
            "--node-id",
            name,
            "--control-report-ms",
            "200",
            "--control-key",
            key.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        Node::start(&dir.join("snapshot.json"), &args)
    }

    /// Polls `check` every 20 ms until it holds; fails the test after `deadline`.
    pub async fn wait_for(what: &str, deadline: Duration, mut check: impl AsyncFnMut() -> bool) {
        let end = Instant::now() + deadline;
        while !check().await {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub mod kafka {
    //! A real Kafka-protocol broker for the usage stream's tests: `tansu` (installed by
    //! `make setup`, from crates.io), in memory, on an ephemeral port of 127.0.0.1.
    use std::path::PathBuf;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::Proc;

    /// Where `tansu` is: on `PATH`, or where `cargo install` puts it.
    pub fn tansu() -> PathBuf {
        let on_path = std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("tansu"))
            .find(|p| p.is_file());
        let cargo_home = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
        on_path.or_else(|| cargo_home.map(|c| c.join("bin/tansu")).filter(|p| p.is_file())).unwrap_or_else(|| {
            panic!("the Kafka-protocol broker `tansu` is not installed: run `make setup` (make test does)")
        })
    }

    /// A running broker, killed on drop.
    pub struct Broker {
        /// The process.
        pub proc: Proc,
        /// `127.0.0.1:port`, for `bootstrap.servers`.
        pub addr: String,
    }

    impl Broker {
        /// Starts a broker and waits until it takes connections.
        pub fn start() -> Broker {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let url = format!("tcp://127.0.0.1:{port}");
            let child = Command::new(tansu())
                .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
                .args(["--storage-engine", "memory://tansu/"])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("tansu broker");
            let mut proc = Proc { child };
            let addr = format!("127.0.0.1:{port}");
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(&addr).is_err() {
                assert!(proc.alive(), "tansu exited before it listened");
                assert!(Instant::now() < deadline, "tansu did not listen within 20 s");
                std::thread::sleep(Duration::from_millis(50));
            }
            Broker { proc, addr }
        }

        /// Freezes the broker (SIGSTOP): connections stay open and nothing answers, as a
        /// broker behind a partition or in a long pause looks to its clients.
        pub fn freeze(&self) {
            self.proc.signal(19);
        }

        /// Lets a frozen broker run again (SIGCONT).
        pub fn thaw(&self) {
            self.proc.signal(18);
        }
    }

    impl Drop for Broker {
        fn drop(&mut self) {
            self.thaw();
        }
    }
}

pub mod usage {
    //! What the usage tests share: billed calls, a node's spool state, and steady clients.
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::Node;
    use super::control_plane::{ControlPlane, PLATFORM_TOKEN, ctl, wait_for};

    /// How long a load client waits for an answer. Far above anything a call takes: a
    /// call that is only slow is still seen; one with no answer by then has an unknown
    /// outcome (served or not), and the test stops there rather than guess.
    pub const ANSWER_GUARD: Duration = Duration::from_secs(30);

    /// Billable calls per key in the current period, from the control plane.
    pub fn billed(cp: &ControlPlane) -> BTreeMap<String, u64> {
        let v = ctl(cp, &["usage", "--json", "--by", "route"]);
        let mut out = BTreeMap::new();
        for r in v["rows"].as_array().cloned().unwrap_or_default() {
            *out.entry(r["caller"].as_str().unwrap().to_owned()).or_default() += r["billable"].as_u64().unwrap();
        }
        out
    }

    /// The running node's usage state, from `/readyz`.
    pub async fn spool_state(node: &Node) -> serde_json::Value {
        super::get(&node.admin_url("/readyz"), &[]).await.json()["usage"].clone()
    }

    /// What the usage store holds of `node`'s windows (`/v1/usage/nodes`: `windows`,
    /// `last_seq`, `missing`, `recovered`, `duplicates`); `Null` before any arrived.
    pub async fn store_node(cp: &ControlPlane, node: &str) -> serde_json::Value {
        let auth = format!("Bearer {PLATFORM_TOKEN}");
        let r = super::get(&format!("{}/v1/usage/nodes", cp.url), &[("authorization", &auth)]).await;
        assert_eq!(r.status, http::StatusCode::OK, "/v1/usage/nodes: {:?}", r.body);
        let nodes = r.json();
        nodes["nodes"].as_array().and_then(|n| n.iter().find(|n| n["node"] == node)).cloned().unwrap_or_default()
    }

    /// The highest sequence number a stopped node's spool (`dir`, its `usage-spool`)
    /// gave a window: from `head.json`, written with every record and acknowledgement.
    pub fn numbered(spool: &Path) -> u64 {
        let path = spool.join("head.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let head: serde_json::Value = serde_json::from_str(&text).unwrap();
        head["next"].as_u64().unwrap_or_else(|| panic!("{}: {text}", path.display())) - 1
    }

    /// Waits until the usage store holds every window `node` numbered up to `through`,
    /// each whole (every part of it): nothing more of that node's usage is on its way.
    pub async fn wait_store_has(cp: &ControlPlane, node: &str, through: u64) {
        let what = format!("the usage store to hold {node}'s windows 1..={through}");
        wait_for(&what, Duration::from_secs(60), async || {
            let n = store_node(cp, node).await;
            n["last_seq"].as_u64() >= Some(through) && n["missing"].as_u64() == Some(0)
        })
        .await;
    }

    fn unix_ms() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
    }

    /// Waits for a moment 3 to 8 s into a 10 s usage window, the node's counts file
    /// (`open.counts`) in its spool: a `kill -9` then strikes mid-window, with the open
    /// window's calls counted only there.
    pub async fn wait_mid_window(spool: &Path) {
        assert!(spool.join("open.counts").exists(), "no counts file in {}", spool.display());
        let into = unix_ms() % 10_000;
        if !(3_000..8_000).contains(&into) {
            tokio::time::sleep(Duration::from_millis((13_000 - into) % 10_000)).await;
        }
    }

    /// Calls `/search` as `key` until `stop`, on `conns` connections at once, resting
    /// `pause` between calls; every call the client saw answered 2xx (body and all), with
    /// the time it completed. A call with no answer within [`ANSWER_GUARD`] panics the
    /// task (awaiting the handle fails the test): its outcome is unknown.
    pub fn load(
        port: u16,
        key: String,
        stop: Arc<AtomicBool>,
        conns: usize,
        pause: Duration,
    ) -> tokio::task::JoinHandle<Vec<Instant>> {
        tokio::spawn(async move {
            let tasks: Vec<_> = (0..conns)
                .map(|_| {
                    let (key, stop) = (key.clone(), stop.clone());
                    tokio::spawn(async move {
                        let client = super::client();
                        let mut ok = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            let req = http::Request::get(format!("http://127.0.0.1:{port}/search"))
                                .header("x-api-key", &key)
                                .body(http_body_util::Full::new(Bytes::new()))
                                .unwrap();
                            let call = async {
                                match client.request(req).await {
                                    Ok(resp) if resp.status().is_success() => {
                                        http_body_util::BodyExt::collect(resp.into_body()).await.is_ok()
                                    }
                                    _ => false,
                                }
                            };
                            match tokio::time::timeout(ANSWER_GUARD, call).await {
                                Ok(true) => ok.push(Instant::now()),
                                Ok(false) => tokio::time::sleep(Duration::from_millis(20)).await,
                                Err(_) => panic!(
                                    "a call to port {port} had no answer within {ANSWER_GUARD:?}: whether it was served is unknown"
                                ),
                            }
                            if !pause.is_zero() {
                                tokio::time::sleep(pause).await;
                            }
                        }
                        ok
                    })
                })
                .collect();
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            all
        })
    }
}
