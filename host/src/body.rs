//! Bodies: requests stream to the backend under a byte-counted limit, responses stream
//! back unbuffered. Neither allocates per request beyond what hyper does.

use std::future::Future;
use std::pin::Pin;
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
}

/// A client's request body, counted as it streams; past `limit` bytes it ends in
/// [`BodyError::TooLarge`], whatever `Content-Length` said.
#[derive(Debug)]
pub struct LimitedBody {
    inner: Incoming,
    limit: u64,
    seen: u64,
}

impl LimitedBody {
    /// Wraps `inner` with a limit of `limit` bytes.
    pub fn new(inner: Incoming, limit: u64) -> LimitedBody {
        LimitedBody { inner, limit, seen: 0 }
    }
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.seen = this.seen.saturating_add(data.len() as u64);
                    if this.seen > this.limit {
                        return Poll::Ready(Some(Err(BodyError::TooLarge { limit: this.limit })));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(BodyError::Client(e)))),
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
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if matches!(e.downcast_ref::<BodyError>(), Some(BodyError::Client(_))) {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A timer for a body that stops moving: armed when the body goes pending after
/// progress, so a steadily moving body reads no clock; allocated once, for a body that
/// ever waits.
#[derive(Debug)]
pub struct Stall {
    after: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl Stall {
    /// A body may wait at most `after` for its next frame.
    pub fn new(after: Duration) -> Stall {
        Stall { after, timer: None, armed: false }
    }

    /// The body moved.
    fn progress(&mut self) {
        self.armed = false;
    }

    /// The body is pending: whether it has now waited `after` since it last moved.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = tokio::time::Instant::now() + self.after;
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        timer.as_mut().poll(cx).is_ready()
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
        /// The place in the cluster's cap.
        permit: Option<crate::upstream::Permit>,
    },
    /// Made by the gateway (problem+json, admin pages).
    Full(Option<Bytes>),
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
            ResponseBody::Upstream { body, stall, permit } => match Pin::new(body).poll_frame(cx) {
                Poll::Pending if stall.expired(cx) => Poll::Ready(Some(Err(ResponseBodyError::Stalled(stall.after)))),
                Poll::Pending => Poll::Pending,
                Poll::Ready(r) => {
                    stall.progress();
                    if r.is_none() {
                        // Ended: the cluster's connection is free again.
                        *permit = None;
                    }
                    Poll::Ready(r.map(|f| f.map_err(ResponseBodyError::from)))
                }
            },
            ResponseBody::Full(b) => Poll::Ready(b.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream { body, .. } => body.is_end_stream(),
            ResponseBody::Full(b) => b.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream { body, .. } => body.size_hint(),
            ResponseBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
