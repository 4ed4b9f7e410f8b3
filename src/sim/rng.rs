//! A small seeded random generator and the distributions the workloads need.
//!
//! The simulator carries its own generator instead of depending on an external crate's stream so
//! that a seed names the same workload in every build, forever.

/// A 64-bit generator (SplitMix64 state update with an xorshift-multiply output mix).
#[derive(Clone, Debug)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A generator seeded with `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed ^ 0x5DEE_CE66_D1CE_4E5B,
        }
    }

    /// A generator derived from this seed and a stream number, so independent streams (one per
    /// session, one per trace line) do not depend on the order they are drawn in.
    #[must_use]
    pub fn derive(seed: u64, stream: u64) -> Self {
        let mut base = Self::new(seed);
        let a = base.next_u64();
        Self::new(a ^ stream.wrapping_mul(0xA076_1D64_78BD_642F))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        // 53 random mantissa bits.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform integer in `lo..=hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let span = hi - lo + 1;
        // The modulo bias is below 2^-40 for the spans a workload uses.
        lo + self.next_u64() % span
    }

    /// An exponentially distributed interval with the given rate (events per unit).
    pub fn exponential(&mut self, rate: f64) -> f64 {
        if rate <= 0.0 || !rate.is_finite() {
            return 0.0;
        }
        // 1 - unit() is in (0, 1], so the logarithm is finite.
        -(1.0 - self.unit()).ln() / rate
    }

    /// A token id (vocabulary of 2^17 ids, like a large tokenizer).
    pub fn token(&mut self) -> u32 {
        (self.next_u64() >> 47) as u32
    }

    /// `n` random token ids.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.token()).collect()
    }
}

/// A Zipf distribution over ranks `0..n`: rank `r` has weight `1 / (r + 1)^s`.
#[derive(Clone, Debug)]
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    /// A Zipf distribution over `n` ranks with exponent `s` (`n` ≥ 1).
    #[must_use]
    pub fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (0..n.max(1))
            .map(|r| {
                total += 1.0 / ((r + 1) as f64).powf(s);
                total
            })
            .collect();
        Self { cumulative }
    }

    /// Draws a rank.
    pub fn sample(&self, rng: &mut SimRng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let u = rng.unit() * total;
        self.cumulative
            .partition_point(|&c| c <= u)
            .min(self.cumulative.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut r = SimRng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..8)
            .map({
                let mut r = SimRng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(SimRng::derive(7, 1).next_u64(), SimRng::derive(7, 2).next_u64());
    }

    #[test]
    fn range_stays_in_bounds_and_unit_below_one() {
        let mut r = SimRng::new(1);
        for _ in 0..10_000 {
            let v = r.range(3, 9);
            assert!((3..=9).contains(&v));
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_eq!(r.range(5, 5), 5);
        assert_eq!(r.range(5, 2), 5);
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(100, 1.1);
        let mut r = SimRng::new(3);
        let mut counts = [0usize; 100];
        for _ in 0..20_000 {
            counts[z.sample(&mut r)] += 1;
        }
        assert!(counts[0] > counts[10]);
        assert!(counts[10] > counts[90]);
        assert!(counts.iter().all(|&c| c < 20_000));
    }
}
