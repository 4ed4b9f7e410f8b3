//! Criterion benches of the CPU tier's hot paths at 100k and 1M slots, next to a plain hash-map
//! probe with the same hasher measured in the same run (the reference for lookups).
//!
//! - `lookup_hit` / `lookup_miss` vs `hashmap_probe_hit` / `hashmap_probe_miss`
//! - `store16_evict`: `prepare_store` of 16 new keys into a full tier (16 evictions) +
//!   `complete_store`, as the first store of a fresh request
//! - `load16`: `prepare_load` + `complete_load` of 16 resident keys, as a fresh request
//! - `touch16`: `touch` of 16 resident keys
//! - the floors of the batch ops, on a plain map of the same size (tiering-core's `KeyMap`, the
//!   tier's hasher) measured in the same run: `floor_probe16`, 16 probes of the batch's keys
//!   (for `touch16` and `load16`), and `floor_ops32`, 16 removals of the keys inserted longest
//!   ago and 16 inserts of new keys (for `store16_evict`; the map stays full, as the tier does)
//!
//! Chunks are 64 bytes (one page per row); the arena is not pre-faulted, so 1M rows map 4 GiB of
//! untouched virtual memory. `KVTIER_BENCH_SIZES=100000` limits the sizes and
//! `KVTIER_BENCH_POLICIES=lru,arc` the policies; the default run is kept short (20 samples, 1 s
//! each; criterion's `--measurement-time` lengthens it).
//!
//! `tests/data/recorder/compare.sh` runs this bench at 10k and 100k slots interleaved with vLLM
//! 0.33.0's Python manager on the same operations and prints both rates, their ratio, each batch
//! op's ratio to its floor and whether the op meets its target (≥ 50× vLLM or ≤ 2× its floor).

use std::hint::black_box;
use std::time::Duration;

mod support {
    pub mod fresh_keys;
    pub mod key_ring;
}

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use support::fresh_keys::{BATCH, FreshKeys};
use support::key_ring::KeyRing;
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{KeyMap, OffloadKey, PrimaryTier, ReqContext};

/// Store batches made (untimed) at a time: few enough that their keys stay a small stream
/// through the cache, as an engine's batch of keys is.
const KEY_SLICE: u64 = 256;

/// Length of the pre-shuffled key sequence the batches are cut from (as the Python reference's).
const SEQUENCE: usize = 100_000;

fn sizes() -> Vec<usize> {
    std::env::var("KVTIER_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![100_000, 1_000_000])
}

fn policies() -> Vec<PolicyKind> {
    std::env::var("KVTIER_BENCH_POLICIES")
        .ok()
        .map(|s| s.split(',').filter_map(|p| p.parse().ok()).collect())
        .filter(|v: &Vec<PolicyKind>| !v.is_empty())
        .unwrap_or_else(|| PolicyKind::ALL.to_vec())
}

/// A cheap permutation step so consecutive probes hit unrelated keys.
fn scramble(i: usize, n: usize) -> usize {
    (i.wrapping_mul(0x9E37_79B9) ^ (i >> 7)) % n
}

/// A full tier of `n` ready chunks, keys `0..n`.
fn full_tier(n: usize, policy: PolicyKind) -> CpuTier {
    let mut tier = CpuTier::new(n, 64, policy).expect("bench tier");
    let keys: Vec<OffloadKey> = (0..n as u64).map(OffloadKey::from_u64).collect();
    for batch in keys.chunks(1024) {
        let ctx = ReqContext::local("fill");
        tier.prepare_store(batch, &ctx).expect("room while filling");
        tier.complete_store(batch, &ctx, true);
    }
    tier.take_events();
    tier
}

fn bench_size(c: &mut Criterion, n: usize) {
    let resident: Vec<OffloadKey> = (0..n as u64).map(OffloadKey::from_u64).collect();
    let absent: Vec<OffloadKey> = (0..n as u64)
        .map(|i| OffloadKey::from_u64(i + (1 << 40)))
        .collect();
    let shuffled: Vec<OffloadKey> = (0..SEQUENCE).map(|i| resident[scramble(i, n)]).collect();
    let mut group = c.benchmark_group(format!("cpu_tier/{n}"));
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300));

    // Batches are consecutive slices of a pre-shuffled sequence of resident keys, as the
    // Python reference takes them from a pre-drawn random list: the harness adds no work per
    // key.
    let batch_of = |i: usize| &shuffled[(i.wrapping_mul(BATCH)) % (shuffled.len() - BATCH)..][..BATCH];

    // The reference: a plain map with the tier's hasher (tiering-core's KeyMap), same keys.
    let mut map: KeyMap<u32> = resident.iter().enumerate().map(|(i, k)| (*k, i as u32)).collect();
    group.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    group.bench_function("hashmap_probe_hit", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(map.get(&resident[scramble(i, n)]))
        });
    });
    group.bench_function("hashmap_probe_miss", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(map.get(&absent[scramble(i, n)]))
        });
    });
    group.bench_function("floor_probe16", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let sum: u32 = batch_of(i).iter().filter_map(|k| map.get(k)).sum();
            black_box(sum)
        });
    });
    let mut ring = KeyRing::new(&resident);
    // New keys are made outside the timed routine, as the stores' are below.
    let mut fresh = FreshKeys::new(1 << 48);
    group.bench_function("floor_ops32", |b| {
        b.iter_batched_ref(
            || fresh.batch(),
            |batch| {
                for key in batch {
                    ring.replace_oldest(&mut map, *key);
                }
            },
            BatchSize::NumIterations(KEY_SLICE),
        );
    });
    drop(map);
    drop(ring);

    for policy in policies() {
        let mut tier = full_tier(n, policy);
        let ctx = ReqContext::local("bench");
        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("lookup_hit", policy), |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                black_box(tier.lookup(&resident[scramble(i, n)], &ctx))
            });
        });
        group.bench_function(BenchmarkId::new("lookup_miss", policy), |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                black_box(tier.lookup(&absent[scramble(i, n)], &ctx))
            });
        });

        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("touch16", policy), |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                tier.touch(black_box(batch_of(i)), &ctx);
            });
        });
        // Each iteration is a fresh request, as an engine's first load or store of a request is;
        // creating and dropping its context is part of the measured cost.
        group.bench_function(BenchmarkId::new("load16", policy), |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                let batch = batch_of(i);
                let req = ReqContext::local("load");
                let rows = tier.prepare_load(batch, &req).expect("resident keys");
                tier.complete_load(batch, &req).expect("pinned keys");
                black_box(rows)
            });
        });
        // Stores evict keys, so they run last for this tier. Their new keys are made outside
        // the timed routine (an engine hands over keys it has already hashed).
        group.bench_function(BenchmarkId::new("store16_evict", policy), |b| {
            b.iter_batched_ref(
                || fresh.batch(),
                |batch| {
                    let req = ReqContext::local("store");
                    let out = tier.prepare_store(&batch[..], &req).expect("evictable chunks");
                    debug_assert_eq!(out.evicted.len(), BATCH);
                    tier.complete_store(&out.keys_to_store, &req, true);
                    black_box(tier.take_events());
                },
                BatchSize::NumIterations(KEY_SLICE),
            );
        });
        drop(tier);
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    for n in sizes() {
        bench_size(c, n);
    }
}

criterion_group!(cpu_tier, benches);
criterion_main!(cpu_tier);
