//! The hasher of the tier's own key maps.
//!
//! An [`OffloadKey`](tiering_core::OffloadKey) is a cryptographic prefix hash plus a group index:
//! its first eight bytes are already uniformly random, so a map needs no mixing beyond folding in
//! the group. This hasher does exactly that (a load, a multiply, two xors), where the general
//! `tiering_core::KeyHasher` mixes the length prefix and the group with a full finalizer each.
//! It is only meant for keys whose first written bytes are random; other shapes fall back to a
//! multiply-rotate fold, correct but no better than that.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use tiering_core::OffloadKey;

const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// See the module docs.
#[derive(Default, Clone, Copy, Debug)]
pub struct RowHasher(u64);

impl Hasher for RowHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        if let Some(word) = bytes.first_chunk::<8>() {
            // The key's hash bytes: the first word is uniformly random on its own.
            self.0 ^= u64::from_le_bytes(*word);
            return;
        }
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(SPREAD).rotate_left(23);
        }
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.0 ^= u64::from(n).wrapping_mul(SPREAD);
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(SPREAD).rotate_left(29);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        // Only the constant length prefix of the key's byte array arrives here.
        self.0 ^= n as u64;
    }
}

/// [`BuildHasher`] of [`RowHasher`].
#[derive(Default, Clone, Copy, Debug)]
pub struct RowBuildHasher;

impl BuildHasher for RowBuildHasher {
    type Hasher = RowHasher;

    #[inline]
    fn build_hasher(&self) -> RowHasher {
        RowHasher::default()
    }
}

/// A map keyed by [`OffloadKey`] with [`RowHasher`].
pub type RowMap<V> = HashMap<OffloadKey, V, RowBuildHasher>;

/// A set of [`OffloadKey`]s with [`RowHasher`].
pub type RowSet = HashSet<OffloadKey, RowBuildHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(k: &OffloadKey) -> u64 {
        RowBuildHasher.hash_one(k)
    }

    #[test]
    fn keys_that_differ_in_bytes_or_group_hash_apart_and_maps_work() {
        let a = OffloadKey::from_u64(1);
        assert_ne!(hash(&a), hash(&OffloadKey::from_u64(2)));
        assert_ne!(hash(&a), hash(&a.with_group(1)));
        assert_eq!(hash(&a), hash(&OffloadKey::from_u64(1)));
        let m: RowMap<u64> = (0..10_000).map(|n| (OffloadKey::from_u64(n), n)).collect();
        assert!((0..10_000).all(|n| m[&OffloadKey::from_u64(n)] == n));
        // The control bits hashbrown takes from the top of the hash are spread.
        let tops: HashSet<u64> = (0..1000).map(|n| hash(&OffloadKey::from_u64(n)) >> 57).collect();
        assert!(tops.len() > 100, "only {} distinct top-7-bit values", tops.len());
    }
}
