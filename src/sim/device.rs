//! The simulated device KV pool: fixed blocks of host memory (one chunk each) with the engine's
//! own prefix cache, smaller than the working set so that offloading matters.
//!
//! Free blocks that still hold a computed chunk stay findable by key until they are reused,
//! least recently freed first, as an engine's block manager does.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use tiering_core::{KeyMap, OffloadKey};

use crate::host_buffer::{DEVICE_ALIGN, HostBuffer};

/// The bytes of every device block. Each block has its own lock, so the model (scheduler thread)
/// and the copy worker touch different blocks without contention.
pub struct DeviceMemory {
    /// Aligned as GPU allocations are (see [`crate::host_buffer`]: a block copied to or from
    /// an arena row at a mismatched alignment copies at a fraction of memory speed).
    blocks: Vec<Mutex<HostBuffer>>,
}

impl DeviceMemory {
    /// `num_blocks` zeroed blocks of `block_bytes` bytes.
    #[must_use]
    pub fn new(num_blocks: usize, block_bytes: usize) -> Self {
        Self {
            blocks: (0..num_blocks)
                .map(|_| Mutex::new(HostBuffer::filled(block_bytes, DEVICE_ALIGN, 0)))
                .collect(),
        }
    }

    /// Runs `f` on block `id`'s bytes; `None` when the id is out of range.
    pub fn with_block<R>(&self, id: u32, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        self.blocks.get(id as usize).map(|b| f(&mut b.lock()))
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct BlockMeta {
    key: Option<OffloadKey>,
    refs: u32,
    /// Position in the free queue while free.
    free_tick: Option<u64>,
}

/// Block bookkeeping and the prefix cache.
pub struct DevicePool {
    blocks: Vec<BlockMeta>,
    cached: KeyMap<u32>,
    free: BTreeMap<u64, u32>,
    tick: u64,
}

impl DevicePool {
    /// A pool of `num_blocks` free, empty blocks.
    #[must_use]
    pub fn new(num_blocks: u32) -> Self {
        let mut pool = Self {
            blocks: vec![BlockMeta::default(); num_blocks as usize],
            cached: KeyMap::default(),
            free: BTreeMap::new(),
            tick: 0,
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    fn push_free(&mut self, id: u32) {
        self.tick += 1;
        self.free.insert(self.tick, id);
        self.blocks[id as usize].free_tick = Some(self.tick);
    }

    /// Blocks not referenced by any request or copy job.
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// How many leading `keys` the prefix cache holds.
    #[must_use]
    pub fn cached_prefix(&self, keys: &[OffloadKey]) -> usize {
        keys.iter().take_while(|k| self.cached.contains_key(k)).count()
    }

    /// Takes a reference on the cached block of `key`.
    pub fn acquire_cached(&mut self, key: &OffloadKey) -> Option<u32> {
        let id = *self.cached.get(key)?;
        self.acquire(id);
        Some(id)
    }

    /// Takes one more reference on block `id` (a copy job reading or writing it).
    pub fn acquire(&mut self, id: u32) {
        let meta = &mut self.blocks[id as usize];
        if let Some(t) = meta.free_tick.take() {
            self.free.remove(&t);
        }
        meta.refs += 1;
    }

    /// `n` fresh blocks (each with one reference), reusing the least recently freed blocks and
    /// dropping their cached chunks; `None` (and no change) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            let meta = &mut self.blocks[id as usize];
            meta.free_tick = None;
            meta.refs = 1;
            if let Some(key) = meta.key.take()
                && self.cached.get(&key) == Some(&id)
            {
                self.cached.remove(&key);
            }
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference; a block with none left becomes free (still cached if it was).
    pub fn release(&mut self, id: u32) {
        let meta = &mut self.blocks[id as usize];
        debug_assert!(meta.refs > 0, "release of an unreferenced block {id}");
        meta.refs = meta.refs.saturating_sub(1);
        if meta.refs == 0 {
            self.push_free(id);
        }
    }

    /// Block `id` now holds the computed chunk `key`: make it findable. A chunk already cached
    /// in another block keeps that block (two requests computed it at once).
    pub fn register(&mut self, id: u32, key: OffloadKey) {
        if self.cached.contains_key(&key) {
            return;
        }
        let meta = &mut self.blocks[id as usize];
        if let Some(old) = meta.key.replace(key)
            && self.cached.get(&old) == Some(&id)
        {
            self.cached.remove(&old);
        }
        self.cached.insert(key, id);
    }

    /// Blocks still referenced (for the end-of-run leak check).
    #[must_use]
    pub fn referenced_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.refs > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn cached_blocks_survive_release_until_reused_lru_first() {
        let mut pool = DevicePool::new(3);
        let a = pool.allocate(2).unwrap();
        pool.register(a[0], key(1));
        pool.register(a[1], key(2));
        pool.release(a[0]);
        pool.release(a[1]);
        assert_eq!(pool.cached_prefix(&[key(1), key(2), key(3)]), 2);
        // The never-used block goes first, then key(1)'s (freed before key(2)'s).
        let b = pool.allocate(2).unwrap();
        assert!(!b.contains(&a[1]));
        assert_eq!(pool.cached_prefix(&[key(1)]), 0);
        assert_eq!(pool.cached_prefix(&[key(2)]), 1);
        assert_eq!(pool.allocate(2), None);
        assert_eq!(pool.free_blocks(), 1);
    }

    #[test]
    fn acquired_blocks_are_not_reused_and_refs_balance() {
        let mut pool = DevicePool::new(2);
        let a = pool.allocate(1).unwrap()[0];
        pool.register(a, key(7));
        pool.release(a);
        let again = pool.acquire_cached(&key(7)).unwrap();
        assert_eq!(again, a);
        pool.acquire(a);
        assert_eq!(pool.free_blocks(), 1);
        assert_eq!(pool.allocate(2), None);
        pool.release(a);
        pool.release(a);
        assert_eq!(pool.referenced_blocks(), 0);
        assert_eq!(pool.free_blocks(), 2);
    }

    #[test]
    fn duplicate_registration_keeps_the_first_block() {
        let mut pool = DevicePool::new(2);
        let b = pool.allocate(2).unwrap();
        pool.register(b[0], key(1));
        pool.register(b[1], key(1));
        assert_eq!(pool.acquire_cached(&key(1)), Some(b[0]));
    }

    #[test]
    fn memory_blocks_are_independent() {
        let mem = DeviceMemory::new(2, 8);
        mem.with_block(0, |b| b.fill(1));
        assert_eq!(
            mem.with_block(1, |b| b.iter().map(|&x| u32::from(x)).sum::<u32>()),
            Some(0)
        );
        assert_eq!(mem.with_block(2, |_| ()), None);
    }
}
