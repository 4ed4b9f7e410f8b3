//! The fault schedule: which fault happens when, and for how long, derived from a seed.
//!
//! The soak's fault window is cut into equal slots, one fault per slot, at a seeded offset in
//! the first half of its slot and held for at most the rest of that half, so faults never
//! overlap and every kind has recovered before the next one starts. The first six slots hold
//! one fault of each kind (in a seeded order), so a run of six slots or more injects every kind.

use std::fmt;
use std::time::Duration;

use crate::sim::SimRng;

/// What the injector does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL `redis-server`, then start it again on the same port (empty: no persistence).
    RedisRestart,
    /// SIGTERM the peer node (the second `kvtier` process), then start it again.
    PeerRestart,
    /// Fill the filesystem the disk tiers live on, hold it full, then free it.
    DiskFill,
    /// Overwrite bytes inside chunks stored in this node's disk-tier slab.
    DiskCorrupt,
    /// SIGSTOP `redis-server` or the peer node, then SIGCONT it.
    Stall,
    /// SIGKILL the peer node, then start it again (its disk tier recovers its slab at open).
    NodeKill,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [Self; 6] = [
        Self::RedisRestart,
        Self::PeerRestart,
        Self::DiskFill,
        Self::DiskCorrupt,
        Self::Stall,
        Self::NodeKill,
    ];

    /// The kind's name in the summary table.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::RedisRestart => "redis-server SIGKILL + restart",
            Self::PeerRestart => "peer node SIGTERM + restart",
            Self::DiskFill => "disk filesystem filled",
            Self::DiskCorrupt => "disk slab slots corrupted",
            Self::Stall => "tier stalled (SIGSTOP/SIGCONT)",
            Self::NodeKill => "node SIGKILL + restart",
        }
    }

    /// How long the fault may be held: the shortest and longest hold, before the slot's limit.
    fn hold_range(self) -> (Duration, Duration) {
        let ms = Duration::from_millis;
        match self {
            Self::RedisRestart | Self::PeerRestart | Self::NodeKill => (ms(300), ms(2500)),
            Self::DiskFill => (ms(1000), ms(4000)),
            Self::DiskCorrupt => (ms(0), ms(0)),
            Self::Stall => (ms(300), ms(2000)),
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One scheduled fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// When it starts, from the start of the soak.
    pub at: Duration,
    /// What it is.
    pub kind: FaultKind,
    /// How long it is held (down, full, stopped) before the injector undoes it.
    pub hold: Duration,
    /// A per-fault seed (which slots to corrupt, which process to stall).
    pub seed: u64,
}

/// The faults of one soak, in time order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The faults.
    pub faults: Vec<Fault>,
}

impl Schedule {
    /// The faults between `start` and `end` (from the start of the soak), one per `gap` (at
    /// least one of each kind when the window holds six gaps; fewer slots give fewer kinds).
    #[must_use]
    pub fn generate(seed: u64, start: Duration, end: Duration, gap: Duration) -> Self {
        let window = end.saturating_sub(start);
        let gap = gap.max(Duration::from_millis(100));
        let slots = usize::try_from(window.as_nanos() / gap.as_nanos()).unwrap_or(usize::MAX);
        if slots == 0 {
            return Self { faults: Vec::new() };
        }
        let slot = window / u32::try_from(slots).unwrap_or(u32::MAX);
        let mut rng = SimRng::derive(seed, 0x5_0a_c0);
        let mut kinds = FaultKind::ALL.to_vec();
        // Fisher–Yates: the first six slots get every kind once, in a seeded order.
        for i in (1..kinds.len()).rev() {
            let j = rng.range(0, i as u64) as usize;
            kinds.swap(i, j);
        }
        let faults = (0..slots)
            .map(|i| {
                let kind = kinds
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| FaultKind::ALL[rng.range(0, 5) as usize]);
                let half = slot / 2;
                let offset = half.mul_f64(rng.unit() * 0.5);
                let (lo, hi) = kind.hold_range();
                let hold =
                    (lo + (hi.saturating_sub(lo)).mul_f64(rng.unit())).min(half.saturating_sub(offset));
                Fault {
                    at: start + slot * u32::try_from(i).unwrap_or(u32::MAX) + offset,
                    kind,
                    hold,
                    seed: rng.next_u64(),
                }
            })
            .collect();
        Self { faults }
    }

    /// How many faults of `kind` are scheduled.
    #[must_use]
    pub fn count(&self, kind: FaultKind) -> usize {
        self.faults.iter().filter(|f| f.kind == kind).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_seed_gives_one_schedule_every_kind_and_no_overlap() {
        let a = Schedule::generate(7, 6 * S, 54 * S, 6 * S);
        assert_eq!(a, Schedule::generate(7, 6 * S, 54 * S, 6 * S));
        assert_ne!(a, Schedule::generate(8, 6 * S, 54 * S, 6 * S));
        assert_eq!(a.faults.len(), 8);
        for k in FaultKind::ALL {
            assert!(a.count(k) >= 1, "{k} missing");
        }
        for w in a.faults.windows(2) {
            assert!(w[0].at + w[0].hold <= w[1].at, "{w:?}");
        }
        assert!(a.faults.iter().all(|f| f.at >= 6 * S && f.at + f.hold <= 54 * S));
    }

    #[test]
    fn a_window_shorter_than_a_gap_has_no_fault() {
        assert!(Schedule::generate(1, 5 * S, 6 * S, 2 * S).faults.is_empty());
        assert!(Schedule::generate(1, 6 * S, 5 * S, 2 * S).faults.is_empty());
    }
}
