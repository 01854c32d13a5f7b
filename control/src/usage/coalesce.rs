//! The intake's group commit: batches that arrive while earlier ones are being applied
//! wait together and go to the store as one transaction ([`UsageStore::apply_group`]).
//!
//! A node ships one window as it closes, so each HTTP request is a small batch; applied
//! one a transaction, a fleet's batches upsert the same callers' totals and wait on each
//! other's row locks and commits. Here a request hands its batch to one task and waits
//! for its own answer. The task takes the first batch waiting, waits for a free slot
//! (at most [`IN_FLIGHT`] groups at the store at once), then takes every batch that came
//! meanwhile, up to [`GROUP_WINDOWS`] windows and [`GROUP_ROWS`] rows, as one group. An
//! idle intake adds no wait: a lone batch goes at once, as a group of one.

use std::sync::Arc;

use postern_model::protocol::UsageAck;
use postern_model::usage::Window;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::intake::ApplyError;
use super::quota::Quotas;
use super::store::UsageStore;

/// Groups applied at the store at once at most: fewer than its workers, which queries and
/// reconciles use too.
pub const IN_FLIGHT: usize = 4;
/// Windows a group holds at most: past ~30 windows a transaction, larger groups hold
/// their row locks longer and apply no faster (BENCHMARKS.md).
pub const GROUP_WINDOWS: usize = 32;
/// Rows a group holds at most (a batch larger than this goes alone).
pub const GROUP_ROWS: usize = 200_000;
/// Batches waiting for the task at most; past that a request is answered busy.
const WAITING: usize = 4_096;

/// One request's batch and where its answer goes.
struct Pending {
    windows: Vec<Window>,
    quotas: Arc<Quotas>,
    now: u64,
    answer: oneshot::Sender<Result<UsageAck, ApplyError>>,
}

/// The handle requests apply their batches through.
#[derive(Debug, Clone)]
pub struct Coalescer {
    queue: mpsc::Sender<Pending>,
}

impl Coalescer {
    /// Starts the group-commit task on the current tokio runtime; it ends when the last
    /// handle is dropped.
    pub fn start(store: Arc<UsageStore>) -> Coalescer {
        let (queue, rx) = mpsc::channel(WAITING);
        tokio::spawn(run(store, rx));
        Coalescer { queue }
    }

    /// Applies `windows` (checked) in a group with whatever else is waiting; the answer is
    /// this batch's own, as [`UsageStore::apply`] gives it.
    pub async fn apply(&self, windows: Vec<Window>, now: u64, quotas: Arc<Quotas>) -> Result<UsageAck, ApplyError> {
        let (answer, rx) = oneshot::channel();
        self.queue
            .try_send(Pending { windows, quotas, now, answer })
            .map_err(|_| ApplyError::Unavailable(format!("intake busy: {WAITING} batches waiting")))?;
        rx.await.map_err(|_| ApplyError::Unavailable("the intake's group commit ended".into()))?
    }
}

async fn run(store: Arc<UsageStore>, mut rx: mpsc::Receiver<Pending>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Waiting for a slot is when the next group gathers.
        let Ok(slot) = slots.clone().acquire_owned().await else { break };
        let mut rows = first.windows.iter().map(|w| w.rows.len()).sum::<usize>();
        let mut windows = first.windows.len();
        let mut group = vec![first];
        while windows < GROUP_WINDOWS && rows < GROUP_ROWS {
            let Ok(p) = rx.try_recv() else { break };
            windows += p.windows.len();
            rows += p.windows.iter().map(|w| w.rows.len()).sum::<usize>();
            group.push(p);
        }
        let store = store.clone();
        tokio::spawn(async move {
            let _slot = slot;
            apply(&store, group).await;
        });
    }
}

/// Applies one group on the store's workers and answers each request.
async fn apply(store: &Arc<UsageStore>, group: Vec<Pending>) {
    let mut answers = Vec::with_capacity(group.len());
    let mut batches = Vec::with_capacity(group.len());
    // The newest quotas and time of the group: each request read them as it arrived.
    let (mut now, mut quotas) = (0, Arc::new(Quotas::default()));
    for p in group {
        if p.now >= now {
            now = p.now;
            quotas = p.quotas;
        }
        answers.push(p.answer);
        batches.push(p.windows);
    }
    let n = batches.len();
    let results = match store.run(move |s| s.apply_group(&batches, now, &quotas)).await {
        Ok(r) => r,
        Err(e) => (0..n).map(|_| Err(ApplyError::Unavailable(e.to_string()))).collect(),
    };
    for (answer, result) in answers.into_iter().zip(results) {
        // A request that went away leaves its answer unread; its batch is applied.
        let _ = answer.send(result);
    }
}
