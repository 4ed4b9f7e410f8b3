//! Dispatch: loads overtake queued stores within the fairness bound, consecutive slots of a job
//! move in one vectored call, and the tier reports queue depths and measured cost.

mod common;

use common::{PATIENCE, Rig, content, key, keys, options};
use tier_disk::{DiskGeometry, DiskTier, FaultInjector, LOADS_PER_STORE};
use tiering_core::{
    JobId, JobKind, JobOutcome, OffloadKey, ReqContext, SecondaryTier, TransferJob, arena::RowGrant,
};

const CHUNK: usize = 16 * 1024;

/// A tier with one I/O thread (so the completion order is the dispatch order) and a fault
/// injector whose gate holds that thread.
fn one_thread_rig(dir: &std::path::Path, rows: usize) -> (Rig, FaultInjector) {
    let mut opts = options(dir, 64, CHUNK);
    opts.io_threads = 1;
    let faults = FaultInjector::new();
    let geometry = DiskGeometry {
        chunk_bytes: CHUNK,
        row_stride: CHUNK,
    };
    let tier = DiskTier::open_with_faults(&opts, geometry, faults.clone()).unwrap();
    (Rig::new(tier, rows), faults)
}

/// A one-key store job of `k` from arena row `row` (filled with `k`'s content).
fn store_in_row(rig: &Rig, id: u64, k: OffloadKey, row: u32) -> TransferJob {
    rig.arena
        .write_row(row)
        .unwrap()
        .copy_from_slice(&content(&k, CHUNK));
    TransferJob {
        id: JobId(id),
        kind: JobKind::Store,
        keys: vec![k],
        chunk_ids: vec![row],
        req: ReqContext::local("test"),
        rows: RowGrant::Read(rig.arena.read_rows(&[row]).unwrap()),
    }
}

/// A one-key promotion job of `k` into arena row `row`.
fn load_into_row(rig: &Rig, id: u64, k: OffloadKey, row: u32) -> TransferJob {
    TransferJob {
        id: JobId(id),
        kind: JobKind::Promotion,
        keys: vec![k],
        chunk_ids: vec![row],
        req: ReqContext::local("test"),
        rows: RowGrant::Write(rig.arena.write_rows(&[row]).unwrap()),
    }
}

/// Holds the I/O thread inside a first store, queues `stores` more stores and then `loads`
/// loads, releases it, and returns the job ids in completion order (stores are ids 1000+,
/// loads 2000+; the held store is 999).
fn completion_order(stores: u64, loads: u64) -> Vec<u64> {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = one_thread_rig(dir.path(), 64);
    rig.store(&keys(0..4));
    faults.hold_io();
    rig.tier.submit_store(store_in_row(&rig, 999, key(100), 0));
    assert!(
        faults.wait_until_held(1, PATIENCE),
        "the first store reached the gate"
    );
    for i in 0..stores {
        rig.tier
            .submit_store(store_in_row(&rig, 1000 + i, key(200 + i), 1 + i as u32));
    }
    for i in 0..loads {
        rig.tier
            .submit_load(load_into_row(&rig, 2000 + i, key(i % 4), 32 + i as u32));
    }
    let cost = rig.tier.io_cost();
    assert_eq!(cost.stores.queued_chunks, stores);
    assert_eq!(cost.stores.queued_bytes, stores * CHUNK as u64);
    assert_eq!(cost.stores.in_flight_chunks, 1, "the held store");
    assert_eq!(cost.loads.queued_chunks, loads);
    let stats = rig.tier.stats();
    assert_eq!(stats.extra["load_queued_chunks"], loads as f64);
    assert_eq!(stats.extra["store_queued_chunks"], stores as f64);
    faults.release_io();
    let results = rig.wait((1 + stores + loads) as usize);
    for r in &results {
        assert_eq!(r.outcome, JobOutcome::Ok, "{r:?}");
    }
    for i in 0..loads {
        let row = rig.arena.read_row(32 + i as u32).unwrap();
        assert!(
            *row == content(&key(i % 4), CHUNK)[..],
            "load {i} brought the right bytes"
        );
    }
    let cost = rig.tier.io_cost();
    assert_eq!(cost.loads.queued_chunks + cost.stores.queued_chunks, 0);
    assert!(cost.loads.samples >= loads && cost.stores.samples > stores);
    assert!(cost.loads.secs_per_mib.is_some_and(|s| s > 0.0));
    assert!(cost.stores.mib_per_sec().is_some_and(|t| t > 0.0));
    assert_eq!(rig.arena.granted_rows(), 0);
    results.iter().map(|r| r.id.0).collect()
}

#[test]
fn disk_loads_overtake_queued_stores() {
    let order = completion_order(12, 1);
    let mut expected = vec![999, 2000];
    expected.extend(1000..1012);
    assert_eq!(
        order, expected,
        "the load queued after twelve stores runs right after the store in progress"
    );
}

#[test]
fn stores_still_progress_under_a_stream_of_loads() {
    let loads = 2 * LOADS_PER_STORE as u64 + 4;
    let order = completion_order(3, loads);
    // After the held store: LOADS_PER_STORE loads, one store, and so on; the last store
    // follows the last load.
    let mut expected = vec![999];
    let mut next_load = 2000;
    for s in 0..3 {
        let burst = (2000 + loads - next_load).min(LOADS_PER_STORE as u64);
        expected.extend(next_load..next_load + burst);
        next_load += burst;
        expected.push(1000 + s);
    }
    assert_eq!(order, expected);
    let first_store = order.iter().position(|&id| id == 1000).unwrap();
    assert_eq!(first_store, 1 + LOADS_PER_STORE, "the fairness bound");
}

#[test]
fn consecutive_slots_of_a_job_move_in_one_call() {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = one_thread_rig(dir.path(), 16);
    assert_eq!(rig.store(&keys(0..16)).outcome, JobOutcome::Ok);
    assert_eq!(faults.write_calls(), 1, "16 fresh slots in a row: one pwritev");
    rig.assert_loads(&keys(0..16));
    assert_eq!(faults.read_calls(), 1, "and one preadv");
    // Every other key: eight runs of one slot.
    let scattered: Vec<OffloadKey> = (0..16).step_by(2).map(key).collect();
    rig.assert_loads(&scattered);
    assert_eq!(faults.read_calls(), 1 + 8);
    // Runs follow slot order, not key order: keys in reverse slot order still move in one call.
    let reversed: Vec<OffloadKey> = (0..16).rev().map(key).collect();
    rig.assert_loads(&reversed);
    assert_eq!(faults.read_calls(), 1 + 8 + 1);
}

#[test]
fn a_job_is_spread_over_the_io_threads() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), 64, CHUNK);
    opts.io_threads = 4;
    let faults = FaultInjector::new();
    let geometry = DiskGeometry {
        chunk_bytes: CHUNK,
        row_stride: CHUNK,
    };
    let tier = DiskTier::open_with_faults(&opts, geometry, faults.clone()).unwrap();
    let mut rig = Rig::new(tier, 16);
    faults.hold_io();
    let job = rig.store_job(&keys(0..16));
    rig.tier.submit_store(job);
    assert!(
        faults.wait_until_held(4, PATIENCE),
        "four runs of four slots, one per thread"
    );
    assert_eq!(faults.held(), 4);
    faults.release_io();
    assert_eq!(rig.wait(1)[0].outcome, JobOutcome::Ok);
    assert_eq!(faults.write_calls(), 4);
    rig.assert_loads(&keys(0..16));
}
