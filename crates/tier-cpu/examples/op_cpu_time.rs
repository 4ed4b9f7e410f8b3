//! Thread CPU time per tier-cpu operation (the loops of `benches/cpu_tier.rs`), robust to a
//! shared machine's preemption: `cargo run --release -p tier-cpu --example op_cpu_time -- 10000 arc`
//! (a third argument runs one op only; 10M rows work too, over a sparse file arena). Also prints
//! references on the same keys, over a plain hash map of the same size as the tier (tiering-core's
//! `KeyMap`, the tier's hasher): one probe (`hashmap_probe_hit`, for `lookup_hit`), 16 of them
//! (`probe16`, the floor of `touch16` and `load16`), 16 inserts of new keys and 16 removals of the
//! oldest ones (`ops32`, the floor of `store16_evict`: the map stays full, as the tier does), and
//! 16 of the tier's own lookups (`lookup16`, what a batch op costs before any policy or
//! request-record work).
//!
//! Three more references measure the work each batch op cannot skip under vLLM 0.33.0's
//! semantics, each on the plainest structure that does it (see [`ExactOrder`] and
//! [`GhostedMap`]): `exact_touch16` (16 probes, then 16 moves to the back of an exact recency
//! order, a doubly-linked list over rows, as a touch must), `pin16` (16 probes that pin their
//! rows, a fresh request record of the 16 keys, 16 unpins through the rows: a load), and
//! `ops48` (ARC's store into a full tier: 16 inserts, 16 residents turned into ghosts in place,
//! 16 oldest ghosts removed, on a map holding the tier's residents and ghosts), and
//! `store_work16`, a store's map work (`ops32` under LRU, `ops48` under ARC) plus the request's
//! fresh record of the 16 offered keys, and `exact_store16`, a whole store into a full tier on a
//! plain map and exact recency lists (see [`ExactStore`]).
//!
//! Two diagnostics run only when named as the third argument: `interleaved_touch16` and
//! `interleaved_load16` alternate slices of the op with slices of `probe16` (see
//! [`interleaved`]), so neither finds the cache as its own previous call left it. They show how
//! much of the isolated ratio to the floor comes from which data each keeps cached.

use std::hint::black_box;

use tiering_core::{KeyMap, KeySet};

#[path = "../benches/support/fresh_keys.rs"]
mod fresh_keys;
#[path = "../benches/support/key_ring.rs"]
mod key_ring;
use fresh_keys::{BATCH, FreshKeys};
use key_ring::KeyRing;

use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{
    LookupResult, OffloadKey, PrimaryTier, ReqContext,
    arena::{ArenaOptions, ChunkArena},
};

fn cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Length of the pre-shuffled key sequence the batches are cut from.
const SEQUENCE: usize = 100_000;

fn scramble(i: usize, n: usize) -> usize {
    (i.wrapping_mul(0x9E37_79B9) ^ (i >> 7)) % n
}

fn best(iters: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut best = f64::MAX;
    let mut i = 0;
    for _ in 0..7 {
        let t = cpu_ns();
        for _ in 0..iters {
            f(i);
            i += 1;
        }
        best = best.min((cpu_ns() - t) as f64 / iters as f64);
    }
    best
}

/// A plain map from each of `keys` to its index: the tier's rows, as the references keep them.
fn row_map(keys: &[OffloadKey]) -> KeyMap<u32> {
    keys.iter().zip(0..).map(|(k, i)| (*k, i)).collect()
}

/// The floor of a 16-key batch: one plain hash-map probe per key, nothing else.
fn probe16(map: &KeyMap<u32>, batch: &[OffloadKey]) {
    let sum: u32 = batch.iter().filter_map(|k| map.get(k)).sum();
    black_box(sum);
}

/// A load of `batch` as a fresh request: pins, then unpins.
fn load16(tier: &mut CpuTier, batch: &[OffloadKey]) {
    let req = ReqContext::local("load");
    let rows = tier.prepare_load(batch, &req).unwrap();
    tier.complete_load(batch, &req).unwrap();
    black_box(rows);
}

/// Calls per slice of [`interleaved`].
const SLICE_CALLS: usize = 2_000;

/// Slices of [`SLICE_CALLS`] calls of `op` alternating with as many of `floor`, `slices` of
/// each, so that each slice starts with the caches the other one left (run alone, an op finds
/// its own data where its previous call left it). Returns the medians of the op's and the
/// floor's time per call and of the ratio within each pair of slices.
fn interleaved(slices: usize, mut floor: impl FnMut(usize), mut op: impl FnMut(usize)) -> [f64; 3] {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    let (mut floors, mut ops, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    for _ in 0..slices {
        let t = cpu_ns();
        for _ in 0..SLICE_CALLS {
            floor(j);
            j += 1;
        }
        let f = (cpu_ns() - t) as f64 / SLICE_CALLS as f64;
        let t = cpu_ns();
        for _ in 0..SLICE_CALLS {
            op(i);
            i += 1;
        }
        let o = (cpu_ns() - t) as f64 / SLICE_CALLS as f64;
        floors.push(f);
        ops.push(o);
        ratios.push(o / f);
    }
    [median(ops), median(floors), median(ratios)]
}

/// [`best`] for a store: new keys are made a slice of batches at a time with the clock stopped,
/// so the time is the store's alone (an engine hands over keys it has already hashed) and the
/// keys a slice streams through the cache are few (147 KiB), as an engine's batch of keys is.
fn best_store(iters: usize, fresh: &mut FreshKeys, mut f: impl FnMut(&[OffloadKey; BATCH])) -> f64 {
    const SLICE: usize = 256;
    let mut best = f64::MAX;
    for _ in 0..7 {
        let mut spent = 0;
        let mut done = 0;
        while done < iters {
            let batches = fresh.batches(SLICE.min(iters - done));
            let t = cpu_ns();
            for b in &batches {
                f(b);
            }
            spent += cpu_ns() - t;
            done += batches.len();
        }
        best = best.min(spent as f64 / iters as f64);
    }
    best
}

/// The "no row" marker of [`ExactOrder`]'s links.
const NIL: u32 = u32::MAX;

/// Starts loading `value`'s cache line (a hint; no effect elsewhere than x86_64).
#[inline]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch never faults and writes nothing; the address is a live reference's.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// The plainest exact recency order: a map from key to row and a doubly-linked list of rows,
/// least recent first, its links side by side per row. A touch of a batch probes every key
/// first (independent misses in flight together), requests the rows' links and then their
/// neighbours' (the tier's two-stage prefetch), then moves each row to the back.
struct ExactOrder {
    map: KeyMap<u32>,
    links: Vec<[u32; 2]>,
    tail: u32,
}

impl ExactOrder {
    fn new(keys: &[OffloadKey]) -> Self {
        let n = keys.len() as u32;
        Self {
            map: row_map(keys),
            links: (0..n)
                .map(|i| {
                    [
                        i.checked_sub(1).unwrap_or(NIL),
                        if i + 1 < n { i + 1 } else { NIL },
                    ]
                })
                .collect(),
            tail: n - 1,
        }
    }

    fn touch16(&mut self, batch: &[OffloadKey]) {
        let mut rows = [NIL; 16];
        for (r, k) in rows.iter_mut().zip(batch) {
            *r = self.map.get(k).copied().unwrap_or(NIL);
        }
        for &r in rows.iter().filter(|&&r| r != NIL) {
            prefetch(&self.links[r as usize]);
        }
        for &r in rows.iter().filter(|&&r| r != NIL) {
            for m in self.links[r as usize] {
                if let Some(l) = self.links.get(m as usize) {
                    prefetch(l);
                }
            }
        }
        // The first key of the call ends most recent, as the tier's touch.
        for &r in rows.iter().rev().filter(|&&r| r != NIL) {
            self.move_to_back(r);
        }
    }

    fn move_to_back(&mut self, r: u32) {
        if r == self.tail {
            return;
        }
        let [prev, next] = self.links[r as usize];
        if prev != NIL {
            self.links[prev as usize][1] = next;
        }
        self.links[next as usize][0] = prev;
        self.links[self.tail as usize][1] = r;
        self.links[r as usize] = [self.tail, NIL];
        self.tail = r;
    }
}

/// A map holding a full ARC tier's keys: `n` residents and the `n` ghosts evicted before them,
/// in insertion order in a ring. Storing a new key evicts the oldest resident, which becomes a
/// ghost in place (its entry stays, marked), and drops the oldest ghost.
struct GhostedMap {
    map: KeyMap<bool>,
    ring: Vec<OffloadKey>,
    next: usize,
}

impl GhostedMap {
    fn new(n: usize) -> Self {
        let ring: Vec<OffloadKey> = (0..2 * n as u64)
            .map(|i| OffloadKey::from_u64(i | (1 << 40)))
            .collect();
        Self {
            map: ring.iter().zip(0..).map(|(k, i)| (*k, i >= n)).collect(),
            ring,
            next: 2 * n,
        }
    }

    /// One new key: the oldest ghost removed, the key inserted, the oldest resident a ghost.
    fn store(&mut self, key: OffloadKey) {
        let len = self.ring.len();
        let at = self.next % len;
        black_box(self.map.remove(&self.ring[at]));
        self.map.insert(key, true);
        self.ring[at] = key;
        if let Some(resident) = self.map.get_mut(&self.ring[(self.next + len / 2) % len]) {
            *resident = false;
        }
        self.next += 1;
    }
}

/// A doubly-linked list over dense ids (`[prev, next]` per id), oldest first: what an exact
/// recency order needs to also support removal and moves anywhere (touches), used here only at
/// its ends.
struct IdList {
    links: Vec<[u32; 2]>,
    head: u32,
    tail: u32,
}

impl IdList {
    /// The list `0, 1, ..., n - 1`.
    fn new(n: u32) -> Self {
        Self {
            links: (0..n)
                .map(|i| {
                    [
                        i.checked_sub(1).unwrap_or(NIL),
                        if i + 1 < n { i + 1 } else { NIL },
                    ]
                })
                .collect(),
            head: 0,
            tail: n - 1,
        }
    }

    fn pop_front(&mut self) -> u32 {
        let id = self.head;
        let next = self.links[id as usize][1];
        self.head = next;
        if next == NIL {
            self.tail = NIL;
        } else {
            self.links[next as usize][0] = NIL;
        }
        id
    }

    fn push_back(&mut self, id: u32) {
        self.links[id as usize] = [self.tail, NIL];
        if self.tail == NIL {
            self.head = id;
        } else {
            self.links[self.tail as usize][1] = id;
        }
        self.tail = id;
    }
}

/// Marks a map value whose row's write is in flight ([`ExactStore`]).
const WRITING_BIT: u32 = 1 << 31;
/// Marks a map value that names a ghost slot, not a row ([`ExactStore`]).
const GHOST_BIT: u32 = 1 << 30;

/// All a 16-key store into a full tier must do under vLLM 0.33.0's semantics and the
/// `PrimaryTier` API, on the plainest structures: one map from key to row (or ghost slot) with
/// a write-in-flight bit, an exact recency list of the rows (and, under ARC, one of the ghost
/// slots). Per key: the oldest row evicted from the list and its key removed from the map (ARC:
/// its key becomes a ghost in place, taking the oldest ghost's slot, whose key leaves the map),
/// the new key inserted writing and its row appended; then the request's fresh record of the
/// offered keys, the owned outputs (keys to store, their rows, the evicted keys), and the
/// completion: one probe per key clearing its writing bit, and the stored and removed events'
/// key lists. A store that reuses a row in place never takes more.
struct ExactStore {
    map: KeyMap<u32>,
    /// The key in each row.
    rows: Vec<OffloadKey>,
    order: IdList,
    /// ARC's ghosts: the key in each ghost slot and their order, oldest first.
    ghosts: Option<(Vec<OffloadKey>, IdList)>,
}

impl ExactStore {
    fn new(n: usize, arc: bool) -> Self {
        let rows: Vec<OffloadKey> = (0..n as u64)
            .map(|i| OffloadKey::from_u64(i | (1 << 41)))
            .collect();
        let mut map: KeyMap<u32> = rows.iter().zip(0..).map(|(k, i)| (*k, i)).collect();
        let ghosts = arc.then(|| {
            let keys: Vec<OffloadKey> = (0..n as u64)
                .map(|i| OffloadKey::from_u64(i | (1 << 42)))
                .collect();
            map.extend(keys.iter().zip(0..).map(|(k, i)| (*k, i | GHOST_BIT)));
            (keys, IdList::new(n as u32))
        });
        Self {
            map,
            order: IdList::new(n as u32),
            rows,
            ghosts,
        }
    }

    fn store16(&mut self, offered: &[OffloadKey; BATCH]) {
        let record: KeySet = offered.iter().copied().collect();
        let mut to_store = Vec::with_capacity(16);
        let mut chunk_ids = Vec::with_capacity(16);
        let mut evicted = Vec::with_capacity(16);
        for &key in offered {
            let row = self.order.pop_front();
            let old = self.rows[row as usize];
            match self.ghosts.as_mut() {
                Some((ghost_keys, ghost_order)) => {
                    let g = ghost_order.pop_front();
                    black_box(self.map.remove(&ghost_keys[g as usize]));
                    ghost_keys[g as usize] = old;
                    if let Some(v) = self.map.get_mut(&old) {
                        *v = g | GHOST_BIT;
                    }
                    ghost_order.push_back(g);
                }
                None => {
                    black_box(self.map.remove(&old));
                }
            }
            self.map.insert(key, row | WRITING_BIT);
            self.rows[row as usize] = key;
            self.order.push_back(row);
            to_store.push(key);
            chunk_ids.push(row);
            evicted.push(old);
        }
        let removed_event = evicted.clone();
        black_box((&record, &chunk_ids, &evicted, &removed_event));
        for k in &to_store {
            if let Some(v) = self.map.get_mut(k) {
                *v &= !WRITING_BIT;
            }
        }
        let stored_event = to_store.clone();
        black_box((to_store, stored_event));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let policy: PolicyKind = args
        .get(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(PolicyKind::Lru);
    let only = args.get(3).cloned();
    // A tier too large for an anonymous arena of one page per row (10M rows would be 40 GiB)
    // gets a sparse file arena that is never touched, as `benches/scaling.rs` does: only the
    // tier's metadata is measured.
    let dir = tempfile::tempdir().unwrap();
    let mut tier = CpuTier::new(n, 64, policy).unwrap_or_else(|_| {
        let arena = ChunkArena::with_options(&ArenaOptions {
            shared_memory: Some(dir.path().join("arena")),
            ..ArenaOptions::new(n, 64)
        })
        .unwrap();
        CpuTier::with_arena(arena, policy.build(n), true)
    });
    let keys: Vec<OffloadKey> = (0..n as u64).map(OffloadKey::from_u64).collect();
    for batch in keys.chunks(1024) {
        let ctx = ReqContext::local("fill");
        tier.prepare_store(batch, &ctx).unwrap();
        tier.complete_store(batch, &ctx, true);
    }
    tier.take_events();
    let ctx = ReqContext::local("bench");
    let want = |name: &str| only.as_deref().is_none_or(|o| o == name);
    // Batches are consecutive slices of one pre-shuffled sequence of resident keys (as the
    // Python reference takes them from a pre-drawn random list), so the harness adds no work
    // per key.
    let shuffled: Vec<OffloadKey> = (0..SEQUENCE).map(|i| keys[scramble(i, n)]).collect();
    let batch = |i: usize| &shuffled[(i * 16) % (SEQUENCE - 16)..][..16];
    // New keys for the stores and their references, above every key the tier was filled with.
    let mut fresh = FreshKeys::new(1 << 48);
    if want("lookup_hit") {
        let ns = best(200_000, |i| {
            black_box(tier.lookup(&shuffled[i % SEQUENCE], &ctx));
        });
        println!("{policy} {n} lookup_hit {ns:.1} ns");
    }
    // References: a plain hash map (tiering-core's KeyMap, the tier's hasher) over the same keys.
    let mut map: Option<tiering_core::KeyMap<u32>> =
        (want("hashmap_probe_hit") || want("probe16") || want("ops32") || want("store_work16"))
            .then(|| row_map(&keys));
    if let Some(map) = map.as_ref().filter(|_| want("hashmap_probe_hit")) {
        // What a lookup hit is compared with: one probe of the same key sequence.
        let ns = best(200_000, |i| {
            black_box(map.get(&shuffled[i % SEQUENCE]));
        });
        println!("{policy} {n} hashmap_probe_hit {ns:.1} ns");
    }
    if let Some(map) = map.as_ref().filter(|_| want("probe16")) {
        // The floor of a 16-key batch: one plain hash-map probe per key, nothing else.
        let ns = best(20_000, |i| probe16(map, batch(i)));
        println!("{policy} {n} probe16 {ns:.1} ns");
    }
    if let Some(map) = map.as_mut().filter(|_| want("ops32") || want("store_work16")) {
        // The floor of a 16-key store into a full tier: 16 removals of the keys inserted longest
        // ago and 16 inserts of new keys (made before the clock starts, as the store's are),
        // kept in a ring as the tier keeps its keys in its rows. The map stays at `n` keys.
        let mut ring = KeyRing::new(&keys);
        let ns = best_store(20_000, &mut fresh, |b| {
            for k in b {
                ring.replace_oldest(map, *k);
            }
        });
        println!("{policy} {n} ops32 {ns:.1} ns");
        if policy != PolicyKind::Arc {
            // The same with the request's fresh record of the offered keys: all a store into a
            // full LRU tier must do besides its policy's list.
            let ns = best_store(20_000, &mut fresh, |b| {
                for k in b {
                    ring.replace_oldest(map, *k);
                }
                black_box(b.iter().copied().collect::<KeySet>());
            });
            println!("{policy} {n} store_work16 {ns:.1} ns");
        }
    }
    drop(map);
    if want("exact_touch16") {
        let mut order = ExactOrder::new(&keys);
        let ns = best(20_000, |i| order.touch16(black_box(batch(i))));
        println!("{policy} {n} exact_touch16 {ns:.1} ns");
    }
    if want("pin16") {
        // A load's own work: pin each key's row (one probe each), record the 16 keys in the
        // request's fresh record (vLLM 0.33.0 keeps the keys a request observed), unpin through
        // the rows.
        let map = row_map(&keys);
        let mut refs = vec![0u32; n];
        let ns = best(20_000, |i| {
            let b = batch(i);
            let mut rows = [0u32; 16];
            for (r, k) in rows.iter_mut().zip(b) {
                *r = map.get(k).copied().unwrap_or(0);
                refs[*r as usize] += 1;
            }
            let record: KeySet = b.iter().copied().collect();
            for &r in &rows {
                refs[r as usize] -= 1;
            }
            black_box(record);
        });
        println!("{policy} {n} pin16 {ns:.1} ns");
    }
    if want("ops48") || want("store_work16") {
        // ARC's map work alone (`ops48`), and with the request's fresh record of the offered
        // keys (`store_work16`: all a store into a full ARC tier must do besides its policy's
        // lists).
        let mut ghosted = GhostedMap::new(n);
        // The LRU's store reference is `store_work16` on `ops32` (above).
        let variants: &[bool] = if policy == PolicyKind::Arc {
            &[false, true]
        } else {
            &[false]
        };
        for &record in variants {
            let ns = best_store(20_000, &mut fresh, |b| {
                for k in b {
                    ghosted.store(*k);
                }
                if record {
                    black_box(b.iter().copied().collect::<KeySet>());
                }
            });
            let name = if record { "store_work16" } else { "ops48" };
            println!("{policy} {n} {name} {ns:.1} ns");
        }
    }
    if want("exact_store16") {
        let mut exact = ExactStore::new(n, policy == PolicyKind::Arc);
        let ns = best_store(20_000, &mut fresh, |b| exact.store16(b));
        println!("{policy} {n} exact_store16 {ns:.1} ns");
    }
    if want("lookup16") {
        // The tier's own floor of a 16-key batch: its index probes of the batch (one lookup per
        // key: digest, index slot, row), no policy work and no request record.
        let ns = best(20_000, |i| {
            let hits = batch(i)
                .iter()
                .filter(|k| matches!(tier.lookup(k, &ctx), LookupResult::Hit))
                .count();
            black_box(hits);
        });
        println!("{policy} {n} lookup16 {ns:.1} ns");
    }
    if want("touch16") {
        let ns = best(20_000, |i| {
            tier.touch(black_box(batch(i)), &ctx);
        });
        println!("{policy} {n} touch16 {ns:.1} ns");
    }
    if want("load16") {
        let ns = best(20_000, |i| load16(&mut tier, batch(i)));
        println!("{policy} {n} load16 {ns:.1} ns");
    }
    // Diagnostics, run only when named: touch16 or load16 in slices alternating with slices of
    // their floor (16 probes of a plain map), each slice starting with the caches the other left.
    for name in ["interleaved_touch16", "interleaved_load16"] {
        if only.as_deref() != Some(name) {
            continue;
        }
        let map = row_map(&keys);
        let floor = |j: usize| probe16(&map, batch(j));
        let [op, floor, ratio] = if name == "interleaved_touch16" {
            interleaved(150, floor, |i| tier.touch(black_box(batch(i)), &ctx))
        } else {
            interleaved(150, floor, |i| load16(&mut tier, batch(i)))
        };
        println!(
            "{policy} {n} {name} {op:.1} ns, probe16 {floor:.1} ns, ratio {ratio:.2} (medians of 150 slice pairs)"
        );
    }
    if want("store16_evict") {
        let ns = best_store(20_000, &mut fresh, |b| {
            let req = ReqContext::local("store");
            let out = tier.prepare_store(b, &req).unwrap();
            tier.complete_store(&out.keys_to_store, &req, true);
            black_box(tier.take_events());
        });
        println!("{policy} {n} store16_evict {ns:.1} ns");
    }
}
