//! Admission policies and backpressure in front of secondary tiers, through the manager:
//! step-driven, with a manual clock for cascade latency, so every effect is deterministic.

mod common;

use std::time::Duration;

use common::*;
use tiering_core::admission::{AdmissionConfig, BackpressureConfig, Clock, ManualClock};
use tiering_core::testing::Completion;
use tiering_core::{
    JobKind, LookupResult, ManagerConfig, OffloadPolicy, ReqContext, TierGateConfig, TierGateStats,
};

fn gated(admission: AdmissionConfig, backpressure: BackpressureConfig) -> ManagerConfig {
    let mut config = ManagerConfig::step_driven();
    config.tier_gates.insert(
        "disk".into(),
        TierGateConfig {
            admission: Some(admission),
            backpressure,
        },
    );
    config
}

fn policy(name: &str, options: &str) -> AdmissionConfig {
    AdmissionConfig::new(name, options.parse().unwrap()).unwrap()
}

fn new_req(r: &mut Rig, id: &str) -> ReqContext {
    let ctx = ReqContext::local(id);
    r.m.on_new_request(&ctx).unwrap();
    ctx
}

fn gate(r: &mut Rig) -> TierGateStats {
    r.m.stats().unwrap().gates[0].clone()
}

/// Keys the disk tier was asked to store, in submission order.
fn cascaded(r: &Rig) -> Vec<u64> {
    let mut out = Vec::new();
    for (_, kind, keys) in r.tiers[0].held_jobs() {
        if kind == JobKind::Store {
            out.extend(keys.iter().map(|k| (0..1000).find(|&n| key(n) == *k).unwrap()));
        }
    }
    out
}

/// A request loads `k` from the primary (lookup, load, complete), as the engine does on a hit.
fn reuse(r: &mut Rig, ctx: &ReqContext, k: u64) {
    assert_eq!(r.m.lookup(&key(k), ctx).unwrap(), LookupResult::Hit);
    let primary = r.primary.clone();
    assert_eq!(load_bytes(&mut r.m, &primary, ctx, key(k)), bytes_for(&key(k)));
}

fn manual_rig(config: ManagerConfig) -> Rig {
    let r = rig(32, &["disk"], config);
    r.tiers[0].set_completion(Completion::Manual);
    r
}

#[test]
fn after_first_reuse_cascades_a_chunk_only_once_it_is_reused() {
    let mut r = manual_rig(gated(
        policy("after_first_reuse", ""),
        BackpressureConfig::disabled(),
    ));
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    store(&mut r.m, &primary, &a, &[key(1), key(2)]);
    end_step(&mut r.m);
    assert_eq!(
        cascaded(&r),
        Vec::<u64>::new(),
        "chunks used once stay in the primary"
    );
    assert_eq!(gate(&mut r).admission_rejections, 2);

    let b = new_req(&mut r, "b");
    reuse(&mut r, &b, 1);
    assert_eq!(
        cascaded(&r),
        [1],
        "the reuse lets chunk 1 through, from the primary's copy"
    );
    reuse(&mut r, &b, 1);
    end_step(&mut r.m);
    assert_eq!(cascaded(&r), [1], "cascaded once, not on every reuse");
    let g = gate(&mut r);
    assert_eq!((g.admission_rejections, g.late_admissions), (2, 1));

    // The cascade pinned chunk 1 like any other; completing it releases the pin.
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    end_step(&mut r.m);
    assert!(r.tiers[0].contains(&key(1)));
    assert!(!r.tiers[0].contains(&key(2)));
    assert_eq!(r.primary.total_pins(), 0);
    assert_eq!(r.m.stats().unwrap().jobs_in_flight, 0);
}

#[test]
fn store_threshold_two_cascades_on_the_second_offer() {
    let mut r = manual_rig(gated(
        policy("store_threshold", "n = 2"),
        BackpressureConfig::disabled(),
    ));
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    store(&mut r.m, &primary, &a, &[key(1), key(2)]);
    end_step(&mut r.m);
    assert!(cascaded(&r).is_empty());
    // A load is not an offer: vLLM 0.33.0 counts offers only.
    let b = new_req(&mut r, "b");
    reuse(&mut r, &b, 2);
    assert!(cascaded(&r).is_empty());
    // A second request offers chunk 1 again (it recomputed it): the second offer admits it.
    let out = r.m.prepare_store(&[key(1), key(3)], &b).unwrap().unwrap();
    assert_eq!(out.keys_to_store, [key(3)], "chunk 1 is already resident");
    assert_eq!(cascaded(&r), [1]);
    let arena = tiering_core::PrimaryTier::arena(&primary).clone();
    arena
        .write_row(out.chunk_ids[0])
        .unwrap()
        .copy_from_slice(&bytes_for(&key(3)));
    r.m.complete_store(&[key(3)], &b, true).unwrap();
    assert_eq!(cascaded(&r), [1], "chunk 3 was offered once");
    assert_eq!(gate(&mut r).admission_rejections, 3);
}

#[test]
fn tinylfu_admits_a_frequent_chunk_over_a_one_hit_wonder() {
    // The tier holds one chunk: once chunk 1 is in, a newcomer must be more frequent than it.
    let mut r = manual_rig(gated(
        policy("tinylfu", "capacity = 1"),
        BackpressureConfig::disabled(),
    ));
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    store(&mut r.m, &primary, &a, &[key(1)]);
    assert_eq!(cascaded(&r), [1], "room in the tier: admitted");
    store(&mut r.m, &primary, &a, &[key(10)]);
    store(&mut r.m, &primary, &a, &[key(20)]);
    assert_eq!(cascaded(&r), [1], "seen once each: neither beats the victim");
    let b = new_req(&mut r, "b");
    reuse(&mut r, &b, 20);
    assert_eq!(cascaded(&r), [1, 20], "chunk 20, used twice, displaces chunk 1");
    let c = new_req(&mut r, "c");
    store(&mut r.m, &primary, &c, &[key(30)]);
    assert_eq!(cascaded(&r), [1, 20], "a one-hit wonder never gets in");
    assert_eq!(gate(&mut r).admission_rejections, 3);
}

fn pressured_rig() -> (Rig, ManualClock) {
    let (clock, hand) = Clock::manual();
    let mut config = gated(
        AdmissionConfig::always(),
        BackpressureConfig {
            alpha: 0.5,
            warmup: 1,
            high_water_per_mib: Duration::from_secs(1),
            low_water_per_mib: Duration::from_millis(500),
            probe_interval: Duration::from_millis(100),
            ..BackpressureConfig::default()
        },
    );
    config.gate_clock = clock;
    (manual_rig(config), hand)
}

/// Completes every held job of the tier after `latency` (as the tier reports it, and on the
/// manager's clock) and lets the manager see the results.
fn finish_after(r: &mut Rig, hand: &ManualClock, latency: Duration) {
    hand.advance(latency);
    r.tiers[0].set_store_latency(Some(latency));
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    r.m.stats().unwrap();
    end_step(&mut r.m);
}

#[test]
fn backpressure_drops_cascades_never_promotions_and_recovers_through_probes() {
    let (mut r, hand) = pressured_rig();
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    // A 64-byte chunk taking 1 ms is 16 s per MiB: far above the high water.
    store(&mut r.m, &primary, &a, &[key(1)]);
    assert_eq!(cascaded(&r), [1]);
    finish_after(&mut r, &hand, Duration::from_millis(1));
    let g = gate(&mut r);
    assert!(g.backpressure_active, "{g:?}");
    assert!(g.store_seconds_per_mib.unwrap() > 16.0);

    // Under pressure: cascades are dropped …
    store(&mut r.m, &primary, &a, &[key(2), key(3)]);
    store(&mut r.m, &primary, &a, &[key(4)]);
    assert!(cascaded(&r).is_empty());
    let g = gate(&mut r);
    assert_eq!(
        (g.backpressure_dropped_jobs, g.backpressure_dropped_chunks),
        (2, 3)
    );
    assert!(r.tiers[0].count("submit_store") == 1);
    // … promotions are not.
    r.tiers[0].insert(key(99), bytes_for(&key(99)));
    let b = new_req(&mut r, "b");
    assert_eq!(r.m.lookup(&key(99), &b).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert_eq!(
        r.tiers[0].count("submit_load"),
        1,
        "the promotion went out under pressure"
    );
    finish_after(&mut r, &hand, Duration::ZERO);
    assert_eq!(r.m.lookup(&key(99), &b).unwrap(), LookupResult::Hit);

    // Recovery: one probe per interval gets through; fast probes bring the average down.
    let mut probes = 0;
    let mut next = 100;
    while gate(&mut r).backpressure_active {
        assert!(probes < 10, "no recovery after {probes} probes");
        hand.advance(Duration::from_millis(100));
        store(&mut r.m, &primary, &a, &[key(next)]);
        store(&mut r.m, &primary, &a, &[key(next + 1)]);
        assert_eq!(
            cascaded(&r),
            [next],
            "one probe per interval, the second cascade is dropped"
        );
        finish_after(&mut r, &hand, Duration::ZERO);
        probes += 1;
        next += 2;
    }
    // 16.4 s/MiB halves with each zero-latency probe: below 0.5 after six.
    assert_eq!(probes, 6);
    assert_eq!(gate(&mut r).backpressure_probes, 6);
    store(&mut r.m, &primary, &a, &[key(500)]);
    store(&mut r.m, &primary, &a, &[key(501)]);
    assert_eq!(cascaded(&r), [500, 501], "cascades flow again");
    finish_after(&mut r, &hand, Duration::ZERO);
    assert_eq!(r.primary.total_pins(), 0, "dropped cascades pinned nothing");
}

#[test]
fn a_tier_the_request_routes_its_chunks_to_passes_no_gate_and_feeds_no_sample() {
    let (mut r, hand) = pressured_rig();
    let primary = r.primary.clone();
    // A hand-off request: the tier takes its chunks at request level, and the job lasts until
    // the remote side fetches them — 1 s for 64 bytes, which as a sample would be pressure.
    r.tiers[0].set_policy(OffloadPolicy::RequestLevel);
    let handoff = new_req(&mut r, "handoff");
    r.tiers[0].set_policy(OffloadPolicy::ChunkLevel);
    store(&mut r.m, &primary, &handoff, &[key(1)]);
    assert_eq!(cascaded(&r), [1]);
    finish_after(&mut r, &hand, Duration::from_secs(1));
    let g = gate(&mut r);
    assert!(!g.backpressure_active, "{g:?}");
    assert_eq!(g.store_seconds_per_mib, None, "a routed job is no latency sample");

    // A chunk-level request's slow cascade turns the pressure on …
    let a = new_req(&mut r, "a");
    store(&mut r.m, &primary, &a, &[key(2)]);
    finish_after(&mut r, &hand, Duration::from_millis(1));
    assert!(gate(&mut r).backpressure_active);
    // … which drops that request's cascades, never the hand-off's.
    store(&mut r.m, &primary, &a, &[key(3)]);
    store(&mut r.m, &primary, &handoff, &[key(4)]);
    assert_eq!(cascaded(&r), [4]);
    let g = gate(&mut r);
    assert_eq!(
        (g.backpressure_dropped_jobs, g.backpressure_dropped_chunks),
        (1, 1)
    );
    finish_after(&mut r, &hand, Duration::ZERO);
    assert_eq!(r.primary.total_pins(), 0);
}

#[test]
fn chunks_dropped_under_pressure_cascade_on_a_later_reuse() {
    let (mut r, hand) = pressured_rig();
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    store(&mut r.m, &primary, &a, &[key(1)]);
    finish_after(&mut r, &hand, Duration::from_millis(1));
    store(&mut r.m, &primary, &a, &[key(2)]);
    assert!(cascaded(&r).is_empty());
    // Recover with fast probes.
    let mut next = 100;
    while gate(&mut r).backpressure_active {
        hand.advance(Duration::from_millis(100));
        store(&mut r.m, &primary, &a, &[key(next)]);
        finish_after(&mut r, &hand, Duration::ZERO);
        next += 1;
    }
    let b = new_req(&mut r, "b");
    reuse(&mut r, &b, 2);
    assert_eq!(
        cascaded(&r),
        [2],
        "the dropped chunk goes out once it is used again"
    );
    assert_eq!(gate(&mut r).late_admissions, 1);
}

#[test]
fn the_tiers_reported_latency_is_the_sample_and_promotions_feed_nothing() {
    let (mut r, hand) = pressured_rig();
    let a = new_req(&mut r, "a");
    let primary = r.primary.clone();
    // Slow promotions do not count: only cascades are store samples.
    r.tiers[0].insert(key(99), bytes_for(&key(99)));
    assert_eq!(r.m.lookup(&key(99), &a).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    end_step(&mut r.m);
    assert_eq!(gate(&mut r).store_seconds_per_mib, None);
    // The manager's clock stands still; the tier says the store took 1 ms (16 s per MiB).
    r.tiers[0].set_store_latency(Some(Duration::from_millis(1)));
    store(&mut r.m, &primary, &a, &[key(1)]);
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    end_step(&mut r.m);
    let g = gate(&mut r);
    assert!(g.backpressure_active, "{g:?}");
    assert_eq!(g.backpressure_activations, 1);
    // A failed probe is no sample either.
    r.tiers[0].set_fail_stores(true);
    store(&mut r.m, &primary, &a, &[key(7)]);
    assert_eq!(
        gate(&mut r).backpressure_dropped_jobs,
        1,
        "inside the probe interval: dropped"
    );
    hand.advance(Duration::from_millis(100));
    store(&mut r.m, &primary, &a, &[key(8)]);
    assert_eq!(r.tiers[0].count("submit_store"), 2, "the probe went out");
    let before = gate(&mut r).store_seconds_per_mib;
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    end_step(&mut r.m);
    let g = gate(&mut r);
    assert_eq!((g.store_seconds_per_mib, g.backpressure_active), (before, true));
    assert_eq!(r.primary.total_pins(), 0);
}
