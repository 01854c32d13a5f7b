//! `postern-grpc-echo`: serves the demo `orders.v1.Orders` gRPC service over h2c (see the
//! library's docs for its behaviour). `--listen ADDR` (default `127.0.0.1:0`) picks the
//! address; the first line on stdout is `listening on <addr>`, with the port bound, and
//! nothing else is printed. It stops on Ctrl-C or SIGTERM, draining open connections.

use std::io::Write as _;
use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;

/// Demo and test gRPC backend: the orders.v1.Orders service, in memory, over h2c.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = TcpListener::bind(args.listen).await.with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr().context("cannot read the bound address")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {addr}").and_then(|()| stdout.flush()).context("cannot write to stdout")?;
    drop(stdout);
    postern_grpc_echo::serve(listener, shutdown()).await.context("serving gRPC")?;
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM; a signal that cannot be listened for never comes.
async fn shutdown() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let sigterm = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = sigterm => {}
    }
}
