//! The step guard: the engine holds the manager's lock as a value, releases it by dropping the
//! step (also when a tier panics and the stack unwinds), may call `on_schedule_end` anywhere in
//! the step (vLLM's connector calls it before the step's stores), and a tier that does not opt
//! in to the control thread is only ever called from the scheduler thread.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use common::*;
use tiering_core::testing::{Completion, MemoryPrimary, PeerRequest, ScriptedTier, next_sequence};
use tiering_core::{
    LookupResult, ManagerConfig, ManagerError, OffloadingManager, PrimaryTier, ReqContext, RequestId,
    ScheduleEndContext, SecondaryTier, TieringManager,
};

fn peer_fetch(id: &str, keys: &[u64]) -> PeerRequest {
    PeerRequest {
        ctx: ReqContext::new(RequestId::remote("10.0.0.9:7000", id)),
        keys: keys.iter().map(|&n| key(n)).collect(),
        fetch: true,
        wait_for_pending: false,
    }
}

fn lock_is_free(m: &TieringManager) -> bool {
    tiering_core::testing::lock_is_free(m, PATIENCE)
}

#[test]
fn step_guard_releases_on_panic_in_tier_hooks() {
    for op in ["on_schedule_end", "submit_store", "drain"] {
        let primary = MemoryPrimary::new(8, CHUNK);
        let (tier, h) = ScriptedTier::new("flaky");
        let mut m = TieringManager::new(
            Box::new(primary.clone()),
            vec![Box::new(tier) as Box<dyn SecondaryTier>],
            ManagerConfig::step_driven(),
        );
        let ctx = ReqContext::local("r");
        m.step().on_new_request(&ctx).unwrap();
        h.panic_next(op);
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<(), ManagerError> {
            match op {
                "drain" => m.reset_cache(),
                _ => {
                    let mut s = m.step();
                    let out = s.prepare_store(&[key(1)], &ctx)?.expect("room");
                    primary.arena().write_row(out.chunk_ids[0]).unwrap().fill(1);
                    s.complete_store(&out.keys_to_store, &ctx, true)?;
                    s.on_schedule_end(&ScheduleEndContext::default())
                }
            }
        }));
        // The tier's panic is caught at the boundary: under the default `quarantine` policy the
        // tier leaves the chain and the call goes on without it (tests/tier_panics.rs covers
        // every call and the `fail` policy); a drain that panics fails the reset that needed it.
        let Ok(result) = outcome else {
            panic!("{op}: the tier's panic escaped the manager");
        };
        if op == "drain" {
            let err = result.expect_err("the reset could not drain the tier");
            assert!(err.to_string().contains("panicked in drain"), "{op}: {err}");
        } else {
            result.unwrap_or_else(|e| panic!("{op}: {e}"));
        }
        assert!(lock_is_free(&m), "{op}: the lock stayed held");
        let mut s = m.step();
        assert_eq!(s.lookup(&key(99), &ctx).unwrap(), LookupResult::Miss, "{op}");
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        drop(s);
        assert_eq!(
            m.inspect(|s| s.quarantined_tiers().len()),
            1,
            "{op}: the tier left the chain"
        );
        assert_eq!(primary.total_pins(), 0, "{op}: no pin leaked");
        m.shutdown().unwrap();
    }
}

#[test]
fn a_panic_unwinding_through_a_held_step_releases_the_lock() {
    let primary = MemoryPrimary::new(8, CHUNK);
    let mut m = TieringManager::new(Box::new(primary), Vec::new(), ManagerConfig::step_driven());
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut s = m.step();
        s.on_new_request(&ReqContext::local("r")).unwrap();
        panic!("the engine's own code panicked mid-step");
    }));
    assert!(outcome.is_err());
    assert!(lock_is_free(&m));
    m.shutdown().unwrap();
}

#[test]
fn vllm_connector_order_does_not_hold_the_lock_through_the_model() {
    let mut r = rig(16, &["peer"], ManagerConfig::default());
    let producer = ReqContext::local("prefill-1");
    // Step 1 in vLLM's connector order: lookups, on_schedule_end, then the step's stores and
    // finished requests; the step is dropped before the model runs.
    let rows;
    {
        let mut s = r.m.handle.step();
        s.on_new_request(&producer).unwrap();
        assert_eq!(s.lookup(&key(1), &producer).unwrap(), LookupResult::Miss);
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        let out = s.prepare_store(&[key(1), key(2)], &producer).unwrap().unwrap();
        rows = out.chunk_ids.clone();
        for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            r.primary
                .arena()
                .write_row(*c)
                .unwrap()
                .copy_from_slice(&bytes_for(k));
        }
        s.complete_store(&out.keys_to_store, &producer, true).unwrap();
        s.on_request_finished(&producer).unwrap();
    }
    assert_eq!(rows.len(), 2);
    // The store queued after on_schedule_end was flushed when the step dropped: both chunks
    // cascaded, and the control thread started.
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("submit_store") >= 1));
    assert!(r.m.control_thread_running());
    // "The model runs": no step is held. A peer's fetch is served meanwhile, by the control
    // thread.
    let mark = next_sequence();
    r.tiers[0].push_peer_request(peer_fetch("decode-1", &[1, 2]));
    assert!(
        r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1),
        "the peer was not served while the model ran"
    );
    let served = r.tiers[0].served();
    assert_eq!(
        served[0].fetched,
        vec![(key(1), bytes_for(&key(1))), (key(2), bytes_for(&key(2)))]
    );
    assert_eq!(Some(served[0].thread), r.m.control_thread_id());
    assert!(
        r.tiers[0].calls().iter().any(|c| c.seq > mark && c.op == "serve"),
        "served after the step ended"
    );
    r.m.shutdown().unwrap();
}

#[test]
fn promotions_queued_after_on_schedule_end_are_flushed_when_the_step_drops() {
    let mut r = rig(8, &["disk"], ManagerConfig::step_driven());
    r.tiers[0].insert(key(4), bytes_for(&key(4)));
    let ctx = ReqContext::local("r");
    {
        let mut s = r.m.handle.step();
        s.on_new_request(&ctx).unwrap();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        assert_eq!(s.lookup(&key(4), &ctx).unwrap(), LookupResult::HitPending);
        assert_eq!(r.tiers[0].count("submit_load"), 0, "batched until the flush");
    }
    assert_eq!(r.tiers[0].count("submit_load"), 1, "dropping the step flushed it");
    r.m.shutdown().unwrap();
}

#[test]
fn quiet_tier_is_never_called_from_the_control_thread() {
    let primary = MemoryPrimary::new(8, CHUNK);
    let (peer, peer_h) = ScriptedTier::new("peer");
    let (quiet, quiet_h) = ScriptedTier::quiet("python-tier");
    quiet_h.set_completion(Completion::Manual);
    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(peer), Box::new(quiet)];
    let mut m = TieringManager::new(Box::new(primary.clone()), tiers, ManagerConfig::default());
    let ctx = ReqContext::local("r");
    let me = std::thread::current().id();
    for i in 0..5 {
        let mut s = m.step();
        if i == 0 {
            s.on_new_request(&ctx).unwrap();
        }
        let out = s.prepare_store(&[key(10 + i)], &ctx).unwrap().unwrap();
        primary.arena().write_row(out.chunk_ids[0]).unwrap().fill(7);
        s.complete_store(&out.keys_to_store, &ctx, true).unwrap();
        quiet_h.push_peer_request(peer_fetch(&format!("p{i}"), &[10 + i]));
        quiet_h.complete_all();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        drop(s);
        // Let the control thread run several sweeps between steps.
        assert!(peer_h.wait_until(PATIENCE, |v| v.count("serve") >= 2 * (i as usize + 1)));
    }
    let control = m.control_thread_id().expect("the peer tier opted in");
    assert!(peer_h.calls().iter().any(|c| c.thread == control));
    let quiet_calls = quiet_h.calls();
    assert!(quiet_calls.iter().any(|c| c.op == "serve"), "served at step end");
    assert!(quiet_calls.iter().any(|c| c.op == "poll"), "polled at step end");
    for c in &quiet_calls {
        assert_eq!(c.thread, me, "{} ran on the control thread", c.op);
    }
    assert_eq!(quiet_h.served().len(), 5);
    m.shutdown().unwrap();
}

#[test]
fn idle_manager_does_not_spin() {
    let mut r = rig(8, &["peer"], ManagerConfig::default());
    let ctx = ReqContext::local("r");
    r.m.on_new_request(&ctx).unwrap();
    end_step(&mut r.m);
    assert!(eventually(|| r.m.control_thread_running()));
    let sweeps = |m: &mut Engine| m.stats().unwrap().manager.sweeps;
    let before = sweeps(&mut r.m);
    let idle = Duration::from_secs(2);
    std::thread::sleep(idle);
    let during = sweeps(&mut r.m) - before;
    // Counted, not timed: at most 20 sweeps per idle second (the default idle bound allows 10).
    assert!(
        during <= 20 * idle.as_secs(),
        "{during} sweeps in {idle:?} of idleness"
    );
    // And a wake still gets an immediate sweep.
    r.tiers[0].push_peer_request(peer_fetch("p", &[]));
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    r.m.shutdown().unwrap();
}

#[test]
fn hung_tier_drain_is_bounded() {
    let primary = MemoryPrimary::new(8, CHUNK);
    let (tier, h) = ScriptedTier::new("stuck");
    let config = ManagerConfig {
        tier_timeout: Duration::from_millis(200),
        ..ManagerConfig::step_driven()
    };
    let mut m = TieringManager::new(
        Box::new(primary),
        vec![Box::new(tier) as Box<dyn SecondaryTier>],
        config,
    );
    h.block_drain();
    let err = m.reset_cache().unwrap_err();
    assert!(
        matches!(err, ManagerError::TierTimedOut { op: "drain_jobs", .. }),
        "{err}"
    );
    assert_eq!(m.inspect(|s| s.quarantined_tiers().len()), 1);
    // The manager still works, and shutdown does not wait for the abandoned tier.
    let ctx = ReqContext::local("r");
    let mut s = m.step();
    s.on_new_request(&ctx).unwrap();
    assert_eq!(s.lookup(&key(1), &ctx).unwrap(), LookupResult::Miss);
    drop(s);
    m.shutdown().unwrap();
    // Let the abandoned drain return so its thread ends with the test.
    h.release_drain();
}
