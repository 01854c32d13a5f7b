//! Bodies: requests stream to the backend under a byte-counted limit, responses stream
//! back unbuffered. Neither allocates per request beyond what hyper does.

use std::pin::Pin;
use std::task::{Context, Poll};

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

/// A response body: the backend's stream, or a small body the gateway made.
#[derive(Debug)]
pub enum ResponseBody {
    /// Streamed from the backend as it arrives.
    Upstream(Incoming),
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
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ResponseBody::Upstream(b) => Pin::new(b).poll_frame(cx),
            ResponseBody::Full(b) => Poll::Ready(b.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream(b) => b.is_end_stream(),
            ResponseBody::Full(b) => b.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream(b) => b.size_hint(),
            ResponseBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
