//! `postern`: the data plane binary. Parses flags, sets up logging and the runtime, and
//! hands over to [`postern::node::server::run`].

use std::process::ExitCode;

use clap::Parser;

/// mimalloc: loading a large key table and serving requests make many small allocations,
/// where glibc malloc spent a fifth of a million-key load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = postern::node::args::Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("POSTERN_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // One worker: a current-thread runtime, the leanest for a proxy pinned to one core.
    let mut rt = match args.workers {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n.max(1));
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("postern: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(postern::node::server::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postern: {e:#}");
            ExitCode::FAILURE
        }
    }
}
