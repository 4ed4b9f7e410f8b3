//! A failed promotion is remembered: lookups of the key skip the tier it failed on (falling
//! through to the next tier, or missing) until the tier's back-off expires or the tier reports a
//! recovery; a tier whose promotions keep failing is skipped for every key, so its hits turn into
//! misses within a few steps, in both off-step modes. Time is a manual clock: nothing here
//! depends on how fast the machine is.

mod common;

use std::time::Duration;

use common::*;
use tiering_core::admission::{Clock, ManualClock};
use tiering_core::{LookupResult, ManagerConfig, ReqContext, TierHealth};

const SECOND: Duration = Duration::from_secs(1);

fn with_clock(mut config: ManagerConfig) -> (ManagerConfig, ManualClock) {
    let (clock, hand) = Clock::manual();
    config.gate_clock = clock;
    (config, hand)
}

/// One step of an engine: announce, look `keys` up, end the step.
fn step_lookups(r: &mut Rig, ctx: &ReqContext, keys: &[u64]) -> Vec<LookupResult> {
    let out = keys.iter().map(|&k| r.m.lookup(&key(k), ctx).unwrap()).collect();
    end_step(&mut r.m);
    out
}

fn stored(r: &Rig, tier: usize, keys: impl IntoIterator<Item = u64>) {
    for k in keys {
        r.tiers[tier].insert(key(k), bytes_for(&key(k)));
    }
}

#[test]
fn a_failed_promotion_is_not_started_again_until_the_backoff_expires() {
    let (config, clock) = with_clock(ManagerConfig::step_driven());
    let mut r = rig(8, &["remote"], config);
    stored(&r, 0, [1]);
    r.tiers[0].set_fail_loads(true);
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::HitPending]);
    assert_eq!(r.tiers[0].count("submit_load"), 1);
    // The next lookup applies the failure and does not start the same promotion again.
    for _ in 0..20 {
        assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Miss]);
    }
    assert_eq!(
        r.tiers[0].count("submit_load"),
        1,
        "no new promotion job for the key"
    );
    r.m.inspect(|s| assert_eq!(s.remembered_promotion_failures(), 1));
    let stats = r.m.stats().unwrap().manager;
    assert_eq!(stats.failed_promotion_keys, 1);
    assert_eq!(stats.backed_off_lookups, 20);
    // Just before the back-off expires the key is still skipped; at expiry it is tried again.
    clock.advance(SECOND - Duration::from_millis(1));
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Miss]);
    clock.advance(Duration::from_millis(1));
    r.tiers[0].set_fail_loads(false);
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::HitPending]);
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Hit]);
    assert_eq!(r.tiers[0].count("submit_load"), 2);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, key(1)), bytes_for(&key(1)));
    r.m.shutdown().unwrap();
}

#[test]
fn a_key_that_failed_on_one_tier_is_promoted_from_the_next() {
    let (config, _clock) = with_clock(ManagerConfig::step_driven());
    let mut r = rig(8, &["first", "second"], config);
    stored(&r, 0, [1, 2]);
    stored(&r, 1, [1]);
    r.tiers[0].fail_loads_of(key(1));
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    // One job for both keys: key 1 fails, key 2 lands (a partial result).
    assert_eq!(
        step_lookups(&mut r, &ctx, &[1, 2]),
        [LookupResult::HitPending, LookupResult::HitPending]
    );
    assert_eq!(
        step_lookups(&mut r, &ctx, &[1, 2]),
        [LookupResult::HitPending, LookupResult::Hit],
        "key 1 comes from the second tier now"
    );
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Hit]);
    assert_eq!(r.tiers[0].count("submit_load"), 1);
    assert_eq!(r.tiers[1].count("submit_load"), 1);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, key(1)), bytes_for(&key(1)));
    let suspended = r.m.inspect(|s| s.promotions_suspended(0));
    assert!(!suspended, "a partial failure does not suspend the tier");
    r.m.shutdown().unwrap();
}

#[test]
fn a_recovered_tier_is_used_again_before_its_backoff_expires() {
    let (config, _clock) = with_clock(ManagerConfig::step_driven());
    let mut r = rig(16, &["remote"], config);
    stored(&r, 0, 0..10);
    r.tiers[0].set_fail_loads(true);
    r.tiers[0].set_health(TierHealth {
        healthy: false,
        recoveries: 0,
    });
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    for k in 0..6 {
        step_lookups(&mut r, &ctx, &[k]);
    }
    r.m.inspect(|s| assert!(s.promotions_suspended(0)));
    let jobs = r.tiers[0].count("submit_load");
    assert_eq!(step_lookups(&mut r, &ctx, &[0, 7]), [LookupResult::Miss; 2]);
    // The tier comes back and says so: the next step's lookups use it at once.
    r.tiers[0].set_fail_loads(false);
    r.tiers[0].set_health(TierHealth {
        healthy: true,
        recoveries: 1,
    });
    assert_eq!(step_lookups(&mut r, &ctx, &[0]), [LookupResult::HitPending]);
    assert_eq!(step_lookups(&mut r, &ctx, &[0]), [LookupResult::Hit]);
    assert_eq!(r.tiers[0].count("submit_load"), jobs + 1);
    r.m.inspect(|s| {
        assert!(!s.promotions_suspended(0));
        assert_eq!(s.remembered_promotion_failures(), 0);
    });
    r.m.shutdown().unwrap();
}

#[test]
fn reset_cache_forgets_the_failures() {
    let (config, _clock) = with_clock(ManagerConfig::step_driven());
    let mut r = rig(8, &["remote"], config);
    stored(&r, 0, [1]);
    r.tiers[0].set_fail_loads(true);
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    step_lookups(&mut r, &ctx, &[1]);
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Miss]);
    r.tiers[0].set_fail_loads(false);
    r.m.reset_cache().unwrap();
    r.m.inspect(|s| assert_eq!(s.remembered_promotion_failures(), 0));
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::HitPending]);
    assert_eq!(step_lookups(&mut r, &ctx, &[1]), [LookupResult::Hit]);
    r.m.shutdown().unwrap();
}

/// A tier that fails every promotion, under a scheduler that brings new requests with new keys
/// every step (what a killed server looks like to the engine): lookups answer `Miss` within 50
/// steps of the first failed promotion, the promotion jobs stay few, and after the back-off the
/// tier is probed with a bounded number of jobs, not one per key.
fn a_failing_tier_turns_into_misses(config: ManagerConfig) {
    let (config, clock) = with_clock(config);
    let mut r = rig(64, &["remote"], config);
    const REQS_PER_STEP: u64 = 4;
    const KEYS_PER_REQ: u64 = 4;
    const STEPS: u64 = 120;
    stored(&r, 0, 0..(STEPS + 20) * REQS_PER_STEP * KEYS_PER_REQ);
    r.tiers[0].set_fail_loads(true);
    let mut first_failure_step = None;
    let mut last_non_miss_step = None;
    let mut next_key = 0;
    for step in 0..STEPS {
        let mut answers = Vec::new();
        let mut ctxs = Vec::new();
        for q in 0..REQS_PER_STEP {
            let ctx = ReqContext::local(format!("req-{step}-{q}"));
            r.m.on_new_request(&ctx).unwrap();
            for _ in 0..KEYS_PER_REQ {
                answers.push(r.m.lookup(&key(next_key), &ctx).unwrap());
                next_key += 1;
            }
            ctxs.push(ctx);
        }
        for ctx in &ctxs {
            r.m.on_request_finished(ctx).unwrap();
        }
        end_step(&mut r.m);
        let failed = r.m.stats().unwrap().manager.failed_promotion_keys;
        if failed > 0 && first_failure_step.is_none() {
            first_failure_step = Some(step);
        }
        if answers.iter().any(|a| *a != LookupResult::Miss) {
            last_non_miss_step = Some(step);
        }
    }
    let first = first_failure_step.expect("a promotion failed");
    let last = last_non_miss_step.expect("the tier was hit at first");
    assert!(
        last < first + 50,
        "lookups still answered from the failing tier at step {last}, first failure at step {first}"
    );
    let jobs = r.m.stats().unwrap().manager.promotion_jobs;
    // Each request makes one job; at most the steps until the tier is suspended make jobs.
    assert!(jobs <= REQS_PER_STEP * 4, "{jobs} promotion jobs");
    r.m.inspect(|s| assert!(s.promotions_suspended(0)));
    assert_eq!(r.m.stats().unwrap().manager.promotion_suspensions, 1);
    // The back-off expires: one step's requests probe the tier again, fail, and the back-off
    // doubles; nothing is tried during it.
    clock.advance(SECOND);
    let mut probe_steps = 0;
    for step in 0..40 {
        let ctx = ReqContext::local(format!("late-{step}"));
        r.m.on_new_request(&ctx).unwrap();
        let a = r.m.lookup(&key(next_key), &ctx).unwrap();
        next_key += 1;
        r.m.on_request_finished(&ctx).unwrap();
        end_step(&mut r.m);
        if a != LookupResult::Miss {
            probe_steps += 1;
        }
    }
    assert!(probe_steps <= 2, "the tier was probed in {probe_steps} steps");
    let after = r.m.stats().unwrap().manager.promotion_jobs;
    assert!(after - jobs <= 2, "{} jobs after the back-off", after - jobs);
    // Half of the doubled back-off later, the tier is still skipped.
    clock.advance(SECOND);
    let ctx = ReqContext::local("later");
    r.m.on_new_request(&ctx).unwrap();
    assert_eq!(r.m.lookup(&key(next_key), &ctx).unwrap(), LookupResult::Miss);
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    r.m.shutdown().unwrap();
}

#[test]
fn a_failing_tier_turns_into_misses_step_driven() {
    a_failing_tier_turns_into_misses(ManagerConfig::step_driven());
}

#[test]
fn a_failing_tier_turns_into_misses_on_step_with_the_control_thread() {
    a_failing_tier_turns_into_misses(ManagerConfig::default());
}

#[test]
fn a_failing_tier_turns_into_misses_off_step() {
    a_failing_tier_turns_into_misses(ManagerConfig {
        off_step: true,
        ..ManagerConfig::default()
    });
}

#[test]
fn a_failing_tier_turns_into_misses_off_step_without_the_thread() {
    a_failing_tier_turns_into_misses(ManagerConfig {
        off_step: true,
        ..ManagerConfig::step_driven()
    });
}
