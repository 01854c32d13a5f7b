//! Connections to backends: pooled keep-alive HTTP/1.1 clients, one per connect timeout
//! (hyper pools by endpoint inside each), kept across snapshot reloads.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::UpstreamBody;

/// A pooled HTTP client for backends.
pub type Client = hyper_util::client::legacy::Client<HttpConnector, UpstreamBody>;

/// Clients by connect timeout.
#[derive(Debug, Default)]
pub struct Clients {
    by_connect_timeout: HashMap<Duration, Client>,
}

impl Clients {
    /// The client with this connect timeout, made on first use.
    pub fn get(&mut self, connect_timeout: Duration) -> Client {
        self.by_connect_timeout
            .entry(connect_timeout)
            .or_insert_with(|| {
                let mut connector = HttpConnector::new();
                connector.set_connect_timeout(Some(connect_timeout));
                connector.set_nodelay(true);
                connector.set_keepalive(Some(Duration::from_secs(60)));
                hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                    .pool_timer(TokioTimer::new())
                    .timer(TokioTimer::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_max_idle_per_host(1024)
                    // As the listeners' (`server::http_builder`): a backend connection's
                    // read buffer stops at 64 KiB instead of hyper's ~400 KiB, so a
                    // large response streams through in small chunks.
                    .http1_max_buf_size(64 * 1024)
                    .build(connector)
            })
            .clone()
    }
}

/// A request's place in its cluster's connection cap (requests in flight to a cluster,
/// each on its own pooled HTTP/1.1 connection); given back on drop.
#[derive(Debug)]
pub struct Permit(Arc<AtomicU32>);

impl Permit {
    /// A place under `max` in `gate`, or `None` when the cluster is at its cap.
    pub fn take(gate: &Arc<AtomicU32>, max: u32) -> Option<Permit> {
        if gate.fetch_add(1, Ordering::Relaxed) >= max {
            gate.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Permit(gate.clone()))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
