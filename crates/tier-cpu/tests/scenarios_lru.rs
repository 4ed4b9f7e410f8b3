//! The LRU scenarios of note 02 §12.1 and note 06, with the exact keys, chunk ids, evictions and
//! events the released vLLM 0.33.0 manager produces (each was confirmed against it).

mod common;

use common::{event_summary, k, ks, nums, tier};
use tier_cpu::PolicyKind::{self, Lru};
use tiering_core::{LookupResult, PrimaryTier, ReqContext};

fn lru_order(t: &tier_cpu::CpuTier) -> Vec<u64> {
    nums(&t.policy_snapshot().list("lru"))
}

#[test]
fn test_cpu_manager_sequence_matches_logical_lru() {
    let mut t = tier(4, Lru);
    let ctx = ReqContext::local("a");

    // 1. store [1,2]: chunks [0,1], pending until completed, no event before completion.
    let out = t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    assert_eq!(
        (nums(&out.keys_to_store), out.chunk_ids.clone(), out.evicted.len()),
        (vec![1, 2], vec![0, 1], 0)
    );
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::HitPending);
    assert!(t.take_events().is_empty());
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    assert_eq!(event_summary(&t.take_events()), vec![(false, false, vec![1, 2])]);
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::Hit);
    assert_eq!(t.lookup(&k(3), &ctx), LookupResult::Miss);

    // 2. store [2,3,4,5]: 2 is skipped, fresh chunks 2,3 then the evicted 1's chunk 0.
    let out = t.prepare_store(&ks(&[2, 3, 4, 5]), &ctx).unwrap();
    assert_eq!(nums(&out.keys_to_store), vec![3, 4, 5]);
    assert_eq!(out.chunk_ids, vec![2, 3, 0]);
    assert_eq!(nums(&out.evicted), vec![1]);
    assert_eq!(event_summary(&t.take_events()), vec![(true, false, vec![1])]);

    // 3. store [1,6] needs two evictions, only 2 is evictable: None, nothing changes.
    assert!(t.prepare_store(&ks(&[1, 6]), &ctx).is_none());
    t.complete_store(&ks(&[2, 3, 4, 5]), &ctx, true);
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::Miss);
    for n in 2..=5 {
        assert_eq!(t.lookup(&k(n), &ctx), LookupResult::Hit);
    }

    // 4. loads pin: store [6,7,8] fails while 2 and 3 are loading.
    assert_eq!(t.prepare_load(&ks(&[2, 3]), &ctx).unwrap(), vec![1, 2]);
    assert!(t.prepare_store(&ks(&[6, 7, 8]), &ctx).is_none());
    t.complete_load(&ks(&[2, 3]), &ctx).unwrap();

    // 5. the load did not refresh 2 and 3: they go first, in rank order.
    let out = t.prepare_store(&ks(&[6, 7, 8]), &ctx).unwrap();
    assert_eq!(nums(&out.evicted), vec![2, 3, 4]);
    assert_eq!(out.chunk_ids, vec![3, 2, 1]);
    t.complete_store(&ks(&[6, 7, 8]), &ctx, true);

    // 6. touch [5,6,7]: 8 becomes the oldest.
    t.touch(&ks(&[5, 6, 7]), &ctx);
    let out = t.prepare_store(&ks(&[9]), &ctx).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![8], vec![1]));

    // 7. failed completion of [7,9]: 7 is ready (ignored), 9 is dropped.
    t.complete_store(&ks(&[7, 9]), &ctx, false);
    assert_eq!(t.lookup(&k(7), &ctx), LookupResult::Hit);
    assert_eq!(t.lookup(&k(9), &ctx), LookupResult::Miss);

    // 8. the events, removals queued at prepare time, the failure as metadata-only.
    assert_eq!(
        event_summary(&t.take_events()),
        vec![
            (false, false, vec![3, 4, 5]),
            (true, false, vec![2, 3, 4]),
            (false, false, vec![6, 7, 8]),
            (true, false, vec![8]),
            (true, true, vec![9]),
        ]
    );
    assert_eq!(lru_order(&t), vec![7, 6, 5]);
    t.check_invariants().unwrap();
}

#[test]
fn touch_takes_keys_in_reverse_so_the_first_ends_most_recent() {
    let mut t = tier(4, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2, 3, 4]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2, 3, 4]), &ctx, true);
    t.touch(&ks(&[1, 2]), &ctx);
    assert_eq!(lru_order(&t), vec![3, 4, 2, 1]);
    let out = t.prepare_store(&ks(&[5, 6, 7, 8]), &ctx).unwrap();
    assert_eq!(nums(&out.evicted), vec![3, 4, 2, 1]);
    // Freed in eviction order, reused last-in-first-out.
    assert_eq!(out.chunk_ids, vec![0, 1, 3, 2]);
}

#[test]
fn touching_absent_keys_is_ignored_and_touching_pinned_keys_counts_at_unpin() {
    let mut t = tier(3, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2, 3]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2, 3]), &ctx, true);
    t.prepare_load(&ks(&[1]), &ctx).unwrap();
    t.touch(&ks(&[42, 1]), &ctx);
    t.complete_load(&ks(&[1]), &ctx).unwrap();
    assert_eq!(lru_order(&t), vec![2, 3, 1]);
}

#[test]
fn a_completed_load_does_not_change_eviction_order() {
    let mut t = tier(2, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1]), &ctx).unwrap();
    t.prepare_store(&ks(&[2]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    t.prepare_load(&ks(&[1]), &ctx).unwrap();
    t.complete_load(&ks(&[1]), &ctx).unwrap();
    let out = t.prepare_store(&ks(&[3]), &ReqContext::local("b")).unwrap();
    assert_eq!(nums(&out.evicted), vec![1]);
}

#[test]
fn store_completion_order_does_not_change_rank() {
    let mut t = tier(2, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1]), &ctx).unwrap();
    t.prepare_store(&ks(&[2]), &ctx).unwrap();
    t.complete_store(&ks(&[2]), &ctx, true);
    t.complete_store(&ks(&[1]), &ctx, true);
    let out = t.prepare_store(&ks(&[3]), &ReqContext::local("b")).unwrap();
    assert_eq!(nums(&out.evicted), vec![1]);
}

#[test]
fn positions_rank_a_request_tail_first_and_finish_moves_its_head_to_most_recent() {
    let mut t = tier(5, Lru);
    let a = ReqContext::local("a");
    for (n, pos) in [(1, 16), (2, 32), (3, 48)] {
        a.set_key_position(k(n), pos);
    }
    t.prepare_store(&ks(&[1, 2, 3]), &a).unwrap();
    t.complete_store(&ks(&[1, 2, 3]), &a, true);
    let b = ReqContext::local("b");
    t.prepare_store(&ks(&[4]), &b).unwrap();
    t.complete_store(&ks(&[4]), &b, true);
    // During the request its keys share the request's rank, tail before head; 4 came later.
    assert_eq!(lru_order(&t), vec![3, 2, 1, 4]);
    t.on_request_finished(&a);
    assert_eq!(lru_order(&t), vec![4, 3, 2, 1]);
    let out = t.prepare_store(&ks(&[6, 7, 8]), &ReqContext::local("c")).unwrap();
    assert_eq!(nums(&out.evicted), vec![4, 3]);
    assert_eq!(out.chunk_ids, vec![4, 2, 3]);
}

#[test]
fn a_finished_request_storing_a_seen_key_again_ranks_it_with_its_old_rank() {
    // Recorded from vLLM 0.33.0: tests/data/vllm033/lru_finished_rank.txt, case 1.
    let mut t = tier(4, Lru);
    let a = ReqContext::local("a");
    a.set_key_position(k(1), 10);
    a.set_key_position(k(2), 20);
    t.prepare_store(&ks(&[1, 2]), &a).unwrap();
    t.complete_store(&ks(&[1]), &a, true);
    t.complete_store(&ks(&[2]), &a, false);
    let b = ReqContext::local("b");
    t.prepare_store(&ks(&[3]), &b).unwrap();
    t.complete_store(&ks(&[3]), &b, true);
    t.on_request_finished(&a);
    t.prepare_store(&ks(&[4]), &b).unwrap();
    t.complete_store(&ks(&[4]), &b, true);
    assert_eq!(lru_order(&t), vec![3, 1, 4]);
    // Key 2 was observed by `a` before it finished: it takes a's rank, older than 3.
    t.prepare_store(&ks(&[2]), &a).unwrap();
    assert_eq!(lru_order(&t), vec![2, 3, 1, 4]);
    t.complete_store(&ks(&[2]), &a, true);
    let out = t.prepare_store(&ks(&[5, 6]), &b).unwrap();
    assert_eq!(nums(&out.evicted), vec![2, 3]);
    assert_eq!(out.chunk_ids, vec![2, 1]);
}

#[test]
fn a_positioned_load_moves_the_key_up_to_the_request_rank_at_once() {
    let mut t = tier(4, Lru);
    let a = ReqContext::local("a");
    a.set_key_position(k(1), 16);
    a.set_key_position(k(2), 32);
    t.prepare_store(&ks(&[1, 2]), &a).unwrap();
    t.complete_store(&ks(&[1, 2]), &a, true);
    t.on_request_finished(&a);
    let b = ReqContext::local("b");
    t.prepare_store(&ks(&[3, 4]), &b).unwrap();
    t.complete_store(&ks(&[3, 4]), &b, true);
    let c = ReqContext::local("c");
    c.set_key_position(k(2), 32);
    t.prepare_load(&ks(&[2]), &c).unwrap();
    assert_eq!(lru_order(&t), vec![1, 3, 4, 2]);
    t.complete_load(&ks(&[2]), &c).unwrap();
    t.on_request_finished(&c);
    assert_eq!(lru_order(&t), vec![1, 3, 4, 2]);
}

#[test]
fn finish_without_positions_uses_first_observed_order_grouped_by_kv_group() {
    let mut t = tier(6, Lru);
    let a = ReqContext::local("a");
    let keys = [common::kg(1, 1), k(2), common::kg(3, 1), k(4)];
    t.prepare_store(&keys, &a).unwrap();
    t.complete_store(&keys, &a, true);
    t.touch(&keys, &ReqContext::local("x"));
    t.on_request_finished(&a);
    // Group 0 (2, 4) then group 1 (1, 3): the head of group 0 ends most recent.
    let order: Vec<String> = t.policy_snapshot().list("lru").iter().map(common::name).collect();
    assert_eq!(order, vec!["3g1", "1g1", "4", "2"]);
}

#[test]
fn already_stored_keys_of_an_offer_are_never_its_victims() {
    for policy in [Lru, PolicyKind::Arc, PolicyKind::S3Fifo] {
        let mut t = tier(4, policy);
        let ctx = ReqContext::local("a");
        t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
        t.complete_store(&ks(&[1, 2]), &ctx, true);
        t.touch(&ks(&[1]), &ctx);
        let out = t.prepare_store(&ks(&[2, 3, 4, 5]), &ctx).unwrap();
        assert_eq!(nums(&out.keys_to_store), vec![3, 4, 5], "{policy}");
        if policy != PolicyKind::S3Fifo {
            assert_eq!(out.chunk_ids, vec![2, 3, 0], "{policy}");
            assert_eq!(nums(&out.evicted), vec![1], "{policy}");
        }
        t.complete_store(&ks(&[3, 4, 5]), &ctx, true);
        assert_eq!(t.lookup(&k(2), &ctx), LookupResult::Hit, "{policy}");
    }
}

#[test]
fn protected_evictable_keys_can_make_a_store_fail_without_change() {
    let mut t = tier(2, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    t.prepare_load(&ks(&[2]), &ctx).unwrap();
    // One row is needed and 1 is the only evictable one, but it is part of the offer.
    assert!(t.prepare_store(&ks(&[1, 3]), &ctx).is_none());
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::Hit);
    assert!(t.take_events().iter().all(|e| !e.removed));
    t.check_invariants().unwrap();
}

#[test]
fn prepare_load_returns_rows_in_key_order_for_every_permutation() {
    let mut t = tier(4, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2, 3]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2, 3]), &ctx, true);
    for perm in [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]] {
        let ids = t.prepare_load(&ks(&perm), &ctx).unwrap();
        let expected: Vec<u32> = perm.iter().map(|&n| (n - 1) as u32).collect();
        assert_eq!(ids, expected);
        t.complete_load(&ks(&perm), &ctx).unwrap();
    }
    assert_eq!(t.total_pins(), 0);
}

#[test]
fn every_removal_event_precedes_the_store_events_of_the_same_drain() {
    let mut t = tier(2, Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    t.take_events();
    t.prepare_store(&ks(&[3, 4]), &ctx).unwrap();
    t.complete_store(&ks(&[3, 4]), &ctx, true);
    assert_eq!(
        event_summary(&t.take_events()),
        vec![(true, false, vec![1, 2]), (false, false, vec![3, 4])]
    );
}

#[test]
fn request_groups_are_released_once_their_contexts_are_dropped() {
    let mut t = tier(64, Lru);
    let ctx = ReqContext::local("fill");
    t.prepare_store(&ks(&[1, 2, 3]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2, 3]), &ctx, true);
    for i in 0..10_000 {
        let req = ReqContext::local(format!("r{i}"));
        t.prepare_load(&ks(&[1 + i % 3]), &req).unwrap();
        t.complete_load(&ks(&[1 + i % 3]), &req).unwrap();
    }
    let groups = t.stats().extra["lru_request_groups"];
    assert!(groups <= 4.0, "{groups} request groups left behind");
    // Finished requests release theirs at once.
    let live: Vec<ReqContext> = (0..50).map(|i| ReqContext::local(format!("live{i}"))).collect();
    for req in &live {
        t.prepare_load(&ks(&[1]), req).unwrap();
        t.complete_load(&ks(&[1]), req).unwrap();
    }
    assert!(t.stats().extra["lru_request_groups"] >= 50.0);
    for req in &live {
        t.on_request_finished(req);
    }
    // A finished request keeps its rank while its context lives (it may store a key it saw
    // before, which then ranks with the request); dropping the contexts releases the groups as
    // later requests come and go.
    assert!(t.stats().extra["lru_request_groups"] >= 50.0);
    drop(live);
    for i in 0..100 {
        let req = ReqContext::local(format!("later{i}"));
        t.prepare_load(&ks(&[1]), &req).unwrap();
        t.complete_load(&ks(&[1]), &req).unwrap();
        t.on_request_finished(&req);
    }
    let groups = t.stats().extra["lru_request_groups"];
    assert!(groups <= 4.0, "{groups} request groups left behind");
}
