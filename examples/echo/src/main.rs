//! `postern-echo`: a demo and test backend. Every request is answered with JSON of what
//! arrived: method, path, query, headers and the body's size (and the body itself when
//! it is small UTF-8 text).
//!
//! Query parameters shape the answer, for tests:
//! `delay_ms=N` waits before answering, `status=N` sets the status, `bytes=N` streams N
//! bytes of body instead of JSON (in 64 KiB chunks, `pace_ms=N` apart; with `cut=1` the connection breaks
//! after them, one byte short of the length announced; `type=T` sets their media type,
//! `application/octet-stream` by default), `reset=1` closes the connection
//! without answering, `not_processed=1` marks the answer `x-postern-not-processed: 1` (a
//! 503 so marked may be retried by the gateway). Every answer names the backend in
//! `x-echo-name`.
//!
//! Requests under `/__echo/` are sent directly (not through a gateway); they are neither
//! delayed nor counted. `GET /__echo/count` returns how many requests this process has
//! answered (`count`), and how many of them a gateway marked as its retry
//! (`x-postern-retry`; `retried`). `PUT /__echo/delay?ms=N` sets a base delay added before every later answer
//! (on top of any `delay_ms=`; `ms=0` removes it) and answers `{"delay_ms":N}`;
//! `--delay-ms N` sets its initial value.
//!
//! With `--tls-cert PATH --tls-key PATH` (PEM: certificate chain, private key) the
//! listener serves TLS, offering ALPN `h2` and `http/1.1`; without them it serves plain
//! HTTP/1.1 and HTTP/2 with prior knowledge. `--client-ca PATH` (PEM) requires a client
//! certificate signed by that CA: handshakes without one fail. The JSON answer says
//! `"client_cert": true` and gives the certificate's subject common name in
//! `"client_cert_cn"` (null if it has none) when the client presented a certificate,
//! `"client_cert": false` otherwise.

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
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsAcceptor;

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
    /// Initial base delay before every answer, in milliseconds (`PUT /__echo/delay?ms=N`
    /// changes it).
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Serve TLS with this certificate chain (PEM); needs `--tls-key`.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) for `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require a client certificate signed by a CA in this file (PEM); needs `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
}

struct State {
    name: String,
    count: AtomicU64,
    /// Base delay before every answer, in milliseconds.
    delay_ms: AtomicU64,
    /// Requests a gateway marked as its retry (`x-postern-retry`).
    retried: AtomicU64,
}

/// The client certificate of a TLS connection, if one was presented.
#[derive(Default)]
struct ClientCert {
    present: bool,
    /// The subject's common name, when it has one.
    cn: Option<String>,
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

async fn handle(
    state: Arc<State>,
    client: Arc<ClientCert>,
    req: Request<Incoming>,
) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let query = parts.uri.query().unwrap_or("").to_owned();
    match parts.uri.path() {
        "/__echo/count" => {
            let n = state.count.load(Ordering::Relaxed);
            let r = state.retried.load(Ordering::Relaxed);
            return Ok(full(StatusCode::OK, &state.name, format!("{{\"count\":{n},\"retried\":{r}}}").into_bytes()));
        }
        "/__echo/delay" => {
            if parts.method == hyper::Method::PUT {
                let Some(ms) = query_param(&query, "ms").and_then(|v| v.parse::<u64>().ok()) else {
                    let msg = br#"{"error":"expected ?ms=N"}"#.to_vec();
                    return Ok(full(StatusCode::BAD_REQUEST, &state.name, msg));
                };
                state.delay_ms.store(ms, Ordering::Relaxed);
            }
            let n = state.delay_ms.load(Ordering::Relaxed);
            return Ok(full(StatusCode::OK, &state.name, format!("{{\"delay_ms\":{n}}}").into_bytes()));
        }
        p if p.starts_with("/__echo/") => {
            return Ok(full(StatusCode::NOT_FOUND, &state.name, br#"{"error":"unknown /__echo/ path"}"#.to_vec()));
        }
        _ => {}
    }
    state.count.fetch_add(1, Ordering::Relaxed);
    if parts.headers.contains_key("x-postern-retry") {
        state.retried.fetch_add(1, Ordering::Relaxed);
    }
    if query_param(&query, "reset") == Some("1") {
        return Err(std::io::Error::other("reset requested"));
    }
    let extra = query_param(&query, "delay_ms").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let delay = state.delay_ms.load(Ordering::Relaxed).saturating_add(extra);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
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
        let pace = Duration::from_millis(query_param(&query, "pace_ms").and_then(|v| v.parse().ok()).unwrap_or(0));
        let mut resp = Response::new(Chunks { left: n, chunk, cut, pace, wait: None }.boxed());
        *resp.status_mut() = status;
        // `type=` names the media type (compression tests); octet-stream by default.
        let ct = query_param(&query, "type")
            .and_then(|t| hyper::header::HeaderValue::from_str(t).ok())
            .unwrap_or(hyper::header::HeaderValue::from_static("application/octet-stream"));
        resp.headers_mut().insert("content-type", ct);
        return Ok(resp);
    }

    let headers: Vec<serde_json::Value> = parts
        .headers
        .iter()
        .map(|(k, v)| serde_json::json!([k.as_str(), String::from_utf8_lossy(v.as_bytes())]))
        .collect();
    let mut json = serde_json::json!({
        "backend": state.name,
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": query,
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_bytes": size,
        "body": std::str::from_utf8(&kept).ok(),
        "client_cert": client.present,
    });
    if client.present {
        json["client_cert_cn"] = client.cn.clone().into();
    }
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
    /// Wait this long before each chunk after the first (`pace_ms=`).
    pace: Duration,
    wait: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
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
        if let Some(sleep) = self.wait.as_mut() {
            std::task::ready!(sleep.as_mut().poll(cx));
        }
        let pace = self.pace;
        self.wait = (!pace.is_zero()).then(|| Box::pin(tokio::time::sleep(pace)));
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

/// The subject common name of a DER certificate, if it has a text one.
fn subject_cn(cert: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

/// Serves HTTP/1.1 and HTTP/2 on one accepted connection.
async fn serve<I>(io: I, state: Arc<State>, client: ClientCert)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let client = Arc::new(client);
    let svc = hyper::service::service_fn(move |req| handle(state.clone(), client.clone(), req));
    let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(io), svc).await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsAcceptor::from(postern_model::tls::server_config(
            cert,
            key,
            &[b"h2", b"http/1.1"],
            args.client_ca.as_deref(),
        )?)),
        _ => None,
    };
    // Room for a gateway pool's burst of new connections (`TcpListener::bind` asks for 128).
    let listener = postern_model::net::listen(args.listen, postern_model::net::BACKLOG)?;
    let addr = listener.local_addr()?;
    if let Some(p) = &args.port_file {
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, addr.port().to_string())?;
        std::fs::rename(&tmp, p)?;
    }
    eprintln!("postern-echo {} listening on {addr}", args.name);
    let state = Arc::new(State {
        name: args.name,
        count: AtomicU64::new(0),
        delay_ms: AtomicU64::new(args.delay_ms),
        retried: AtomicU64::new(0),
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let Some(tls) = tls else {
                return serve(stream, state, ClientCert::default()).await;
            };
            match tls.accept(stream).await {
                Ok(stream) => {
                    let cert = stream.get_ref().1.peer_certificates().and_then(|c| c.first());
                    let client = ClientCert { present: cert.is_some(), cn: cert.and_then(|c| subject_cn(c.as_ref())) };
                    serve(stream, state, client).await;
                }
                Err(e) => eprintln!("TLS handshake with {peer}: {e}"),
            }
        });
    }
}
