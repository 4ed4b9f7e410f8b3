//! The ARC scenarios of note 02 §12.1 (`TestARCPolicy`) and note 06, with the exact lists,
//! target, evictions and chunk ids of the released vLLM 0.33.0 manager (each confirmed against
//! it).

mod common;

use common::{event_summary, k, ks, nums, tier};
use tier_cpu::CpuTier;
use tier_cpu::PolicyKind::Arc;
use tiering_core::{LookupResult, PrimaryTier, ReqContext};

/// (T1, T2, B1, B2) as key numbers, LRU end first, and the target.
fn lists(t: &CpuTier) -> (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>, f64) {
    let s = t.policy_snapshot();
    (
        nums(&s.list("t1")),
        nums(&s.list("t2")),
        nums(&s.list("b1")),
        nums(&s.list("b2")),
        s.target.unwrap(),
    )
}

fn stored(t: &mut CpuTier, keys: &[u64], ctx: &ReqContext) {
    t.prepare_store(&ks(keys), ctx).unwrap();
    t.complete_store(&ks(keys), ctx, true);
}

#[test]
fn new_keys_enter_t1_pending_and_a_touch_of_a_ready_key_promotes_it_to_t2() {
    let mut t = tier(4, Arc);
    let ctx = ReqContext::local("a");
    let out = t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    assert_eq!(out.chunk_ids, vec![0, 1]);
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::HitPending);
    assert_eq!(lists(&t), (vec![1, 2], vec![], vec![], vec![], 0.0));
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    t.touch(&ks(&[1]), &ctx);
    assert_eq!(lists(&t), (vec![2], vec![1], vec![], vec![], 0.0));
}

#[test]
fn touching_a_key_still_being_written_keeps_it_in_t1() {
    let mut t = tier(3, Arc);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1]), &ctx).unwrap();
    t.touch(&ks(&[1]), &ctx);
    assert_eq!(lists(&t).0, vec![1]);
    t.complete_store(&ks(&[1]), &ctx, true);
    t.touch(&ks(&[1]), &ctx);
    assert_eq!((lists(&t).0, lists(&t).1), (vec![], vec![1]));
}

#[test]
fn loads_block_eviction_until_they_complete() {
    let mut t = tier(4, Arc);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    t.touch(&ks(&[1]), &ctx);
    stored(&mut t, &[3, 4], &ctx);
    t.prepare_load(&ks(&[1, 2, 3, 4]), &ctx).unwrap();
    assert!(t.prepare_store(&ks(&[5]), &ctx).is_none());
    t.complete_load(&ks(&[1, 2, 3, 4]), &ctx).unwrap();
    let out = t.prepare_store(&ks(&[5]), &ctx).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![2], vec![1]));
    assert_eq!(lists(&t), (vec![3, 4, 5], vec![1], vec![2], vec![], 0.0));
}

#[test]
fn with_t1_at_target_the_victim_is_t1_lru_and_goes_to_b1() {
    let mut t = tier(4, Arc);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2, 3, 4], &ctx);
    t.touch(&ks(&[3, 4]), &ctx);
    assert_eq!(lists(&t), (vec![1, 2], vec![4, 3], vec![], vec![], 0.0));
    let out = t.prepare_store(&ks(&[5]), &ctx).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![1], vec![0]));
    assert_eq!(lists(&t), (vec![2, 5], vec![4, 3], vec![1], vec![], 0.0));
}

#[test]
fn touch_ordering_leaves_the_untouched_key_as_the_victim() {
    let mut t = tier(4, Arc);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2, 3, 4], &ctx);
    t.touch(&ks(&[1, 3, 4]), &ctx);
    assert_eq!(lists(&t), (vec![2], vec![4, 3, 1], vec![], vec![], 0.0));
    let out = t.prepare_store(&ks(&[5]), &ctx).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![2], vec![1]));
    assert_eq!(lists(&t), (vec![5], vec![4, 3, 1], vec![2], vec![], 0.0));
}

#[test]
fn a_failed_store_leaves_the_key_out_of_t1_and_t2_and_its_victim_in_b1() {
    let mut t = tier(2, Arc);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    t.prepare_store(&ks(&[3]), &ctx).unwrap();
    t.complete_store(&ks(&[3]), &ctx, false);
    assert_eq!(t.lookup(&k(3), &ctx), LookupResult::Miss);
    assert_eq!(lists(&t), (vec![2], vec![], vec![1], vec![], 0.0));
    assert_eq!(
        event_summary(&t.take_events()),
        vec![
            (false, false, vec![1, 2]),
            (true, false, vec![1]),
            (true, true, vec![3])
        ]
    );
}

#[test]
fn ghost_adaptation_happens_once_per_key_per_request() {
    let mut t = tier(4, Arc);
    let a = ReqContext::local("a");
    stored(&mut t, &[1, 2, 3, 4], &a);
    stored(&mut t, &[5], &a);
    assert_eq!(lists(&t), (vec![2, 3, 4, 5], vec![], vec![1], vec![], 0.0));
    // 1 is a B1 ghost, but request `a` already offered 1 once: no adaptation.
    let out = t.prepare_store(&ks(&[1]), &a).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![2], vec![1]));
    assert_eq!(lists(&t), (vec![3, 4, 5, 1], vec![], vec![2], vec![], 0.0));
    // A new request storing the ghost 2 raises the target by max(1, |B2|/|B1|) = 1.
    let b = ReqContext::local("b");
    let out = t.prepare_store(&ks(&[2]), &b).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![3], vec![2]));
    assert_eq!(lists(&t), (vec![4, 5, 1, 2], vec![], vec![3], vec![], 1.0));
}

#[test]
fn a_target_above_t1_takes_victims_from_t2_and_b2_hits_lower_it() {
    let mut t = tier(4, Arc);
    let a = ReqContext::local("a");
    stored(&mut t, &[1, 2, 3, 4], &a);
    t.touch(&ks(&[3, 4]), &a);
    stored(&mut t, &[5], &a);
    stored(&mut t, &[1], &ReqContext::local("b"));
    assert_eq!(lists(&t), (vec![5, 1], vec![4, 3], vec![2], vec![], 1.0));
    stored(&mut t, &[2], &ReqContext::local("c"));
    assert_eq!(lists(&t), (vec![1, 2], vec![4, 3], vec![5], vec![], 2.0));
    // Target 3 > |T1| = 2: the victim is T2's LRU, into B2.
    let out = t.prepare_store(&ks(&[5]), &ReqContext::local("d")).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![4], vec![3]));
    assert_eq!(lists(&t), (vec![1, 2, 5], vec![3], vec![], vec![4], 3.0));
    // A B2 ghost comes back: the target drops by max(1, |B1|/|B2|) = 1.
    let out = t.prepare_store(&ks(&[4]), &ReqContext::local("e")).unwrap();
    assert_eq!((nums(&out.evicted), out.chunk_ids), (vec![1], vec![1]));
    assert_eq!(lists(&t), (vec![2, 5, 4], vec![3], vec![1], vec![], 2.0));
}

#[test]
fn request_finish_promotes_reused_keys_and_only_refreshes_inserted_ones() {
    let mut t = tier(4, Arc);
    let a = ReqContext::local("a");
    stored(&mut t, &[1, 2], &a);
    let b = ReqContext::local("b");
    stored(&mut t, &[3], &b);
    t.prepare_load(&ks(&[1]), &b).unwrap();
    t.complete_load(&ks(&[1]), &b).unwrap();
    assert_eq!(lists(&t).0, vec![1, 2, 3], "loads do not move keys");
    t.on_request_finished(&b);
    assert_eq!((lists(&t).0, lists(&t).1), (vec![2, 3], vec![1]));
    t.on_request_finished(&a);
    assert_eq!((lists(&t).0, lists(&t).1), (vec![3, 2], vec![1]));
}

#[test]
fn ghost_lists_stay_within_capacity_after_many_stores() {
    let mut t = tier(4, Arc);
    for n in 0..100u64 {
        let ctx = ReqContext::local(format!("r{n}"));
        stored(&mut t, &[n], &ctx);
        if n % 3 == 0 {
            t.touch(&ks(&[n]), &ctx);
        }
        let (t1, t2, b1, b2, target) = lists(&t);
        assert!(t1.len() + t2.len() <= 4);
        assert!(b1.len() <= 4 && b2.len() <= 4, "ghosts {b1:?} {b2:?}");
        assert!((0.0..=4.0).contains(&target));
    }
    t.check_invariants().unwrap();
}

#[test]
fn t2_keys_stay_resident_through_a_stream_of_one_time_keys() {
    let mut t = tier(4, Arc);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    t.touch(&ks(&[1, 2]), &ctx);
    for n in 10..30 {
        stored(&mut t, &[n], &ctx);
        assert_eq!(t.lookup(&k(1), &ctx), LookupResult::Hit);
        assert_eq!(t.lookup(&k(2), &ctx), LookupResult::Hit);
    }
    assert_eq!(lists(&t).1, vec![2, 1]);
}
