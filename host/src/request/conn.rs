//! Facts about one client connection, computed once per connection.

use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderValue;
use postern_model::Pool;

/// Facts about one client connection, computed once per connection.
#[derive(Debug)]
pub struct ConnInfo {
    /// The listener's pool.
    pub pool: Pool,
    /// The client's address.
    pub peer: SocketAddr,
    /// `http` or `https`.
    pub proto: HeaderValue,
    /// `X-Forwarded-For` value (the client's IP; client-sent values are not trusted).
    pub xff: HeaderValue,
    /// `Forwarded` value (`for=..;proto=..`, RFC 7239).
    pub forwarded: HeaderValue,
    /// The trusted hops, when the peer is one: its `X-Forwarded-For` names the client.
    pub via_hop: Option<Arc<crate::request::forwarded::Hops>>,
}

impl ConnInfo {
    /// Facts for a connection from `peer` on a `pool` listener.
    pub fn new(pool: Pool, peer: SocketAddr, tls: bool, hops: &Arc<crate::request::forwarded::Hops>) -> ConnInfo {
        let proto = if tls { "https" } else { "http" };
        let ip = peer.ip();
        let xff = HeaderValue::from_str(&ip.to_string()).unwrap_or(HeaderValue::from_static("unknown"));
        let fwd =
            if ip.is_ipv6() { format!("for=\"[{ip}]\";proto={proto}") } else { format!("for={ip};proto={proto}") };
        ConnInfo {
            pool,
            peer,
            proto: HeaderValue::from_static(proto),
            xff,
            forwarded: HeaderValue::from_str(&fwd).unwrap_or(HeaderValue::from_static("for=unknown")),
            via_hop: hops.trusts(ip).then(|| hops.clone()),
        }
    }
}
