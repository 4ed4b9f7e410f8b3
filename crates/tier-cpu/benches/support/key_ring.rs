//! The map work of a store into a full tier, the floor `store16+evict` is judged against: shared
//! by `benches/cpu_tier.rs` and the `op_cpu_time` example, so both measure the same loop.

use std::hint::black_box;

use tiering_core::{KeyMap, OffloadKey};

/// The keys of a full map by insertion slot, so each replacement removes the key inserted
/// longest ago (as the tier keeps its keys in its rows).
pub struct KeyRing {
    ring: Vec<OffloadKey>,
    next: usize,
}

impl KeyRing {
    /// A ring over `keys`, the map's keys in insertion order (map value = position).
    pub fn new(keys: &[OffloadKey]) -> Self {
        Self {
            ring: keys.to_vec(),
            next: 0,
        }
    }

    /// Removes the oldest key from `map` and inserts `key`, a new one, in its slot: one removal
    /// and one insertion, the map staying at its size.
    pub fn replace_oldest(&mut self, map: &mut KeyMap<u32>, key: OffloadKey) {
        let at = self.next % self.ring.len();
        black_box(map.remove(&self.ring[at]));
        map.insert(key, at as u32);
        self.ring[at] = key;
        self.next += 1;
    }
}
