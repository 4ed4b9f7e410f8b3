//! Off-step completions: the device worker reports a finished store straight to the manager and
//! the control thread completes it between steps, so a peer waiting on the producer is served
//! without a scheduler step in between; promotions a peer starts go out within the sweep.

mod common;

use std::time::Duration;

use common::*;
use tiering_core::testing::{Completion, PeerRequest, next_sequence};
use tiering_core::{LookupResult, ManagerConfig, PrimaryTier, ReqContext, RequestId};

fn off_step() -> ManagerConfig {
    ManagerConfig {
        off_step: true,
        ..ManagerConfig::default()
    }
}

fn step_driven_off_step() -> ManagerConfig {
    ManagerConfig {
        off_step: true,
        ..ManagerConfig::step_driven()
    }
}

fn waiting_fetch(id: &str, keys: &[u64]) -> PeerRequest {
    PeerRequest {
        ctx: ReqContext::new(RequestId::remote("consumer:7000", id)),
        keys: keys.iter().map(|&n| key(n)).collect(),
        fetch: true,
        wait_for_pending: true,
    }
}

/// The producer's engine prepares a store of `k` and writes its row, then ends the step: the
/// device copy is "in flight" from the manager's point of view.
fn producer_store_in_flight(r: &mut Rig, ctx: &ReqContext, k: u64) -> Vec<tiering_core::OffloadKey> {
    r.m.on_new_request(ctx).unwrap();
    let out = r.m.prepare_store(&[key(k)], ctx).unwrap().unwrap();
    let arena = r.primary.arena().clone();
    arena
        .write_row(out.chunk_ids[0])
        .unwrap()
        .copy_from_slice(&bytes_for(&key(k)));
    end_step(&mut r.m);
    out.keys_to_store
}

#[test]
fn a_fetch_waiting_on_the_producer_is_answered_before_its_next_engine_call() {
    let mut r = rig(8, &["p2p"], off_step());
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("prefill-1");
    let keys = producer_store_in_flight(&mut r, &ctx, 1);
    // The consumer's fetch arrives before the producer's store completes (prefill → decode).
    r.tiers[0].push_peer_request(waiting_fetch("decode-1", &[1]));
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("serve") >= 3));
    assert!(r.tiers[0].served().is_empty(), "the chunk is still being written");
    // The device worker finishes the copy. No engine call happens from here on.
    let reported = next_sequence();
    sender.report(&keys, true);
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    let served = r.tiers[0].served();
    assert_eq!(served[0].fetched, vec![(key(1), bytes_for(&key(1)))]);
    assert_eq!(Some(served[0].thread), r.m.control_thread_id());
    let cascade = r.tiers[0].calls_of("submit_store")[0].seq;
    assert!(
        cascade > reported,
        "the store was completed and cascaded off-step"
    );
    // The engine's own report at its next step is recognised as the same completion.
    r.m.complete_store(&keys, &ctx, true).unwrap();
    end_step(&mut r.m);
    assert_eq!(r.tiers[0].count("submit_store"), 1, "no double cascade");
    r.m.inspect(|s| assert_eq!(s.unmatched_store_reports(), 0));
    r.m.shutdown().unwrap();
}

#[test]
fn without_off_step_reporting_the_fetch_waits_for_the_engine() {
    let mut r = rig(8, &["p2p"], ManagerConfig::default());
    let ctx = ReqContext::local("prefill-1");
    let keys = producer_store_in_flight(&mut r, &ctx, 1);
    r.tiers[0].push_peer_request(waiting_fetch("decode-1", &[1]));
    let before = r.tiers[0].count("serve");
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("serve") >= before + 5));
    assert!(
        r.tiers[0].served().is_empty(),
        "nothing completes the store but the engine"
    );
    r.m.complete_store(&keys, &ctx, true).unwrap();
    end_step(&mut r.m);
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    r.m.shutdown().unwrap();
}

fn both_ways(worker_first: bool) {
    let mut r = rig(8, &["a", "b"], step_driven_off_step());
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("req");
    let keys = producer_store_in_flight(&mut r, &ctx, 3);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    if worker_first {
        sender.report(&keys, true);
        end_step(&mut r.m); // step-driven: the catch-all poll applies it
        r.m.complete_store(&keys, &ctx, true).unwrap();
    } else {
        r.m.complete_store(&keys, &ctx, true).unwrap();
        sender.report(&keys, true);
    }
    end_step(&mut r.m);
    end_step(&mut r.m);
    for t in &r.tiers {
        assert_eq!(t.count("submit_store"), 1, "one cascade per tier");
        assert_eq!(
            t.finished_requests(),
            vec![RequestId::local("req")],
            "finalized once"
        );
    }
    assert_eq!(r.m.lookup(&key(3), &ctx).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    r.m.inspect(|s| {
        assert_eq!(s.unmatched_store_reports(), 0);
        assert_eq!(s.jobs_in_flight(), 0);
    });
    assert_eq!(r.primary.total_pins(), 0);
}

#[test]
fn a_store_completion_reported_both_ways_completes_once_worker_first() {
    both_ways(true);
}

#[test]
fn a_store_completion_reported_both_ways_completes_once_engine_first() {
    both_ways(false);
}

#[test]
fn reset_cache_with_completions_in_flight_loses_nothing() {
    let mut r = rig(8, &["disk"], step_driven_off_step());
    r.tiers[0].set_completion(Completion::Manual);
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("req");
    let keys = producer_store_in_flight(&mut r, &ctx, 4);
    sender.report(&keys, true); // queued, not yet applied
    r.m.reset_cache().unwrap();
    assert_eq!(
        r.tiers[0].count("submit_store"),
        1,
        "the queued completion was applied and cascaded"
    );
    assert_eq!(r.tiers[0].count("drain"), 1);
    r.m.inspect(|s| assert_eq!(s.jobs_in_flight(), 0));
    assert_eq!(r.primary.total_pins(), 0);
    assert_eq!(r.primary.arena().granted_rows(), 0);
    // reset_cache forgot the store: the engine's late report of it is a contract violation,
    // refused without changing anything.
    assert!(matches!(
        r.m.complete_store(&keys, &ctx, true),
        Err(tiering_core::ManagerError::NoPendingStore(_))
    ));
    end_step(&mut r.m);
    r.m.inspect(|s| assert_eq!(s.unmatched_store_reports(), 0, "the ledger was cleared"));
    r.primary.check_invariants().unwrap();
}

#[test]
fn shutdown_with_completions_in_flight_loses_nothing() {
    let mut r = rig(8, &["disk"], off_step());
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("req");
    let keys = producer_store_in_flight(&mut r, &ctx, 5);
    r.tiers[0].set_completion(Completion::Manual);
    sender.report(&keys, true);
    r.m.shutdown().unwrap();
    assert_eq!(
        r.tiers[0].count("submit_store"),
        1,
        "the queued store was cascaded before shutdown"
    );
    let calls = r.tiers[0].calls();
    let drain = calls.iter().find(|c| c.op == "drain").unwrap().seq;
    let stop = calls.iter().find(|c| c.op == "shutdown").unwrap().seq;
    assert!(drain < stop, "jobs are drained before the tier stops");
    assert_eq!(r.primary.total_pins(), 0);
    assert_eq!(r.primary.arena().granted_rows(), 0);
}

#[test]
fn a_peer_driven_promotion_is_submitted_within_the_sweep() {
    let mut r = rig(8, &["p2p", "disk"], off_step());
    r.tiers[1].insert(key(6), bytes_for(&key(6)));
    end_step(&mut r.m); // starts the thread; no engine call after this
    r.tiers[0].push_peer_request(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("consumer:7000", "r1")),
        keys: vec![key(6)],
        fetch: true,
        wait_for_pending: true,
    });
    // The peer's lookup hits only on disk: the promotion is submitted and lands within sweeps,
    // and the waiting fetch is then served from the primary.
    assert!(r.tiers[1].wait_until(PATIENCE, |v| v.count("submit_load") == 1));
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    assert_eq!(r.tiers[0].served()[0].fetched, vec![(key(6), bytes_for(&key(6)))]);
    r.m.shutdown().unwrap();
}

#[test]
fn without_off_step_a_peer_driven_promotion_waits_for_the_step_end() {
    let mut r = rig(8, &["p2p", "disk"], ManagerConfig::default());
    r.tiers[1].insert(key(6), bytes_for(&key(6)));
    end_step(&mut r.m);
    r.tiers[0].push_peer_request(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("consumer:7000", "r1")),
        keys: vec![key(6)],
        fetch: false,
        wait_for_pending: false,
    });
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        r.tiers[1].count("submit_load"),
        0,
        "reserved, waiting for on_schedule_end"
    );
    assert!(
        r.m.has_pending_work().unwrap(),
        "the reservation keeps the engine stepping"
    );
    end_step(&mut r.m);
    assert_eq!(r.tiers[1].count("submit_load"), 1);
    r.m.shutdown().unwrap();
}
