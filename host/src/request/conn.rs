//! Facts about one client connection, computed once per connection, and what it holds:
//! its backend requests in flight (its fair share of a cluster) and its answers waiting
//! for it to read them (the send bound).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};

use http::HeaderValue;
use postern_model::Pool;

/// Ticks of the send bound: a stream whose answer waited on its client through this many
/// ticks of `bound / SEND_TICKS` has waited at least `bound`.
pub const SEND_TICKS: u8 = 5;

/// How much of a cluster one client may hold once the cluster is busy (half its cap or
/// more): this connection, and its source address on this listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Percent of a cluster's cap one connection may hold.
    pub connection: u8,
    /// Percent of a cluster's cap one source address may hold.
    pub address: u8,
}

impl Default for Shares {
    fn default() -> Shares {
        Shares { connection: 10, address: 25 }
    }
}

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
    /// The share of a busy cluster this client may hold.
    shares: Shares,
    /// This connection's backend requests in flight.
    held: AtomicU32,
    /// Its source address's on this listener (shared by the address's connections).
    held_by_address: Arc<AtomicU32>,
    /// Answers waiting for this client to take them, by the tick they began waiting.
    pub sending: SendWatch,
}

impl ConnInfo {
    /// Facts for a connection from `peer` on a `pool` listener; `by_address` counts the
    /// backend requests of every connection from its address.
    pub fn new(
        pool: Pool,
        peer: SocketAddr,
        tls: bool,
        hops: &Arc<crate::request::forwarded::Hops>,
        shares: Shares,
        by_address: Arc<AtomicU32>,
    ) -> ConnInfo {
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
            shares,
            held: AtomicU32::new(0),
            held_by_address: by_address,
            sending: SendWatch::default(),
        }
    }

    /// A place in this client's share of a cluster whose cap is `cap` with `busy` true
    /// once it holds half of it or more, or `None` when the client already holds its
    /// share of a busy cluster. A trusted hop speaks for many clients: it has no share.
    pub fn hold(self: &Arc<Self>, cap: u32, busy: bool) -> Option<ClientPlace> {
        let share = |percent: u8| match busy && self.via_hop.is_none() {
            true => (u64::from(cap) * u64::from(percent) / 100).clamp(1, u64::from(u32::MAX)) as u32,
            false => u32::MAX,
        };
        if self.held.fetch_add(1, Ordering::Relaxed) >= share(self.shares.connection) {
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if self.held_by_address.fetch_add(1, Ordering::Relaxed) >= share(self.shares.address) {
            self.held_by_address.fetch_sub(1, Ordering::Relaxed);
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(ClientPlace { conn: self.clone(), waiting: None })
    }
}

/// A backend request's place in its client's share, held until its answer ends; it also
/// marks the answer as waiting on the client (see [`SendWatch`]).
#[derive(Debug)]
pub struct ClientPlace {
    conn: Arc<ConnInfo>,
    /// The tick the answer began waiting for the client to take it, while it does.
    waiting: Option<u8>,
}

impl ClientPlace {
    /// The answer has something the client has not taken yet.
    pub fn waits(&mut self) {
        if self.waiting.is_none() {
            self.waiting = Some(self.conn.sending.enter());
        }
    }

    /// The client asked for more: the answer no longer waits on it.
    pub fn taken(&mut self) {
        if let Some(tick) = self.waiting.take() {
            self.conn.sending.leave(tick);
        }
    }
}

impl Drop for ClientPlace {
    fn drop(&mut self) {
        self.taken();
        self.conn.held.fetch_sub(1, Ordering::Relaxed);
        self.conn.held_by_address.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The send bound's account of a connection: how many answers began waiting on the
/// client in each of the last `SEND_TICKS + 1` ticks. The connection's watchdog moves the
/// tick on; an answer still waiting when its tick comes round again has waited at least
/// `SEND_TICKS` ticks. Two atomic operations per wait, no clock read.
#[derive(Debug, Default)]
pub struct SendWatch {
    tick: AtomicU8,
    waiting: [AtomicU32; SEND_TICKS as usize + 1],
}

impl SendWatch {
    fn enter(&self) -> u8 {
        let tick = self.tick.load(Ordering::Relaxed);
        if let Some(n) = self.waiting.get(usize::from(tick)) {
            n.fetch_add(1, Ordering::Relaxed);
        }
        tick
    }

    fn leave(&self, tick: u8) {
        if let Some(n) = self.waiting.get(usize::from(tick)) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Moves to the next tick; `true` when an answer has waited on the client through
    /// every tick since it began (the connection is then closed).
    pub fn tick(&self) -> bool {
        let next = (self.tick.load(Ordering::Relaxed) + 1) % (SEND_TICKS + 1);
        let stalled = self.waiting.get(usize::from(next)).is_some_and(|n| n.load(Ordering::Relaxed) > 0);
        self.tick.store(next, Ordering::Relaxed);
        stalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(shares: Shares, address: &Arc<AtomicU32>) -> Arc<ConnInfo> {
        let hops = Arc::new(crate::request::forwarded::Hops::default());
        let peer: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        Arc::new(ConnInfo::new(Pool::Public, peer, false, &hops, shares, address.clone()))
    }

    #[test]
    fn a_client_holds_at_most_its_share_of_a_busy_cluster() {
        let address = Arc::new(AtomicU32::new(0));
        let (a, b) = (conn(Shares::default(), &address), conn(Shares::default(), &address));
        // A cluster of 100 that is not busy: no share applies.
        let idle: Vec<_> = (0..30).map(|_| a.hold(100, false).unwrap()).collect();
        // Busy: the connection holds 30 > 10 %, so it gets no more; another connection
        // from the same address may take up to the address's 25 %... which 30 already is.
        assert!(a.hold(100, true).is_none());
        assert!(b.hold(100, true).is_none());
        drop(idle);
        let held: Vec<_> = (0..10).map(|_| a.hold(100, true).unwrap()).collect();
        assert!(a.hold(100, true).is_none(), "11th place of one connection");
        let more: Vec<_> = (0..10).map(|_| b.hold(100, true).unwrap()).collect();
        let c = conn(Shares::default(), &address);
        let last: Vec<_> = (0..5).map(|_| c.hold(100, true).unwrap()).collect();
        assert!(c.hold(100, true).is_none(), "26th place of one address");
        assert_eq!(address.load(Ordering::Relaxed), 25);
        drop((held, more, last));
        assert_eq!(address.load(Ordering::Relaxed), 0);
        assert_eq!(a.held.load(Ordering::Relaxed), 0);
        // A tiny cluster still lets each client have one.
        assert!(a.hold(3, true).is_some());
    }

    #[test]
    fn an_answer_waiting_on_its_client_through_every_tick_is_found() {
        let address = Arc::new(AtomicU32::new(0));
        let c = conn(Shares::default(), &address);
        let mut slow = c.hold(10, false).unwrap();
        let mut quick = c.hold(10, false).unwrap();
        slow.waits();
        for _ in 0..SEND_TICKS {
            quick.waits();
            assert!(!c.sending.tick(), "not yet waited through every tick");
            quick.taken();
        }
        assert!(c.sending.tick(), "waited through every tick");
        slow.taken();
        for _ in 0..=SEND_TICKS {
            assert!(!c.sending.tick());
        }
        // Dropped while waiting: no longer counted.
        slow.waits();
        drop(slow);
        for _ in 0..=SEND_TICKS {
            assert!(!c.sending.tick());
        }
    }
}
