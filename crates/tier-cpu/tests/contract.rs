//! The tier contract around the policies: the two documented deviations from vLLM 0.33.0,
//! contract violations, cascade reads, events, stats, reset, and construction errors.

mod common;

use common::{event_summary, k, ks, nums, tier};
use tier_cpu::{Capacity, CpuTier, CpuTierError, CpuTierOptions, PolicyKind};
use tiering_core::{LookupResult, PrimaryTier, ReqContext, TierError};

fn stored(t: &mut CpuTier, keys: &[u64], ctx: &ReqContext) {
    t.prepare_store(&ks(keys), ctx).unwrap();
    t.complete_store(&ks(keys), ctx, true);
}

#[test]
fn a_key_repeated_in_one_offer_is_stored_once() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    let out = t.prepare_store(&ks(&[7, 7, 8, 7]), &ctx).unwrap();
    assert_eq!(
        (nums(&out.keys_to_store), out.chunk_ids),
        (vec![7, 8], vec![0, 1])
    );
    t.complete_store(&ks(&[7, 8]), &ctx, true);
    assert_eq!(t.resident(), 2);
    t.check_invariants().unwrap();
    // Large offers take the hashed path for the same check.
    let mut big: Vec<u64> = (100..140).collect();
    big.extend(100..140);
    let mut t = tier(64, PolicyKind::Arc);
    let out = t.prepare_store(&ks(&big), &ctx).unwrap();
    assert_eq!(nums(&out.keys_to_store), (100..140).collect::<Vec<_>>());
    t.check_invariants().unwrap();
}

#[test]
fn loading_an_absent_or_unready_key_fails_and_pins_nothing() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1], &ctx);
    t.prepare_store(&ks(&[2]), &ctx).unwrap();
    assert!(matches!(t.prepare_load(&ks(&[1, 9]), &ctx), Err(TierError::NotFound(key)) if key == k(9)));
    assert!(matches!(t.prepare_load(&ks(&[1, 2]), &ctx), Err(TierError::NotReady(key)) if key == k(2)));
    assert!(matches!(
        t.prepare_read(&ks(&[1, 2]), &ctx),
        Err(TierError::NotReady(_))
    ));
    assert_eq!(
        t.ref_count(&k(1)),
        Some(0),
        "key 1 was not pinned by the failed batches"
    );
    assert_eq!(t.num_evictable(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn completing_more_loads_than_were_prepared_fails_and_releases_nothing() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    assert!(matches!(
        t.complete_load(&ks(&[1]), &ctx),
        Err(TierError::NotPinned(_))
    ));
    assert!(matches!(
        t.complete_load(&ks(&[5]), &ctx),
        Err(TierError::NotFound(_))
    ));
    t.prepare_load(&ks(&[1, 1, 2]), &ctx).unwrap();
    assert_eq!(t.ref_count(&k(1)), Some(2), "a key loaded twice is pinned twice");
    // Three releases of 1 against two pins: refused as a whole.
    assert!(
        matches!(t.complete_load(&ks(&[2, 1, 1, 1]), &ctx), Err(TierError::NotPinned(key)) if key == k(1))
    );
    assert_eq!((t.ref_count(&k(1)), t.ref_count(&k(2))), (Some(2), Some(1)));
    t.complete_load(&ks(&[1, 2, 1]), &ctx).unwrap();
    assert_eq!(t.total_pins(), 0);
    assert_eq!(t.num_evictable(), 2);
    // The hashed duplicate count of large batches agrees.
    let many: Vec<u64> = std::iter::repeat_n(1, 40).collect();
    t.prepare_load(&ks(&many[..39]), &ctx).unwrap();
    assert!(t.complete_load(&ks(&many), &ctx).is_err());
    t.complete_load(&ks(&many[..39]), &ctx).unwrap();
    t.check_invariants().unwrap();
}

#[test]
fn cascade_reads_pin_without_counting_as_a_request_access() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut t = tier(4, policy);
        let a = ReqContext::local("a");
        stored(&mut t, &[1, 2], &a);
        t.on_request_finished(&a);
        let before = t.policy_snapshot();
        let b = ReqContext::local("b");
        // Key 2 is the least recent (a's head, 1, ended most recent).
        assert_eq!(t.prepare_read(&ks(&[2]), &b).unwrap(), vec![1]);
        assert_eq!(t.ref_count(&k(2)), Some(1));
        t.complete_read(&ks(&[2]), &b).unwrap();
        t.on_request_finished(&b);
        assert_eq!(
            t.policy_snapshot(),
            before,
            "{policy}: a read must not move key 2"
        );
        // A load is an access.
        let c = ReqContext::local("c");
        t.prepare_load(&ks(&[2]), &c).unwrap();
        t.complete_load(&ks(&[2]), &c).unwrap();
        t.on_request_finished(&c);
        assert_ne!(t.policy_snapshot(), before, "{policy}: a load moves key 2");
    }
}

#[test]
fn complete_store_ignores_absent_and_ready_keys() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1], &ctx);
    t.take_events();
    t.complete_store(&ks(&[1, 9]), &ctx, true);
    t.complete_store(&ks(&[1, 9]), &ctx, false);
    assert_eq!(t.lookup(&k(1), &ctx), LookupResult::Hit);
    assert!(t.take_events().is_empty());
    t.check_invariants().unwrap();
}

#[test]
fn a_failed_store_event_omits_keys_stored_again_before_the_drain() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    t.complete_store(&ks(&[1, 2]), &ctx, false);
    let retry = ReqContext::local("retry");
    stored(&mut t, &[1], &retry);
    assert_eq!(
        event_summary(&t.take_events()),
        vec![(true, true, vec![2]), (false, false, vec![1])]
    );
    // All keys stored again: the cleanup event disappears.
    t.prepare_store(&ks(&[3]), &ctx).unwrap();
    t.complete_store(&ks(&[3]), &ctx, false);
    stored(&mut t, &[3], &retry);
    assert_eq!(event_summary(&t.take_events()), vec![(false, false, vec![3])]);
}

#[test]
fn events_can_be_disabled() {
    let opts = CpuTierOptions {
        events: false,
        ..CpuTierOptions::new(Capacity::Chunks(2))
    };
    let mut t = CpuTier::from_options(&opts, 64).unwrap();
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    stored(&mut t, &[3], &ctx);
    t.prepare_store(&ks(&[4]), &ctx).unwrap();
    t.complete_store(&ks(&[4]), &ctx, false);
    assert!(t.take_events().is_empty());
    assert_eq!(t.stats().evictions, 2);
}

#[test]
fn reset_forgets_everything_restarts_rows_and_drops_stale_request_records() {
    let mut t = tier(3, PolicyKind::Lru);
    let a = ReqContext::local("a");
    stored(&mut t, &[1, 2], &a);
    t.prepare_store(&ks(&[3]), &a).unwrap();
    t.prepare_load(&ks(&[1]), &a).unwrap();
    t.take_events();
    t.reset();
    assert_eq!((t.resident(), t.num_evictable(), t.total_pins()), (0, 0, 0));
    assert!(t.take_events().is_empty(), "reset emits no events");
    assert_eq!(t.lookup(&k(1), &a), LookupResult::Miss);
    let b = ReqContext::local("b");
    let out = t.prepare_store(&ks(&[4, 5, 6]), &b).unwrap();
    assert_eq!(out.chunk_ids, vec![0, 1, 2], "fresh rows again, ascending");
    t.complete_store(&ks(&[4, 5, 6]), &b, true);
    // `a`'s record predates the reset: finishing it re-ranks nothing.
    let before = t.policy_snapshot();
    t.on_request_finished(&a);
    assert_eq!(t.policy_snapshot(), before);
    t.check_invariants().unwrap();
}

#[test]
fn stats_count_lookups_transfers_evictions_and_pinned_usage() {
    let mut t = tier(4, PolicyKind::Lru);
    let ctx = ReqContext::local("a");
    let usage = |t: &CpuTier| {
        let s = t.stats();
        (
            s.extra["usage_perc"],
            s.extra["write_usage_perc"],
            s.extra["read_usage_perc"],
        )
    };
    assert_eq!(usage(&t), (0.0, 0.0, 0.0));
    t.prepare_store(&ks(&[1, 2]), &ctx).unwrap();
    assert_eq!(usage(&t), (0.5, 0.5, 0.0));
    t.complete_store(&ks(&[1, 2]), &ctx, true);
    assert_eq!(usage(&t), (0.0, 0.0, 0.0), "a full idle cache reads 0");
    t.prepare_load(&ks(&[1]), &ctx).unwrap();
    assert_eq!(usage(&t), (0.25, 0.0, 0.25));
    t.prepare_store(&ks(&[3, 4]), &ctx).unwrap();
    assert_eq!(usage(&t), (0.75, 0.5, 0.25));
    t.complete_store(&ks(&[3, 4]), &ctx, false);
    assert_eq!(usage(&t), (0.25, 0.0, 0.25));
    t.complete_load(&ks(&[1]), &ctx).unwrap();
    t.lookup(&k(1), &ctx);
    t.lookup(&k(3), &ctx);
    stored(&mut t, &[5, 6, 7], &ctx);
    let s = t.stats();
    assert_eq!(
        (s.hits, s.misses, s.stores, s.loads, s.evictions, s.failures),
        (1, 1, 5, 1, 1, 2)
    );
    assert_eq!((s.resident_chunks, s.capacity_chunks), (4, 4));
    assert_eq!((s.bytes_written, s.bytes_read), (5 * 64, 64));
    assert_eq!(s.name, "cpu");
}

#[test]
fn construction_rejects_zero_capacity_oversized_tiers_and_unknown_policies() {
    let zero = CpuTier::from_options(&CpuTierOptions::new(Capacity::Chunks(0)), 64).unwrap_err();
    assert!(matches!(zero, CpuTierError::ZeroCapacity { .. }), "{zero}");
    assert!(zero.to_string().contains("zero capacity"));
    // Less than one 4 KiB row.
    let tiny = CpuTier::from_options(&CpuTierOptions::new(Capacity::Bytes(1000)), 64).unwrap_err();
    assert!(matches!(tiny, CpuTierError::ZeroCapacity { .. }), "{tiny}");
    let huge = CpuTier::from_options(&CpuTierOptions::new(Capacity::Bytes(1 << 60)), 64).unwrap_err();
    assert!(matches!(huge, CpuTierError::TooLarge { .. }), "{huge}");
    assert!(huge.to_string().contains("exceeds"), "{huge}");
    assert!(matches!(
        CpuTier::new(4, 0, PolicyKind::Lru),
        Err(CpuTierError::ZeroChunkBytes)
    ));
    let err = "belady".parse::<PolicyKind>().unwrap_err();
    assert!(err.to_string().contains("supported: lru, arc, s3fifo"));
    // Through the typed options table, as a tier registry would build it.
    let opts: Result<CpuTierOptions, _> = toml::from_str("capacity = \"1MiB\"\neviction = \"belady\"");
    assert!(opts.unwrap_err().to_string().contains("unknown eviction policy"));
    let opts: CpuTierOptions = toml::from_str("capacity = \"1MiB\"\neviction = \"s3fifo\"").unwrap();
    let t = CpuTier::from_options(&opts, 4096).unwrap();
    assert_eq!((t.capacity(), t.policy_kind()), (256, PolicyKind::S3Fifo));
    let err: TierError = zero.into();
    assert!(matches!(err, TierError::Config(_)));
}

#[test]
fn a_shared_memory_arena_is_backed_by_the_named_file_and_prefaulted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("arena");
    let opts = CpuTierOptions {
        shared_memory: Some(path.clone()),
        prefault: true,
        ..CpuTierOptions::new(Capacity::Chunks(4))
    };
    let mut t = CpuTier::from_options(&opts, 100).unwrap();
    // The header page (geometry, row locks) comes first, then the rows.
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        t.arena().mapped_bytes() as u64
    );
    assert_eq!(
        t.arena().mapped_bytes(),
        t.arena().header_bytes() + 4 * t.arena().row_stride()
    );
    let ctx = ReqContext::local("a");
    let out = t.prepare_store(&ks(&[1]), &ctx).unwrap();
    t.arena()
        .write_row(out.chunk_ids[0])
        .unwrap()
        .copy_from_slice(&[7u8; 100]);
    t.complete_store(&ks(&[1]), &ctx, true);
    let bytes = std::fs::read(&path).unwrap();
    let row = t.arena().header_bytes() + out.chunk_ids[0] as usize * t.arena().row_stride();
    assert_eq!(
        &bytes[row..row + 100],
        &[7u8; 100],
        "another process mapping the file sees the row"
    );
    assert_eq!(t.arena().shared_path(), Some(path.as_path()));
}

#[test]
fn huge_pages_fall_back_to_normal_pages_when_unavailable() {
    let opts = CpuTierOptions {
        huge_pages: true,
        ..CpuTierOptions::new(Capacity::Chunks(8))
    };
    let mut t = CpuTier::from_options(&opts, 4096).unwrap();
    let ctx = ReqContext::local("a");
    stored(&mut t, &[1, 2], &ctx);
    assert_eq!(t.resident(), 2);
}

#[test]
fn completions_through_stale_or_missing_row_hints_act_as_probes_would() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        // One row, so every store reuses row 0.
        let mut t = tier(1, policy);
        let (a, b, c) = (
            ReqContext::local("a"),
            ReqContext::local("b"),
            ReqContext::local("c"),
        );
        // a reserves row 0 for key 1, its write fails, and b's key 2 takes row 0 over: a's hint
        // for key 1 now names a row holding another key.
        assert_eq!(t.prepare_store(&ks(&[1]), &a).unwrap().chunk_ids, vec![0]);
        t.complete_store(&ks(&[1]), &a, false);
        assert_eq!(t.prepare_store(&ks(&[2]), &b).unwrap().chunk_ids, vec![0]);
        t.complete_store(&ks(&[1]), &a, true);
        assert_eq!(
            t.lookup(&k(2), &a),
            LookupResult::HitPending,
            "{policy}: key 2 still in flight"
        );
        assert_eq!(t.lookup(&k(1), &a), LookupResult::Miss);
        // A context that never stored key 2 completes it (no hint: probed).
        t.complete_store(&ks(&[2]), &c, true);
        assert_eq!(t.ref_count(&k(2)), Some(0));
        t.take_events();
        // Loads: b pins through its own record, c (which never loaded) completes one of the
        // pins, b the other; a third completion fails and changes nothing.
        assert_eq!(t.prepare_load(&ks(&[2]), &b).unwrap(), vec![0]);
        assert_eq!(t.prepare_load(&ks(&[2]), &b).unwrap(), vec![0]);
        assert_eq!(t.ref_count(&k(2)), Some(2));
        t.complete_load(&ks(&[2]), &c).unwrap();
        t.complete_load(&ks(&[2]), &b).unwrap();
        assert!(
            matches!(t.complete_load(&ks(&[2]), &b), Err(TierError::NotPinned(key)) if key == k(2)),
            "{policy}"
        );
        assert_eq!((t.ref_count(&k(2)), t.num_evictable()), (Some(0), 1));
        // Key 2 is evicted and key 3 takes its row: b's hint for key 2 is stale.
        stored(&mut t, &[3], &c);
        assert_eq!(t.ref_count(&k(2)), None);
        assert!(
            matches!(t.complete_load(&ks(&[2]), &b), Err(TierError::NotFound(key)) if key == k(2)),
            "{policy}"
        );
        t.check_invariants().unwrap();
    }
}
