//! Load-versus-recompute decisions: a promotion slower than recomputing is declined, a stalled
//! one is abandoned at its deadline (the request recomputes, the chunk still lands, no pin
//! leaks), and without a recompute cost nothing changes. Step-driven, so every effect is
//! deterministic; the only timing is an injected delay the assertions sit safely on one side of.

mod common;

use std::time::Duration;

use common::*;
use tiering_core::testing::Completion;
use tiering_core::{CostConfig, LookupResult, ManagerConfig, RecomputeCost, ReqContext};

/// 1 µs per token, 16 tokens per chunk: recomputing a chunk costs 16 µs.
fn cheap_recompute() -> ManagerConfig {
    ManagerConfig {
        cost: CostConfig {
            recompute: Some(RecomputeCost::new(Duration::from_micros(1), 16)),
            deadline_floor: Duration::from_millis(1),
            // No probes: a declined tier stays declined, whatever the machine's pace.
            probe_interval: Duration::ZERO,
            ..CostConfig::default()
        },
        ..ManagerConfig::step_driven()
    }
}

fn new_req(r: &mut Rig, id: &str) -> ReqContext {
    let ctx = ReqContext::local(id);
    r.m.on_new_request(&ctx).unwrap();
    ctx
}

/// One more step whose lookup polls the tiers, so cascades submitted last step are applied.
fn settle(r: &mut Rig) {
    let probe = new_req(r, "probe");
    assert_eq!(r.m.lookup(&key(999), &probe).unwrap(), LookupResult::Miss);
    r.m.on_request_finished(&probe).unwrap();
    end_step(&mut r.m);
}

fn decisions(r: &mut Rig) -> tiering_core::PromotionDecisions {
    r.m.stats().unwrap().decisions[0].clone()
}

/// A rig over one tier, "slow", whose loads take `delay` and which holds `keys`; and a request.
fn slow_tier(config: ManagerConfig, delay: Duration, keys: &[tiering_core::OffloadKey]) -> (Rig, ReqContext) {
    let mut r = rig(8, &["slow"], config);
    r.tiers[0].set_load_delay(delay);
    for k in keys {
        r.tiers[0].insert(*k, bytes_for(k));
    }
    let ctx = new_req(&mut r, "a");
    (r, ctx)
}

/// `k` is promoted (`HitPending`) and has landed a step later (`Hit`).
fn promote_and_land(r: &mut Rig, ctx: &ReqContext, k: tiering_core::OffloadKey) {
    assert_eq!(r.m.lookup(&k, ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert_eq!(r.m.lookup(&k, ctx).unwrap(), LookupResult::Hit);
}

#[test]
fn a_promotion_slower_than_its_recompute_estimate_is_declined() {
    let (k1, k2) = (key(1), key(2));
    let (mut r, ctx) = slow_tier(cheap_recompute(), Duration::from_millis(5), &[k1, k2]);
    // Nothing measured yet: the first hit is promoted; its 5 ms load is the tier's first sample.
    promote_and_land(&mut r, &ctx, k1);
    // A load of at least 5 ms against 16 µs of recompute: declined, nothing reserved or loaded.
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::Miss);
    end_step(&mut r.m);
    assert_eq!(r.tiers[0].count("submit_load"), 1);
    assert_eq!(r.primary.ref_count(&k2), None, "no primary row was reserved");
    assert!(r.tiers[0].contains(&k2), "the chunk stays in the secondary tier");
    let d = decisions(&mut r);
    assert_eq!(
        (d.started, d.promoted, d.declined_by_cost, d.abandoned_by_deadline),
        (1, 1, 1, 0)
    );
    assert_eq!(d.samples, 1);
    assert!(d.load_secs_per_mib.is_some_and(|s| s > 0.0));
    // The engine recomputes and stores the chunk like any miss.
    store(&mut r.m, &r.primary, &ctx, &[k2]);
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::Hit);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    settle(&mut r);
    assert_eq!(r.primary.total_pins(), 0);
    r.primary.check_invariants().unwrap();
}

#[test]
fn a_promotion_faster_than_recomputing_is_still_promoted() {
    let mut config = cheap_recompute();
    // 1 s per token: any load wins.
    config.cost.recompute = Some(RecomputeCost::new(Duration::from_secs(1), 16));
    let mut r = rig(8, &["slow"], config);
    r.tiers[0].set_load_delay(Duration::from_millis(2));
    let (k1, k2) = (key(1), key(2));
    r.tiers[0].insert(k1, bytes_for(&k1));
    r.tiers[0].insert(k2, bytes_for(&k2));
    let ctx = new_req(&mut r, "a");
    assert_eq!(r.m.lookup(&k1, &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, k2), bytes_for(&k2));
    let d = decisions(&mut r);
    assert_eq!((d.started, d.promoted, d.declined_by_cost), (2, 2, 0));
}

#[test]
fn a_stalled_promotion_is_abandoned_at_its_deadline_and_still_lands() {
    let mut r = rig(8, &["stalled"], cheap_recompute());
    r.tiers[0].set_completion(Completion::Manual);
    let (k, next) = (key(1), key(2));
    r.tiers[0].insert(k, bytes_for(&k));
    let ctx = new_req(&mut r, "a");
    assert_eq!(r.m.lookup(&k, &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert_eq!(
        r.tiers[0].held_jobs().len(),
        1,
        "the promotion is stuck in the tier"
    );
    // Unmeasured tier: the deadline is the floor (1 ms), since 2 × 16 µs of recompute is less.
    std::thread::sleep(Duration::from_millis(3));
    assert_eq!(
        r.m.lookup(&k, &ctx).unwrap(),
        LookupResult::Miss,
        "past its deadline the engine stops waiting"
    );
    assert_eq!(
        r.m.lookup(&k, &ctx).unwrap(),
        LookupResult::Miss,
        "and keeps not waiting"
    );
    let d = decisions(&mut r);
    assert_eq!((d.started, d.abandoned_by_deadline, d.promoted), (1, 1, 0));
    // The request recomputes: the abandoned chunk is still being written, so its store is a
    // no-op for that key; the next chunk is stored normally.
    let out = r.m.prepare_store(&[k, next], &ctx).unwrap().unwrap();
    assert_eq!(out.keys_to_store, vec![next]);
    let arena = tiering_core::PrimaryTier::arena(&r.primary).clone();
    arena
        .write_row(out.chunk_ids[0])
        .unwrap()
        .copy_from_slice(&bytes_for(&next));
    r.m.complete_store(&[next], &ctx, true).unwrap();
    end_step(&mut r.m);
    // The stall ends: the promotion completes and its chunk becomes readable.
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    assert_eq!(r.m.lookup(&k, &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, k), bytes_for(&k));
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    assert!(!r.m.has_pending_work().unwrap());
    assert_eq!(r.primary.total_pins(), 0, "no pin leaked");
    assert_eq!(r.primary.writes_in_flight(), 0);
    assert_eq!(r.m.inspect(|s| s.jobs_in_flight()), 0);
    r.primary.check_invariants().unwrap();
    let d = decisions(&mut r);
    assert_eq!((d.promoted, d.abandoned_by_deadline), (1, 1));
}

#[test]
fn without_a_recompute_cost_every_hit_is_promoted_and_waited_for() {
    let (k1, k2) = (key(1), key(2));
    let (mut r, ctx) = slow_tier(ManagerConfig::step_driven(), Duration::from_millis(3), &[k1, k2]);
    promote_and_land(&mut r, &ctx, k1);
    // However slow the tier was measured to be, the next hit is promoted too.
    r.tiers[0].set_completion(Completion::Manual);
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    // And a stalled promotion is waited for, with no deadline.
    std::thread::sleep(Duration::from_millis(3));
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::HitPending);
    r.tiers[0].complete_all();
    end_step(&mut r.m);
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::Hit);
    let d = decisions(&mut r);
    assert_eq!(
        (d.started, d.promoted, d.declined_by_cost, d.abandoned_by_deadline),
        (2, 2, 0, 0)
    );
}

#[test]
fn a_quarantined_tier_leaves_no_watch_behind() {
    let mut r = rig(8, &["doomed"], cheap_recompute());
    r.tiers[0].set_completion(Completion::Manual);
    let k = key(1);
    r.tiers[0].insert(k, bytes_for(&k));
    let ctx = new_req(&mut r, "a");
    assert_eq!(r.m.lookup(&k, &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    // The tier fails: its held promotion is reported failed and the reserved row freed.
    r.tiers[0].panic_next("poll");
    std::thread::sleep(Duration::from_millis(3));
    let _ = r.m.lookup(&k, &ctx);
    assert_eq!(r.primary.ref_count(&k), None, "the reserved row was freed");
    // A fresh store of the same key is in flight now; its HitPending is not a stale deadline.
    let out = r.m.prepare_store(&[k], &ctx).unwrap().unwrap();
    assert_eq!(out.keys_to_store, vec![k]);
    assert_eq!(r.m.lookup(&k, &ctx).unwrap(), LookupResult::HitPending);
    r.m.complete_store(&[k], &ctx, true).unwrap();
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    settle(&mut r);
    assert_eq!(r.primary.total_pins(), 0);
}

/// Tier 0 answers `Retry` for `k`, the engine waits a step (≥ 1 ms), then the tier answers
/// `answer`: one answered question, timed by the manager. Returns the lookup's verdicts.
fn ask_then_answer(
    r: &mut Rig,
    ctx: &ReqContext,
    k: tiering_core::OffloadKey,
    answer: LookupResult,
) -> [LookupResult; 2] {
    r.tiers[0].set_lookup(k, LookupResult::Retry);
    let first = r.m.lookup(&k, ctx).unwrap();
    end_step(&mut r.m);
    std::thread::sleep(Duration::from_millis(1));
    if answer == LookupResult::Hit {
        r.tiers[0].insert(k, bytes_for(&k));
        r.tiers[0].set_lookup(k, LookupResult::Hit);
    } else {
        r.tiers[0].set_lookup(k, LookupResult::Miss);
    }
    let second = r.m.lookup(&k, ctx).unwrap();
    end_step(&mut r.m);
    [first, second]
}

#[test]
fn a_tier_whose_retries_end_as_misses_is_no_longer_waited_for() {
    let mut r = rig(8, &["asks"], cheap_recompute());
    let ctx = new_req(&mut r, "scan");
    // Unmeasured: the engine is told to wait, and the answer (a miss, ≥ 1 ms later) is timed.
    assert_eq!(
        ask_then_answer(&mut r, &ctx, key(1), LookupResult::Miss),
        [LookupResult::Retry, LookupResult::Miss]
    );
    let d = decisions(&mut r);
    assert_eq!((d.retry_samples, d.retry_hit_rate), (1, Some(0.0)));
    assert!(d.retry_answer_secs.unwrap() >= 1e-3, "{d:?}");
    // Waiting ≥ 1 ms for answers that are never hits: the next `Retry` is passed on as `Miss`
    // and the request recomputes; the tier still got the lookup (it asks the question).
    r.tiers[0].set_lookup(key(2), LookupResult::Retry);
    let asked = r.tiers[0].count("lookup");
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Miss);
    assert_eq!(r.tiers[0].count("lookup"), asked + 1);
    assert_eq!(decisions(&mut r).retries_declined_by_cost, 1);
    end_step(&mut r.m);
    // Nobody waits for key 2: the next step's first lookup asks the tier again itself, and
    // the tier's answer (a miss) is the second sample. (The manager's recheck also took the
    // first sample: it runs before the engine's own lookup in that step.)
    r.tiers[0].set_lookup(key(2), LookupResult::Miss);
    assert_eq!(r.m.lookup(&key(3), &ctx).unwrap(), LookupResult::Miss);
    let d = decisions(&mut r);
    assert_eq!((d.retry_rechecks, d.retry_samples), (2, 2), "{d:?}");
    end_step(&mut r.m);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
}

#[test]
fn a_tier_whose_retries_end_as_hits_is_waited_for_while_it_pays() {
    // 1 ms per token: a chunk costs 16 ms to recompute, far more than a ~1 ms answer.
    let mut cfg = cheap_recompute();
    cfg.cost.recompute = Some(RecomputeCost::new(Duration::from_millis(1), 16));
    let mut r = rig(8, &["asks"], cfg);
    let ctx = new_req(&mut r, "shared");
    assert_eq!(
        ask_then_answer(&mut r, &ctx, key(1), LookupResult::Hit),
        [LookupResult::Retry, LookupResult::HitPending]
    );
    r.tiers[0].set_lookup(key(2), LookupResult::Retry);
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Retry);
    let d = decisions(&mut r);
    assert_eq!((d.retry_hit_rate, d.retries_declined_by_cost), (Some(1.0), 0));
    end_step(&mut r.m);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
}

#[test]
fn without_a_recompute_cost_every_retry_is_waited_for() {
    let mut r = rig(8, &["asks"], ManagerConfig::step_driven());
    let ctx = new_req(&mut r, "a");
    assert_eq!(
        ask_then_answer(&mut r, &ctx, key(1), LookupResult::Miss),
        [LookupResult::Retry, LookupResult::Miss]
    );
    r.tiers[0].set_lookup(key(2), LookupResult::Retry);
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Retry);
    let d = decisions(&mut r);
    assert_eq!((d.retry_samples, d.retries_declined_by_cost), (0, 0));
    end_step(&mut r.m);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
}

#[test]
fn a_probe_of_a_declined_tier_is_not_waited_for_and_its_chunk_still_lands() {
    let mut cfg = cheap_recompute();
    cfg.cost.probe_interval = Duration::from_secs(1);
    let (k1, k2, k3) = (key(1), key(2), key(3));
    let (mut r, ctx) = slow_tier(cfg, Duration::from_millis(5), &[k1, k2, k3]);
    // The first hit is the tier's first sample (≥ 5 ms against 16 µs of recompute)...
    promote_and_land(&mut r, &ctx, k1);
    // ... so the next is declined,
    assert_eq!(r.m.lookup(&k2, &ctx).unwrap(), LookupResult::Miss);
    end_step(&mut r.m);
    // and a probe interval later one hit is promoted to measure the tier again, while the
    // lookup that started it still answers `Miss`: the request recomputes instead of waiting.
    std::thread::sleep(Duration::from_millis(1050));
    assert_eq!(r.m.lookup(&k3, &ctx).unwrap(), LookupResult::Miss);
    end_step(&mut r.m);
    assert_eq!(r.tiers[0].count("submit_load"), 2, "the probe was submitted");
    let d = decisions(&mut r);
    assert_eq!((d.started, d.probes, d.declined_by_cost), (2, 1, 1));
    // The probe lands: a later lookup hits in the primary, and it was a second sample.
    settle(&mut r);
    assert_eq!(r.m.lookup(&k3, &ctx).unwrap(), LookupResult::Hit);
    let d = decisions(&mut r);
    assert_eq!((d.promoted, d.samples, d.abandoned_by_deadline), (2, 2, 0));
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    settle(&mut r);
    assert_eq!(r.primary.total_pins(), 0);
    r.primary.check_invariants().unwrap();
}
