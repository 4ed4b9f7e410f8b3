//! The control-plane thread: sweeps between steps, off the scheduler thread, never during a
//! step, with failures handed back to the engine and an orderly shutdown.

mod common;

use std::time::Duration;

use common::*;
use tiering_core::testing::{Completion, PeerRequest, next_sequence};
use tiering_core::{
    JobOutcome, LookupResult, ManagerConfig, ManagerError, OnTierFailure, ReqContext, RequestId,
};

fn threaded() -> ManagerConfig {
    ManagerConfig::default()
}

fn peer_request(id: &str, keys: &[u64], fetch: bool) -> PeerRequest {
    PeerRequest {
        ctx: ReqContext::new(RequestId::remote("10.0.0.2:5555", id)),
        keys: keys.iter().map(|&n| key(n)).collect(),
        fetch,
        wait_for_pending: false,
    }
}

/// One step with a stored chunk, so the thread starts and the primary holds `key(1)`.
fn first_step(r: &mut Rig) -> ReqContext {
    let ctx = ReqContext::local("engine-1");
    r.m.on_new_request(&ctx).unwrap();
    store(&mut r.m, &r.primary, &ctx, &[key(1)]);
    end_step(&mut r.m);
    assert!(r.m.control_thread_running());
    ctx
}

#[test]
fn sweeps_continue_with_no_further_steps() {
    let mut r = rig(8, &["peer"], threaded());
    first_step(&mut r);
    // No engine call from here on: only the control thread can serve this.
    r.tiers[0].push_peer_request(peer_request("p1", &[1, 2], true));
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    let served = r.tiers[0].served();
    assert_eq!(served[0].lookups, vec![LookupResult::Hit, LookupResult::Miss]);
    assert_eq!(served[0].fetched, vec![(key(1), bytes_for(&key(1)))]);
    assert_eq!(Some(served[0].thread), r.m.control_thread_id());
    // The peer job the serve created is reported and its pin released by a later sweep.
    assert!(eventually(|| r.primary.total_pins() == 0));
    r.m.shutdown().unwrap();
}

#[test]
fn sweeps_run_off_the_scheduler_thread() {
    let mut r = rig(8, &["a", "b"], threaded());
    first_step(&mut r);
    let me = std::thread::current().id();
    let control = r.m.control_thread_id().unwrap();
    assert_ne!(control, me);
    let mark = next_sequence();
    for t in &r.tiers {
        assert!(t.wait_until(PATIENCE, |v| v.count("poll") >= 3 && v.count("serve") >= 3));
    }
    for t in &r.tiers {
        for c in t
            .calls()
            .iter()
            .filter(|c| c.seq > mark && (c.op == "poll" || c.op == "serve"))
        {
            assert_eq!(c.thread, control, "{} ran on {:?}", c.op, c.thread);
        }
    }
    r.m.shutdown().unwrap();
}

#[test]
fn step_lock_excludes_the_control_thread() {
    let mut r = rig(8, &["peer"], threaded());
    let ctx = first_step(&mut r);
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("serve") >= 1));
    // First call of a step takes the lock.
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
    assert!(r.m.in_step());
    let start = next_sequence();
    r.tiers[0].push_peer_request(peer_request("p1", &[1], false));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Miss);
    let end = next_sequence();
    let during: Vec<_> = r.tiers[0]
        .calls()
        .into_iter()
        .filter(|c| c.seq > start && c.seq < end && (c.op == "poll" || c.op == "serve"))
        .collect();
    assert!(during.is_empty(), "sweeps ran inside the step: {during:?}");
    assert!(r.tiers[0].served().is_empty());
    end_step(&mut r.m);
    assert!(!r.m.in_step());
    assert!(
        r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1),
        "sweeps resume after the step"
    );
    r.m.shutdown().unwrap();
}

#[test]
fn on_schedule_end_does_not_double_serve() {
    let mut r = rig(8, &["peer"], threaded());
    let ctx = first_step(&mut r);
    let me = std::thread::current().id();
    let mark = next_sequence();
    for i in 0..20 {
        r.m.lookup(&key(100 + i), &ctx).unwrap();
        end_step(&mut r.m);
    }
    let on_me: Vec<_> = r.tiers[0]
        .calls()
        .into_iter()
        .filter(|c| c.seq > mark && c.thread == me && (c.op == "poll" || c.op == "serve"))
        .collect();
    assert!(
        on_me.is_empty(),
        "the scheduler thread polled or served: {on_me:?}"
    );
    r.m.shutdown().unwrap();
}

/// The engine waits on a promotion: its lookup polls the control thread's tiers itself, once
/// per step, so a promotion that finished is a hit at that lookup even when the control thread
/// could not sweep yet (here: it cannot, the step holds the lock).
#[test]
fn a_lookup_lands_a_finished_promotion_without_waiting_for_the_control_thread() {
    let mut r = rig(8, &["peer"], threaded());
    first_step(&mut r);
    r.m.end();
    r.tiers[0].set_completion(Completion::Manual);
    let (a, b) = (ReqContext::local("engine-a"), ReqContext::local("engine-b"));
    for (ctx, n) in [(&a, 5), (&b, 6)] {
        r.tiers[0].insert(key(n), bytes_for(&key(n)));
        r.m.on_new_request(ctx).unwrap();
        assert_eq!(r.m.lookup(&key(n), ctx).unwrap(), LookupResult::HitPending);
    }
    end_step(&mut r.m);
    r.m.end();
    // One promotion job per request.
    let jobs = r.tiers[0].held_jobs();
    let job_of = |n: u64| {
        jobs.iter()
            .find(|(_, _, keys)| keys == &[key(n)])
            .map(|j| j.0)
            .unwrap()
    };
    let (job5, job6) = (job_of(5), job_of(6));
    assert_eq!(jobs.len(), 2, "{jobs:?}");

    let me = std::thread::current().id();
    let mark = next_sequence();
    // The step is open (the lock held) before key(5)'s promotion finishes: only this thread can
    // apply it until the step ends.
    r.m.step();
    assert!(r.tiers[0].complete(job5, JobOutcome::Ok));
    assert_eq!(r.m.lookup(&key(6), &b).unwrap(), LookupResult::HitPending);
    assert_eq!(
        r.m.lookup(&key(5), &a).unwrap(),
        LookupResult::Hit,
        "applied by the poll at the step's first lookup"
    );
    // Once per step: key(6)'s promotion finishing now is seen at the next step.
    assert!(r.tiers[0].complete(job6, JobOutcome::Ok));
    assert_eq!(r.m.lookup(&key(6), &b).unwrap(), LookupResult::HitPending);
    let polls_here = |from: u64| {
        r.tiers[0]
            .calls()
            .iter()
            .filter(|c| c.seq > from && c.op == "poll" && c.thread == me)
            .count()
    };
    assert_eq!(
        polls_here(mark),
        1,
        "one poll from the scheduler thread in this step"
    );
    assert_eq!(load_bytes(&mut r.m, &r.primary, &a, key(5)), bytes_for(&key(5)));
    r.m.end();
    assert_eq!(r.m.lookup(&key(6), &b).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &b, key(6)), bytes_for(&key(6)));
    // Nothing awaited: a step polls nothing from this thread.
    let mark = next_sequence();
    for n in 100..110 {
        assert_eq!(r.m.lookup(&key(n), &a).unwrap(), LookupResult::Miss);
    }
    assert_eq!(polls_here(mark), 0);
    r.m.end();
    r.m.shutdown().unwrap();
}

/// Under the `fail` policy a failed sweep is returned once by the next engine call, the control
/// thread stops, and the tier (still in the chain) is serviced at step end from then on.
fn failure_is_returned_once(inject: impl FnOnce(&Rig), expect: &str) {
    let config = ManagerConfig {
        on_tier_failure: OnTierFailure::Fail,
        ..threaded()
    };
    let mut r = rig(8, &["peer"], config);
    let ctx = first_step(&mut r);
    inject(&r);
    assert!(eventually(|| r.m.control_failure().is_some()));
    assert!(
        eventually(|| !r.m.control_thread_running()),
        "under the fail policy a failed sweep stops the thread"
    );
    let err = r.m.lookup(&key(1), &ctx).unwrap_err();
    assert!(matches!(err, ManagerError::ControlPlane(_)), "{err}");
    assert!(err.to_string().contains(expect), "{err}");
    r.m.end();
    // Returned once: the next step works, and services the tier from the scheduler thread.
    let me = std::thread::current().id();
    let mark = next_sequence();
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    assert!(
        r.tiers[0]
            .calls()
            .iter()
            .any(|c| c.seq > mark && c.op == "serve" && c.thread == me),
        "after the fallback the scheduler serves the tier at step end"
    );
    r.m.shutdown().unwrap();
    assert_eq!(r.tiers[0].count("shutdown"), 1);
}

#[test]
fn failed_sweep_is_returned_on_the_scheduler_thread() {
    failure_is_returned_once(
        |r| r.tiers[0].fail_next_serve("transport exploded"),
        "transport exploded",
    );
}

#[test]
fn failed_sweep_by_panic_is_returned_on_the_scheduler_thread() {
    failure_is_returned_once(|r| r.tiers[0].panic_next_serve(), "scripted panic while serving");
}

#[test]
fn failing_tier_is_quarantined_and_the_manager_keeps_serving() {
    let mut r = rig(8, &["bad", "good"], threaded());
    r.tiers[0].set_completion(Completion::Manual);
    let ctx = first_step(&mut r);
    // The bad tier holds a cascade of key(1) (a pin) when it fails.
    assert_eq!(r.tiers[0].held_jobs().len(), 1);
    r.tiers[0].panic_next_serve();
    // A panic is contained at the tier-call boundary: the tier is quarantined at once and the
    // engine hears no error for it (the quarantine reason names the tier and the call).
    assert!(eventually(|| r.m.inspect(|s| s.quarantined_tiers().len()) == 1));
    assert!(
        r.m.control_failure().is_none(),
        "a quarantined panic is not an engine error"
    );
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    assert!(
        r.m.control_thread_running(),
        "quarantine keeps the control thread"
    );
    let q = r.m.inspect(|s| s.quarantined_tiers());
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].0, "bad");
    assert!(
        q[0].1
            .contains("panicked in serve_external_requests: scripted panic while serving"),
        "{}",
        q[0].1
    );
    assert_eq!(
        r.tiers[0].count("shutdown"),
        1,
        "the quarantined tier was stopped"
    );
    // Its in-flight cascade was reported failed: no pin is left behind.
    assert!(eventually(|| r.primary.total_pins() == 0));
    // New work skips it: stores cascade to the good tier only, lookups never ask it, and the
    // good tier is still served by the control thread.
    let before_bad = r.tiers[0].calls().len();
    store(&mut r.m, &r.primary, &ctx, &[key(2)]);
    assert_eq!(r.m.lookup(&key(50), &ctx).unwrap(), LookupResult::Miss);
    end_step(&mut r.m);
    assert_eq!(
        r.tiers[0].calls().len(),
        before_bad,
        "nothing reaches a quarantined tier"
    );
    assert!(r.tiers[1].wait_until(PATIENCE, |v| v.count("submit_store") >= 2));
    r.tiers[1].push_peer_request(peer_request("p9", &[2], true));
    assert!(r.tiers[1].wait_until(PATIENCE, |v| v.served() == 1));
    let stats = r.m.stats().unwrap();
    assert_eq!(stats.manager.tiers_quarantined, 1);
    assert_eq!(stats.secondaries[0].extra.get("quarantined"), Some(&1.0));
    r.m.shutdown().unwrap();
    assert_eq!(
        r.tiers[0].count("shutdown"),
        1,
        "a quarantined tier is not shut down twice"
    );
}

#[test]
fn failed_serve_in_step_driven_mode_is_returned_by_on_schedule_end() {
    let mut r = rig(8, &["peer"], ManagerConfig::step_driven());
    r.tiers[0].fail_next_serve("bad frame");
    let err = r.m.on_schedule_end(&Default::default()).unwrap_err();
    assert!(err.to_string().contains("bad frame"), "{err}");
    assert!(!r.m.in_step(), "the step is dropped even on error");
    r.m.shutdown().unwrap();
}

#[test]
fn shutdown_joins_the_thread_before_tier_shutdown() {
    let mut r = rig(8, &["peer"], threaded());
    first_step(&mut r);
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("serve") >= 2));
    let control = r.m.control_thread_id().unwrap();
    r.m.shutdown().unwrap();
    assert!(!r.m.control_thread_running());
    let calls = r.tiers[0].calls();
    let shutdown_seq = calls.iter().find(|c| c.op == "shutdown").unwrap().seq;
    let last_sweep = calls
        .iter()
        .filter(|c| c.thread == control)
        .map(|c| c.seq)
        .max()
        .unwrap();
    assert!(last_sweep < shutdown_seq, "a sweep ran after tier shutdown began");
    let after = r.tiers[0].calls().len();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        r.tiers[0].calls().len(),
        after,
        "nothing touches the tier after shutdown"
    );
    // Later calls fail cleanly.
    assert!(matches!(
        r.m.lookup(&key(1), &ReqContext::local("x")),
        Err(ManagerError::ShutDown)
    ));
}

#[test]
fn shutdown_keeps_going_when_a_tier_fails_to_stop() {
    let mut r = rig(8, &["a", "b"], threaded());
    first_step(&mut r);
    r.tiers[0].fail_shutdown("stuck io");
    let err = r.m.shutdown().unwrap_err();
    assert!(err.to_string().contains("stuck io"), "{err}");
    assert_eq!(r.tiers[1].count("shutdown"), 1, "other tiers are still shut down");
}

#[test]
fn reset_cache_with_the_thread_live() {
    let mut r = rig(8, &["slow"], threaded());
    let ctx = first_step(&mut r);
    // Leave cascade jobs outstanding in the tier.
    r.tiers[0].set_completion(Completion::Manual);
    store(&mut r.m, &r.primary, &ctx, &[key(2), key(3)]);
    end_step(&mut r.m);
    assert_eq!(r.tiers[0].held_jobs().len(), 1);
    assert!(r.primary.total_pins() > 0);
    let control = r.m.control_thread_id().unwrap();
    let start = next_sequence();
    r.m.reset_cache().unwrap();
    let end = next_sequence();
    let calls = r.tiers[0].calls();
    assert!(
        calls
            .iter()
            .any(|c| c.op == "drain" && c.seq > start && c.seq < end),
        "tiers drained"
    );
    let interleaved: Vec<_> = calls
        .iter()
        .filter(|c| c.seq > start && c.seq < end && c.thread == control)
        .collect();
    assert!(
        interleaved.is_empty(),
        "a sweep ran during the reset: {interleaved:?}"
    );
    r.m.inspect(|s| assert_eq!(s.jobs_in_flight(), 0));
    assert_eq!(r.primary.resident(), 0);
    assert_eq!(r.primary.total_pins(), 0);
    assert!(r.tiers[0].contains(&key(1)), "secondary data survives a reset");
    // Sweeps resume afterwards.
    let mark = next_sequence();
    assert!(eventually(|| r.tiers[0]
        .calls_of("poll")
        .iter()
        .any(|c| c.seq > mark)));
    r.m.shutdown().unwrap();
}

#[test]
fn idle_engine_hooks_do_not_starve_the_thread() {
    let mut r = rig(8, &["peer"], threaded());
    first_step(&mut r);
    r.tiers[0].push_peer_request(peer_request("p1", &[1], true));
    // An idle engine ticking its read-only hooks as fast as it can.
    let served = eventually(|| {
        for _ in 0..100 {
            let _ = r.m.has_pending_work().unwrap();
            let _ = r.m.stats().unwrap();
            let _ = r.m.take_events().unwrap();
        }
        !r.tiers[0].served().is_empty()
    });
    assert!(served, "the control thread was starved by the read-only hooks");
    assert!(!r.m.in_step(), "read-only hooks never start a step");
    r.m.shutdown().unwrap();
}

#[test]
fn thread_disabled_or_no_secondary_tiers_means_no_thread() {
    let mut r = rig(8, &["peer"], ManagerConfig::step_driven());
    r.tiers[0].push_peer_request(peer_request("p1", &[1], false));
    end_step(&mut r.m);
    assert!(r.m.control_thread_id().is_none());
    let served = r.tiers[0].served();
    assert_eq!(served.len(), 1, "step-driven mode serves inside on_schedule_end");
    assert_eq!(served[0].thread, std::thread::current().id());

    let mut bare = rig(8, &[], threaded());
    end_step(&mut bare.m);
    assert!(bare.m.control_thread_id().is_none());
}

#[test]
fn waker_wakes_the_thread_without_waiting_for_the_idle_timeout() {
    let config = ManagerConfig {
        idle_wait: Duration::from_secs(3600),
        ..ManagerConfig::default()
    };
    let mut r = rig(8, &["peer"], config);
    first_step(&mut r);
    // Without the wake, the next sweep would come an hour from now.
    r.tiers[0].push_peer_request(peer_request("p1", &[1], false));
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 1));
    // A request queued without a wake stays queued (the thread really is idle-waiting)...
    r.tiers[0].push_peer_request_quietly(peer_request("p2", &[1], false));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r.tiers[0].served().len(), 1);
    // ...until someone wakes it.
    r.m.waker().wake();
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.served() == 2));
    r.m.shutdown().unwrap();
}

#[test]
fn shutdown_gives_up_on_a_control_thread_stuck_in_a_tier() {
    let config = ManagerConfig {
        join_timeout: Duration::from_millis(20),
        shutdown_lock_timeout: Duration::from_millis(20),
        ..ManagerConfig::default()
    };
    let mut r = rig(8, &["wedged"], config);
    first_step(&mut r);
    r.tiers[0].set_serve_delay(Duration::from_millis(400));
    let before = r.tiers[0].count("serve");
    // A serve recorded after the delay was set reads it in the same critical section, so the
    // thread is now inside a 400 ms serve: shutdown must not hang on it.
    assert!(r.tiers[0].wait_until(PATIENCE, |v| v.count("serve") > before));
    let err = r.m.shutdown().unwrap_err();
    assert!(matches!(err, ManagerError::ShutdownTimedOut(_)), "{err}");
    assert_eq!(
        r.tiers[0].count("shutdown"),
        0,
        "tiers are left alive while a sweep may use them"
    );
    // Once the serve returns, the thread sees the stop flag and a retried shutdown completes.
    r.tiers[0].set_serve_delay(Duration::ZERO);
    assert!(eventually(|| r.m.shutdown().is_ok()));
    assert_eq!(r.tiers[0].count("shutdown"), 1);
}
