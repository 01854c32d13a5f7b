//! Quotas end to end: `posternctl serve` (intake, quota service, webhook sender) and two
//! `postern` nodes. A key on a hard quota that crosses it is refused 429
//! `quota_exceeded` on every node (in about 20 s: the lag is printed; 30 s is only the
//! guard against it never coming), and served
//! again at its period's end with no new credentials version; the calls admitted before
//! the flag reached the nodes are overshoot, not billed; a key on an overage plan is
//! never refused; both are warned at 80 % and 100 % through the webhook; the calls around
//! a period's end land in the period of their answer.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use postern_e2e::control_plane::*;
use postern_e2e::{Echo, Node, Repo, get, new_key, platform};

const ROUTES: &str = "routes:\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: search }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

/// Quotas renew every minute: the test watches a period end.
const PLANS: &str = "scopes: []\nproducts: [search]\nplans:\n  capped: { products: [search], quota: { monthly: 60, mode: hard, anchor: every-60s } }\n  metered: { products: [search], quota: { monthly: 20, mode: overage, anchor: every-60s } }\n";
const PERIOD_S: u64 = 60;
const CAP: u64 = 60;

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The quota webhook's signing secret (its file's bytes as they are).
const WEBHOOK_SECRET: &[u8] = b"a secret of the quota webhook, 41 bytes.";

/// A webhook receiver on an ephemeral port: keeps every body it is posted, and refuses
/// the first one (the sender must retry).
struct Webhook {
    url: String,
    got: Arc<Mutex<Vec<serde_json::Value>>>,
    posts: Arc<Mutex<u32>>,
}

async fn webhook() -> Webhook {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let posts = Arc::new(Mutex::new(0));
    let (g, r) = (got.clone(), posts.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (g, r) = (g.clone(), r.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (g, r) = (g.clone(), r.clone());
                    async move {
                        let signed = ["webhook-id", "webhook-timestamp", "webhook-signature"]
                            .map(|h| req.headers().get(h).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned());
                        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let first = {
                            let mut n = r.lock().unwrap();
                            *n += 1;
                            *n == 1
                        };
                        let status = if first {
                            StatusCode::SERVICE_UNAVAILABLE
                        } else {
                            // Kept with whether its Standard Webhooks signature is right.
                            let [id, at, sig] = &signed;
                            let key = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, WEBHOOK_SECRET);
                            let mut ctx = aws_lc_rs::hmac::Context::with_key(&key);
                            ctx.update(format!("{id}.{at}.").as_bytes());
                            ctx.update(&body);
                            let good = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, ctx.sign());
                            let mut event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                            event["signed"] = (*sig == format!("v1,{good}")).into();
                            event["webhook_id"] = id.clone().into();
                            g.lock().unwrap().push(event);
                            StatusCode::NO_CONTENT
                        };
                        let mut resp = http::Response::new(Full::new(Bytes::new()));
                        *resp.status_mut() = status;
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
            });
        }
    });
    Webhook { url, got, posts }
}

/// One call to `/search` as `key`: the status, the problem code (if any), `Retry-After`
/// and `RateLimit-Policy`.
async fn call(node: &Node, key: &str) -> (StatusCode, String, Option<String>, Option<String>) {
    let r = get(&node.url("/search"), &[("x-api-key", key)]).await;
    let code = if r.status.is_success() { String::new() } else { r.json()["code"].as_str().unwrap_or("").to_owned() };
    (r.status, code, r.header("retry-after").map(str::to_owned), r.header("ratelimit-policy").map(str::to_owned))
}

async fn platform_get(cp: &ControlPlane, path: &str) -> serde_json::Value {
    let auth = format!("Bearer {PLATFORM_TOKEN}");
    get(&format!("{}{path}", cp.url), &[("authorization", &auth)]).await.json()
}

async fn credentials_version(node: &Node) -> u64 {
    get(&node.admin_url("/readyz"), &[]).await.json()["credentials"]["version"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_quota_refuses_on_every_node_until_its_period_ends_and_overage_is_never_refused() {
    hard_and_overage(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_hard_quota_refuses_on_every_node_until_its_period_ends_and_overage_is_never_refused() {
    hard_and_overage(Some(PgDb::create())).await;
}

/// The quota flow with a control plane on a directory store (usage in SQLite), or all in
/// PostgreSQL database `pg` (dropped after the control plane).
async fn hard_and_overage(pg: Option<PgDb>) {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", PLANS);
    repo.write("teams/t/routes.yaml", ROUTES);
    let capped = new_key(repo.path(), "kc", "app-c", "acme", "capped", &[]);
    let metered = new_key(repo.path(), "ko", "app-o", "acme", "metered", &[]);
    let hook = webhook().await;
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    let store = match &pg {
        Some(db) => db.url.clone(),
        None => work.path().join("store").to_str().unwrap().to_owned(),
    };
    let secret = work.path().join("webhook.secret");
    std::fs::write(&secret, WEBHOOK_SECRET).unwrap();
    let cp = serve(
        repo.path(),
        &store,
        &tokens,
        &["--dwell", "0s", "--quota-webhook", &hook.url, "--quota-webhook-secret-file", secret.to_str().unwrap()],
    );
    ctl(&cp, &["publish"]);
    let nodes = [
        start_node(&cp.url, &work.path().join("n0"), "node-0"),
        start_node(&cp.url, &work.path().join("n1"), "node-1"),
    ];
    for node in &nodes {
        wait_for("the node to take the keys", Duration::from_secs(10), async || {
            get(&node.url("/search"), &[("x-api-key", "ak_live_nope")]).await.status == StatusCode::UNAUTHORIZED
                && credentials_version(node).await > 0
        })
        .await;
    }

    // Start early in a period, so the crossing and the flag fall in it with room to
    // spare: the crossing takes a few seconds, the flag about 20 s more (30 s at most
    // below), and the period has 60.
    loop {
        let into = unix_now() % PERIOD_S as f64;
        if (1.0..15.0).contains(&into) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let period_end = ((unix_now() as u64) / PERIOD_S + 1) * PERIOD_S;

    // The capped key, 20 calls a second spread over both nodes, until both refuse it.
    let mut served_first = 0u64;
    let mut crossed: Option<Instant> = None;
    let mut refused_at: [Option<Instant>; 2] = [None, None];
    let mut i = 0usize;
    let mut metered_served = 0u64;
    while refused_at.iter().any(Option::is_none) {
        assert!((unix_now() as u64) < period_end - 5, "no 429 on every node before the period ends");
        if let Some(crossed) = crossed {
            // Only a guard against the flag never coming.
            assert!(
                crossed.elapsed() < Duration::from_secs(30),
                "the quota flag did not reach every node in 30 s: refused at {refused_at:?}"
            );
        }
        let n = i % 2;
        i += 1;
        let sent = unix_now();
        let (status, code, retry, policy) = call(&nodes[n], &capped).await;
        let done = unix_now();
        match status {
            StatusCode::OK => {
                served_first += 1;
                if served_first == CAP {
                    crossed = Some(Instant::now());
                }
            }
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(code, "quota_exceeded");
                assert!(served_first >= CAP, "refused after {served_first} calls of {CAP}");
                // The whole seconds to the period's end when the node answered, which was
                // between `sent` and `done` (a second either way for the rounding).
                let retry: u64 = retry.unwrap().parse().unwrap();
                let (most, least) = (period_end as f64 - sent + 1.0, period_end as f64 - done - 1.0);
                assert!(
                    (least..=most).contains(&(retry as f64)),
                    "Retry-After {retry} s; the period ends {least:.1} to {most:.1} s after the answer"
                );
                assert_eq!(policy.as_deref(), Some("\"quota\";q=60;w=60"));
                refused_at[n].get_or_insert_with(Instant::now);
            }
            other => panic!("unexpected {other}"),
        }
        // The overage key alongside: never refused.
        if i.is_multiple_of(3) {
            assert_eq!(call(&nodes[n], &metered).await.0, StatusCode::OK, "an overage plan is never blocked");
            metered_served += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let crossed = crossed.unwrap();
    let lags: Vec<u128> = refused_at.iter().map(|t| t.unwrap().duration_since(crossed).as_millis()).collect();
    eprintln!(
        "quota lag from the crossing (call {CAP}) to the first 429: node-0 {} ms, node-1 {} ms",
        lags[0], lags[1]
    );
    assert!(served_first > CAP, "calls admitted before the flag: the overshoot");

    // Refused on both nodes from now on, until the period ends; the flag lifts then
    // with no new credentials version.
    let version = [credentials_version(&nodes[0]).await, credentials_version(&nodes[1]).await];
    for node in &nodes {
        assert_eq!(call(node, &capped).await.0, StatusCode::TOO_MANY_REQUESTS);
    }
    // Meanwhile the overage key, through the period's end: each call lands in the period
    // of its answer.
    let next_end = period_end;
    let (mut before, mut after, mut around) = (0u64, 0u64, 0u64);
    // Start a few seconds before the end.
    let start_at = next_end as f64 - 3.0;
    while unix_now() < start_at {
        for node in &nodes {
            assert_eq!(call(node, &capped).await.0, StatusCode::TOO_MANY_REQUESTS, "refused until the period ends");
        }
        tokio::time::sleep(Duration::from_secs_f64((start_at - unix_now()).clamp(0.0, 1.0))).await;
    }
    while unix_now() < next_end as f64 + 3.0 {
        let sent = unix_now();
        assert_eq!(call(&nodes[0], &metered).await.0, StatusCode::OK);
        let done = unix_now();
        if done < next_end as f64 {
            before += 1;
        } else if sent >= next_end as f64 {
            after += 1;
        } else {
            around += 1;
        }
    }
    assert!(before > 0 && after > 0, "{before} before, {after} after");

    let mut served_second = 0u64;
    for node in &nodes {
        assert_eq!(call(node, &capped).await.0, StatusCode::OK, "served again in the new period");
        served_second += 1;
        assert_eq!(credentials_version(node).await, version[0].max(version[1]), "no message lifted it");
    }

    // Billing: the capped key is billed its quota in the first period and everything in
    // the next; what it was served past the quota is overshoot, not billed.
    let want = (CAP + served_second, served_first - CAP);
    let period =
        String::from_utf8_lossy(&std::process::Command::new("date").args(["-u", "+%Y-%m"]).output().unwrap().stdout)
            .trim()
            .to_owned();
    // The overage key is billed every call, past its quota too.
    let want_metered = metered_served + before + after + around;
    wait_for("the bills", Duration::from_secs(25), async || {
        let v = platform_get(&cp, &format!("/v1/usage/totals?period={period}")).await;
        let bill = |caller: &str| {
            v["totals"]
                .as_array()
                .and_then(|ts| ts.iter().find(|t| t["caller"] == caller))
                .map(|t| (t["billable"].as_u64().unwrap_or(0), t["overshoot"].as_u64().unwrap_or(0)))
        };
        bill("kc") == Some(want) && bill("ko") == Some((want_metered, 0))
    })
    .await;
    eprintln!(
        "capped key: served {served_first} in its first period (quota {CAP}), billed {}, overshoot {}",
        want.0, want.1
    );

    // Around the boundary: the minute before holds every call answered before it, the
    // minute after every call sent after it; the ones in flight across it land in one.
    let minute =
        |t: u64| ctl(&cp, &["usage", "--json", "--key", "ko", "--from", &t.to_string(), "--to", &(t + 60).to_string()]);
    let calls =
        |v: &serde_json::Value| v["rows"].as_array().unwrap().iter().map(|r| r["calls"].as_u64().unwrap()).sum::<u64>();
    wait_for("the boundary's windows", Duration::from_secs(25), async || calls(&minute(next_end)) >= after).await;
    let (last_n, next_n) = (calls(&minute(next_end - 60)), calls(&minute(next_end)));
    eprintln!(
        "boundary: {before} answered before it, {after} sent after it, {around} across; the minutes hold {last_n} and {next_n}"
    );
    assert!((after..=after + around).contains(&next_n), "{next_n}");
    // The minute before holds the calls of the first loop too (the same period).
    let early = metered_served + before;
    assert!((early..=early + around).contains(&last_n), "{last_n}");

    // The webhook: 80 % and 100 % for both keys, once each, after a refused first try.
    wait_for("the quota events delivered", Duration::from_secs(20), async || {
        let got = hook.got.lock().unwrap();
        let seen = |caller: &str, p: u64| {
            got.iter().filter(|e| e["data"]["caller"] == caller && e["data"]["percent"] == p).count()
        };
        seen("kc", 80) >= 1 && seen("kc", 100) >= 1 && seen("ko", 80) >= 1 && seen("ko", 100) >= 1
    })
    .await;
    assert!(*hook.posts.lock().unwrap() > 4, "the refused delivery was tried again");
    let got = hook.got.lock().unwrap().clone();
    let mut ids: Vec<&str> = got.iter().map(|e| e["id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), got.len(), "each event delivered once: {got:#?}");
    for e in &got {
        assert_eq!(e["signed"], true, "signed with the webhook's secret: {e}");
        assert_eq!(e["webhook_id"], e["id"], "{e}");
    }
    let exhausted = got.iter().find(|e| e["data"]["caller"] == "kc" && e["data"]["percent"] == 100).unwrap();
    assert_eq!(exhausted["type"], "postern.quota.exhausted");
    assert_eq!(exhausted["data"]["mode"], "hard");
    // The store knows what the webhook took (later events may still be on their way).
    let events = platform_get(&cp, "/v1/usage/events").await;
    for e in events["events"].as_array().unwrap() {
        let taken = ids.contains(&format!("quota-{}", e["id"]).as_str());
        assert!(!taken || e["delivered"] == true, "{e}");
    }
    assert!(events["events"][0]["attempts"].as_u64() >= Some(2), "the first event was refused once: {events}");
    drop(echo);
}
