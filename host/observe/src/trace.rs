//! OpenTelemetry traces, built and exported off the request path.
//!
//! Which requests: every server error (status 500 and above), every request of a
//! caller under a debug-trace flag, and a share of the rest decided from the request's
//! random id — the same ids the access log samples, so a sampled success has both its
//! log line and its trace. A request that is traced hands over one compact [`Trace`]
//! (its server span's facts and its child spans' offsets) through a bounded lock-free
//! queue; a full queue drops it and counts the drop.
//!
//! The `traces` thread turns each [`Trace`] into OpenTelemetry span data — a server
//! span, one span per request-phase filter (the first, on an authenticated route,
//! named `auth`), one client span for the upstream call — and exports them with
//! `opentelemetry-otlp` over HTTP/protobuf through a blocking client: no async runtime
//! is involved. A failed export counts its spans; it is never retried past the
//! timeout and never blocks a request.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind as OtelKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};

use crate::drain::{Drain, sampled};
use crate::log::{CallerKind, Record};

/// Where to export and how much to trace.
#[derive(Debug, Clone)]
pub struct TraceSettings {
    /// The collector's OTLP/HTTP traces endpoint (`http://host:4318/v1/traces`); a URL
    /// with no path gets `/v1/traces`.
    pub endpoint: String,
    /// Requests traced without an error or a debug flag, in parts per 10,000 (100: 1 %).
    pub success_per_10k: u32,
    /// Traces the queue holds; past it, traces are dropped and counted.
    pub capacity: usize,
    /// The `service.name` resource attribute.
    pub service: String,
    /// The `service.instance.id` resource attribute (the node's name).
    pub instance: String,
    /// How long one export may take.
    pub timeout: Duration,
}

impl TraceSettings {
    /// Traces to `endpoint`: 1 % sampled, 4,096 queued, `postern`, 5 s per export.
    pub fn new(endpoint: &str, instance: &str) -> TraceSettings {
        TraceSettings {
            endpoint: endpoint.to_owned(),
            success_per_10k: 100,
            capacity: 4096,
            service: "postern".to_owned(),
            instance: instance.to_owned(),
            timeout: Duration::from_secs(5),
        }
    }

    /// The endpoint with the traces path when it was given without one.
    fn url(&self) -> Result<String, EndpointError> {
        let endpoint = || self.endpoint.clone();
        let uri: http::Uri = self
            .endpoint
            .parse()
            .map_err(|e: http::uri::InvalidUri| EndpointError::Parse { endpoint: endpoint(), why: e.to_string() })?;
        match uri.scheme_str() {
            Some("http") => {}
            _ => return Err(EndpointError::NotHttp { endpoint: endpoint() }),
        }
        if uri.authority().is_none() {
            return Err(EndpointError::NoHost { endpoint: endpoint() });
        }
        Ok(match uri.path() {
            "" | "/" => format!("{}/v1/traces", self.endpoint.trim_end_matches('/')),
            _ => self.endpoint.clone(),
        })
    }
}

/// Counters of the tracer, for metrics.
#[derive(Debug, Default)]
pub struct TraceStats {
    /// Traces queued for export.
    pub queued: AtomicU64,
    /// Traces dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans lost to a failed export (collector down, refused, timed out).
    pub failed: AtomicU64,
}

/// What a child span measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// The route's authentication filter.
    Auth,
    /// Another request-phase filter.
    Filter,
    /// The call to the backend, from sending to its response head.
    Upstream,
}

/// A child of the server span, in offsets from the request's arrival.
#[derive(Debug, Clone)]
pub struct Span {
    /// What it measured.
    pub kind: SpanKind,
    /// The filter's name on its route, or the backend cluster.
    pub name: String,
    /// Its span id (the upstream span's is the parent id the backend was sent).
    pub id: u64,
    /// From arrival to its start.
    pub start: Duration,
    /// From arrival to its end.
    pub end: Duration,
    /// A filter's outcome (`continue`, `answered`, `failed`); empty for the upstream call.
    pub outcome: &'static str,
    /// The backend's status, on an upstream span that got an answer.
    pub status: Option<u16>,
    /// The backend endpoint (`host:port`), on an upstream span.
    pub address: Option<String>,
    /// Why it failed, if it did: makes the span's status an error.
    pub error: Option<&'static str>,
}

/// One traced request: its server span's facts (the access log's record of it) and
/// its children. Made only for a request that is traced, on its way out; the body's end
/// fills in the total.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The request, as the access log records it.
    pub request: Record,
    /// The trace id: the client's, from a valid `traceparent`, else the request's own.
    pub trace_id: u128,
    /// The client's span (`traceparent`'s parent id), 0 if it sent none.
    pub parent: u64,
    /// The server span's id.
    pub span_id: u64,
    /// Traced because its caller is under a debug-trace flag.
    pub debug: bool,
    /// Filters and the upstream call, in order.
    pub spans: Vec<Span>,
}

impl Trace {
    /// The spans of this trace as OpenTelemetry span data: the server span first.
    pub fn span_data(&self, scope: &InstrumentationScope) -> Vec<SpanData> {
        let r = &self.request;
        let at = r.at.unwrap_or(SystemTime::UNIX_EPOCH);
        let trace_id = TraceId::from(self.trace_id);
        let data = |id: u64, parent: SpanId, kind, name, start: Duration, end: Duration, attributes, status| SpanData {
            span_context: SpanContext::new(
                trace_id,
                SpanId::from(id),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: parent,
            parent_span_is_remote: parent != SpanId::INVALID && id == self.span_id,
            span_kind: kind,
            name,
            start_time: at + start,
            end_time: at + end.max(start),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: scope.clone(),
        };
        let name = match &r.route {
            Some(route) => format!("{} {route}", r.method),
            None => r.method.clone(),
        };
        let mut attributes = vec![
            KeyValue::new("http.request.method", r.method.clone()),
            KeyValue::new("url.path", r.path.clone()),
            KeyValue::new("http.response.status_code", i64::from(r.status)),
            KeyValue::new("postern.request_id", r.request_id.clone()),
            KeyValue::new("postern.origin", r.origin),
            KeyValue::new("postern.snapshot", i64::try_from(r.snapshot).unwrap_or(i64::MAX)),
            KeyValue::new("postern.pool", r.pool),
            KeyValue::new("postern.body", r.body),
        ];
        if let Some(route) = &r.route {
            attributes.push(KeyValue::new("postern.route", route.clone()));
        }
        if let Some((kind, caller)) = &r.caller {
            let key = match kind {
                CallerKind::Key => "postern.key_id",
                CallerKind::App => "postern.client_id",
            };
            attributes.push(KeyValue::new(key, caller.clone()));
        }
        if let Some(p) = &r.plan {
            attributes.push(KeyValue::new("postern.plan", p.clone()));
        }
        if let Some(c) = r.code {
            attributes.push(KeyValue::new("postern.problem", c));
        }
        if self.debug {
            attributes.push(KeyValue::new("postern.debug_trace", true));
        }
        // A server span is an error only for a server error (OpenTelemetry's HTTP
        // conventions): a 4xx is the client's.
        let status = if r.status >= 500 {
            Status::Error { description: Cow::Borrowed(r.code.unwrap_or("upstream server error")) }
        } else {
            Status::Unset
        };
        let parent = if self.parent == 0 { SpanId::INVALID } else { SpanId::from(self.parent) };
        let mut out = Vec::with_capacity(1 + self.spans.len());
        out.push(data(
            self.span_id,
            parent,
            OtelKind::Server,
            Cow::Owned(name),
            Duration::ZERO,
            r.total,
            attributes,
            status,
        ));
        for s in &self.spans {
            let (kind, name, mut attributes) = match s.kind {
                SpanKind::Auth | SpanKind::Filter => (
                    OtelKind::Internal,
                    match s.kind {
                        SpanKind::Auth => Cow::Borrowed("auth"),
                        _ => Cow::Owned(format!("filter {}", s.name)),
                    },
                    vec![KeyValue::new("postern.filter", s.name.clone()), KeyValue::new("postern.outcome", s.outcome)],
                ),
                SpanKind::Upstream => (
                    OtelKind::Client,
                    Cow::Owned(format!("{} upstream", r.method)),
                    vec![KeyValue::new("postern.cluster", s.name.clone())],
                ),
            };
            if let Some(a) = &s.address {
                attributes.push(KeyValue::new("server.address", a.clone()));
            }
            if let Some(code) = s.status {
                attributes.push(KeyValue::new("http.response.status_code", i64::from(code)));
            }
            let status = match s.error {
                Some(e) => Status::Error { description: Cow::Borrowed(e) },
                None => Status::Unset,
            };
            out.push(data(s.id, SpanId::from(self.span_id), kind, name, s.start, s.end, attributes, status));
        }
        out
    }
}

/// The tracer: a bounded queue in front of its own exporting thread.
pub struct Tracer {
    queue: Drain<Trace>,
    success_per_10k: u32,
    /// Counters, for metrics.
    pub stats: TraceStats,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer").field("queued", &self.queue.len()).finish_non_exhaustive()
    }
}

/// An OTLP endpoint the tracer cannot export to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// Not a URL.
    #[error("{endpoint:?}: {why}")]
    Parse {
        /// The endpoint as given.
        endpoint: String,
        /// Why it does not parse.
        why: String,
    },
    /// Not `http://`.
    #[error("{endpoint:?}: the collector is reached over plain http://")]
    NotHttp {
        /// The endpoint as given.
        endpoint: String,
    },
    /// No host.
    #[error("{endpoint:?}: no host")]
    NoHost {
        /// The endpoint as given.
        endpoint: String,
    },
}

/// Why the tracer could not start.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The endpoint is refused.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The exporter could not be built.
    #[error("the OTLP exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// The export thread could not start.
    #[error("the traces thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Spans sent in one export at most.
const BATCH_SPANS: usize = 2048;

impl Tracer {
    /// Builds the exporter (a bad endpoint is refused here) and starts the thread.
    pub fn start(settings: TraceSettings) -> Result<Arc<Tracer>, TraceError> {
        let url = settings.url()?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(settings.timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_timeout(settings.timeout)
            .with_http_client(Blocking(agent))
            .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
            .build()
            .map_err(TraceError::Exporter)?;
        let resource = Resource::builder_empty()
            .with_service_name(settings.service.clone())
            .with_attributes([KeyValue::new("service.instance.id", settings.instance.clone())])
            .build();
        exporter.set_resource(&resource);
        let tracer = Arc::new(Tracer {
            queue: Drain::new(settings.capacity),
            success_per_10k: settings.success_per_10k.min(10_000),
            stats: TraceStats::default(),
        });
        let worker = tracer.clone();
        tracer.queue.spawn("traces", move || worker.run(exporter)).map_err(TraceError::Thread)?;
        Ok(tracer)
    }

    /// Whether a request is traced from its start: its random id falls in the sample
    /// (the access log samples the same ids), or its caller is under a debug flag.
    pub fn samples(&self, sample: u128, debug: bool) -> bool {
        debug || sampled(sample, self.success_per_10k)
    }

    /// Whether a request that ended with `status` is traced: sampled, or a server error.
    pub fn wants(&self, status: u16, sample: u128, debug: bool) -> bool {
        status >= 500 || self.samples(sample, debug)
    }

    /// Queues a trace; a full queue drops it and counts the drop. Never blocks.
    pub fn submit(&self, trace: Box<Trace>) {
        let counter = if self.queue.push(trace) { &self.stats.queued } else { &self.stats.dropped };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Exports what is queued and stops the thread (at shutdown, after the drain).
    pub fn shutdown(&self) {
        self.queue.shutdown();
    }

    fn run(&self, exporter: opentelemetry_otlp::SpanExporter) {
        let scope = InstrumentationScope::builder("postern").with_version(env!("CARGO_PKG_VERSION")).build();
        let mut batch: Vec<SpanData> = Vec::new();
        loop {
            let stopping = self.queue.stopping();
            loop {
                while batch.len() < BATCH_SPANS
                    && let Some(t) = self.queue.pop()
                {
                    batch.extend(t.span_data(&scope));
                }
                if batch.is_empty() {
                    break;
                }
                let n = batch.len() as u64;
                match futures_executor::block_on(exporter.export(std::mem::take(&mut batch))) {
                    Ok(()) => self.stats.exported.fetch_add(n, Ordering::Relaxed),
                    Err(_) => self.stats.failed.fetch_add(n, Ordering::Relaxed),
                };
            }
            if stopping {
                return;
            }
            std::thread::park_timeout(Duration::from_millis(100));
        }
    }
}

/// The exporter's HTTP client: blocking, on the `traces` thread.
#[derive(Debug)]
struct Blocking(ureq::Agent);

/// The largest collector answer read.
const MAX_ANSWER: u64 = 1 << 20;

#[async_trait::async_trait]
impl HttpClient for Blocking {
    async fn send_bytes(&self, request: http::Request<Bytes>) -> Result<http::Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let answer = self.0.run(http::Request::from_parts(parts, body.as_ref()))?;
        let (parts, mut body) = answer.into_parts();
        let bytes = body.with_config().limit(MAX_ANSWER).read_to_vec()?;
        Ok(http::Response::from_parts(parts, Bytes::from(bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Trace {
        Trace {
            request: Record {
                at: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)),
                total: Duration::from_millis(12),
                method: "GET".into(),
                path: "/v1/orders".into(),
                route: Some("orders/list".into()),
                caller: Some((CallerKind::Key, "k-1".into())),
                status: 502,
                code: Some("upstream_unavailable"),
                origin: "gateway",
                ..Record::default()
            },
            trace_id: 0x0af7651916cd43dd8448eb211c80319c,
            parent: 0xb7ad6b7169203331,
            span_id: 7,
            debug: false,
            spans: vec![
                Span {
                    kind: SpanKind::Auth,
                    name: "auth".into(),
                    id: 8,
                    start: Duration::from_micros(5),
                    end: Duration::from_micros(9),
                    outcome: "continue",
                    status: None,
                    address: None,
                    error: None,
                },
                Span {
                    kind: SpanKind::Upstream,
                    name: "orders".into(),
                    id: 9,
                    start: Duration::from_micros(20),
                    end: Duration::from_millis(11),
                    outcome: "",
                    status: None,
                    address: Some("127.0.0.1:9".into()),
                    error: Some("upstream_unavailable"),
                },
            ],
        }
    }

    #[test]
    fn a_trace_is_a_server_span_with_its_children() {
        let scope = InstrumentationScope::builder("postern").build();
        let spans = trace().span_data(&scope);
        assert_eq!(spans.len(), 3);
        let server = &spans[0];
        assert_eq!(server.span_kind, OtelKind::Server);
        assert_eq!(server.name, "GET orders/list");
        assert_eq!(server.span_context.trace_id(), TraceId::from(0x0af7651916cd43dd8448eb211c80319c_u128));
        assert_eq!(server.parent_span_id, SpanId::from(0xb7ad6b7169203331_u64));
        assert!(server.parent_span_is_remote);
        assert!(matches!(server.status, Status::Error { .. }), "a 502 is an error");
        assert_eq!(server.end_time.duration_since(server.start_time).ok(), Some(Duration::from_millis(12)));
        for child in &spans[1..] {
            assert_eq!(child.parent_span_id, server.span_context.span_id());
            assert_eq!(child.span_context.trace_id(), server.span_context.trace_id());
            assert!(child.start_time >= server.start_time && child.end_time <= server.end_time);
        }
        assert_eq!(spans[1].name, "auth");
        assert_eq!(spans[2].span_kind, OtelKind::Client);
        assert_eq!(spans[2].span_context.span_id(), SpanId::from(9_u64));
        assert!(matches!(spans[2].status, Status::Error { .. }));
        let key = server.attributes.iter().find(|kv| kv.key.as_str() == "postern.key_id");
        assert_eq!(key.map(|kv| kv.value.to_string()), Some("k-1".to_owned()));
    }

    #[test]
    fn a_request_without_a_client_parent_is_a_root() {
        let scope = InstrumentationScope::builder("postern").build();
        let mut t = trace();
        t.parent = 0;
        t.request.status = 200;
        let spans = t.span_data(&scope);
        assert_eq!(spans[0].parent_span_id, SpanId::INVALID);
        assert!(!spans[0].parent_span_is_remote);
        assert_eq!(spans[0].status, Status::Unset);
    }

    #[test]
    fn sampling_follows_the_request_id_and_keeps_errors_and_debug_callers() {
        let t = Tracer { queue: Drain::new(1), success_per_10k: 100, stats: TraceStats::default() };
        let sampled = (0..10_000_u128).filter(|&i| t.wants(200, i * 7919, false)).count();
        assert_eq!(sampled, 100, "1 % of ids");
        assert!(t.wants(503, 5_000, false), "a server error is kept");
        assert!(!t.wants(404, 5_000, false), "a client error follows the sample");
        assert!(t.wants(200, 5_000, true), "a debug caller is always traced");
        t.submit(Box::new(trace()));
        t.submit(Box::new(trace()));
        assert_eq!(t.stats.queued.load(Ordering::Relaxed), 1);
        assert_eq!(t.stats.dropped.load(Ordering::Relaxed), 1, "a full queue drops and counts");
    }

    #[test]
    fn endpoints_are_checked_and_given_the_traces_path() {
        let url = |e: &str| TraceSettings::new(e, "n").url();
        assert_eq!(url("http://127.0.0.1:4318").as_deref(), Ok("http://127.0.0.1:4318/v1/traces"));
        assert_eq!(url("http://127.0.0.1:4318/").as_deref(), Ok("http://127.0.0.1:4318/v1/traces"));
        assert_eq!(url("http://c:4318/otlp/v1/traces").as_deref(), Ok("http://c:4318/otlp/v1/traces"));
        assert!(url("https://c:4318").is_err());
        assert!(url("c:4318").is_err());
        assert!(url("not a url").is_err());
    }

    #[test]
    fn a_collector_that_is_down_costs_counted_spans() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let mut settings = TraceSettings::new(&url, "n");
        settings.timeout = Duration::from_secs(1);
        let tracer = Tracer::start(settings).unwrap();
        tracer.submit(Box::new(trace()));
        tracer.shutdown();
        assert_eq!(tracer.stats.queued.load(Ordering::Relaxed), 1);
        assert_eq!(tracer.stats.failed.load(Ordering::Relaxed), 3, "the trace's three spans");
        assert_eq!(tracer.stats.exported.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn spans_are_posted_as_otlp_protobuf() {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use prost::Message as _;
        use std::io::{BufRead, BufReader, Read, Write};
        // A one-request OTLP/HTTP receiver.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let (mut line, mut head) = (String::new(), Vec::new());
            while reader.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
                head.push(line.trim_end().to_ascii_lowercase());
                line.clear();
            }
            let length: usize =
                head.iter().find_map(|h| h.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap())).unwrap();
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            (head, ExportTraceServiceRequest::decode(&body[..]).unwrap())
        });
        let tracer = Tracer::start(TraceSettings::new(&url, "node-7")).unwrap();
        tracer.submit(Box::new(trace()));
        tracer.shutdown();
        let (head, export) = server.join().unwrap();
        assert_eq!(head[0], "post /v1/traces http/1.1");
        assert!(head.contains(&"content-type: application/x-protobuf".to_owned()), "{head:?}");
        assert_eq!(tracer.stats.exported.load(Ordering::Relaxed), 3);
        let rs = &export.resource_spans[0];
        let instance = rs.resource.as_ref().unwrap().attributes.iter().find(|kv| kv.key == "service.instance.id");
        assert!(format!("{instance:?}").contains("node-7"));
        let spans = &rs.scope_spans[0].spans;
        assert_eq!(spans.len(), 3);
        assert_eq!(spans[0].trace_id, 0x0af7651916cd43dd8448eb211c80319c_u128.to_be_bytes());
        assert_eq!(spans[1].parent_span_id, spans[0].span_id);
    }
}
