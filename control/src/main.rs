//! `posternctl`: the control plane's command line. Its commands and flags are in
//! `cli.rs`; this runs them.

mod cli;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use postern_model::apikey::KeyEnv;
use postern_model::credentials::Credentials;
use postern_model::disk::unix_now;
use posternctl::compile::RepoError;
use posternctl::credentials::{CREDENTIALS_FILE, publish_credentials};
use posternctl::keys;
use posternctl::{out, outln};

use crate::cli::{
    Cli, Command, ControlArgs, FilterCommand, KeyCommand, Remote, SigningKeyCommand, TokenCommand, TraceWhich,
    UsageAction, UsageQuery,
};

/// mimalloc, as in the node: compiling a large key table makes many small allocations.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

impl Remote {
    /// POSTs `body` to `path`; returns the answer, or the control plane's errors.
    fn post(&self, path: &str, body: &impl serde::Serialize) -> anyhow::Result<Option<serde_json::Value>> {
        let Some(base) = &self.control else { return Ok(None) };
        let body = serde_json::to_value(body)?;
        let token =
            self.token.as_deref().ok_or_else(|| anyhow::anyhow!("--control needs --token (or POSTERN_TOKEN)"))?;
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let (status, bytes) = runtime()?.block_on(posternctl::serve::request_with(
            http::Method::POST.as_str(),
            &url,
            token,
            self.control_ca.as_deref(),
            Some(body),
        ))?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            let errors =
                v["errors"].as_array().map(|e| e.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join("\n  "));
            let why = errors.filter(|e| !e.is_empty()).or_else(|| v["error"].as_str().map(str::to_owned));
            anyhow::bail!("control plane answered {status}: {}", why.unwrap_or_default());
        }
        Ok(Some(v))
    }
}

/// Says which nodes run a fast-lane change.
fn report_acks(v: &serde_json::Value) {
    let c = &v["credentials"];
    let names = |k: &str| c[k].as_array().map(|a| a.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", "));
    eprintln!(
        "credentials v{} applied on {} node(s){}",
        c["version"],
        c["acked"].as_array().map_or(0, Vec::len),
        names("stale").filter(|s| !s.is_empty()).map(|s| format!("; stale: {s}")).unwrap_or_default()
    );
}

/// The admin endpoint's metrics page.
fn node_metrics(admin: &str) -> anyhow::Result<String> {
    let url = format!("{}/metrics", admin.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with("GET", &url, "", None, None))?;
    anyhow::ensure!(status.is_success(), "{url}: {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn filter_cost(route: &str, admin: &str, window: Option<std::time::Duration>, as_json: bool) -> anyhow::Result<bool> {
    use posternctl::filter_cost;
    let first = filter_cost::costs(&node_metrics(admin)?, route);
    let costs = match window {
        None => first,
        Some(w) => {
            std::thread::sleep(w);
            filter_cost::window(&filter_cost::costs(&node_metrics(admin)?, route), &first)
        }
    };
    let window_s = window.map(|w| w.as_secs());
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&filter_cost::json(admin, route, window_s, &costs))?);
    } else {
        outln!("{}", filter_cost::table(admin, route, window_s, &costs).trim_end());
    }
    Ok(true)
}

fn filter_new(
    name: &str,
    template: posternctl::filter_new::Template,
    dir: Option<PathBuf>,
    sdk: Option<PathBuf>,
) -> anyhow::Result<bool> {
    let cwd = std::env::current_dir()?;
    let sdk = posternctl::filter_new::find_sdk(sdk.as_deref(), &cwd)?;
    let dir = dir.unwrap_or_else(|| PathBuf::from(name));
    let files = posternctl::filter_new::create(name, template, &dir, &sdk)?;
    outln!("created filter {name} in {} (SDK: {})", dir.display(), sdk.display());
    for f in files {
        outln!("  {}", f.display());
    }
    outln!("next: cd {} && cargo test && posternctl filter build", dir.display());
    Ok(true)
}

fn filter_build(dir: &Path) -> anyhow::Result<bool> {
    use posternctl::filter_review;
    let (manifest_path, manifest) = filter_review::build(dir)?;
    let review = filter_review::review(&manifest_path, &manifest)?;
    outln!("{}", filter_review::summary(&review).trim_end());
    Ok(review.problems.is_empty())
}

fn filter_approve(
    module: &Path,
    team: Option<String>,
    reviewer: &str,
    approvals: Option<PathBuf>,
) -> anyhow::Result<bool> {
    use posternctl::filter_review;
    let (manifest_path, manifest) = filter_review::manifest_of(module)?;
    let placed = filter_review::repo_and_team(&manifest_path);
    let team = match (team, &placed) {
        (Some(t), Some((_, placed_team))) if &t != placed_team => {
            anyhow::bail!("--team {t}, but the module sits in teams/{placed_team}/filters/")
        }
        (Some(t), _) => t,
        (None, Some((_, t))) => t.clone(),
        (None, None) => anyhow::bail!("--team: the module is not in teams/<team>/filters/ of a config repository"),
    };
    let approvals = match (approvals, placed) {
        (Some(file), _) => file,
        (None, Some((repo, _))) => repo.join("platform/filters.yaml"),
        (None, None) => anyhow::bail!("--approvals: the module is not in a config repository's teams/<team>/filters/"),
    };
    let review = filter_review::review(&manifest_path, &manifest)?;
    outln!("{}", filter_review::summary(&review).trim_end());
    if !review.problems.is_empty() {
        outln!("not approved: nothing written to {}", approvals.display());
        return Ok(false);
    }
    let at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let replaced = filter_review::approve(&approvals, &review, &team, reviewer, at)?;
    match replaced {
        Some(old) => {
            for line in filter_review::diff(&old, &review) {
                outln!("  {line}");
            }
        }
        None => outln!("  first approved version of {} for team {team}", review.filter),
    }
    outln!("approved {} ({}) for team {team} by {reviewer} in {}", review.filter, review.digest, approvals.display());
    Ok(true)
}

fn filter_run(command: FilterCommand) -> anyhow::Result<bool> {
    let (module, config, limits, method, path, headers, body, response_status, response_headers) = match command {
        FilterCommand::New { name, template, dir, sdk } => return filter_new(&name, template, dir, sdk),
        FilterCommand::Build { dir, manifest_path } => {
            let dir = match manifest_path {
                Some(m) => m.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf(),
                None => dir,
            };
            return filter_build(&dir);
        }
        FilterCommand::Approve { module, team, reviewer, approvals } => {
            return filter_approve(&module, team, &reviewer, approvals);
        }
        FilterCommand::Run {
            module,
            config,
            limits,
            method,
            path,
            headers,
            body,
            response_status,
            response_headers,
        } => (module, config, limits, method, path, headers, body, response_status, response_headers),
        FilterCommand::Cost { route, admin, window, json } => return filter_cost(&route, &admin, window, json),
    };
    let config: serde_json::Value = serde_json::from_str(&config).map_err(|e| anyhow::anyhow!("--config: {e}"))?;
    let limits: postern_model::wasm::Limits =
        serde_json::from_str(&limits).map_err(|e| anyhow::anyhow!("--limits: {e}"))?;
    let parse = |flag: &str, list: &[String]| {
        list.iter()
            .map(|h| {
                h.split_once(':')
                    .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                    .ok_or_else(|| anyhow::anyhow!("--{flag} {h:?}: use 'name: value'"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    };
    let headers = parse("header", &headers)?;
    let response = match (response_status, response_headers.is_empty()) {
        (None, true) => None,
        (status, _) => Some(posternctl::filter_run::RunResponse {
            status: status.unwrap_or(200),
            headers: parse("response-header", &response_headers)?,
        }),
    };
    let req =
        posternctl::filter_run::RunRequest { method, path, headers, body: body.map(String::into_bytes), response };
    let report = posternctl::filter_run::run(&module, &config, limits, &req)?;
    outln!("{}", serde_json::to_string_pretty(&report)?);
    Ok(report["ok"] == true)
}

fn print_credential_errors(errors: &[String]) {
    eprintln!("{} error(s) in the credentials:", errors.len());
    for e in errors {
        eprintln!("  {e}");
    }
}

/// `credentials.json` beside the snapshot.
fn credentials_out(out: &Path) -> anyhow::Result<PathBuf> {
    if out.file_name().is_some_and(|n| n == CREDENTIALS_FILE) {
        anyhow::bail!("-o {}: that name is taken by the credentials file; name the snapshot otherwise", out.display());
    }
    Ok(out.parent().unwrap_or(Path::new(".")).join(CREDENTIALS_FILE))
}

/// The snapshot and the credential state of `repo`, or the exit code after printing
/// every error.
fn compile_all(repo: &Path) -> Result<(posternctl::compile::Compiled, Credentials), ExitCode> {
    posternctl::compile::compile_repo(repo).map_err(|e| {
        match e {
            RepoError::Rejected(rejected) => eprint!("{rejected}"),
            RepoError::Credentials(errors) => print_credential_errors(&errors),
        }
        ExitCode::from(1)
    })
}

fn compile(repo: &Path, out: &Path, version: Option<u64>) -> ExitCode {
    let (compiled, creds) = match compile_all(repo) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let publish = || -> anyhow::Result<()> {
        let creds_out = credentials_out(out)?;
        let file = posternctl::publish(&compiled, out, version)?;
        outln!(
            "snapshot v{} {} with {} routes and {} clusters written to {}",
            file.version,
            file.hash,
            compiled.snapshot.routes.len(),
            compiled.snapshot.clusters.len(),
            out.display()
        );
        let file = publish_credentials(&creds, &creds_out)?;
        outln!(
            "credentials v{} {} with {} keys, {} signing keys written to {}",
            file.version,
            file.hash,
            creds.keys.len(),
            creds.signing_keys.len(),
            creds_out.display()
        );
        Ok(())
    };
    match publish() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn validate(repo: &Path) -> ExitCode {
    let (compiled, creds) = match compile_all(repo) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let s = &compiled.snapshot;
    outln!(
        "ok: {} routes, {} clusters, {} filter modules; {} keys, {} signing keys, {} apps",
        s.routes.len(),
        s.clusters.len(),
        compiled.modules.len(),
        creds.keys.len(),
        creds.signing_keys.len(),
        creds.apps.len()
    );
    ExitCode::SUCCESS
}

fn key(command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::New { repo, remote, id, app, tenant, plan, scopes, priority, test } => {
            let body = posternctl::keyservice::CreateBody {
                id: id.clone(),
                app: app.clone(),
                tenant: tenant.clone(),
                plan: plan.clone(),
                scopes: scopes.clone(),
                priority,
                test,
            };
            if let Some(v) = remote.post("/v1/keys", &body)? {
                outln!("{}", v["key"].as_str().unwrap_or_default());
                report_acks(&v);
                eprintln!("key {id:?} created. The raw key above is shown only this once; only its hash is kept.");
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let env = if test { KeyEnv::Test } else { KeyEnv::Live };
            let spec = keys::NewKey { id, app, tenant, plan, scopes, priority, env };
            let raw = keys::new_key(&repo, &spec)?;
            outln!("{raw}");
            eprintln!(
                "key {:?} added to {}. The raw key above is shown only this once: give it to its owner now; \
                 only its hash is kept.",
                spec.id,
                repo.join(posternctl::credentials::KEYS_FILE).display()
            );
        }
        KeyCommand::Rotate { repo, remote, id, new_id, overlap, test } => {
            let body = posternctl::keyservice::RotateBody {
                new_id: new_id.clone(),
                overlap: Some(format!("{}s", overlap.as_secs())),
                test,
            };
            if let Some(v) = remote.post(&format!("/v1/keys/{id}/rotate"), &body)? {
                outln!("{}", v["key"].as_str().unwrap_or_default());
                report_acks(&v);
                eprintln!("key {new_id:?} replaces {id:?}. The raw key above is shown only this once.");
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let env = if test { KeyEnv::Test } else { KeyEnv::Live };
            let rotated = keys::rotate_key(&repo, &id, &new_id, overlap, env, unix_now())?;
            outln!("{}", rotated.raw_key);
            let until = std::time::UNIX_EPOCH + Duration::from_secs(rotated.old_expires_at);
            eprintln!(
                "key {new_id:?} replaces {id:?}, which keeps working until {}. The raw key above is shown only \
                 this once.",
                humantime::format_rfc3339_seconds(until)
            );
        }
        KeyCommand::Revoke { repo, remote, which } => {
            let raw;
            let by = match (&which.id, &which.key) {
                (Some(id), _) => keys::RevokeBy::Id(id),
                (None, Some(k)) if k == "-" => {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line)?;
                    raw = line;
                    keys::RevokeBy::RawKey(&raw)
                }
                (None, Some(k)) => keys::RevokeBy::RawKey(k),
                (None, None) => anyhow::bail!("give --id or --key"),
            };
            let body = match by {
                keys::RevokeBy::Id(id) => posternctl::keyservice::RevokeBody { id: Some(id.to_owned()), key: None },
                keys::RevokeBy::RawKey(k) => {
                    posternctl::keyservice::RevokeBody { id: None, key: Some(k.trim().to_owned()) }
                }
            };
            if let Some(v) = remote.post("/v1/keys/revoke", &body)? {
                outln!("revoked key {}", v["id"]);
                report_acks(&v);
                return Ok(());
            }
            let revoked = keys::revoke_key(&repo.unwrap_or_default(), by)?;
            if revoked.already {
                outln!("key {:?} was already revoked", revoked.id);
            } else {
                outln!("revoked key {:?}", revoked.id);
            }
        }
    }
    Ok(())
}

fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::Keygen { kid, issuer, alg, private_out, public_out } => {
            let pair = keys::keygen(alg)?;
            let yaml = keys::signing_key_yaml(&kid, alg, &issuer, &pair.public_pem)?;
            keys::write_private_key(&private_out, &pair.private_pem)?;
            if let Some(path) = &public_out {
                posternctl::write_atomic(path, pair.public_pem.as_bytes())?;
            }
            out!("{yaml}");
            eprintln!(
                "private key written to {} (keep it secret); paste the record above under signing_keys: in \
                 platform/auth.yaml",
                private_out.display()
            );
        }
        TokenCommand::Mint { key, kid, issuer, audience, sub, client_id, scope, ttl, alg, jti } => {
            let pem =
                std::fs::read_to_string(&key).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", key.display()))?;
            let req = keys::MintRequest {
                alg,
                kid: &kid,
                issuer: &issuer,
                audience: &audience,
                sub: &sub,
                client_id: &client_id,
                scope: scope.as_deref(),
                ttl,
                jti: jti.as_deref(),
                now: unix_now(),
            };
            outln!("{}", keys::mint(&pem, &req)?);
        }
        TokenCommand::Revoke { repo, remote, which } => {
            let body = posternctl::keyservice::DenyBody { jti: which.jti, sub: which.sub, client_id: which.client_id };
            if let Some(v) = remote.post("/v1/deny", &body)? {
                outln!("{}", v["deny"]);
                report_acks(&v);
                return Ok(());
            }
            let repo = repo.unwrap_or_default();
            let plans = posternctl::compile::compile(&repo).map_err(|e| anyhow::anyhow!("{e}"))?.snapshot.plans;
            let v = posternctl::keyservice::apply(&repo, &plans, posternctl::keyservice::Op::Deny(body))
                .map_err(|e| anyhow::anyhow!("refused:\n  {}", e.join("\n  ")))?
                .answer;
            outln!("{}", v["deny"]);
            eprintln!(
                "added to {}; compile or publish to apply it",
                repo.join(posternctl::credentials::DENY_FILE).display()
            );
        }
    }
    Ok(())
}

/// `posternctl serve`: its settings checked and gathered, then the control plane run.
fn serve_command(cmd: Command) -> ExitCode {
    let Command::Serve {
        repo,
        store,
        tokens,
        listen,
        dwell,
        canary_nodes,
        rollout_min_requests,
        rollout_max_5xx_increase,
        rollout_p99_slack,
        signing_key,
        tls_cert,
        tls_key,
        publish_dir,
        usage_db,
        quota_webhook,
        quota_webhook_ca,
        quota_webhook_secret_file,
        usage_kafka,
        usage_kafka_topic,
        usage_kafka_group,
        usage_kafka_partitions,
        usage_kafka_replication,
        usage_kafka_option,
        usage_kafka_options_file,
        usage_node_keys,
    } = cmd
    else {
        return ExitCode::FAILURE;
    };
    if let Err(e) = secrets_off_the_command_line(&store, usage_db.as_deref(), quota_webhook.as_deref()) {
        return report(Err(anyhow::anyhow!(e)));
    }
    let mut options = match postern_model::usage::kafka_options(&usage_kafka_option) {
        Ok(o) => o,
        Err(e) => return report(Err(anyhow::anyhow!(e))),
    };
    if let Some(file) = &usage_kafka_options_file {
        match postern_model::usage::kafka_options_file(file) {
            Ok(o) => options.extend(o),
            Err(e) => return report(Err(anyhow::anyhow!(e))),
        }
    }
    let usage_kafka = usage_kafka.map(|brokers| posternctl::serve::UsageKafka {
        brokers,
        topic: usage_kafka_topic,
        group: usage_kafka_group,
        partitions: usage_kafka_partitions,
        replication: usage_kafka_replication,
        options,
    });
    let rollout = posternctl::rollout::RolloutSettings {
        dwell,
        canary_nodes,
        min_requests: rollout_min_requests,
        max_5xx_increase: rollout_max_5xx_increase,
        p99_slack: rollout_p99_slack,
        ..Default::default()
    };
    let tls = tls_cert.zip(tls_key);
    // A directory store keeps usage in `usage.db` beside it; a PostgreSQL store in
    // the same database, unless --usage-db says otherwise.
    let usage_db = usage_db.or_else(|| {
        if posternctl::store::is_postgres(&store) {
            Some(store.clone())
        } else {
            Some(Path::new(&store).join("usage.db").display().to_string())
        }
    });
    let settings = posternctl::serve::ServeSettings {
        repo,
        listen,
        tokens,
        rollout,
        tls,
        publish_dir,
        usage_db,
        quota_webhook: quota_webhook.map(|url| posternctl::serve::QuotaWebhook {
            url,
            ca: quota_webhook_ca,
            secret_file: quota_webhook_secret_file,
        }),
        usage_kafka,
        usage_node_keys,
    };
    report(serve(settings, &store, signing_key.as_deref()))
}

/// Refuses a URL carrying a credential given on `posternctl serve`'s command line, where
/// every process of the host can read it: each has an environment variable instead.
fn secrets_off_the_command_line(
    store: &str,
    usage_db: Option<&str>,
    quota_webhook: Option<&str>,
) -> Result<(), postern_model::secrets::OnCommandLine> {
    use postern_model::secrets::{OnCommandLine, in_url, on_command_line};
    let urls = [
        ("--store", Some(store), "POSTERN_STORE"),
        ("--usage-db", usage_db, "POSTERN_USAGE_DB"),
        ("--quota-webhook", quota_webhook, "POSTERN_QUOTA_WEBHOOK"),
    ];
    for (flag, url, instead) in urls {
        if let Some(what) = url.and_then(in_url)
            && on_command_line(flag)
        {
            return Err(OnCommandLine { flag, what, instead });
        }
    }
    Ok(())
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Compile { repo, out, version } => compile(&repo, &out, version),
        Command::Filter { command } => match filter_run(command) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        },
        Command::Validate { repo } => validate(&repo),
        Command::Plan { repo, against } => plan(&repo, &against),
        Command::Key { command } => report(key(command)),
        Command::Token { command } => report(token(command)),
        cmd @ Command::Serve { .. } => serve_command(cmd),
        Command::SigningKey { command } => report(signing_key(command)),
        Command::Publish { control, wait_acks, wait } => {
            let published = call_served(&control, &format!("/v1/publish?wait_acks={wait_acks}&wait={wait}"));
            if published.is_ok() {
                advise(&control);
            }
            report(published)
        }
        Command::Rollback { control, to, wait } => {
            report(call_served(&control, &format!("/v1/rollback?to={to}&wait={wait}")))
        }
        Command::Status { control, wait } => report(status(&control, Duration::from_secs(wait))),
        Command::Routes { control, advice, last, json } => report(routes(&control, advice, &last, json)),
        Command::Trace { control, which, duration, off, wait_acks } => {
            report(trace(&control, which, if off { Duration::ZERO } else { duration }, wait_acks))
        }
        Command::Usage { action: Some(UsageAction::Reconcile { control, period }), .. } => {
            report(call(&control, "POST", &format!("/v1/usage/reconcile?period={period}")))
        }
        Command::Usage { action: Some(UsageAction::Lift { control, key, app, product }), .. } => {
            let mut query = match (key, app) {
                (Some(k), _) => format!("key={}", posternctl::usage::query_escape(&k)),
                (None, a) => format!("app={}", posternctl::usage::query_escape(&a.unwrap_or_default())),
            };
            if let Some(p) = product {
                query.push_str(&format!("&product={}", posternctl::usage::query_escape(&p)));
            }
            report(call(&control, "POST", &format!("/v1/usage/flags/lift?{query}")))
        }
        Command::Usage { action: Some(UsageAction::Retire { control, node, after }), .. } => match node {
            None => report(call(&control, "GET", "/v1/usage/nodes/retired")),
            Some(node) => {
                let mut query = format!("node={}", posternctl::usage::query_escape(&node));
                if let Some(a) = after {
                    query.push_str(&format!("&after={a}"));
                }
                report(call(&control, "POST", &format!("/v1/usage/nodes/retire?{query}")))
            }
        },
        Command::Usage { action: Some(UsageAction::Held { control, apply, discard }), .. } => match (apply, discard) {
            (Some(p), _) => report(call(
                &control,
                "POST",
                &format!("/v1/usage/held/apply?period={}", posternctl::usage::query_escape(&p)),
            )),
            (None, Some(p)) => report(call(
                &control,
                "POST",
                &format!("/v1/usage/held/discard?period={}", posternctl::usage::query_escape(&p)),
            )),
            (None, None) => report(call(&control, "GET", "/v1/usage/held")),
        },
        Command::Usage { action: Some(UsageAction::Export { control, period }), .. } => {
            report(usage_export(&control, &period))
        }
        Command::Usage { action: None, control, query } => {
            report(control.required().and_then(|control| usage(&control, query)))
        }
    }
}

/// `GET <control><path>`: the answer's body, or an error with the control plane's reason.
fn get_ok(control: &ControlArgs, path: &str) -> anyhow::Result<bytes::Bytes> {
    let url = format!("{}{path}", control.control.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with(
        "GET",
        &url,
        &control.token,
        control.control_ca.as_deref(),
        None,
    ))?;
    if !status.is_success() {
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        anyhow::bail!(
            "control plane answered {status}: {}",
            v["error"].as_str().unwrap_or(&String::from_utf8_lossy(&body))
        );
    }
    Ok(body)
}

/// `posternctl trace`: sets (or ends) one caller's debug-trace flag; says until when, then
/// the control plane's answer (the credentials version, and the nodes that run it).
fn trace(control: &ControlArgs, which: TraceWhich, duration: Duration, wait_acks: u64) -> anyhow::Result<()> {
    let body = serde_json::json!({"key": which.key, "app": which.app, "for_s": duration.as_secs()});
    let url = format!("{}/v1/trace?wait_acks={wait_acks}", control.control.trim_end_matches('/'));
    let (status, bytes) = runtime()?.block_on(posternctl::serve::request_with(
        "POST",
        &url,
        &control.token,
        control.control_ca.as_deref(),
        Some(body),
    ))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    anyhow::ensure!(
        status.is_success(),
        "control plane answered {status}: {}",
        v["error"].as_str().unwrap_or(&String::from_utf8_lossy(&bytes))
    );
    let until = std::time::UNIX_EPOCH + Duration::from_secs(v["until"].as_u64().unwrap_or(0));
    let who = format!("{} {}", v["kind"].as_str().unwrap_or("?"), v["caller"].as_str().unwrap_or("?"));
    if duration.is_zero() {
        outln!("tracing of {who} is off");
    } else {
        outln!("tracing every request of {who} until {}", humantime::format_rfc3339_seconds(until));
    }
    outln!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `posternctl usage export`: a final period's billing lines, as the control plane gives them.
fn usage_export(control: &ControlArgs, period: &str) -> anyhow::Result<()> {
    let body = get_ok(control, &format!("/v1/usage/export?period={period}"))?;
    out!("{}", String::from_utf8_lossy(&body));
    Ok(())
}

/// `posternctl usage`: the control plane's usage rows as a table, a chart (`--chart`) or
/// the answer's JSON (`--json`, which wins over `--chart`).
fn usage(control: &ControlArgs, q: UsageQuery) -> anyhow::Result<()> {
    let chart = q.chart && !q.json;
    let by = if chart { "minute" } else { q.by.as_str() };
    let (from, to) = match q.last {
        Some(seconds) => {
            let now = unix_now();
            (Some(now.saturating_sub(seconds).to_string()), Some(now.to_string()))
        }
        None => (q.from, q.to),
    };
    let mut query = format!("by={by}");
    for (name, v) in [("key", q.key), ("product", q.product), ("from", from), ("to", to)] {
        if let Some(v) = v {
            query.push_str(&format!("&{name}={}", posternctl::usage::query_escape(&v)));
        }
    }
    let body = get_ok(control, &format!("{}?{query}", postern_model::protocol::USAGE_PATH))?;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    if q.json {
        outln!("{}", serde_json::to_string_pretty(&v)?);
    } else if chart {
        out!("{}", posternctl::usage::chart(&v));
    } else {
        out!("{}", posternctl::usage::table(&v));
    }
    Ok(())
}

fn plan(repo: &Path, against: &Path) -> ExitCode {
    let old = match std::fs::read(against)
        .map_err(|e| e.to_string())
        .and_then(|b| postern_model::SnapshotFile::open(&b).map(|(_, s)| s).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}: {e}", against.display());
            return ExitCode::from(2);
        }
    };
    match posternctl::compile::compile(repo) {
        Ok(new) => {
            out!("{}", posternctl::plan::render(&posternctl::plan::diff(&old, &new.snapshot)));
            ExitCode::SUCCESS
        }
        Err(rejected) => {
            eprint!("{rejected}");
            ExitCode::from(1)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

fn serve(settings: posternctl::serve::ServeSettings, store: &str, key: Option<&Path>) -> anyhow::Result<()> {
    let signer = match key {
        Some(path) => posternctl::keys::read_signer(path)?,
        None if !posternctl::store::is_postgres(store) => posternctl::keys::store_signer(Path::new(store))?,
        None => anyhow::bail!(
            "a PostgreSQL store is shared by several instances: give each the same --signing-key \
             (`posternctl signing-key new FILE` makes one)"
        ),
    };
    eprintln!("posternctl serve: signing versions with {}", signer.public());
    runtime()?.block_on(async {
        let store = posternctl::store::Store::open(store, Some(std::sync::Arc::new(signer))).await?;
        posternctl::serve::serve(settings, store).await
    })
}

fn signing_key(command: SigningKeyCommand) -> anyhow::Result<()> {
    match command {
        SigningKeyCommand::New { out } => {
            let signer = postern_model::sign::Signer::generate()?;
            posternctl::keys::write_private_key(&out, &signer.to_text())?;
            outln!("{}", signer.public());
        }
        SigningKeyCommand::Public { key } => outln!("{}", posternctl::keys::read_signer(&key)?.public()),
    }
    Ok(())
}

/// One request to the control plane; prints the answer (its summary line first).
fn call(control: &ControlArgs, method: &str, path: &str) -> anyhow::Result<()> {
    print_answer(ask(control, method, path)?)
}

/// One request to the control plane: its status and JSON answer.
fn ask(control: &ControlArgs, method: &str, path: &str) -> anyhow::Result<(http::StatusCode, serde_json::Value)> {
    let url = format!("{}{path}", control.control.trim_end_matches('/'));
    let (status, body) = runtime()?.block_on(posternctl::serve::request_with(
        method,
        &url,
        &control.token,
        control.control_ca.as_deref(),
        None,
    ))?;
    Ok((status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null)))
}

fn print_answer((status, v): (http::StatusCode, serde_json::Value)) -> anyhow::Result<()> {
    if let Some(summary) = v["summary"].as_str() {
        outln!("{summary}");
    }
    outln!("{}", serde_json::to_string_pretty(&v)?);
    anyhow::ensure!(status.is_success(), "control plane answered {status}");
    Ok(())
}

/// After a publish: the timeout advice of the last 7 days on stderr, one line a route
/// advised on (nothing when the control plane keeps no usage store).
fn advise(control: &ControlArgs) {
    let Ok((status, v)) = ask(control, "GET", "/v1/usage/advice?last=7d") else { return };
    if !status.is_success() {
        return;
    }
    for r in v["routes"].as_array().into_iter().flatten() {
        if let (Some(route), Some(advice)) = (r["route"].as_str(), r["advice"].as_str()) {
            eprintln!("advice: {route}: {advice}");
        }
    }
}

/// `posternctl routes`: the timeout advice as a table (or JSON), only the routes advised
/// on with `advice_only`.
fn routes(control: &ControlArgs, advice_only: bool, last: &str, as_json: bool) -> anyhow::Result<()> {
    let path = format!("/v1/usage/advice?last={}", posternctl::usage::query_escape(last));
    let (status, v) = ask(control, "GET", &path)?;
    if as_json || !status.is_success() {
        return print_answer((status, v));
    }
    let rows: Vec<&serde_json::Value> = v["routes"]
        .as_array()
        .map(|r| r.iter().filter(|r| !advice_only || r["advice"].is_string()).collect())
        .unwrap_or_default();
    outln!("answers from {} to {}", v["from"].as_str().unwrap_or("?"), v["to"].as_str().unwrap_or("?"));
    outln!("{:<32} {:>10} {:>10} {:>9}  advice", "route", "timeout", "p99.9", "answers");
    for r in &rows {
        let p999 = r["p999_ms"].as_u64().map_or_else(|| "-".to_owned(), |p| format!("<= {p} ms"));
        outln!(
            "{:<32} {:>7} ms {:>10} {:>9}  {}",
            r["route"].as_str().unwrap_or("?"),
            r["timeout_ms"].as_u64().unwrap_or(0),
            p999,
            r["calls"].as_u64().unwrap_or(0),
            r["advice"].as_str().unwrap_or("-")
        );
    }
    if advice_only && rows.is_empty() {
        outln!("no route's response timeout is {}x its p99.9 or more", v["ratio"].as_u64().unwrap_or(10));
    }
    Ok(())
}

/// A publish or a rollback that waits for nodes to serve it: fails when one refused it
/// or did not serve it in time.
fn call_served(control: &ControlArgs, path: &str) -> anyhow::Result<()> {
    let (status, v) = ask(control, "POST", path)?;
    let served = v["snapshot"]["served"].clone();
    print_answer((status, v))?;
    anyhow::ensure!(
        served.is_null() || served["complete"] == true,
        "not served everywhere it should be: behind {}, refused {}",
        served["behind"],
        served["refused"]
    );
    Ok(())
}

/// `posternctl status`, after waiting (up to `wait`) for the fleet to settle: no rollout
/// in progress and every live node on the head.
fn status(control: &ControlArgs, wait: Duration) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let (code, v) = ask(control, "GET", "/v1/status")?;
        let settled = v["rollout"].is_null() && v["laggards"].as_array().is_some_and(Vec::is_empty);
        if wait.is_zero() || !code.is_success() || settled {
            return print_answer((code, v));
        }
        if std::time::Instant::now() >= deadline {
            print_answer((code, v))?;
            anyhow::bail!("the fleet did not settle within {} s", wait.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
