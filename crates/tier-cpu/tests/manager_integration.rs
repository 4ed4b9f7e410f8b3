//! `CpuTier` as the primary of a `TieringManager`, with a scripted secondary tier: store →
//! cascade → eviction → lookup → promotion → load, bytes intact end to end.

mod common;

use common::{k, ks, nums};
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::testing::ScriptedTier;
use tiering_core::{
    LookupResult, ManagerConfig, OffloadKey, OffloadingManager, PrimaryTier, ReqContext, ScheduleEndContext,
    Step, TieringManager,
};

const CHUNK: usize = 64;

fn bytes_for(key: &OffloadKey) -> Vec<u8> {
    let seed = key.to_bytes()[31];
    (0..CHUNK)
        .map(|i| seed.wrapping_mul(7).wrapping_add(i as u8))
        .collect()
}

/// Ends the step: `on_schedule_end`, then the step is dropped (the lock released).
fn end_step(mut s: Step<'_>) {
    s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

#[test]
fn chunks_cascade_get_evicted_and_come_back_through_promotion_byte_for_byte() {
    for policy in PolicyKind::ALL {
        let tier = CpuTier::new(4, CHUNK, policy).unwrap();
        let arena = tier.arena().clone();
        let (disk, disk_h) = ScriptedTier::new("disk");
        let mut m = TieringManager::new(Box::new(tier), vec![Box::new(disk)], ManagerConfig::step_driven());

        // Step 1: the engine stores four chunks and writes their rows; they cascade.
        let a = ReqContext::local("a");
        let mut s = m.step();
        s.on_new_request(&a).unwrap();
        let first = ks(&[1, 2, 3, 4]);
        let out = s.prepare_store(&first, &a).unwrap().expect("empty tier has room");
        assert_eq!(out.chunk_ids, vec![0, 1, 2, 3], "{policy}");
        for (key, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            arena.write_row(row).unwrap().copy_from_slice(&bytes_for(key));
        }
        s.complete_store(&first, &a, true).unwrap();
        s.on_request_finished(&a).unwrap();
        end_step(s);
        for key in &first {
            assert_eq!(
                disk_h.get(key),
                Some(bytes_for(key)),
                "{policy}: cascade copied the row"
            );
        }
        assert_eq!(arena.granted_rows(), 0, "{policy}: cascade grants released");

        // Step 2: four more chunks evict the first four (their cascade pins are released).
        let b = ReqContext::local("b");
        let mut s = m.step();
        s.on_new_request(&b).unwrap();
        let second = ks(&[5, 6, 7, 8]);
        let out = s
            .prepare_store(&second, &b)
            .unwrap()
            .expect("evictable chunks exist");
        let mut evicted = nums(&out.evicted);
        evicted.sort_unstable();
        assert_eq!(evicted, vec![1, 2, 3, 4], "{policy}");
        for (key, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            arena.write_row(row).unwrap().copy_from_slice(&bytes_for(key));
        }
        s.complete_store(&second, &b, true).unwrap();
        s.on_request_finished(&b).unwrap();
        end_step(s);

        // Step 3: key 1 misses in the primary, hits on disk: a slot is reserved at once.
        let c = ReqContext::local("c");
        let mut s = m.step();
        s.on_new_request(&c).unwrap();
        assert_eq!(s.lookup(&k(1), &c).unwrap(), LookupResult::HitPending, "{policy}");
        assert_eq!(
            s.lookup(&k(1), &c).unwrap(),
            LookupResult::HitPending,
            "{policy}: reservation reused"
        );
        end_step(s);

        // Step 4: the promotion completed; the engine loads key 1 and reads the original bytes.
        let mut s = m.step();
        assert_eq!(s.lookup(&k(1), &c).unwrap(), LookupResult::Hit, "{policy}");
        let rows = s.prepare_load(&[k(1)], &c).unwrap();
        assert_eq!(
            arena.read_row(rows[0]).unwrap().to_vec(),
            bytes_for(&k(1)),
            "{policy}"
        );
        s.complete_load(&[k(1)], &c).unwrap();
        s.on_request_finished(&c).unwrap();
        end_step(s);

        let stats = m.stats().unwrap();
        assert_eq!(stats.manager.promoted_keys, 1, "{policy}");
        assert_eq!(stats.primary.name, "cpu");
        assert_eq!(
            stats.primary.evictions, 5,
            "{policy}: four for step 2, one for the promotion"
        );
        assert_eq!(stats.primary.resident_chunks, 4);
        let events = m.take_events().unwrap();
        let primary: Vec<_> = events.iter().filter(|e| e.ownership.is_none()).collect();
        assert!(primary.len() >= 4, "{policy}: {primary:?}");
        assert_eq!(arena.granted_rows(), 0, "{policy}");
        m.shutdown().unwrap();
    }
}

#[test]
fn a_full_pinned_primary_turns_a_secondary_hit_into_a_miss() {
    let tier = CpuTier::new(2, CHUNK, PolicyKind::Lru).unwrap();
    let (disk, disk_h) = ScriptedTier::new("disk");
    let mut m = TieringManager::new(Box::new(tier), vec![Box::new(disk)], ManagerConfig::step_driven());
    let a = ReqContext::local("a");
    let mut s = m.step();
    s.on_new_request(&a).unwrap();
    s.prepare_store(&ks(&[1, 2]), &a).unwrap().unwrap();
    s.complete_store(&ks(&[1, 2]), &a, true).unwrap();
    end_step(s);
    let mut s = m.step();
    s.prepare_load(&ks(&[1, 2]), &a).unwrap();
    disk_h.insert(k(3), bytes_for(&k(3)));
    assert_eq!(s.lookup(&k(3), &a).unwrap(), LookupResult::Miss);
    s.complete_load(&ks(&[1, 2]), &a).unwrap();
    assert_eq!(s.lookup(&k(3), &a).unwrap(), LookupResult::HitPending);
    s.on_request_finished(&a).unwrap();
    end_step(s);
    m.shutdown().unwrap();
}
