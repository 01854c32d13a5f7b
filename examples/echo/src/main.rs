//! `postern-echo`: a demo and test backend. Every request is answered with JSON of what
//! arrived: method, path, query, headers and the body's size (and the body itself when
//! it is small UTF-8 text).
//!
//! Query parameters shape the answer, for tests:
//! `delay_ms=N` waits before answering, `status=N` sets the status, `bytes=N` streams N
//! bytes of body instead of JSON (in 64 KiB chunks; with `cut=1` the connection breaks
//! after them, one byte short of the length announced), `reset=1` closes the connection
//! without answering, `not_processed=1` marks the answer `x-postern-not-processed: 1` (a
//! 503 so marked may be retried by the gateway). Every answer names the backend in
//! `x-echo-name`. `GET /__echo/count` (sent directly, not through a gateway) returns
//! how many requests this process has answered.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

#[derive(Parser)]
#[command(about = "Echo backend for Postern demos and tests")]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9001")]
    listen: SocketAddr,
    /// Name reported in the `x-echo-name` header and the JSON, to tell backends apart.
    #[arg(long, default_value = "echo")]
    name: String,
    /// Write the bound port to this file once listening.
    #[arg(long)]
    port_file: Option<PathBuf>,
}

struct State {
    name: String,
    count: AtomicU64,
}

type Body = BoxBody<Bytes, std::io::Error>;

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query.split('&').find_map(|kv| kv.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
}

fn full(status: StatusCode, name: &str, body: Vec<u8>) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body)).map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
    if let Ok(v) = hyper::header::HeaderValue::from_str(name) {
        resp.headers_mut().insert("x-echo-name", v);
    }
    resp
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let query = parts.uri.query().unwrap_or("").to_owned();
    if parts.uri.path() == "/__echo/count" {
        let n = state.count.load(Ordering::Relaxed);
        return Ok(full(StatusCode::OK, &state.name, format!("{{\"count\":{n}}}").into_bytes()));
    }
    state.count.fetch_add(1, Ordering::Relaxed);
    if query_param(&query, "reset") == Some("1") {
        return Err(std::io::Error::other("reset requested"));
    }
    if let Some(ms) = query_param(&query, "delay_ms").and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = query_param(&query, "status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);

    // Read the body, counting it; keep at most 64 KiB of it for the answer.
    let mut body = body;
    let mut size: u64 = 0;
    let mut kept = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(std::io::Error::other)?;
        if let Some(data) = frame.data_ref() {
            size += data.len() as u64;
            if kept.len() < 64 * 1024 {
                kept.extend_from_slice(&data[..data.len().min(64 * 1024 - kept.len())]);
            }
        }
    }

    if let Some(n) = query_param(&query, "bytes").and_then(|v| v.parse::<u64>().ok()) {
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let cut = query_param(&query, "cut") == Some("1");
        let cut = cut.then(|| Box::pin(tokio::time::sleep(Duration::from_millis(200))));
        let mut resp = Response::new(Chunks { left: n, chunk, cut }.boxed());
        *resp.status_mut() = status;
        resp.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/octet-stream"));
        return Ok(resp);
    }

    let headers: Vec<serde_json::Value> = parts
        .headers
        .iter()
        .map(|(k, v)| serde_json::json!([k.as_str(), String::from_utf8_lossy(v.as_bytes())]))
        .collect();
    let json = serde_json::json!({
        "backend": state.name,
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": query,
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_bytes": size,
        "body": std::str::from_utf8(&kept).ok(),
    });
    let bytes = serde_json::to_vec_pretty(&json).map_err(std::io::Error::other)?;
    let mut resp = full(status, &state.name, bytes);
    if query_param(&query, "not_processed") == Some("1") {
        resp.headers_mut().insert("x-postern-not-processed", hyper::header::HeaderValue::from_static("1"));
    }
    Ok(resp)
}

/// A lazily produced body of `left` bytes, sent in `chunk`-sized frames.
struct Chunks {
    left: u64,
    chunk: Bytes,
    /// Break the stream after the bytes (one more was announced), once they had time to
    /// reach the client.
    cut: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            if let Some(sleep) = self.cut.as_mut() {
                std::task::ready!(sleep.as_mut().poll(cx));
                return std::task::Poll::Ready(Some(Err(std::io::Error::other("cut requested"))));
            }
            return std::task::Poll::Ready(None);
        }
        let n = self.left.min(self.chunk.len() as u64) as usize;
        self.left -= n as u64;
        std::task::Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0 && self.cut.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.left + u64::from(self.cut.is_some()))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    if let Some(p) = &args.port_file {
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, addr.port().to_string())?;
        std::fs::rename(&tmp, p)?;
    }
    eprintln!("postern-echo {} listening on {addr}", args.name);
    let state = Arc::new(State { name: args.name, count: AtomicU64::new(0) });
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { handle(state, req).await }
            });
            let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}
