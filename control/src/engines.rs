//! The data plane's engines, run by the control plane to validate exactly as a node
//! builds: the one place `posternctl` uses the data plane's crates, with
//! [`crate::filter_run`] (the sandbox harness behind `posternctl filter run`, which runs
//! sample cases here too) and the route tables (`postern-router`) the compiler builds per
//! pool to refuse equally specific routes and to route saved samples.
//!
//! Every answer is typed, so the compiler names the file and field itself:
//! a built-in filter's config error, a credential state's [`StoreError`] (a key's index
//! in `keys`), a module's [`LoadError`], a sample case's report.

use std::collections::HashMap;
use std::sync::Arc;

use postern_filter_contract::ConfigError;
use postern_model::credentials::Credentials;
use postern_model::wasm::Limits;
use postern_wasm::{LoadError, Module, Runtime, RuntimeConfig};

pub use postern_builtin_filters::auth::StoreError;

/// Checks a built-in filter's config as a node builds it.
pub fn check_filter_config(kind: &str, config: &serde_json::Value) -> Result<(), ConfigError> {
    postern_builtin_filters::build(kind, config).map(drop)
}

/// Checks a credential state as a node loads it: one bad entry refuses the whole state.
pub fn check_credentials(creds: &Credentials, now: u64) -> Result<(), StoreError> {
    postern_builtin_filters::auth::CredentialStore::build(0, creds, now).map(drop)
}

/// Why a module cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModuleError {
    /// The sandbox itself could not start.
    #[error("cannot start the Wasm runtime: {0}")]
    Runtime(String),
    /// The runtime refused the module.
    #[error("{0}")]
    Refused(String),
}

/// The real Wasm sandbox, started on first need, with every module it checked kept by
/// digest so each is compiled and checked once per compile.
#[derive(Default)]
pub struct Sandbox {
    runtime: Option<Arc<Runtime>>,
    modules: HashMap<String, Result<Arc<Module>, ModuleError>>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("modules", &self.modules.len()).finish_non_exhaustive()
    }
}

impl Sandbox {
    fn runtime(&mut self) -> Result<Arc<Runtime>, ModuleError> {
        if let Some(rt) = &self.runtime {
            return Ok(rt.clone());
        }
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() })
            .map_err(|e| ModuleError::Runtime(format!("{e:#}")))?;
        self.runtime = Some(rt.clone());
        Ok(rt)
    }

    /// Compiles and validates `bytes` (which must hash to `digest`) as a node loads it.
    pub fn load(&mut self, bytes: &[u8], digest: &str) -> Result<Arc<Module>, ModuleError> {
        if let Some(done) = self.modules.get(digest) {
            return done.clone();
        }
        let result =
            self.runtime().and_then(|rt| rt.load(bytes, Some(digest)).map_err(|e| ModuleError::Refused(e.to_string())));
        self.modules.insert(digest.to_owned(), result.clone());
        result
    }

    /// Runs the filter's own check of an attachment's config (`init`), as each node will.
    pub fn check_config(
        &mut self,
        module: &Arc<Module>,
        config: &serde_json::Value,
        limits: &Limits,
    ) -> Result<(), LoadError> {
        match &self.runtime {
            Some(rt) => rt.check_config(module, &postern_model::wasm::config_bytes(config), limits).map(drop),
            None => Ok(()),
        }
    }

    /// Runs one sample request through the module in the real sandbox, with `config` and
    /// `limits`: the report of every phase that ran (as `posternctl filter run` prints it),
    /// path edits checked under `paths`.
    pub fn run_sample(
        &mut self,
        module: &Arc<Module>,
        config: &serde_json::Value,
        limits: Limits,
        req: &crate::filter_run::RunRequest,
        paths: &postern_model::path::PathPolicy,
    ) -> anyhow::Result<serde_json::Value> {
        let rt = self.runtime()?;
        crate::filter_run::run_loaded(&rt, module, config, limits, req, paths)
    }
}
