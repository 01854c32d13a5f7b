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
