//! The node's shared state, which every request reads: the live snapshot, metrics,
//! authentication, the rate sync, usage metering, the access log and traces, and the
//! node's shedding and admission budget.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::metrics::Metrics;
use crate::snapshot::Live;

/// Shared state of the data plane.
#[derive(Debug)]
pub struct Gateway {
    /// The live snapshot, swapped whole.
    pub live: ArcSwap<Live>,
    /// Process metrics.
    pub metrics: Arc<Metrics>,
    /// Authentication state (credentials, verified tokens, outcome counters).
    pub auth: Arc<postern_builtin_filters::auth::Authenticator>,
    /// The fleet-wide rate-limit sync, when the node is part of a fleet.
    pub ratesync: Option<Arc<crate::node::ratesync::RateSync>>,
    /// How long a backend's response body may send nothing before it is cut.
    pub body_idle: Duration,
    /// The control plane keys credential versions and deltas must be signed by (none:
    /// any credentials file).
    pub trust: Option<Arc<postern_model::sign::Trust>>,
    /// Held while a credential state is applied and written to disk, so two writers (the
    /// control plane's lane, the publish directory) never interleave: the file always
    /// holds the live version, or the one before it and the delta log.
    pub credentials_writer: std::sync::Mutex<()>,
    /// Usage metering: every answered call of an authenticated caller is counted.
    pub usage: Option<Arc<postern_usage::Usage>>,
    /// The JSON access log, when the node writes one.
    pub access_log: Option<Arc<postern_observe::AccessLog>>,
    /// OpenTelemetry traces, when the node exports them.
    pub tracer: Option<Arc<postern_observe::Tracer>>,
    /// Priority shedding on the node's CPU.
    pub shed: crate::cluster::shedding::NodeShed,
    /// The node's admission budget, with the partner pool's share.
    pub admission: crate::cluster::shedding::Admission,
    /// The node's places for answers being compressed.
    pub compressing: Arc<crate::request::compress::Slots>,
}
