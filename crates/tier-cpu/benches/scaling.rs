//! How the CPU tier's cost per operation grows with its size: `lookup_hit`, `store16_evict`
//! (16 new keys into a full tier: 16 evictions + completion, a fresh request) and `load16`
//! (pin + unpin of 16 resident keys, a fresh request) at 10k, 100k, 1M and 10M slots, next to a
//! plain hash-map probe with the tier's hasher over the same keys (`hashmap_probe_hit`, the
//! reference the lookup is compared with). Criterion reports time per operation (ns/op).
//!
//! Cost per operation should grow only with cache misses: at 10k the tier's metadata fits in
//! L2, at 10M nothing does, so every random key costs a few DRAM misses there.
//!
//! Keys are computed on the fly from a scrambled counter (no 360 MB key array at 10M): inside
//! the timed loop for the single lookups, on both sides of their comparison alike, and outside
//! it for the batch ops (an engine hands the tier keys it has already hashed; 16 keys take
//! about 190 ns to make, a tenth of a store). The arena is a sparse file in a temporary
//! directory (removed at the end) that is never touched: 10M rows of one page would be 40 GiB
//! of anonymous memory, more than an overcommit heuristic grants, while the tier's own metadata
//! is what is measured. `KVTIER_SCALING_SIZES=10000,100000` limits the sizes and
//! `KVTIER_BENCH_POLICIES` the policies (default `lru,arc`). 1M and 10M use fewer samples
//! (filling a 10M tier takes a while and about 3 GB of memory).

use std::hint::black_box;
use std::time::Duration;

mod support {
    pub mod fresh_keys;
}

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use support::fresh_keys::{BATCH, FreshKeys};
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{
    KeyMap, OffloadKey, PrimaryTier, ReqContext,
    arena::{ArenaOptions, ChunkArena},
};

/// Batches whose keys are made ahead of each timed stretch (see `benches/cpu_tier.rs`).
const KEY_SLICE: u64 = 256;

fn sizes() -> Vec<usize> {
    std::env::var("KVTIER_SCALING_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![10_000, 100_000, 1_000_000, 10_000_000])
}

fn policies() -> Vec<PolicyKind> {
    std::env::var("KVTIER_BENCH_POLICIES")
        .ok()
        .map(|s| s.split(',').filter_map(|p| p.parse().ok()).collect())
        .filter(|v: &Vec<PolicyKind>| !v.is_empty())
        .unwrap_or_else(|| vec![PolicyKind::Lru, PolicyKind::Arc])
}

/// A cheap permutation step so consecutive probes hit unrelated keys.
fn scramble(i: usize, n: usize) -> u64 {
    ((i.wrapping_mul(0x9E37_79B9) ^ (i >> 7)) % n) as u64
}

/// A full tier of `n` ready chunks holding keys `0..n`, over a sparse file arena in `dir`.
fn full_tier(n: usize, policy: PolicyKind, dir: &std::path::Path) -> CpuTier {
    let arena = ChunkArena::with_options(&ArenaOptions {
        shared_memory: Some(dir.join(format!("arena-{policy}-{n}"))),
        ..ArenaOptions::new(n, 64)
    })
    .expect("sparse file arena");
    let mut tier = CpuTier::with_arena(arena, policy.build(n), true);
    let mut batch = Vec::with_capacity(1024);
    for start in (0..n as u64).step_by(1024) {
        batch.clear();
        batch.extend((start..(start + 1024).min(n as u64)).map(OffloadKey::from_u64));
        let ctx = ReqContext::local("fill");
        tier.prepare_store(&batch, &ctx).expect("room while filling");
        tier.complete_store(&batch, &ctx, true);
        tier.take_events();
    }
    tier
}

fn bench_size(c: &mut Criterion, n: usize) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut group = c.benchmark_group(format!("scaling/{n}"));
    let big = n >= 1_000_000;
    group
        .sample_size(if big { 10 } else { 20 })
        .measurement_time(Duration::from_millis(if n >= 10_000_000 { 700 } else { 1000 }))
        .warm_up_time(Duration::from_millis(300))
        .throughput(Throughput::Elements(1));

    let mut i = 0usize;
    {
        let map: KeyMap<u32> = (0..n as u64)
            .map(|k| (OffloadKey::from_u64(k), k as u32))
            .collect();
        group.bench_function("hashmap_probe_hit", |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                black_box(map.get(&OffloadKey::from_u64(scramble(i, n))))
            });
        });
    }

    for policy in policies() {
        let mut tier = full_tier(n, policy, dir.path());
        let ctx = ReqContext::local("bench");
        group.bench_function(BenchmarkId::new("lookup_hit", policy), |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                black_box(tier.lookup(&OffloadKey::from_u64(scramble(i, n)), &ctx))
            });
        });
        group.bench_function(BenchmarkId::new("load16", policy), |b| {
            b.iter_batched_ref(
                || {
                    i = i.wrapping_add(1);
                    let first = i.wrapping_mul(BATCH);
                    std::array::from_fn::<_, BATCH, _>(|j| OffloadKey::from_u64(scramble(first + j, n)))
                },
                |batch| {
                    let req = ReqContext::local("load");
                    let rows = tier.prepare_load(&batch[..], &req).expect("resident keys");
                    tier.complete_load(&batch[..], &req).expect("pinned keys");
                    black_box(rows)
                },
                BatchSize::NumIterations(KEY_SLICE),
            );
        });
        let mut fresh = FreshKeys::new(1 << 48);
        group.bench_function(BenchmarkId::new("store16_evict", policy), |b| {
            b.iter_batched_ref(
                || fresh.batch(),
                |batch| {
                    let req = ReqContext::local("store");
                    let out = tier.prepare_store(&batch[..], &req).expect("evictable chunks");
                    tier.complete_store(&out.keys_to_store, &req, true);
                    black_box(tier.take_events())
                },
                BatchSize::NumIterations(KEY_SLICE),
            );
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    for n in sizes() {
        bench_size(c, n);
    }
}

criterion_group!(scaling, benches);
criterion_main!(scaling);
