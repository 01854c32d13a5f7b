//! The compile's state: the problems found so far, each with its file, field and owner;
//! what is loaded once per compile; and the repository's team directories and files.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use postern_model::path::PathPolicy;
use serde::de::DeserializeOwned;

use crate::config::{PlansDoc, parse_yaml};
use crate::openapi::Spec;

/// One problem found in the repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// File, relative to the repository root.
    pub file: PathBuf,
    /// Field path inside the file, e.g. `routes[2].timeouts.response`.
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// Team that owns the file or route, if any.
    pub owner: Option<String>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(o) = &self.owner {
            write!(f, " (owner: {o})")?;
        }
        Ok(())
    }
}

/// Every problem that stopped a compile.
#[derive(Debug)]
pub struct Rejected(pub Vec<Diagnostic>);

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} error(s) in the config repository:", self.0.len())?;
        for d in &self.0 {
            writeln!(f, "  {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Rejected {}

/// The largest YAML file of the repository a compile reads (a team's routes, a filter's
/// manifest, the platform's files): 4 MiB. Read as files others can write: a symbolic
/// link or anything but a regular file is refused.
pub const YAML_FILE_CAP: u64 = 4 << 20;

pub(crate) struct Ctx {
    pub(crate) root: PathBuf,
    pub(crate) diags: Vec<Diagnostic>,
    pub(crate) review: Vec<crate::config::ApprovedDoc>,
    /// The real Wasm sandbox, for modules, their configs and their sample cases.
    pub(crate) sandbox: crate::engines::Sandbox,
    /// Module digest → file, for every module a route uses.
    pub(crate) modules: BTreeMap<String, PathBuf>,
    /// Filter manifests whose sample cases ran.
    pub(crate) sampled: HashSet<PathBuf>,
    /// `platform/plans.yaml`.
    pub(crate) plans: PlansDoc,
    /// `platform/gateway.yaml`'s path policy.
    pub(crate) paths: PathPolicy,
    /// OpenAPI documents by path, each loaded once (`None`: refused, already reported).
    pub(crate) specs: HashMap<PathBuf, Option<Arc<Spec>>>,
    /// Errors in OpenAPI documents already reported (file, pointer, message): routes
    /// sharing a document report each once.
    pub(crate) spec_errors: HashSet<(PathBuf, String, String)>,
}

impl Ctx {
    pub(crate) fn error(
        &mut self,
        file: &Path,
        field: impl Into<String>,
        message: impl Into<String>,
        owner: Option<&str>,
    ) {
        let file = file.strip_prefix(&self.root).unwrap_or(file).to_path_buf();
        self.diags.push(Diagnostic {
            file,
            field: field.into(),
            message: message.into(),
            owner: owner.map(str::to_owned),
        });
    }

    pub(crate) fn load<T: DeserializeOwned>(&mut self, path: &Path, owner: Option<&str>) -> Option<T> {
        let read = postern_model::disk::read_untrusted(path, YAML_FILE_CAP)
            .and_then(|b| String::from_utf8(b).map_err(|_| std::io::Error::other("not UTF-8 text")));
        let text = match read {
            Ok(t) => t,
            Err(e) => {
                self.error(path, "", format!("cannot read: {e}"), owner);
                return None;
            }
        };
        match parse_yaml::<T>(&text) {
            Ok(v) => Some(v),
            Err((field, msg)) => {
                self.error(path, field, msg, owner);
                None
            }
        }
    }
}

/// The route a `validate:` belongs to.
pub(crate) struct RouteAt<'a> {
    pub(crate) file: &'a Path,
    pub(crate) field: &'a str,
    pub(crate) team: &'a str,
    pub(crate) methods: &'a [String],
    pub(crate) path: &'a str,
    pub(crate) max_body_bytes: u64,
}

pub(crate) struct Owner {
    pub(crate) host: String,
    pub(crate) prefix: Vec<String>,
    pub(crate) team: String,
}

/// The team directories under `teams`, by name, in a stable order.
pub(crate) fn team_dirs(teams: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(teams)?.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    Ok(dirs
        .into_iter()
        .map(|d| (d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), d))
        .collect())
}

/// The `.yaml`/`.yml` files directly in `dir` (none if it is absent), in a stable order.
pub(crate) fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}
