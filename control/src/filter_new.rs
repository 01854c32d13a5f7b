//! `posternctl filter new`: a filter crate that builds and tests as it is, from one of
//! three templates — `header` (sets request headers from its config), `reply` (answers
//! 426 problem+json to clients below a minimum version) and `allowlist` (lets through
//! only listed tenants of the verified caller). Each has a typed config with
//! `deny_unknown_fields` checked in `init`, unit tests on the SDK's `testing` module, the
//! 16 KiB stack setting in `.cargo/config.toml`, and a manifest with sample cases.

use std::path::{Component, Path, PathBuf};

/// What the new filter starts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Template {
    /// Sets request headers from its config.
    Header,
    /// Answers 426 (problem+json) to clients below a minimum version, marks the others.
    Reply,
    /// Lets through only the listed tenants of the verified caller (403 problem+json).
    Allowlist,
}

impl Template {
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Template::Header => {
                (include_str!("../templates/filter/header.rs"), include_str!("../templates/filter/header.yaml"))
            }
            Template::Reply => {
                (include_str!("../templates/filter/reply.rs"), include_str!("../templates/filter/reply.yaml"))
            }
            Template::Allowlist => {
                (include_str!("../templates/filter/allowlist.rs"), include_str!("../templates/filter/allowlist.yaml"))
            }
        }
    }
}

/// The component file a crate named `name` builds: `target/wasm32-wasip2/release/<file>`
/// (dashes become underscores), and the name the manifest gives it.
pub fn module_file(name: &str) -> String {
    format!("{}.wasm", name.replace('-', "_"))
}

/// `api-version-guard` as a Rust type name: `ApiVersionGuard`.
fn type_name(name: &str) -> String {
    name.split('-')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect()
}

/// A filter name: what routes attach (`wasmFilters[].name`), the manifest's file name and
/// the crate's.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.ends_with('-')
        && !name.contains("--");
    anyhow::ensure!(ok, "{name:?}: a filter name is lowercase letters, digits and single '-', starting with a letter");
    Ok(())
}

/// Where the filter SDK (`filter-sdk/guest`) is: `explicit`, else the repository that
/// holds `cwd`, else the repository this `posternctl` was built from.
pub fn find_sdk(explicit: Option<&Path>, cwd: &Path) -> anyhow::Result<PathBuf> {
    let is_sdk = |p: &Path| {
        std::fs::read_to_string(p.join("Cargo.toml")).is_ok_and(|t| t.contains("name = \"postern-filter-sdk\""))
    };
    if let Some(p) = explicit {
        anyhow::ensure!(is_sdk(p), "--sdk {}: not the filter SDK (no Cargo.toml of postern-filter-sdk)", p.display());
        return Ok(std::fs::canonicalize(p)?);
    }
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../filter-sdk/guest");
    let found = cwd.ancestors().map(|a| a.join("filter-sdk/guest")).chain([built_from]).find(|p| is_sdk(p));
    match found {
        Some(p) => Ok(std::fs::canonicalize(p)?),
        None => anyhow::bail!(
            "cannot find the filter SDK (the gateway repository's filter-sdk/guest): run this inside the repository \
             or pass --sdk PATH"
        ),
    }
}

/// `to` relative to the directory `from` (both absolute), e.g. `../../filter-sdk/guest`.
fn relative(from: &Path, to: &Path) -> PathBuf {
    let (a, b): (Vec<Component<'_>>, Vec<Component<'_>>) = (from.components().collect(), to.components().collect());
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common <= 1 {
        return to.to_path_buf(); // only the root in common: the absolute path reads better
    }
    let mut out = PathBuf::new();
    for _ in common..a.len() {
        out.push("..");
    }
    for c in &b[common..] {
        out.push(c);
    }
    out
}

/// Writes the crate of filter `name` into `dir` (which must not exist or be empty), its
/// SDK dependency pointing at `sdk`; returns the files written, relative to `dir`.
pub fn create(name: &str, template: Template, dir: &Path, sdk: &Path) -> anyhow::Result<Vec<PathBuf>> {
    check_name(name)?;
    if dir.exists() {
        anyhow::ensure!(
            dir.read_dir()?.next().is_none(),
            "{} exists and is not empty: choose another --dir",
            dir.display()
        );
    }
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::create_dir_all(dir.join(".cargo"))?;
    let abs_dir = std::fs::canonicalize(dir)?;
    let sdk_path = relative(&abs_dir, sdk);
    let fill = |t: &str| {
        t.replace("__NAME__", name)
            .replace("__TYPE__", &type_name(name))
            .replace("__MODULE__", &module_file(name))
            .replace("__SDK__", &sdk_path.display().to_string())
    };
    let (lib, manifest) = template.source();
    let mut files = vec![
        (PathBuf::from("Cargo.toml"), fill(include_str!("../templates/filter/Cargo.toml.tmpl"))),
        (PathBuf::from(".cargo/config.toml"), include_str!("../templates/filter/cargo-config.toml").to_owned()),
        (PathBuf::from(".gitignore"), include_str!("../templates/filter/gitignore").to_owned()),
        (PathBuf::from("src/lib.rs"), fill(lib)),
        (PathBuf::from(format!("{name}.yaml")), fill(manifest)),
    ];
    // The versions the SDK is tested with, so the crate builds as the SDK does.
    if let Ok(lock) = std::fs::read_to_string(sdk.join("Cargo.lock")) {
        files.push((PathBuf::from("Cargo.lock"), lock));
    }
    for (path, text) in &files {
        std::fs::write(dir.join(path), text)?;
    }
    Ok(files.into_iter().map(|(p, _)| p).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn names_and_paths() {
        assert_eq!(type_name("api-version-guard"), "ApiVersionGuard");
        assert_eq!(module_file("api-version-guard"), "api_version_guard.wasm");
        assert!(check_name("guard-2").is_ok());
        for bad in ["Guard", "2guard", "a_b", "a-", "a--b", ""] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert_eq!(
            relative(Path::new("/r/teams/x"), Path::new("/r/filter-sdk/guest")),
            Path::new("../../filter-sdk/guest")
        );
        assert_eq!(relative(Path::new("/tmp/x"), Path::new("/r/sdk")), Path::new("/r/sdk"));
    }

    #[test]
    fn a_new_crate_names_its_filter_everywhere_and_refuses_a_full_folder() {
        let dir = tempfile::tempdir().unwrap();
        let sdk = find_sdk(None, Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
        let out = dir.path().join("guard");
        let files = create("api-version-guard", Template::Reply, &out, &sdk).unwrap();
        assert!(files.contains(&PathBuf::from("api-version-guard.yaml")), "{files:?}");
        let lib = std::fs::read_to_string(out.join("src/lib.rs")).unwrap();
        assert!(lib.contains("pub struct ApiVersionGuard;") && !lib.contains("__"), "{lib}");
        let manifest = std::fs::read_to_string(out.join("api-version-guard.yaml")).unwrap();
        assert!(manifest.contains("module: api_version_guard.wasm"), "{manifest}");
        let doc: crate::config::FilterManifestDoc = serde_yaml_ng::from_str(&manifest).unwrap();
        assert_eq!(doc.samples.len(), 2);
        // The SDK's path, absolute or relative to the crate (when both sit under one
        // folder), leads to the SDK.
        let cargo = std::fs::read_to_string(out.join("Cargo.toml")).unwrap();
        let written = cargo.lines().find_map(|l| l.strip_prefix("postern-filter-sdk = { path = \"")).unwrap();
        let written = written.split('"').next().unwrap();
        assert_eq!(out.join(written).canonicalize().unwrap(), sdk.canonicalize().unwrap(), "{cargo}");
        let err = create("api-version-guard", Template::Header, &out, &sdk).unwrap_err();
        assert!(err.to_string().contains("is not empty"), "{err}");
    }
}
