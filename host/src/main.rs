//! `postern`: the data plane binary. Parses flags, sets up logging and the runtime, and
//! hands over to [`postern::server::run`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = postern::server::Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("POSTERN_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.workers {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("postern: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(postern::server::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postern: {e:#}");
            ExitCode::FAILURE
        }
    }
}
