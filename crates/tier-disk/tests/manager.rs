//! The disk tier under a `TieringManager` with an in-memory primary, step-driven: a store
//! cascades to disk, the primary evicts it, a lookup finds it on disk, the promotion brings the
//! same bytes back.

mod common;

use std::time::{Duration, Instant};

use common::{PATIENCE, content, key, options};
use std::sync::Arc;

use tier_cpu::{CpuTier, PolicyKind};
use tier_disk::{DiskGeometry, DiskTier};
use tiering_core::testing::{Engine, MemoryPrimary};
use tiering_core::{
    LookupResult, ManagerConfig, OffloadKey, PrimaryTier, ReqContext, ScheduleEndContext, TieringManager,
    arena::ChunkArena,
};

const CHUNK: usize = 32 * 1024;

/// Ends steps until the manager has no pending work.
fn settle(m: &mut Engine) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        if !m.has_pending_work().unwrap() {
            return;
        }
        assert!(Instant::now() < deadline, "the manager never settled");
        m.waker().wait(Duration::from_millis(50));
    }
}

/// Stores `k` through the engine path: prepare, write the row, complete (which cascades).
fn engine_store(m: &mut Engine, primary: &dyn PrimaryTier, ctx: &ReqContext, k: OffloadKey) {
    store_into(m, primary.arena(), ctx, k);
}

fn store_into(m: &mut Engine, arena: &Arc<ChunkArena>, ctx: &ReqContext, k: OffloadKey) {
    let out = m.prepare_store(&[k], ctx).unwrap().expect("room in the primary");
    assert_eq!(out.keys_to_store, vec![k]);
    let bytes = content(&k, CHUNK);
    arena.write_row(out.chunk_ids[0]).unwrap().copy_from_slice(&bytes);
    m.complete_store(&[k], ctx, true).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

#[test]
fn a_chunk_evicted_from_the_primary_is_promoted_back_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let primary = MemoryPrimary::new(2, CHUNK);
    let disk = DiskTier::open(
        &options(dir.path(), 16, CHUNK),
        DiskGeometry::of_arena(primary.arena()),
    )
    .unwrap();
    let mut m = Engine::new(TieringManager::new(
        Box::new(primary.clone()),
        vec![Box::new(disk)],
        ManagerConfig::step_driven(),
    ));
    let ctx = ReqContext::local("r1");
    m.on_new_request(&ctx).unwrap();

    // Store three chunks in a primary of two: the first is evicted from the primary.
    for n in 0..3 {
        engine_store(&mut m, &primary, &ctx, key(n));
        settle(&mut m);
    }
    let stats = m.stats().unwrap();
    assert_eq!(stats.secondaries[0].stores, 3, "every chunk cascaded to disk");
    assert_eq!(primary.total_pins(), 0, "cascade pins were released");
    assert!(primary.ref_count(&key(0)).is_none(), "key 0 left the primary");

    // Lookup: primary miss, disk hit → a promotion is reserved.
    assert_eq!(m.lookup(&key(0), &ctx).unwrap(), LookupResult::HitPending);
    assert_eq!(primary.writes_in_flight(), 1);
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    settle(&mut m);
    assert_eq!(m.lookup(&key(0), &ctx).unwrap(), LookupResult::Hit);
    let rows = m.prepare_load(&[key(0)], &ctx).unwrap();
    let got = primary.arena().read_row(rows[0]).unwrap().to_vec();
    assert!(
        got == content(&key(0), CHUNK),
        "the promoted bytes differ from the stored ones"
    );
    m.complete_load(&[key(0)], &ctx).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();

    let stats = m.stats().unwrap();
    assert_eq!(stats.manager.promoted_keys, 1);
    assert_eq!(stats.manager.failed_promotion_keys, 0);
    assert_eq!(stats.secondaries[0].loads, 1);
    assert_eq!(stats.secondaries[0].hits, 1);
    // A key nobody stored is a miss everywhere.
    assert_eq!(m.lookup(&key(99), &ctx).unwrap(), LookupResult::Miss);
    m.on_request_finished(&ctx).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    let events = m.take_events().unwrap();
    assert!(
        events.iter().any(|e| !e.removed
            && e.removal_expected
            && e.ownership.as_deref() == Some("disk")
            && e.keys.contains(&key(0))),
        "the disk tier's store event promises the removal it will report"
    );
    primary.check_invariants().unwrap();
    m.shutdown().unwrap();
}

#[test]
fn reset_cache_drains_the_disk_tier_and_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let primary = MemoryPrimary::new(4, CHUNK);
    let disk = DiskTier::open(
        &options(dir.path(), 16, CHUNK),
        DiskGeometry::of_arena(primary.arena()),
    )
    .unwrap();
    let mut m = Engine::new(TieringManager::new(
        Box::new(primary.clone()),
        vec![Box::new(disk)],
        ManagerConfig::step_driven(),
    ));
    let ctx = ReqContext::local("r1");
    m.on_new_request(&ctx).unwrap();
    for n in 0..4 {
        engine_store(&mut m, &primary, &ctx, key(n));
    }
    m.reset_cache().unwrap();
    assert_eq!(primary.resident(), 0);
    assert_eq!(primary.total_pins(), 0);
    let ctx2 = ReqContext::local("r2");
    m.on_new_request(&ctx2).unwrap();
    // Whatever reached the disk before the drain is promoted back with its bytes.
    let mut promoted = Vec::new();
    for n in 0..4 {
        if m.lookup(&key(n), &ctx2).unwrap() == LookupResult::HitPending {
            promoted.push(key(n));
        }
    }
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    settle(&mut m);
    for k in &promoted {
        assert_eq!(m.lookup(k, &ctx2).unwrap(), LookupResult::Hit);
        let rows = m.prepare_load(&[*k], &ctx2).unwrap();
        assert!(*primary.arena().read_row(rows[0]).unwrap() == content(k, CHUNK)[..]);
        m.complete_load(&[*k], &ctx2).unwrap();
    }
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    primary.check_invariants().unwrap();
    m.shutdown().unwrap();
}

#[test]
fn the_control_plane_thread_completes_cascades_and_promotions() {
    let dir = tempfile::tempdir().unwrap();
    let primary = MemoryPrimary::new(2, CHUNK);
    let disk = DiskTier::open(
        &options(dir.path(), 16, CHUNK),
        DiskGeometry::of_arena(primary.arena()),
    )
    .unwrap();
    let mut m = Engine::new(TieringManager::new(
        Box::new(primary.clone()),
        vec![Box::new(disk)],
        ManagerConfig::default(),
    ));
    let ctx = ReqContext::local("r1");
    m.on_new_request(&ctx).unwrap();
    // Without scheduler polling, only the control thread (woken by the disk tier) finishes jobs.
    let idle = |m: &mut Engine| {
        let deadline = Instant::now() + PATIENCE;
        while m.has_pending_work().unwrap() {
            assert!(
                Instant::now() < deadline,
                "the control plane never finished the jobs"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for n in 0..3 {
        engine_store(&mut m, &primary, &ctx, key(n));
        idle(&mut m);
    }
    assert!(m.control_thread_running());
    assert_eq!(m.lookup(&key(0), &ctx).unwrap(), LookupResult::HitPending);
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    idle(&mut m);
    assert_eq!(m.lookup(&key(0), &ctx).unwrap(), LookupResult::Hit);
    let rows = m.prepare_load(&[key(0)], &ctx).unwrap();
    assert!(*primary.arena().read_row(rows[0]).unwrap() == content(&key(0), CHUNK)[..]);
    m.complete_load(&[key(0)], &ctx).unwrap();
    m.on_request_finished(&ctx).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    m.shutdown().unwrap();
    primary.check_invariants().unwrap();
}

#[test]
fn tier_cpu_evicts_and_the_disk_tier_promotes_the_same_bytes_back() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = CpuTier::new(2, CHUNK, PolicyKind::Lru).unwrap();
    let arena = Arc::clone(cpu.arena());
    let disk = DiskTier::open(&options(dir.path(), 16, CHUNK), DiskGeometry::of_arena(&arena)).unwrap();
    let mut m = Engine::new(TieringManager::new(
        Box::new(cpu),
        vec![Box::new(disk)],
        ManagerConfig::step_driven(),
    ));
    let ctx = ReqContext::local("r1");
    m.on_new_request(&ctx).unwrap();
    for n in 0..4 {
        store_into(&mut m, &arena, &ctx, key(n));
        settle(&mut m);
    }
    let stats = m.stats().unwrap();
    assert_eq!(stats.secondaries[0].stores, 4);
    assert!(stats.primary.evictions >= 2, "the CPU tier of two chunks evicted");
    for k in [key(0), key(1)] {
        assert_eq!(
            m.lookup(&k, &ctx).unwrap(),
            LookupResult::HitPending,
            "{k} comes back from disk"
        );
    }
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    settle(&mut m);
    for k in [key(0), key(1)] {
        assert_eq!(m.lookup(&k, &ctx).unwrap(), LookupResult::Hit);
    }
    let rows = m.prepare_load(&[key(0), key(1)], &ctx).unwrap();
    for (k, row) in [key(0), key(1)].iter().zip(rows) {
        assert!(
            *arena.read_row(row).unwrap() == content(k, CHUNK)[..],
            "{k} bytes differ"
        );
    }
    m.complete_load(&[key(0), key(1)], &ctx).unwrap();
    m.on_request_finished(&ctx).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    assert_eq!(m.stats().unwrap().manager.promoted_keys, 2);
    m.shutdown().unwrap();
}
