//! A count-min sketch of 4-bit counters with a doorkeeper and periodic halving: the frequency
//! estimate behind `tinylfu`.
//!
//! Four rows of `width` counters (packed sixteen to a word) are indexed by four independent
//! mixes of the key's digest. An increment raises only the row counters equal to the current
//! minimum (conservative update), saturating at 15. A key's first sighting only sets its bits in
//! the doorkeeper (a small Bloom filter), so one-hit wonders never reach the counters. After
//! `sample_size` recorded accesses every counter is halved and the doorkeeper cleared, so old
//! popularity fades.

use crate::key::OffloadKey;

const ROWS: usize = 4;
const MAX_COUNT: u8 = 15;
const SEEDS: [u64; ROWS] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x27D4_EB2F_1656_67C5,
];

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// Frequency estimates of chunk keys (see the module docs).
#[derive(Clone, Debug)]
pub struct FrequencySketch {
    rows: [Vec<u64>; ROWS],
    /// Counters per row minus one (`width` is a power of two).
    mask: u64,
    doorkeeper: Vec<u64>,
    door_mask: u64,
    additions: u64,
    sample_size: u64,
}

impl FrequencySketch {
    /// A sketch of `width` counters per row (rounded up to a power of two, at least 64),
    /// halving after `sample_size` recorded accesses (at least 1).
    #[must_use]
    pub fn new(width: usize, sample_size: u64) -> Self {
        let width = width.max(64).next_power_of_two();
        let words = width / 16;
        let door_bits = (width * 4).next_power_of_two();
        Self {
            rows: std::array::from_fn(|_| vec![0; words]),
            mask: width as u64 - 1,
            doorkeeper: vec![0; door_bits / 64],
            door_mask: door_bits as u64 - 1,
            additions: 0,
            sample_size: sample_size.max(1),
        }
    }

    fn index(&self, key: &OffloadKey, row: usize) -> u64 {
        mix(key.digest() ^ SEEDS[row]) & self.mask
    }

    fn counter(&self, row: usize, i: u64) -> u8 {
        let word = self.rows[row][(i / 16) as usize];
        ((word >> ((i % 16) * 4)) & 0xF) as u8
    }

    fn bump(&mut self, row: usize, i: u64) {
        let shift = (i % 16) * 4;
        self.rows[row][(i / 16) as usize] += 1 << shift;
    }

    fn door_bits(&self, key: &OffloadKey) -> [u64; 2] {
        let h = mix(key.digest() ^ 0xA076_1D64_78BD_642F);
        [h & self.door_mask, (h >> 32) & self.door_mask]
    }

    fn door_contains(&self, key: &OffloadKey) -> bool {
        self.door_bits(key)
            .iter()
            .all(|&b| self.doorkeeper[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    fn count_min(&self, key: &OffloadKey) -> u8 {
        (0..ROWS)
            .map(|r| self.counter(r, self.index(key, r)))
            .min()
            .unwrap_or(0)
    }

    /// Records one access of `key`.
    pub fn record(&mut self, key: &OffloadKey) {
        if self.door_contains(key) {
            let min = self.count_min(key);
            if min < MAX_COUNT {
                for r in 0..ROWS {
                    let i = self.index(key, r);
                    if self.counter(r, i) == min {
                        self.bump(r, i);
                    }
                }
            }
        } else {
            for b in self.door_bits(key) {
                self.doorkeeper[(b / 64) as usize] |= 1 << (b % 64);
            }
        }
        self.additions += 1;
        if self.additions >= self.sample_size {
            self.age();
        }
    }

    /// The estimated number of recent accesses of `key` (never an underestimate between two
    /// agings; at most 16).
    #[must_use]
    pub fn estimate(&self, key: &OffloadKey) -> u32 {
        u32::from(self.count_min(key)) + u32::from(self.door_contains(key))
    }

    /// Halves every counter and clears the doorkeeper.
    pub fn age(&mut self) {
        for row in &mut self.rows {
            for w in row.iter_mut() {
                *w = (*w >> 1) & 0x7777_7777_7777_7777;
            }
        }
        self.doorkeeper.fill(0);
        self.additions = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_saturate_and_halve() {
        let k = OffloadKey::from_u64;
        let mut s = FrequencySketch::new(1024, 1_000_000);
        assert_eq!(s.estimate(&k(1)), 0);
        s.record(&k(1));
        assert_eq!(s.estimate(&k(1)), 1, "the first sighting is the doorkeeper's");
        for _ in 0..3 {
            s.record(&k(1));
        }
        assert_eq!(s.estimate(&k(1)), 4);
        for _ in 0..40 {
            s.record(&k(1));
        }
        assert_eq!(s.estimate(&k(1)), 16, "15 in the counters plus the doorkeeper");
        s.age();
        assert_eq!(s.estimate(&k(1)), 7);
        assert_eq!(s.estimate(&k(2)), 0);
    }

    #[test]
    fn aging_runs_after_the_sample_size() {
        let k = OffloadKey::from_u64;
        let mut s = FrequencySketch::new(64, 8);
        for _ in 0..7 {
            s.record(&k(3));
        }
        assert_eq!(s.estimate(&k(3)), 7);
        s.record(&k(3));
        assert_eq!(
            s.estimate(&k(3)),
            3,
            "halved on the eighth access (7 → 3, doorkeeper cleared)"
        );
    }

    #[test]
    fn distinct_keys_stay_apart() {
        let mut s = FrequencySketch::new(4096, 1_000_000);
        for n in 0..500 {
            s.record(&OffloadKey::from_u64(n));
        }
        for _ in 0..5 {
            s.record(&OffloadKey::from_u64(7));
        }
        assert_eq!(s.estimate(&OffloadKey::from_u64(7)), 6);
        let overcounted = (1000..1500)
            .filter(|&n| s.estimate(&OffloadKey::from_u64(n)) > 1)
            .count();
        assert!(overcounted < 5, "{overcounted} unseen keys estimated above 1");
    }
}
