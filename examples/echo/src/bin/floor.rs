//! The floor a hyper-based proxy stands on, for `bench/instructions.sh`: an HTTP/1 server
//! on a current-thread runtime whose every request goes, unchanged but for its URI, through
//! hyper-util's pooled legacy client to one backend. Nothing else: no routing, no header
//! hygiene, no policy, no metrics. What postern spends beyond this is its own work. It
//! allocates with mimalloc, as the node does, so that the difference is not the allocator.
//!
//!   postern-floor --listen 127.0.0.1:18390 --backend 127.0.0.1:18080

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(about = "A bare hyper proxy: the floor postern's own work is measured against")]
struct Args {
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// The backend's `host:port`.
    #[arg(long)]
    backend: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build_http();
    let base: Arc<str> = Arc::from(format!("http://{}", args.backend));
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let service = service_fn(move |mut req: Request<Incoming>| {
                let client = client.clone();
                let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
                let uri = format!("{base}{path}").parse::<Uri>();
                async move {
                    *req.uri_mut() = uri?;
                    anyhow::Ok(client.request(req).await?)
                }
            });
            // A connection's error (the client went away) ends only that connection.
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}
