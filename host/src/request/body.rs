//! Bodies: requests stream to the backend under a byte-counted limit, responses stream
//! back unbuffered. Neither allocates per request beyond what hyper does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// Why a request body stopped.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// More bytes arrived than the route allows; the stream is cut here.
    #[error("request body is over the route's limit of {limit} bytes")]
    TooLarge {
        /// The route's limit.
        limit: u64,
    },
    /// The client's stream failed.
    #[error("client body: {0}")]
    Client(#[from] hyper::Error),
    /// The client sent nothing for the route's body idle timeout, or took longer than
    /// its total.
    #[error("the request body stalled or took too long")]
    Stalled,
}

/// A client's request body, counted as it streams; past `limit` bytes it ends in
/// [`BodyError::TooLarge`], whatever `Content-Length` said.
#[derive(Debug)]
pub struct LimitedBody {
    inner: Incoming,
    limit: u64,
    seen: u64,
    stall: Stall,
    fate: Option<Arc<Fate>>,
}

/// How a client's body failed, kept where the gateway can read it after the exchange:
/// an HTTP/2 client (hyper's) reports a body's failure only as a cancelled stream.
#[derive(Debug, Default)]
pub struct Fate(AtomicU8);

impl Fate {
    fn set(&self, e: &BodyError) {
        let code = match e {
            BodyError::TooLarge { .. } => 1,
            BodyError::Client(_) => 2,
            BodyError::Stalled => 3,
        };
        self.0.store(code, Ordering::Relaxed);
    }

    /// The failure, if the body failed: too large, broken by the client, or stalled.
    pub fn get(&self) -> Option<FateKind> {
        match self.0.load(Ordering::Relaxed) {
            1 => Some(FateKind::TooLarge),
            2 => Some(FateKind::Client),
            3 => Some(FateKind::Stalled),
            _ => None,
        }
    }
}

/// How a client's body failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FateKind {
    /// Over the route's limit.
    TooLarge,
    /// The client's stream broke.
    Client,
    /// It stalled or ran over its total.
    Stalled,
}

impl LimitedBody {
    /// Wraps `inner` with a limit of `limit` bytes and the time bounds of `stall`; its
    /// failure is also written to `fate` when given.
    pub fn new(inner: Incoming, limit: u64, stall: Stall, fate: Option<Arc<Fate>>) -> LimitedBody {
        LimitedBody { inner, limit, seen: 0, stall, fate }
    }

    fn fail(&self, e: BodyError) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let Some(f) = &self.fate {
            f.set(&e);
        }
        Poll::Ready(Some(Err(e)))
    }
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending if this.stall.expired(cx).is_some() => this.fail(BodyError::Stalled),
            Poll::Ready(Some(Ok(_))) if !this.stall.progress() => this.fail(BodyError::Stalled),
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.seen = this.seen.saturating_add(data.len() as u64);
                    if this.seen > this.limit {
                        return this.fail(BodyError::TooLarge { limit: this.limit });
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.fail(BodyError::Client(e)),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What the gateway sends upstream: the client's body streamed under its limit, or a
/// body buffered for filters' body phase.
#[derive(Debug)]
pub enum UpstreamBody {
    /// Streamed as it arrives.
    Stream(LimitedBody),
    /// Already read (at most the route's limit).
    Full(Option<Bytes>),
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            UpstreamBody::Stream(b) => Pin::new(b).poll_frame(cx),
            UpstreamBody::Full(b) => Poll::Ready(b.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Stream(b) => b.is_end_stream(),
            UpstreamBody::Full(b) => b.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Stream(b) => b.size_hint(),
            UpstreamBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}

/// Finds a [`BodyError::TooLarge`] anywhere in an error's source chain.
pub fn is_too_large(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if matches!(e.downcast_ref::<BodyError>(), Some(BodyError::TooLarge { .. })) {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Whether the client's own body stream failed somewhere in `err`'s sources (the
/// client hung up mid-upload: the caller's failure, not the backend's).
pub fn is_client_body(err: &(dyn std::error::Error + 'static)) -> bool {
    body_error(err, |e| matches!(e, BodyError::Client(_)))
}

/// Whether the client's upload stalled or ran over its total somewhere in `err`'s
/// sources.
pub fn is_stalled(err: &(dyn std::error::Error + 'static)) -> bool {
    body_error(err, |e| matches!(e, BodyError::Stalled))
}

fn body_error(err: &(dyn std::error::Error + 'static), which: impl Fn(&BodyError) -> bool) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<BodyError>().is_some_and(&which) {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A body's time bounds: at most `after` without a frame, and done by `until`. The
/// idle timer is armed when the body goes pending after progress and allocated once,
/// for a body that ever waits; a moving body reads the clock once per frame.
#[derive(Debug)]
pub struct Stall {
    after: Duration,
    until: tokio::time::Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

/// Which bound a body broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Nothing for the idle time.
    Idle(Duration),
    /// Past the total.
    Total,
}

impl Stall {
    /// A body may wait at most `after` for its next frame, and must be done by `until`.
    pub fn new(after: Duration, until: std::time::Instant) -> Stall {
        Stall { after, until: tokio::time::Instant::from_std(until), timer: None, armed: false }
    }

    /// The body moved: whether it is still within its total.
    fn progress(&mut self) -> bool {
        self.armed = false;
        tokio::time::Instant::now() < self.until
    }

    /// The body is pending: which bound, if any, it has now broken.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<Bound> {
        let idle = tokio::time::Instant::now() + self.after;
        let deadline = idle.min(self.until);
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        if timer.as_mut().poll(cx).is_pending() {
            return None;
        }
        Some(if timer.deadline() >= self.until { Bound::Total } else { Bound::Idle(self.after) })
    }
}

/// Why a response body stopped.
#[derive(Debug, thiserror::Error)]
pub enum ResponseBodyError {
    /// The backend's stream failed.
    #[error("backend body: {0}")]
    Upstream(#[from] hyper::Error),
    /// The backend sent nothing for the body idle timeout.
    #[error("the backend's body stalled for {} s", .0.as_secs())]
    Stalled(Duration),
    /// The body was not done within the route's total body time.
    #[error("the backend's body ran past the route's total body time")]
    TooLong,
    /// The response's compression failed.
    #[error("compressing the response: {0}")]
    Compress(#[from] std::io::Error),
}

/// A response body: the backend's stream, or a small body the gateway made.
#[derive(Debug)]
pub enum ResponseBody {
    /// Streamed from the backend as it arrives, holding the request's place in its
    /// cluster's connection cap until it ends.
    Upstream {
        /// The backend's body.
        body: Incoming,
        /// Bounds the wait for each frame.
        stall: Stall,
        /// Its places in the cluster's cap and its client's share, until it ends.
        held: Option<Held>,
    },
    /// Made by the gateway (problem+json, admin pages).
    Full(Option<Bytes>),
    /// Compressed as it streams (a route's `compress:`).
    Compressed(Box<Compressing>),
    /// Counted as it streams for the access log, which gets its record when the body
    /// ends, fails or is dropped (the client left).
    Observed(Box<Observed>),
}

/// What an answer streamed from a backend holds until it ends: its place in the
/// cluster's cap and in its client's share; the latter also marks the answer as waiting
/// on the client while the client has not taken what it was given (the send bound).
#[derive(Debug)]
pub struct Held {
    /// The place in the cluster's cap.
    pub cluster: postern_protect::Permit,
    /// The place in the client's share.
    pub client: crate::request::conn::ClientPlace,
}

/// A body whose request is logged: its bytes are counted, and its end completes the
/// record and queues it.
#[derive(Debug)]
pub struct Observed {
    inner: ResponseBody,
    log: Option<Logged>,
    trace: Option<Traced>,
    start: std::time::Instant,
    ended: Option<&'static str>,
}

/// An access-log record and the log it goes to.
pub type Logged = (Box<postern_observe::Record>, std::sync::Arc<postern_observe::AccessLog>);
/// A trace and the tracer it goes to.
pub type Traced = (Box<postern_observe::trace::Trace>, std::sync::Arc<postern_observe::Tracer>);

impl Drop for Observed {
    fn drop(&mut self) {
        let total = self.start.elapsed();
        let body = self.ended.unwrap_or("client_gone");
        if let Some((mut r, log)) = self.log.take() {
            r.total = total;
            r.body = body;
            log.submit(r);
        }
        if let Some((mut t, tracer)) = self.trace.take() {
            t.request.total = total;
            t.request.body = body;
            tracer.submit(t);
        }
    }
}

/// A body being compressed: the inner body's frames, each compressed and flushed.
#[derive(Debug)]
pub struct Compressing {
    inner: ResponseBody,
    encoder: Option<crate::request::compress::Encoder>,
    trailers: Option<http::HeaderMap>,
    /// The node's place for this stream, given back with the body.
    _slot: crate::request::compress::Slot,
}

impl ResponseBody {
    /// This body, counted for the access log's record and timed for the trace, which
    /// are queued when it ends.
    pub fn observed(self, log: Option<Logged>, trace: Option<Traced>, start: std::time::Instant) -> ResponseBody {
        let ended = self.is_end_stream().then_some("complete");
        ResponseBody::Observed(Box::new(Observed { inner: self, log, trace, start, ended }))
    }

    /// This body compressed with `coding` as it streams, in the node's place `slot`.
    pub fn compressed(
        self,
        coding: crate::request::compress::Coding,
        slot: crate::request::compress::Slot,
    ) -> Result<ResponseBody, std::io::Error> {
        let encoder = crate::request::compress::Encoder::new(coding)?;
        Ok(ResponseBody::Compressed(Box::new(Compressing {
            inner: self,
            encoder: Some(encoder),
            trailers: None,
            _slot: slot,
        })))
    }
}

impl ResponseBody {
    /// A body of these bytes.
    pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
        ResponseBody::Full(Some(bytes.into()))
    }

    /// An empty body.
    pub fn empty() -> ResponseBody {
        ResponseBody::Full(None)
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = ResponseBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ResponseBody::Upstream { body, stall, held } => {
                // Polled: the client took what it was given.
                if let Some(h) = held.as_mut() {
                    h.client.taken();
                }
                match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Pending => match stall.expired(cx) {
                        None => Poll::Pending,
                        Some(Bound::Idle(after)) => Poll::Ready(Some(Err(ResponseBodyError::Stalled(after)))),
                        Some(Bound::Total) => Poll::Ready(Some(Err(ResponseBodyError::TooLong))),
                    },
                    Poll::Ready(Some(Ok(_))) if !stall.progress() => Poll::Ready(Some(Err(ResponseBodyError::TooLong))),
                    Poll::Ready(r) => {
                        match held.as_mut() {
                            // Ended: the cluster's connection is free again.
                            Some(_) if r.is_none() => *held = None,
                            Some(h) if !body.is_end_stream() => h.client.waits(),
                            _ => {}
                        }
                        Poll::Ready(r.map(|f| f.map_err(ResponseBodyError::from)))
                    }
                }
            }
            ResponseBody::Full(b) => Poll::Ready(b.take().map(|d| Ok(Frame::data(d)))),
            ResponseBody::Observed(o) => {
                let polled = Pin::new(&mut o.inner).poll_frame(cx);
                match &polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let (Some(d), Some((r, _))) = (frame.data_ref(), o.log.as_mut()) {
                            r.bytes_out += d.len() as u64;
                        }
                    }
                    Poll::Ready(Some(Err(_))) => o.ended = Some("error"),
                    Poll::Ready(None) => o.ended = Some("complete"),
                    Poll::Pending => {}
                }
                if o.ended.is_none() && o.inner.is_end_stream() {
                    o.ended = Some("complete");
                }
                polled
            }
            ResponseBody::Compressed(c) => loop {
                let Some(encoder) = c.encoder.as_mut() else {
                    // Compressed whole: the inner body's trailers, if any, come last.
                    return Poll::Ready(c.trailers.take().map(|t| Ok(Frame::trailers(t))));
                };
                let frame = match Pin::new(&mut c.inner).poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                    Poll::Ready(Some(Ok(frame))) => frame,
                    Poll::Ready(None) => {
                        let tail = c.encoder.take().map(crate::request::compress::Encoder::finish);
                        return Poll::Ready(tail.map(|t| t.map(Frame::data).map_err(ResponseBodyError::from)));
                    }
                };
                match frame.into_data() {
                    Ok(data) => match encoder.chunk(&data) {
                        Ok(out) if out.is_empty() => continue,
                        Ok(out) => return Poll::Ready(Some(Ok(Frame::data(out)))),
                        Err(e) => return Poll::Ready(Some(Err(e.into()))),
                    },
                    Err(frame) => {
                        c.trailers = frame.into_trailers().ok();
                        let tail = c.encoder.take().map(crate::request::compress::Encoder::finish);
                        return Poll::Ready(tail.map(|t| t.map(Frame::data).map_err(ResponseBodyError::from)));
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream { body, .. } => body.is_end_stream(),
            ResponseBody::Full(b) => b.is_none(),
            ResponseBody::Compressed(c) => c.encoder.is_none() && c.trailers.is_none(),
            ResponseBody::Observed(o) => o.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream { body, .. } => body.size_hint(),
            ResponseBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |d| d.len() as u64)),
            ResponseBody::Compressed(_) => SizeHint::default(),
            ResponseBody::Observed(o) => o.inner.size_hint(),
        }
    }
}
