//! The figures of `kvtier bench tiers`: bytes and time accumulated round by round on each side
//! of a comparison, and the row they become (throughput, the reference's, and their ratios).

use std::time::Duration;

use serde::Serialize;

/// One measured figure.
#[derive(Clone, Debug, Serialize)]
pub struct TierBenchRow {
    /// The tier.
    pub tier: String,
    /// `store` (into the tier) or `load` (out of it).
    pub op: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// Throughput through the tier, GiB/s.
    pub gib_per_s: f64,
    /// The reference measured next to it.
    pub reference: String,
    /// The reference's throughput, GiB/s.
    pub reference_gib_per_s: f64,
    /// Tier ÷ reference, over all the bytes.
    pub ratio: f64,
    /// The median over rounds of tier ÷ reference, each round's pair measured back to back:
    /// steadier than `ratio` when the machine's load drifts during the run.
    pub paired_ratio: f64,
}

/// Accumulates bytes and time for one figure.
#[derive(Default)]
pub(super) struct Meter {
    bytes: u64,
    time: Duration,
    /// Each round's time, in order (rounds move equal bytes on both sides of a row).
    rounds: Vec<Duration>,
}

impl Meter {
    /// Adds one round that moved `bytes` in `time`.
    pub(super) fn add(&mut self, bytes: u64, time: Duration) {
        self.bytes += bytes;
        self.time += time;
        self.rounds.push(time);
    }

    fn gib_per_s(&self) -> f64 {
        let s = self.time.as_secs_f64();
        if s <= 0.0 {
            0.0
        } else {
            self.bytes as f64 / s / f64::from(1u32 << 30)
        }
    }
}

/// The median over rounds of the reference's time ÷ the tier's (a throughput ratio).
fn paired_ratio(tier: &Meter, reference: &Meter) -> f64 {
    let mut ratios: Vec<f64> = (tier.rounds.iter().zip(&reference.rounds))
        .filter(|(t, _)| !t.is_zero())
        .map(|(t, r)| r.as_secs_f64() / t.as_secs_f64())
        .collect();
    if ratios.is_empty() {
        return 0.0;
    }
    ratios.sort_by(f64::total_cmp);
    let mid = ratios.len() / 2;
    if ratios.len() % 2 == 1 {
        ratios[mid]
    } else {
        f64::midpoint(ratios[mid - 1], ratios[mid])
    }
}

/// The row of `tier`'s `op`, measured by `m`, next to `reference` measured by `r` in the same
/// rounds.
pub(super) fn row(tier: &str, op: &'static str, m: &Meter, reference: &str, r: &Meter) -> TierBenchRow {
    let (a, b) = (m.gib_per_s(), r.gib_per_s());
    TierBenchRow {
        tier: tier.to_owned(),
        op,
        bytes: m.bytes,
        gib_per_s: a,
        reference: reference.to_owned(),
        reference_gib_per_s: b,
        ratio: if b > 0.0 { a / b } else { 0.0 },
        paired_ratio: paired_ratio(m, r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meter(ms: &[u64]) -> Meter {
        let mut m = Meter::default();
        for &t in ms {
            m.add(1 << 20, Duration::from_millis(t));
        }
        m
    }

    #[test]
    fn the_paired_ratio_is_the_median_of_per_round_ratios() {
        // The tier took 2 ms per round, the reference 1 ms, except one round where a stall
        // hit the reference: the total ratio moves, the paired median does not.
        let tier = meter(&[2, 2, 2, 2, 2]);
        let reference = meter(&[1, 1, 1, 1, 50]);
        let r = row("t", "store", &tier, "ref", &reference);
        assert!((r.paired_ratio - 0.5).abs() < 1e-9, "{}", r.paired_ratio);
        assert!(r.ratio > 5.0, "{}", r.ratio);
        // An even count takes the midpoint of the middle two.
        assert!((paired_ratio(&meter(&[1, 1, 1, 1]), &meter(&[1, 1, 3, 3])) - 2.0).abs() < 1e-9);
        assert!(paired_ratio(&Meter::default(), &Meter::default()).abs() < f64::EPSILON);
    }
}
