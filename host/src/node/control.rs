//! The control plane subsystem: the node's link to it (URL, token, CA), the key every
//! version must be signed with, and the assembly of the control client and the drop
//! directory watcher, built from their own settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use postern_model::sign::Trust;

use crate::gateway::Gateway;
use crate::node::args::Args;
use crate::node::control_client::{self, ControlSettings};
use crate::node::live;
use crate::snapshot::Builder;

/// The control plane a node reports to: what the control client and the usage shipper
/// both use.
#[derive(Debug, Clone)]
pub struct ControlLink {
    /// Base URL, e.g. `http://127.0.0.1:9400`.
    pub url: String,
    /// Bearer token with the `node` role.
    pub token: String,
    /// CA certificates (PEM) for an `https://` control plane.
    pub ca: Option<PathBuf>,
}

impl ControlLink {
    /// The link the command line gives (`--control`, its token and CA); `None` without
    /// a control plane.
    pub fn from_args(args: &Args) -> anyhow::Result<Option<ControlLink>> {
        let Some(url) = &args.control else { return Ok(None) };
        Ok(Some(ControlLink { url: url.clone(), token: token(args)?, ca: args.control_ca.clone() }))
    }
}

/// The control token: the first line of `--control-token-file`, else `--control-token`.
fn token(args: &Args) -> anyhow::Result<String> {
    Ok(match &args.control_token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the control token from {}", path.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned(),
        None => args.control_token.clone().unwrap_or_default(),
    })
}

/// The control plane's public key (`--control-key`): the node then takes only versions
/// it signed. A control plane without one is refused.
pub fn trust(args: &Args) -> anyhow::Result<Option<Arc<Trust>>> {
    anyhow::ensure!(
        args.control.is_none() || args.control_key.is_some(),
        "--control needs --control-key: the control plane's public key (its store's signing.pub), \
         so this node takes only versions it signed"
    );
    let Some(path) = &args.control_key else { return Ok(None) };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read the control key {}", path.display()))?;
    let trust = Trust::parse(&text).map_err(|e| anyhow::anyhow!("control key {}: {e}", path.display()))?;
    tracing::info!(key = %trust, "only versions signed by the control plane are taken");
    Ok(Some(Arc::new(trust)))
}

/// Where the node keeps what the control plane sends.
#[derive(Debug, Clone)]
pub struct Files {
    /// The snapshot.
    pub snapshot: PathBuf,
    /// The credential state.
    pub credentials: PathBuf,
    /// Filter modules (`<hex>.wasm`).
    pub modules: PathBuf,
}

/// The control client and the drop directory watcher, as settings until started.
pub struct Control {
    client: Option<ControlSettings>,
    drop_dir: Option<(PathBuf, Duration)>,
    credentials: PathBuf,
}

impl Control {
    /// The settings the command line gives, for the node `node_id`.
    pub fn from_args(
        args: &Args,
        link: Option<&ControlLink>,
        trust: Option<&Arc<Trust>>,
        node_id: &str,
        files: &Files,
    ) -> Control {
        let client = link.zip(trust).map(|(link, trust)| ControlSettings {
            url: link.url.clone(),
            token: link.token.clone(),
            node_id: node_id.to_owned(),
            snapshot: files.snapshot.clone(),
            credentials: files.credentials.clone(),
            modules: files.modules.clone(),
            canary: args.control_canary,
            report_every: Duration::from_millis(args.control_report_ms.max(50)),
            ca: link.ca.clone(),
            trust: trust.clone(),
        });
        let drop_dir =
            args.credentials_dir.clone().map(|dir| (dir, Duration::from_secs(args.credentials_dir_poll_s.max(1))));
        Control { client, drop_dir, credentials: files.credentials.clone() }
    }

    /// On first boot, with nothing on disk yet, waits for the control plane's head and
    /// writes it to `snapshot`.
    pub async fn fetch_first(&self, snapshot: &Path) -> anyhow::Result<()> {
        if let Some(c) = &self.client
            && !snapshot.exists()
        {
            let bytes = control_client::fetch_first(c, Duration::from_secs(30)).await?;
            live::persist_snapshot(snapshot, &bytes)?;
        }
        Ok(())
    }

    /// Starts the control client's lanes and the drop directory watcher.
    pub fn start(self, gw: &Arc<Gateway>, builder: &Arc<Builder>) -> anyhow::Result<()> {
        if let Some(c) = self.client {
            control_client::start(gw.clone(), builder.clone(), c)?;
        }
        if let Some((dir, every)) = self.drop_dir {
            control_client::watch_drop(gw.clone(), dir, every, self.credentials);
        }
        Ok(())
    }
}
