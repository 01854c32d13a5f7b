//! Priority load shedding: under overload, requests are refused lowest class first, and
//! the refused share of each class is ramped in steps rather than flipped.
//!
//! One [`Shedder`] per signal: the node's CPU, and each cluster's own overload. Its
//! `level` runs from 0 (nothing shed) to [`FULL`]; each class owns a band of 100 in it,
//! lowest class first, so `level` 40 refuses 40 % of `sheddable` requests and 140 refuses
//! every `sheddable` request and 40 % of `free` ones. `critical` requests are refused
//! only once every other class is refused whole. The level moves only on
//! [`Shedder::adjust`], called off the request path at a steady tick with whether the
//! signal is over its threshold: up a step while it is, down a smaller step once it is
//! not (so shedding eases off more slowly than it began, and does not flap).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Priority classes, most important first; the index is the class's rank.
pub const CLASSES: [&str; 4] = ["critical", "standard", "free", "sheddable"];

/// The level at which every class is refused.
pub const FULL: u32 = 100 * CLASSES.len() as u32;

/// How fast shedding ramps, in level units per tick (100 units are one class).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ramp {
    /// Added per tick while the signal is over.
    pub up: u32,
    /// Taken off per tick once it is not.
    pub down: u32,
    /// The highest level this signal may reach ([`FULL`]: every class).
    pub max: u32,
}

impl Default for Ramp {
    /// At a 250 ms tick: a class is shed whole after 2.5 s of overload, and let back in
    /// over 5 s.
    fn default() -> Ramp {
        Ramp { up: 10, down: 5, max: FULL }
    }
}

/// One signal's shedding state.
#[derive(Debug, Default)]
pub struct Shedder {
    ramp: Ramp,
    level: AtomicU32,
    /// Set from the request path when it saw overload itself; read and cleared by the
    /// next tick.
    strained: AtomicBool,
    shed: [AtomicU64; CLASSES.len()],
}

impl Shedder {
    /// A shedder that sheds nothing yet.
    pub fn new(ramp: Ramp) -> Shedder {
        Shedder { ramp, ..Shedder::default() }
    }

    /// The current level (0: nothing is shed; [`FULL`]: everything is).
    pub fn level(&self) -> u32 {
        self.level.load(Ordering::Relaxed)
    }

    /// Marks the signal over until the next tick (a request saw the overload itself).
    pub fn strain(&self) {
        if !self.strained.load(Ordering::Relaxed) {
            self.strained.store(true, Ordering::Relaxed);
        }
    }

    /// One tick of the ramp: up a step while the signal is `over` (or a request
    /// strained it since the last tick), down otherwise. Returns the new level. Only one
    /// caller (the node's tick) adjusts a shedder.
    pub fn adjust(&self, over: bool) -> u32 {
        let over = self.strained.swap(false, Ordering::Relaxed) || over;
        let level = self.level();
        let next = if over { (level + self.ramp.up).min(self.ramp.max) } else { level.saturating_sub(self.ramp.down) };
        self.level.store(next, Ordering::Relaxed);
        next
    }

    /// The share of class `rank`'s requests refused at `level`, in percent.
    pub fn share(level: u32, rank: usize) -> u32 {
        let lowest_first = CLASSES.len().saturating_sub(rank + 1) as u32;
        level.saturating_sub(100 * lowest_first).min(100)
    }

    /// Whether a request of class `rank` is let through; `draw` is uniform in 0..100.
    /// A refusal is counted for the class.
    pub fn admits(&self, rank: usize, draw: u32) -> bool {
        let level = self.level();
        if level == 0 || draw >= Self::share(level, rank) {
            return true;
        }
        if let Some(c) = self.shed.get(rank) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        false
    }

    /// Requests refused so far, per class rank.
    pub fn shed(&self) -> [u64; CLASSES.len()] {
        std::array::from_fn(|i| self.shed[i].load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRITICAL: usize = 0;
    const STANDARD: usize = 1;
    const FREE: usize = 2;
    const SHEDDABLE: usize = 3;

    /// How many of 100 evenly spread draws a class gets through.
    fn through(s: &Shedder, rank: usize) -> u32 {
        (0..100).filter(|&d| s.admits(rank, d)).count() as u32
    }

    #[test]
    fn the_ramp_sheds_lowest_class_first_in_steps() {
        let s = Shedder::new(Ramp { up: 25, down: 10, max: FULL });
        assert_eq!([through(&s, SHEDDABLE), through(&s, CRITICAL)], [100, 100], "idle: nothing shed");
        let mut seen = Vec::new();
        for _ in 0..16 {
            s.adjust(true);
            seen.push([SHEDDABLE, FREE, STANDARD, CRITICAL].map(|r| 100 - through(&s, r)));
        }
        // Each tick sheds a quarter more of one class, lowest first; never two at once.
        assert_eq!(seen[0], [25, 0, 0, 0]);
        assert_eq!(seen[3], [100, 0, 0, 0]);
        assert_eq!(seen[4], [100, 25, 0, 0]);
        assert_eq!(seen[8], [100, 100, 25, 0]);
        assert_eq!(seen[11], [100, 100, 100, 0], "critical only when nothing else is left");
        assert_eq!(seen[12], [100, 100, 100, 25]);
        assert_eq!(seen[15], [100, 100, 100, 100]);
        assert_eq!(s.adjust(true), FULL, "the level stops at full");
        for w in seen.windows(2) {
            for (a, b) in w[0].iter().zip(&w[1]) {
                assert!(b >= a && b - a <= 25, "ramped, not flipped: {w:?}");
            }
        }
        // Refusals are counted per class.
        let shed = s.shed();
        assert!(shed[SHEDDABLE] > shed[FREE] && shed[FREE] > shed[STANDARD] && shed[STANDARD] > shed[CRITICAL]);
    }

    #[test]
    fn it_eases_off_more_slowly_than_it_began() {
        let s = Shedder::new(Ramp { up: 20, down: 5, max: FULL });
        for _ in 0..10 {
            s.adjust(true);
        }
        assert_eq!(s.level(), 200, "sheddable and free shed whole");
        assert_eq!(s.adjust(false), 195);
        assert_eq!(Shedder::share(195, FREE), 95);
        assert_eq!(Shedder::share(195, SHEDDABLE), 100);
        for _ in 0..39 {
            s.adjust(false);
        }
        assert_eq!(s.level(), 0);
        assert_eq!(s.adjust(false), 0, "never below nothing");
        assert_eq!(through(&s, SHEDDABLE), 100);
    }

    #[test]
    fn a_ramp_stops_at_its_max() {
        let s = Shedder::new(Ramp { up: 50, down: 5, max: 200 });
        for _ in 0..20 {
            s.adjust(true);
        }
        assert_eq!(s.level(), 200);
        assert_eq!([through(&s, FREE), through(&s, STANDARD), through(&s, CRITICAL)], [0, 100, 100]);
    }

    #[test]
    fn a_strain_counts_as_over_for_one_tick() {
        let s = Shedder::new(Ramp { up: 10, down: 10, max: FULL });
        s.strain();
        s.strain();
        assert_eq!(s.adjust(false), 10);
        assert_eq!(s.adjust(false), 0, "cleared by the tick that read it");
    }
}
