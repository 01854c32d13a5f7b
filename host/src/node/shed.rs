//! The shedding tick: every [`TICK`] it reads this process's CPU and each cluster's
//! overload, and moves their ramps a step (off the request path).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::gateway::Gateway;

/// How often the signals are read and the ramps moved.
pub const TICK: Duration = Duration::from_millis(250);
/// The CPU reading is the average over this many ticks (one second).
const CPU_TICKS: usize = 4;

/// This process's CPU time so far (user and system), from `/proc/self/stat`.
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command's closing parenthesis start at the 3rd (state); utime
    // and stime are the 14th and 15th, in clock ticks of 10 ms (USER_HZ on Linux).
    let mut fields = stat.rsplit_once(')')?.1.split_ascii_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime).saturating_mul(10)))
}

/// The CPU used between two readings, as a percentage of `cores` over the wall time.
fn percent(from: (Instant, Duration), to: (Instant, Duration), cores: u32) -> u32 {
    let wall = to.0.saturating_duration_since(from.0).as_secs_f64() * f64::from(cores.max(1));
    if wall <= 0.0 {
        return 0;
    }
    let used = to.1.saturating_sub(from.1).as_secs_f64();
    (used / wall * 100.0).round().clamp(0.0, 1000.0) as u32
}

/// Reads the signals every [`TICK`] and moves the ramps, until `stop`.
pub async fn run(gw: Arc<Gateway>, workers: Option<usize>, mut stop: watch::Receiver<bool>) {
    // The cores the node may use: its workers, at most the machine's.
    let available = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let cores = u32::try_from(workers.unwrap_or(available).clamp(1, available)).unwrap_or(u32::MAX);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut samples: VecDeque<(Instant, Duration)> = VecDeque::with_capacity(CPU_TICKS + 1);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if let Some(t) = cpu_time() {
            samples.push_back((Instant::now(), t));
            if samples.len() > CPU_TICKS + 1 {
                samples.pop_front();
            }
        }
        let node = &gw.shed;
        if let (Some(&first), Some(&last)) = (samples.front(), samples.back()) {
            node.reading.store(percent(first, last, cores), Ordering::Relaxed);
        }
        node.cpu.adjust(node.threshold > 0 && node.cpu_percent() >= node.threshold);
        for u in &gw.live.load().upstreams {
            u.shed.adjust(u.overloaded());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_readings_are_a_share_of_the_cores() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let cpu = Duration::from_millis;
        assert_eq!(percent((at(0), cpu(0)), (at(1000), cpu(1500)), 2), 75);
        assert_eq!(percent((at(0), cpu(100)), (at(1000), cpu(600)), 1), 50);
        assert_eq!(percent((at(0), cpu(0)), (at(0), cpu(10)), 2), 0, "no time passed");
        assert!(cpu_time().is_some(), "/proc/self/stat is readable");
    }
}
