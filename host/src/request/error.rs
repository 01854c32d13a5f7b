//! The request path's one error type: what went wrong, and where it came from.
//!
//! Retries, breakers and outlier ejection act on an upstream failure's kind, so a failure
//! is classified once, where it happens, from typed sources (never from an error's text).
//! It becomes the caller's problem+json in exactly one place, [`crate::request::respond`].

use std::time::Duration;

use http::HeaderValue;

/// Where a failure came from (as Pingora's `ErrorSource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client: a request the gateway will not or cannot serve.
    Downstream,
    /// The backend, before the request was sent: no endpoint, no connection. Safe to
    /// retry elsewhere whatever the method.
    UpstreamConnect,
    /// The backend, after the request (or part of it) was sent: only an idempotent
    /// request may be retried.
    UpstreamSent,
    /// The gateway itself; never expected.
    Internal,
}

impl Origin {
    /// A stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Downstream => "downstream",
            Origin::UpstreamConnect => "upstream_connect",
            Origin::UpstreamSent => "upstream_sent",
            Origin::Internal => "internal",
        }
    }
}

/// Why the gateway answered a request itself instead of relaying the backend's answer.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The path has no canonical form under the platform's path policy.
    #[error("{0}")]
    InvalidPath(&'static str),
    /// A filter edited the path into one that is not canonical.
    #[error("a filter's path edit is refused: it breaks the rule path_canonical: {0}")]
    FilterPath(&'static str),
    /// The backend answered with something the gateway never relays (an unsolicited
    /// `101`, another `1xx`).
    #[error("{0}")]
    UpstreamProtocol(&'static str),
    /// A malformed request (no host, a bad `Content-Length`, a rewrite that makes no path).
    #[error("{0}")]
    BadRequest(&'static str),
    /// No route for this host and path.
    #[error("no route matches this host and path")]
    RouteNotFound,
    /// The path has routes, none for this method; the value is the `Allow` header.
    #[error("this route does not take this method")]
    MethodNotAllowed(HeaderValue),
    /// The body is over the route's limit (declared or counted).
    #[error("the request body is over this route's limit of {limit} bytes")]
    BodyTooLarge {
        /// The route's limit.
        limit: u64,
    },
    /// A buffered body did not arrive before the route's deadline.
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    /// The client's body stream broke off.
    #[error("the request body broke off")]
    BodyBroken(#[source] crate::request::body::BodyError),
    /// The client's body stream broke off while it was streamed to the backend.
    #[error("the request body broke off")]
    ClientBodyBroken(#[source] crate::cluster::connect::Error),
    /// The route's cluster has as many requests in flight as its connection cap.
    #[error("the route's cluster is at its connection cap")]
    UpstreamOverloaded,
    /// The route's cluster is busy and this client already holds its share of it.
    #[error("the route's cluster is busy and this client holds its share of it")]
    ClientShare,
    /// The node is serving as many requests as its admission budget allows this pool.
    #[error("the gateway is serving as many requests as it may; try again shortly")]
    NodeOverloaded,
    /// The node or the route's cluster is overloaded and sheds this request's class.
    #[error("overloaded: {} requests are being shed; try again shortly", .0.as_str())]
    Shed(postern_model::Priority),
    /// The cluster's circuit breaker is open (or probing and this request is not a
    /// probe); the duration is when to try again.
    #[error("the route's cluster is failing: its circuit breaker is open")]
    CircuitOpen(Duration),
    /// The route's backend has no endpoint to send to.
    #[error("the route's cluster has no endpoints")]
    NoEndpoint,
    /// The backend did not accept the connection within the connect timeout.
    #[error("the backend did not accept the connection in time")]
    ConnectTimeout(#[source] crate::cluster::connect::Error),
    /// The backend refused the connection.
    #[error("the backend refused the connection")]
    ConnectRefused(#[source] crate::cluster::connect::Error),
    /// The backend did not answer within the route's response timeout.
    #[error("the backend did not answer within {} ms", .timeout.as_millis())]
    ResponseTimeout {
        /// The route's response timeout.
        timeout: Duration,
    },
    /// The backend closed or reset the connection after the request was sent.
    #[error("the backend closed or reset the connection")]
    UpstreamBroken(#[source] crate::cluster::connect::Error),
    /// The route's validator refused the request (its OpenAPI operation).
    #[error("{0}")]
    Refused(#[from] postern_validate::Refusal),
    /// A `Content-Encoding` the gateway does not decode, on a route that reads bodies
    /// whole.
    #[error("the request body's Content-Encoding {:?} is not one of gzip, br, zstd", coding_name(.0))]
    Encoding(postern_validate::UnknownCoding),
    /// A compressed body over the route's limits once decoded, or not valid in its
    /// coding.
    #[error("{0}")]
    Decode(#[from] postern_validate::DecodeError),
    /// A transcoded call ended with a gRPC status other than OK.
    #[error("{message}")]
    Grpc {
        /// The gRPC status code.
        code: u32,
        /// Its `grpc-message`.
        message: String,
    },
    /// A gateway bug.
    #[error("{0}")]
    Internal(&'static str),
}

impl ProxyError {
    /// Where the failure came from.
    pub fn origin(&self) -> Origin {
        match self {
            ProxyError::InvalidPath(_)
            | ProxyError::BadRequest(_)
            | ProxyError::RouteNotFound
            | ProxyError::MethodNotAllowed(_)
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout
            | ProxyError::BodyBroken(_)
            | ProxyError::ClientBodyBroken(_)
            | ProxyError::Refused(_)
            | ProxyError::Encoding(_)
            | ProxyError::Decode(_) => Origin::Downstream,
            ProxyError::UpstreamOverloaded
            | ProxyError::ClientShare
            | ProxyError::Shed(_)
            | ProxyError::NodeOverloaded
            | ProxyError::CircuitOpen(_)
            | ProxyError::NoEndpoint
            | ProxyError::ConnectTimeout(_)
            | ProxyError::ConnectRefused(_) => Origin::UpstreamConnect,
            ProxyError::ResponseTimeout { .. } | ProxyError::UpstreamBroken(_) => Origin::UpstreamSent,
            ProxyError::UpstreamProtocol(_) | ProxyError::Grpc { .. } => Origin::UpstreamSent,
            ProxyError::FilterPath(_) | ProxyError::Internal(_) => Origin::Internal,
        }
    }

    /// Classifies a failed exchange with the backend from the client's typed error: a
    /// body over the limit is the caller's; a connect failure is a timeout when an
    /// [`std::io::ErrorKind::TimedOut`] is in its sources (the connector's own timeout),
    /// else a refusal; anything else happened after the request was sent.
    pub fn from_client(e: crate::cluster::connect::Error, limit: u64) -> ProxyError {
        if crate::request::body::is_too_large(&e) {
            return ProxyError::BodyTooLarge { limit };
        }
        if crate::request::body::is_client_body(&e) {
            return ProxyError::ClientBodyBroken(e);
        }
        if crate::request::body::is_stalled(&e) {
            return ProxyError::BodyTimeout;
        }
        if e.is_connect() {
            if has_io_kind(&e, std::io::ErrorKind::TimedOut) {
                return ProxyError::ConnectTimeout(e);
            }
            return ProxyError::ConnectRefused(e);
        }
        ProxyError::UpstreamBroken(e)
    }
}

/// Whether an I/O error of `kind` is anywhere in `e`'s source chain.
fn has_io_kind(e: &(dyn std::error::Error + 'static), kind: std::io::ErrorKind) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == kind) {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The `Content-Encoding` value as sent.
fn coding_name(c: &postern_validate::UnknownCoding) -> &str {
    &c.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_its_origin() {
        assert_eq!(ProxyError::RouteNotFound.origin(), Origin::Downstream);
        assert_eq!(ProxyError::BodyTooLarge { limit: 1 }.origin(), Origin::Downstream);
        assert_eq!(ProxyError::NoEndpoint.origin(), Origin::UpstreamConnect);
        assert_eq!(ProxyError::ResponseTimeout { timeout: Duration::from_millis(5) }.origin(), Origin::UpstreamSent);
        assert_eq!(ProxyError::Internal("x").origin(), Origin::Internal);
    }

    #[test]
    fn a_timed_out_io_error_is_found_in_the_sources() {
        #[derive(Debug, thiserror::Error)]
        #[error("connect")]
        struct Wrap(#[source] std::io::Error);
        let e = Wrap(std::io::Error::new(std::io::ErrorKind::TimedOut, "tcp connect timeout"));
        assert!(has_io_kind(&e, std::io::ErrorKind::TimedOut));
        let e = Wrap(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"));
        assert!(!has_io_kind(&e, std::io::ErrorKind::TimedOut));
    }

    /// The client's errors, made by a real client against real sockets: a refused
    /// connection, and a backend that closes after reading the request.
    #[tokio::test]
    async fn client_failures_are_classified_by_kind() {
        use crate::request::body::UpstreamBody;
        let mut clients = crate::cluster::connect::Clients::default();
        let transport = crate::cluster::connect::Transport::default();
        let client = clients.get(Duration::from_millis(200), &transport).unwrap();
        let mut send = |addr: String| {
            let pool = clients.pool(&transport, &addr.parse().unwrap());
            let client = client.clone();
            async move {
                let req = http::Request::get(format!("http://{addr}/")).body(UpstreamBody::Full(None)).unwrap();
                client.send(&pool, req).await
            }
        };

        // Refused: a port nobody listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = send(format!("127.0.0.1:{port}")).await.unwrap_err();
        let e = ProxyError::from_client(e, 10);
        assert!(matches!(e, ProxyError::ConnectRefused(_)), "{e:?}");
        assert_eq!(e.origin(), Origin::UpstreamConnect);

        // Broken after the request was sent: accept, read, close.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
            }
        });
        let e = send(addr.to_string()).await.unwrap_err();
        let e = ProxyError::from_client(e, 10);
        assert!(matches!(e, ProxyError::UpstreamBroken(_)), "{e:?}");
        assert_eq!(e.origin(), Origin::UpstreamSent);
    }
}
