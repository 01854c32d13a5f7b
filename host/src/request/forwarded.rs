//! Client addresses behind trusted hops (`postern --trusted-hops`).
//!
//! By default every client-sent address header is removed and the gateway tells the
//! backend the connection's peer. When the peer is a hop the platform names (a load
//! balancer in front), its `X-Forwarded-For` is kept: the client is the rightmost address
//! in it that is not itself a trusted hop (what a client writes to the left of that is
//! its own claim, and ignored), and the backend receives the chain with the peer appended,
//! as RFC 7239 and Envoy's `xff_num_trusted_hops` do. A trusted hop's
//! `X-Forwarded-Proto` (`http` or `https`) is kept too, as it terminated TLS.

use std::net::IpAddr;

use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

/// A trusted hop that is neither an address nor a CIDR range, as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trusted hop {0:?}: expected an address or a CIDR range (10.0.0.0/8)")]
pub struct BadHop(pub String);

/// The trusted hops' address ranges.
#[derive(Debug, Clone, Default)]
pub struct Hops(Vec<IpNet>);

impl Hops {
    /// Reads CIDR ranges (`10.0.0.0/8`) or single addresses (`192.0.2.7`).
    pub fn parse(list: &[String]) -> Result<Hops, BadHop> {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            let net = item
                .parse::<IpNet>()
                .or_else(|_| item.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| BadHop(item.to_owned()))?;
            out.push(net);
        }
        Ok(Hops(out))
    }

    /// No hop is trusted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `ip` (an IPv4-mapped IPv6 address read as IPv4) is a trusted hop.
    pub fn trusts(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|n| n.contains(&ip))
    }
}

/// The forwarding headers of a request that arrived from a trusted hop.
#[derive(Debug)]
pub struct Forwarding {
    /// `X-Forwarded-For`: the chain received, then the peer.
    pub xff: HeaderValue,
    /// `X-Real-IP`: the client.
    pub client: HeaderValue,
    /// `Forwarded`: `for=<client>;proto=<proto>`.
    pub forwarded: HeaderValue,
    /// `X-Forwarded-Proto`.
    pub proto: HeaderValue,
}

/// An address as it appears in `X-Forwarded-For`: bare, `[v6]`, or either with a port.
fn read_addr(item: &str) -> Option<IpAddr> {
    let item = item.trim();
    if let Ok(ip) = item.parse() {
        return Some(ip);
    }
    if let Some(rest) = item.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    item.rsplit_once(':').and_then(|(host, _)| host.parse::<std::net::Ipv4Addr>().ok()).map(IpAddr::V4)
}

/// What the backend is told for a request from `peer`, a trusted hop, with `headers` as
/// received (before client-address headers are removed).
pub fn through_hops(headers: &HeaderMap, peer: IpAddr, conn_proto: &HeaderValue, hops: &Hops) -> Forwarding {
    let received: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    // From the right: skip trusted hops; the first other address is the client. An entry
    // that is not an address ends the walk (nothing left of it can be trusted).
    let mut client = peer;
    for item in received.iter().rev() {
        match read_addr(item) {
            Some(ip) if hops.trusts(ip) => client = ip,
            Some(ip) => {
                client = ip;
                break;
            }
            None => break,
        }
    }
    let mut chain: Vec<String> = received.iter().filter_map(|i| read_addr(i)).map(|ip| ip.to_string()).collect();
    chain.push(peer.to_string());
    let proto = headers
        .get("x-forwarded-proto")
        .filter(|v| v.as_bytes() == b"https" || v.as_bytes() == b"http")
        .cloned()
        .unwrap_or_else(|| conn_proto.clone());
    let proto_s = proto.to_str().unwrap_or("http");
    let fwd = if client.is_ipv6() {
        format!("for=\"[{client}]\";proto={proto_s}")
    } else {
        format!("for={client};proto={proto_s}")
    };
    let value = |s: &str| HeaderValue::from_str(s).unwrap_or(HeaderValue::from_static("unknown"));
    Forwarding { xff: value(&chain.join(", ")), client: value(&client.to_string()), forwarded: value(&fwd), proto }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hops() -> Hops {
        Hops::parse(&["10.0.0.0/8".into(), "192.0.2.7".into()]).unwrap()
    }

    fn run(xff: &[&str], peer: &str) -> Forwarding {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        through_hops(&h, peer.parse().unwrap(), &HeaderValue::from_static("http"), &hops())
    }

    #[test]
    fn the_client_is_the_rightmost_untrusted_address() {
        let f = run(&["198.51.100.9, 203.0.113.5, 10.1.2.3"], "192.0.2.7");
        assert_eq!(f.client, "203.0.113.5", "what the client wrote to the left is ignored");
        assert_eq!(f.xff, "198.51.100.9, 203.0.113.5, 10.1.2.3, 192.0.2.7");
        assert_eq!(f.forwarded, "for=203.0.113.5;proto=http");
        let f = run(&["203.0.113.5:4711", "[2001:db8::1]:443"], "10.0.0.1");
        assert_eq!(f.client, "2001:db8::1");
        assert_eq!(f.forwarded, "for=\"[2001:db8::1]\";proto=http");
        assert_eq!(run(&[], "10.0.0.1").client, "10.0.0.1", "no header: the hop itself");
        assert_eq!(run(&["10.9.9.9"], "10.0.0.1").client, "10.9.9.9", "only hops: the leftmost");
        assert_eq!(run(&["203.0.113.5, garbage"], "10.0.0.1").client, "10.0.0.1", "garbage ends the walk");
    }

    #[test]
    fn hops_are_ranges_or_addresses_and_mapped_addresses_count() {
        let h = hops();
        assert!(h.trusts("10.200.0.1".parse().unwrap()));
        assert!(h.trusts("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!h.trusts("192.0.2.8".parse().unwrap()));
        assert!(Hops::parse(&["10.0.0.0/33".into()]).is_err());
        assert!(Hops::parse(&["lb.internal".into()]).is_err());
        assert!(Hops::default().is_empty());
    }
}
