//! `posternctl`: the control plane's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "posternctl", version, about = "Postern control plane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a config repository into a snapshot file.
    Compile {
        /// The config repository (platform/ and teams/).
        repo: PathBuf,
        /// Where to write the snapshot.
        #[arg(short, long)]
        out: PathBuf,
        /// Snapshot number (default: the previous one in `out`, plus one if changed).
        #[arg(long)]
        version: Option<u64>,
    },
    /// Check a config repository without writing anything.
    Validate {
        /// The config repository.
        repo: PathBuf,
    },
    /// Work with Wasm filters.
    Filter {
        #[command(subcommand)]
        command: FilterCommand,
    },
}

#[derive(Subcommand)]
enum FilterCommand {
    /// Run a filter component on one request in the real sandbox and print the decision
    /// and its cost as JSON (exit 1 if the filter failed).
    Run {
        /// The component (`.wasm`).
        module: PathBuf,
        /// The filter's config, as JSON.
        #[arg(long, default_value = "null")]
        config: String,
        /// Limits, as JSON (e.g. `{"fuel": 1000000}`); defaults for the rest.
        #[arg(long, default_value = "{}")]
        limits: String,
        /// Method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// Path, optionally with `?query`.
        #[arg(long, default_value = "/")]
        path: String,
        /// A header, `name: value` (repeatable).
        #[arg(long = "header", short = 'H')]
        headers: Vec<String>,
        /// A body: also runs the body phase.
        #[arg(long)]
        body: Option<String>,
    },
}

fn filter_run(command: FilterCommand) -> anyhow::Result<bool> {
    let FilterCommand::Run { module, config, limits, method, path, headers, body } = command;
    let config: serde_json::Value = serde_json::from_str(&config).map_err(|e| anyhow::anyhow!("--config: {e}"))?;
    let limits: postern_wasm::Limits = serde_json::from_str(&limits).map_err(|e| anyhow::anyhow!("--limits: {e}"))?;
    let headers = headers
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| anyhow::anyhow!("--header {h:?}: use 'name: value'"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let req = posternctl::filter_run::RunRequest { method, path, headers, body: body.map(String::into_bytes) };
    let report = posternctl::filter_run::run(&module, &config, limits, &req)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(report["ok"] == true)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Compile { repo, out, version } => match posternctl::compile::compile(&repo) {
            Err(rejected) => {
                eprint!("{rejected}");
                ExitCode::from(1)
            }
            Ok(compiled) => match posternctl::publish(&compiled, &out, version) {
                Ok(file) => {
                    println!(
                        "snapshot v{} {} with {} routes and {} clusters written to {}",
                        file.version,
                        file.hash,
                        compiled.snapshot.routes.len(),
                        compiled.snapshot.clusters.len(),
                        out.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::from(2)
                }
            },
        },
        Command::Filter { command } => match filter_run(command) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        },
        Command::Validate { repo } => match posternctl::compile::compile(&repo) {
            Err(rejected) => {
                eprint!("{rejected}");
                ExitCode::from(1)
            }
            Ok(compiled) => {
                let s = &compiled.snapshot;
                println!(
                    "ok: {} routes, {} clusters, {} filter modules",
                    s.routes.len(),
                    s.clusters.len(),
                    compiled.modules.len()
                );
                ExitCode::SUCCESS
            }
        },
    }
}
