//! The orchestration algorithms, step-driven (no control thread) so every effect is
//! deterministic.

mod common;

use common::*;
use tiering_core::testing::{Completion, PeerRequest};
use tiering_core::{
    JobId, JobKind, JobOutcome, Locality, LookupResult, ManagerConfig, ManagerError, Medium, OffloadPolicy,
    OffloadingManager, ReqContext, RequestId, TierFilter, TierMatcher,
};

fn step_rig(num_chunks: usize, tiers: &[&str]) -> Rig {
    rig(num_chunks, tiers, ManagerConfig::step_driven())
}

fn new_req(r: &mut Rig, id: &str) -> ReqContext {
    let ctx = ReqContext::local(id);
    r.m.on_new_request(&ctx).unwrap();
    ctx
}

#[test]
fn lookup_walks_tiers_in_order_and_stops_at_the_first_hit() {
    let mut r = step_rig(8, &["t0", "t1", "t2"]);
    let k = key(7);
    r.tiers[0].set_lookup(k, LookupResult::Retry);
    r.tiers[1].insert(k, bytes_for(&k));
    r.tiers[2].insert(k, bytes_for(&k));
    let ctx = new_req(&mut r, "a");
    assert_eq!(
        r.m.lookup(&k, &ctx).unwrap(),
        LookupResult::HitPending,
        "an earlier Retry does not stop the walk"
    );
    assert_eq!(r.tiers[0].count("lookup"), 1);
    assert_eq!(r.tiers[1].count("lookup"), 1);
    assert_eq!(
        r.tiers[2].count("lookup"),
        0,
        "tiers after the first hit are not asked"
    );
    end_step(&mut r.m);
    assert_eq!(r.tiers[1].count("submit_load"), 1);
    assert_eq!(r.tiers[2].count("submit_load"), 0);
    // The promotion landed: the next step's poll makes it a primary hit with the tier's bytes.
    assert_eq!(r.m.lookup(&k, &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, k), bytes_for(&k));
}

#[test]
fn lookup_answers_retry_when_only_retries_and_miss_otherwise() {
    let mut r = step_rig(8, &["t0", "t1"]);
    let ctx = new_req(&mut r, "a");
    r.tiers[1].set_lookup(key(1), LookupResult::Retry);
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Retry);
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Miss);
    // A secondary's HitPending is treated as "maybe later".
    r.tiers[0].set_lookup(key(3), LookupResult::HitPending);
    assert_eq!(r.m.lookup(&key(3), &ctx).unwrap(), LookupResult::Retry);
}

#[test]
fn load_filter_limits_which_tiers_may_promote() {
    use tiering_core::testing::ScriptedTier;
    use tiering_core::{SecondaryTier, TierInfo, TieringManager, testing::MemoryPrimary};
    let (remote, remote_h) =
        ScriptedTier::with_info(TierInfo::new("peer", Some(Medium::Cpu), Some(Locality::Remote)));
    let (disk, disk_h) = ScriptedTier::with_info(TierInfo::new(
        "disk",
        Some(Medium::Storage),
        Some(Locality::Local),
    ));
    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(remote), Box::new(disk)];
    let mut m = TieringManager::new(
        Box::new(MemoryPrimary::new(8, CHUNK)),
        tiers,
        ManagerConfig::step_driven(),
    );
    let mut s = m.step();
    let k = key(9);
    remote_h.insert(k, bytes_for(&k));
    disk_h.insert(k, bytes_for(&k));

    let local_only = ReqContext::builder(RequestId::local("local-only"))
        .filter(TierFilter::Matchers(vec![TierMatcher {
            medium: None,
            locality: Some(Locality::Local),
        }]))
        .build();
    s.on_new_request(&local_only).unwrap();
    assert_eq!(s.lookup(&k, &local_only).unwrap(), LookupResult::HitPending);
    assert_eq!(remote_h.count("lookup"), 0, "the filtered-out tier is not asked");
    assert_eq!(disk_h.count("lookup"), 1);

    let primary_only = ReqContext::builder(RequestId::local("primary-only"))
        .filter(TierFilter::primary_only())
        .build();
    s.on_new_request(&primary_only).unwrap();
    assert_eq!(s.lookup(&key(10), &primary_only).unwrap(), LookupResult::Miss);
    assert_eq!(
        remote_h.count("lookup") + disk_h.count("lookup"),
        1,
        "an empty filter means primary only"
    );
    // The filter never hides the primary: the reserved promotion reads HitPending.
    assert_eq!(s.lookup(&k, &primary_only).unwrap(), LookupResult::HitPending);
    drop(s);
    m.shutdown().unwrap();
}

#[test]
fn promotion_reservation_dedupes_later_lookups() {
    let mut r = step_rig(8, &["t0"]);
    r.tiers[0].set_completion(Completion::Manual);
    let k = key(5);
    r.tiers[0].insert(k, bytes_for(&k));
    let a = new_req(&mut r, "a");
    let b = new_req(&mut r, "b");
    assert_eq!(r.m.lookup(&k, &a).unwrap(), LookupResult::HitPending);
    assert_eq!(r.m.lookup(&k, &a).unwrap(), LookupResult::HitPending);
    assert_eq!(r.m.lookup(&k, &b).unwrap(), LookupResult::HitPending);
    assert_eq!(
        r.tiers[0].count("lookup"),
        1,
        "the reserved slot answers later lookups"
    );
    assert!(
        r.m.has_pending_work().unwrap(),
        "reserved, unsubmitted promotions count as pending work"
    );
    end_step(&mut r.m);
    let held = r.tiers[0].held_jobs();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].1, JobKind::Promotion);
    assert_eq!(held[0].2, vec![k]);
}

#[test]
fn primary_full_answers_miss_not_retry() {
    let mut r = step_rig(2, &["t0"]);
    let ctx = new_req(&mut r, "a");
    store(&mut r.m, &r.primary, &ctx, &[key(1), key(2)]);
    r.m.prepare_load(&[key(1), key(2)], &ctx).unwrap();
    r.tiers[0].insert(key(3), bytes_for(&key(3)));
    assert_eq!(r.m.lookup(&key(3), &ctx).unwrap(), LookupResult::Miss);
    assert_eq!(r.m.stats().unwrap().manager.promotion_alloc_failures, 1);
    r.m.complete_load(&[key(1), key(2)], &ctx).unwrap();
}

#[test]
fn promotions_are_batched_one_job_per_tier_and_request() {
    let mut r = step_rig(16, &["t0", "t1"]);
    for t in &r.tiers {
        t.set_completion(Completion::Manual);
    }
    let a = new_req(&mut r, "a");
    let b = new_req(&mut r, "b");
    for n in 0..3 {
        r.tiers[0].insert(key(n), bytes_for(&key(n)));
        r.tiers[1].insert(key(10 + n), bytes_for(&key(10 + n)));
    }
    for n in 0..3 {
        r.m.lookup(&key(n), &a).unwrap();
        r.m.lookup(&key(10 + n), &a).unwrap();
    }
    r.m.lookup(&key(0), &b).unwrap(); // already reserved by a: no new entry
    r.tiers[0].insert(key(20), bytes_for(&key(20)));
    r.m.lookup(&key(20), &b).unwrap();
    assert_eq!(
        r.tiers[0].count("submit_load"),
        0,
        "nothing is submitted before the step ends"
    );
    end_step(&mut r.m);
    let t0: Vec<_> = r.tiers[0].held_jobs().into_iter().map(|j| j.2).collect();
    let t1: Vec<_> = r.tiers[1].held_jobs().into_iter().map(|j| j.2).collect();
    assert_eq!(
        t0,
        vec![vec![key(0), key(1), key(2)], vec![key(20)]],
        "first-lookup order"
    );
    assert_eq!(t1, vec![vec![key(10), key(11), key(12)]]);
    end_step(&mut r.m);
    assert_eq!(
        r.tiers[0].count("submit_load"),
        2,
        "empty entries are not submitted"
    );
}

/// Keys 1 and 2 promoted from tier `t0` for request "a" in one job, which reports only key 1
/// done: key 1 is then a hit, key 2 (gone from the tier too) a miss.
fn partially_promoted() -> (Rig, ReqContext) {
    let mut r = step_rig(8, &["t0"]);
    r.tiers[0].set_completion(Completion::Manual);
    let ctx = new_req(&mut r, "a");
    for n in [1, 2] {
        r.tiers[0].insert(key(n), bytes_for(&key(n)));
        assert_eq!(r.m.lookup(&key(n), &ctx).unwrap(), LookupResult::HitPending);
    }
    end_step(&mut r.m);
    let (id, _, _) = r.tiers[0].held_jobs()[0].clone();
    assert!(r.tiers[0].complete(id, JobOutcome::Partial(vec![key(1)])));
    r.tiers[0].set_lookup(key(2), LookupResult::Miss);
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Miss);
    (r, ctx)
}

#[test]
fn partial_promotion_completes_the_successes_and_frees_the_rest() {
    let (mut r, ctx) = partially_promoted();
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, key(1)), bytes_for(&key(1)));
    let s = r.m.stats().unwrap().manager;
    assert_eq!((s.promoted_keys, s.failed_promotion_keys), (1, 1));
    r.primary.check_invariants().unwrap();
}

#[test]
fn a_partial_report_with_foreign_keys_is_an_error_and_frees_every_slot() {
    let mut r = step_rig(8, &["t0"]);
    r.tiers[0].set_completion(Completion::Manual);
    let ctx = new_req(&mut r, "a");
    r.tiers[0].insert(key(1), bytes_for(&key(1)));
    r.m.lookup(&key(1), &ctx).unwrap();
    end_step(&mut r.m);
    let (id, _, _) = r.tiers[0].held_jobs()[0].clone();
    r.tiers[0].complete(id, JobOutcome::Partial(vec![key(99)]));
    let err = r.m.lookup(&key(1), &ctx).unwrap_err();
    assert!(matches!(err, ManagerError::InvalidPartialResult { .. }), "{err}");
    assert_eq!(r.primary.resident(), 0, "nothing from that report is trusted");
}

#[test]
fn cascade_goes_to_every_tier_and_failed_cascades_release_their_pins() {
    let mut r = step_rig(8, &["ok", "broken"]);
    r.tiers[1].set_fail_stores(true);
    let ctx = new_req(&mut r, "a");
    store(&mut r.m, &r.primary, &ctx, &[key(1), key(2)]);
    assert_eq!(r.primary.ref_count(&key(1)), Some(2), "one pin per tier");
    // This step already polled (in prepare_store): the reports are processed next step.
    end_step(&mut r.m);
    assert_eq!(
        r.primary.ref_count(&key(1)),
        Some(2),
        "polling happens at most once per step"
    );
    end_step(&mut r.m);
    assert_eq!(r.primary.total_pins(), 0, "both cascades reported; pins released");
    assert_eq!(r.tiers[0].get(&key(2)), Some(bytes_for(&key(2))));
    assert!(!r.tiers[1].contains(&key(1)));
    for _ in 0..3 {
        end_step(&mut r.m);
    }
    assert_eq!(
        r.tiers[1].count("submit_store"),
        1,
        "a failed cascade is not retried"
    );
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
}

#[test]
fn failed_device_store_does_not_cascade_but_still_finalizes() {
    let mut r = step_rig(8, &["t0"]);
    let ctx = new_req(&mut r, "a");
    let out = r.m.prepare_store(&[key(1)], &ctx).unwrap().unwrap();
    r.m.on_request_finished(&ctx).unwrap();
    assert!(r.tiers[0].finished_requests().is_empty());
    r.m.complete_store(&out.keys_to_store, &ctx, false).unwrap();
    assert_eq!(r.tiers[0].count("submit_store"), 0);
    assert_eq!(r.tiers[0].finished_requests(), vec![RequestId::local("a")]);
    assert_eq!(
        r.m.lookup(&key(1), &ReqContext::local("z")).unwrap(),
        LookupResult::Miss
    );
}

#[test]
fn finalization_waits_for_pending_stores() {
    let mut r = step_rig(8, &["t0"]);
    let ctx = new_req(&mut r, "a");
    let out = r.m.prepare_store(&[key(1)], &ctx).unwrap().unwrap();
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    assert!(
        r.tiers[0].finished_requests().is_empty(),
        "a pending complete_store could still cascade"
    );
    r.m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    let calls = r.tiers[0].calls();
    let submit = calls.iter().find(|c| c.op == "submit_store").unwrap().seq;
    let finished = calls.iter().find(|c| c.op == "on_request_finished").unwrap().seq;
    assert!(
        submit < finished,
        "the tier hears on_request_finished after the last cascade"
    );
    r.m.inspect(|s| assert_eq!(s.tracked_requests(), 0));
}

fn request_level_rig() -> (Rig, ReqContext, ReqContext) {
    let mut r = step_rig(16, &["chunky", "wants-all"]);
    r.tiers[1].set_policy(OffloadPolicy::RequestLevel);
    r.tiers[1].set_completion(Completion::Manual);
    let writer = new_req(&mut r, "writer");
    let reader = ReqContext::local("reader");
    assert_eq!(r.m.on_new_request(&reader).unwrap(), OffloadPolicy::RequestLevel);
    // key 0 ready (cascaded to both tiers already), key 1 being written by `writer`.
    store(&mut r.m, &r.primary, &writer, &[key(0)]);
    end_step(&mut r.m);
    r.tiers[1].complete_all();
    end_step(&mut r.m);
    r.tiers[1].clear_calls();
    r.tiers[0].clear_calls();
    (r, writer, reader)
}

#[test]
fn request_level_cascade_parks_in_flight_keys_until_they_resolve_to_hit() {
    let (mut r, writer, reader) = request_level_rig();
    let w = r.m.prepare_store(&[key(1)], &writer).unwrap().unwrap();
    let out =
        r.m.prepare_store(&[key(0), key(1), key(2)], &reader)
            .unwrap()
            .unwrap();
    assert_eq!(out.keys_to_store, vec![key(2)]);
    let held = r.tiers[1].held_jobs();
    assert_eq!(held.len(), 1);
    assert_eq!(
        held[0].2,
        vec![key(0)],
        "the ready key goes to the request-level tier at once"
    );
    assert_eq!(
        r.tiers[0].count("submit_store"),
        0,
        "chunk-level tiers get no existing chunks"
    );
    r.m.on_request_finished(&reader).unwrap();
    r.m.complete_store(&out.keys_to_store, &reader, true).unwrap();
    end_step(&mut r.m);
    assert!(
        r.m.has_pending_work().unwrap(),
        "parked keys keep the engine stepping"
    );
    assert!(
        !r.tiers[1]
            .finished_requests()
            .contains(&RequestId::local("reader"))
    );
    // The writer's store lands; the parked key is cascaded at the next step end.
    r.m.complete_store(&w.keys_to_store, &writer, true).unwrap();
    end_step(&mut r.m);
    let cascaded: Vec<_> = r.tiers[1].held_jobs().into_iter().flat_map(|j| j.2).collect();
    assert!(cascaded.contains(&key(1)), "{cascaded:?}");
    assert!(
        r.tiers[1]
            .finished_requests()
            .contains(&RequestId::local("reader"))
    );
    r.tiers[1].complete_all();
    end_step(&mut r.m);
    assert_eq!(r.primary.total_pins(), 0);
}

#[test]
fn request_level_cascade_drops_parked_keys_that_resolve_to_miss() {
    let (mut r, writer, reader) = request_level_rig();
    let w = r.m.prepare_store(&[key(1)], &writer).unwrap().unwrap();
    r.m.prepare_store(&[key(1)], &reader).unwrap().unwrap();
    r.m.on_request_finished(&reader).unwrap();
    r.m.complete_store(&w.keys_to_store, &writer, false).unwrap();
    end_step(&mut r.m);
    assert!(
        r.tiers[1].held_jobs().is_empty(),
        "nothing to cascade: the write failed"
    );
    assert!(
        r.tiers[1]
            .finished_requests()
            .contains(&RequestId::local("reader"))
    );
    assert!(!r.m.has_pending_work().unwrap());
}

#[test]
fn a_peer_request_never_reaches_its_origin_tier() {
    let mut r = step_rig(8, &["origin", "other"]);
    let k = key(4);
    r.tiers[1].insert(k, bytes_for(&k));
    r.tiers[0].insert(key(5), bytes_for(&key(5)));
    let peer_ctx = ReqContext::new(RequestId::remote("peer:1", "r1"));
    r.tiers[0].push_peer_request_quietly(PeerRequest {
        ctx: peer_ctx,
        keys: vec![k, key(5)],
        fetch: false,
        wait_for_pending: false,
    });
    end_step(&mut r.m);
    let served = r.tiers[0].served();
    assert_eq!(served.len(), 1);
    assert_eq!(
        served[0].lookups,
        vec![LookupResult::HitPending, LookupResult::Miss],
        "{served:?}"
    );
    assert_eq!(
        r.tiers[0].count("lookup"),
        0,
        "the origin is never asked about its own request"
    );
    assert_eq!(r.tiers[0].count("on_new_request"), 0);
    assert_eq!(r.tiers[0].count("on_request_finished"), 0);
    assert_eq!(r.tiers[1].count("on_new_request"), 1);
    assert_eq!(
        r.tiers[1].finished_requests(),
        vec![RequestId::remote("peer:1", "r1")]
    );
    // The promotion it started was submitted within the same step end.
    assert_eq!(r.tiers[1].count("submit_load"), 1);
}

#[test]
fn peer_store_jobs_pin_until_the_origin_reports_them() {
    let mut r = step_rig(8, &["origin"]);
    let ctx = new_req(&mut r, "local");
    store(&mut r.m, &r.primary, &ctx, &[key(1)]);
    end_step(&mut r.m);
    r.tiers[0].push_peer_request_quietly(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("peer:1", "r1")),
        keys: vec![key(1)],
        fetch: true,
        wait_for_pending: false,
    });
    end_step(&mut r.m);
    assert_eq!(r.tiers[0].served()[0].fetched, vec![(key(1), bytes_for(&key(1)))]);
    assert_eq!(
        r.primary.total_pins(),
        1,
        "pinned until the serving tier reports the job"
    );
    end_step(&mut r.m);
    assert_eq!(r.primary.total_pins(), 0);
    assert_eq!(r.m.stats().unwrap().manager.peer_store_jobs, 1);
}

#[test]
fn unknown_and_misattributed_job_reports_are_clear_errors() {
    // Under the `fail` policy the reporting tier stays in the chain, so the same tiers can be
    // checked again (quarantine is covered by the control-thread tests).
    let config = ManagerConfig {
        on_tier_failure: tiering_core::OnTierFailure::Fail,
        ..ManagerConfig::step_driven()
    };
    let mut r = rig(8, &["t0", "t1"], config);
    let ctx = new_req(&mut r, "a");
    r.tiers[0].report_bogus_job(JobId(999));
    let err = r.m.lookup(&key(1), &ctx).unwrap_err();
    assert!(
        matches!(err, ManagerError::UnknownJob { job: JobId(999), .. }),
        "{err}"
    );
    end_step(&mut r.m);

    r.tiers[0].set_completion(Completion::Manual);
    store(&mut r.m, &r.primary, &ctx, &[key(1)]);
    let (id, _, _) = r.tiers[0].held_jobs()[0].clone();
    end_step(&mut r.m);
    r.tiers[1].report_bogus_job(id);
    let err = r.m.lookup(&key(1), &ctx).unwrap_err();
    assert!(matches!(err, ManagerError::WrongTier { .. }), "{err}");
    assert!(
        err.to_string().contains("t1") && err.to_string().contains("t0"),
        "{err}"
    );
    end_step(&mut r.m);
    // The job still belongs to t0, which can report it normally.
    r.tiers[0].complete(id, JobOutcome::Ok);
    assert_eq!(r.m.lookup(&key(1), &ctx).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    r.m.inspect(|s| assert_eq!(s.jobs_in_flight(), 0));
    assert_eq!(r.primary.total_pins(), 0);
}

#[test]
fn engine_contract_violations_return_errors_and_change_nothing() {
    let mut r = step_rig(4, &["t0"]);
    let ctx = new_req(&mut r, "a");
    store(&mut r.m, &r.primary, &ctx, &[key(1)]);
    end_step(&mut r.m);
    end_step(&mut r.m);
    let before = r.primary.total_pins();
    assert_eq!(before, 0, "the cascade pin was released");
    assert!(matches!(
        r.m.prepare_load(&[key(1), key(2)], &ctx),
        Err(ManagerError::Primary(_))
    ));
    assert_eq!(r.primary.total_pins(), before, "no partial pin");
    assert!(matches!(
        r.m.complete_load(&[key(1)], &ctx),
        Err(ManagerError::Primary(_))
    ));
    let stranger = ReqContext::local("stranger");
    assert!(matches!(
        r.m.prepare_store(&[key(3)], &stranger),
        Err(ManagerError::UnknownRequest(_))
    ));
    assert_eq!(r.primary.resident(), 1, "an unknown request reserves nothing");
    assert!(matches!(
        r.m.complete_store(&[key(3)], &stranger, true),
        Err(ManagerError::UnknownRequest(_))
    ));
    assert!(matches!(
        r.m.complete_store(&[key(1)], &ctx, true),
        Err(ManagerError::NoPendingStore(_))
    ));
    assert!(matches!(
        r.m.on_request_finished(&stranger),
        Err(ManagerError::UnknownRequest(_))
    ));
    end_step(&mut r.m);
    // Still fully usable.
    assert_eq!(load_bytes(&mut r.m, &r.primary, &ctx, key(1)), bytes_for(&key(1)));
    end_step(&mut r.m);
    r.m.reset_cache().unwrap();
    r.primary.check_invariants().unwrap();
}

#[test]
fn events_come_primary_first_then_tiers_in_order() {
    let mut r = step_rig(4, &["t0"]);
    let ctx = new_req(&mut r, "a");
    store(&mut r.m, &r.primary, &ctx, &[key(1)]);
    let events = r.m.take_events().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].keys, vec![key(1)]);
    assert!(!events[0].removed);
    assert_eq!(events[0].ownership, None);
    assert!(r.m.take_events().unwrap().is_empty(), "events are drained");
    end_step(&mut r.m);
}

#[test]
fn load_source_names_the_tier_a_request_promoted_from_until_the_request_ends() {
    let mut r = step_rig(8, &["t0", "t1"]);
    let (promoted, local) = (key(1), key(2));
    r.tiers[1].insert(promoted, bytes_for(&promoted));
    let a = new_req(&mut r, "a");
    let b = new_req(&mut r, "b");
    store(&mut r.m, &r.primary, &a, &[local]);
    assert_eq!(r.m.lookup(&promoted, &a).unwrap(), LookupResult::HitPending);
    end_step(&mut r.m);
    assert!(eventually(
        || r.m.lookup(&promoted, &a).unwrap() == LookupResult::Hit
    ));
    // The promotion has landed: the primary holds the key, and the origin is remembered.
    let source = r.m.step().load_source(&promoted, &a).unwrap();
    assert_eq!((source.secondary, source.info.name.as_str()), (Some(1), "t1"));
    assert_eq!(source.info.medium, Some(Medium::Storage));
    // A chunk the request stored itself, and the promoted chunk for a request that found it
    // already in the primary, come from the primary.
    for (k, ctx) in [(&local, &a), (&promoted, &b)] {
        let source = r.m.step().load_source(k, ctx).unwrap();
        assert_eq!(
            (source.secondary, source.info.name.as_str()),
            (None, "memory-primary")
        );
    }
    // The record goes with the request.
    r.m.on_request_finished(&a).unwrap();
    end_step(&mut r.m);
    assert_eq!(r.m.step().load_source(&promoted, &a).unwrap().secondary, None);
}

#[test]
fn load_source_forgets_a_failed_promotion_and_a_reset() {
    let (mut r, ctx) = partially_promoted();
    assert_eq!(r.m.step().load_source(&key(1), &ctx).unwrap().secondary, Some(0));
    assert_eq!(
        r.m.step().load_source(&key(2), &ctx).unwrap().secondary,
        None,
        "the failed key's record is dropped"
    );
    r.m.reset_cache().unwrap();
    assert_eq!(r.m.step().load_source(&key(1), &ctx).unwrap().secondary, None);
}

/// A primary of `rows` rows holding `a`'s chunks 1 and 2 and, stored after them, another
/// request's chunk 9; a new step begins, and tier t0 holds chunk 3.
fn hits_then_promotion(rows: usize) -> (Rig, ReqContext) {
    let mut r = step_rig(rows, &["t0"]);
    let a = new_req(&mut r, "a");
    let other = new_req(&mut r, "other");
    store(&mut r.m, &r.primary, &a, &[key(1), key(2)]);
    if rows > 2 {
        store(&mut r.m, &r.primary, &other, &[key(9)]);
    }
    end_step(&mut r.m);
    r.m.end();
    r.tiers[0].insert(key(3), bytes_for(&key(3)));
    (r, a)
}

#[test]
fn a_promotion_never_evicts_a_hit_its_request_was_told_about_in_the_step() {
    let (mut r, a) = hits_then_promotion(3);
    assert_eq!(r.m.lookup(&key(1), &a).unwrap(), LookupResult::Hit);
    assert_eq!(r.m.lookup(&key(2), &a).unwrap(), LookupResult::Hit);
    // Least recently used is chunk 1, but it was just reported as a hit: the row comes from
    // the other request's chunk instead.
    assert_eq!(r.m.lookup(&key(3), &a).unwrap(), LookupResult::HitPending);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &a, key(1)), bytes_for(&key(1)));
    assert_eq!(load_bytes(&mut r.m, &r.primary, &a, key(2)), bytes_for(&key(2)));
    assert_eq!(
        r.primary.ref_count(&key(9)),
        None,
        "the other request's chunk made room"
    );
    assert_eq!(
        r.primary.total_pins(),
        0,
        "the hits were pinned only around the reservation"
    );
}

#[test]
fn a_promotion_that_could_only_evict_its_own_hits_is_a_miss() {
    let (mut r, a) = hits_then_promotion(2);
    assert_eq!(r.m.lookup(&key(1), &a).unwrap(), LookupResult::Hit);
    assert_eq!(r.m.lookup(&key(2), &a).unwrap(), LookupResult::Hit);
    assert_eq!(r.m.lookup(&key(3), &a).unwrap(), LookupResult::Miss);
    assert_eq!(r.m.stats().unwrap().manager.promotion_alloc_failures, 1);
    assert_eq!(load_bytes(&mut r.m, &r.primary, &a, key(1)), bytes_for(&key(1)));
    assert_eq!(load_bytes(&mut r.m, &r.primary, &a, key(2)), bytes_for(&key(2)));
    assert_eq!(r.primary.total_pins(), 0);
}

#[test]
fn hits_of_an_earlier_step_are_not_protected() {
    let (mut r, a) = hits_then_promotion(2);
    assert_eq!(r.m.lookup(&key(1), &a).unwrap(), LookupResult::Hit);
    assert_eq!(r.m.lookup(&key(2), &a).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    r.m.end();
    // A new step: what the engine did not load then is evictable again.
    assert_eq!(r.m.lookup(&key(3), &a).unwrap(), LookupResult::HitPending);
    assert_eq!(
        r.primary.ref_count(&key(1)),
        None,
        "the least recently used chunk made room"
    );
}
