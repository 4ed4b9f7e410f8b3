//! Behaviour of the disk tier on a real filesystem: round trips, restart, corruption, torn
//! writes, capacity, format checks and job bookkeeping.

mod common;

use common::{Rig, capacity_for, content, flip, key, keys, options, poke};
use tier_disk::{DiskError, DiskGeometry, DiskTier, DiskTierOptions, SLAB_FILE, SyncPolicy};
use tiering_core::{JobOutcome, OffloadingEvent, SecondaryTier};

const CHUNK: usize = 16 * 1024;

fn geometry(chunk_bytes: usize) -> DiskGeometry {
    DiskGeometry {
        chunk_bytes,
        row_stride: chunk_bytes.next_multiple_of(4096),
    }
}

fn removed_keys(events: &[OffloadingEvent]) -> Vec<tiering_core::OffloadKey> {
    events
        .iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys.clone())
        .collect()
}

fn stored_keys(events: &[OffloadingEvent]) -> Vec<tiering_core::OffloadKey> {
    events
        .iter()
        .filter(|e| !e.removed)
        .flat_map(|e| e.keys.clone())
        .collect()
}

#[test]
fn store_then_load_returns_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 16, CHUNK), CHUNK, 8);
    let ks = keys(0..8);
    assert!(!rig.hit(&ks[0]));
    let r = rig.store(&ks);
    assert_eq!(r.outcome, JobOutcome::Ok);
    assert_eq!(r.bytes, (8 * CHUNK) as u64);
    for k in &ks {
        assert!(rig.hit(k), "{k} should be a hit after its store");
    }
    rig.assert_loads(&ks);
    let events = rig.tier.take_events();
    assert_eq!(stored_keys(&events), ks);
    assert!(
        events
            .iter()
            .all(|e| e.medium == Some(tiering_core::Medium::Storage)
                && e.locality == Some(tiering_core::Locality::Local)
                && e.ownership.as_deref() == Some("disk"))
    );
    let s = rig.tier.stats();
    assert_eq!(
        (s.stores, s.loads, s.resident_chunks, s.capacity_chunks),
        (8, 8, 8, 16)
    );
    assert_eq!(s.bytes_written, (8 * CHUNK) as u64);
    assert_eq!(s.failures, 0);
    assert!(!rig.tier.has_pending_work());
    assert_eq!(rig.arena.granted_rows(), 0, "every row grant was released");
}

#[test]
fn loads_are_partial_when_some_keys_are_absent() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 8, CHUNK), CHUNK, 4);
    rig.store(&[key(1), key(3)]);
    let (r, rows) = rig.load(&[key(1), key(2), key(3)]);
    assert_eq!(r.outcome, JobOutcome::Partial(vec![key(1), key(3)]));
    assert_eq!(rows[0], content(&key(1), CHUNK));
    assert_eq!(rows[2], content(&key(3), CHUNK));
    assert_eq!(r.bytes, 2 * CHUNK as u64);
}

#[test]
fn storing_present_keys_and_repeats_succeeds_without_rewriting() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 8, CHUNK), CHUNK, 4);
    rig.store(&[key(1)]);
    let before = rig.tier.stats().bytes_written;
    let r = rig.store(&[key(1), key(2), key(2)]);
    assert_eq!(r.outcome, JobOutcome::Ok);
    let s = rig.tier.stats();
    assert_eq!(
        s.bytes_written - before,
        CHUNK as u64,
        "only key 2 was written, once"
    );
    assert_eq!(s.resident_chunks, 2);
    assert_eq!(s.extra["deduplicated_keys"], 1.0);
}

#[test]
fn an_empty_job_succeeds_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 4, CHUNK), CHUNK, 1);
    assert_eq!(rig.store(&[]).outcome, JobOutcome::Ok);
    assert_eq!(rig.load(&[]).0.outcome, JobOutcome::Ok);
}

#[test]
fn every_sync_policy_round_trips() {
    for sync in [SyncPolicy::Never, SyncPolicy::Batch, SyncPolicy::Always] {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = options(dir.path(), 8, CHUNK);
        opts.sync = sync;
        let mut rig = Rig::open(&opts, CHUNK, 4);
        assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok, "{sync:?}");
        rig.assert_loads(&keys(0..4));
        drop(rig);
        let mut rig = Rig::open(&opts, CHUNK, 4);
        assert_eq!(rig.tier.recovery().recovered, 4, "{sync:?}");
        rig.assert_loads(&keys(0..4));
    }
}

#[test]
fn restart_recovers_every_chunk_with_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 64, CHUNK);
    let n = 40;
    {
        let mut rig = Rig::open(&opts, CHUNK, 8);
        for batch in keys(0..n).chunks(8) {
            assert_eq!(rig.store(batch).outcome, JobOutcome::Ok);
        }
    }
    let mut rig = Rig::open(&opts, CHUNK, 8);
    let rec = rig.tier.recovery();
    assert_eq!((rec.recovered, rec.discarded, rec.duplicates), (n as usize, 0, 0));
    for k in keys(0..n) {
        assert!(rig.hit(&k), "{k} lost across the restart");
    }
    for batch in keys(0..n).chunks(8) {
        rig.assert_loads(batch);
    }
    assert_eq!(
        stored_keys(&rig.tier.take_events()).len(),
        n as usize,
        "recovered chunks are announced"
    );
    // New stores continue after the recovered ones without overwriting them.
    assert_eq!(rig.store(&keys(100..108)).outcome, JobOutcome::Ok);
    for batch in keys(0..n).chunks(8) {
        rig.assert_loads(batch);
    }
}

#[test]
fn recency_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 4, CHUNK);
    {
        let mut rig = Rig::open(&opts, CHUNK, 4);
        for n in 0..4 {
            rig.store(&[key(n)]);
        }
    }
    let mut rig = Rig::open(&opts, CHUNK, 4);
    assert_eq!(
        rig.tier.resident_keys(),
        keys(0..4),
        "least recent first, in write order"
    );
    rig.store(&[key(9)]);
    assert!(
        !rig.hit(&key(0)),
        "the oldest write is evicted first after a restart"
    );
}

#[test]
fn a_flipped_payload_byte_fails_that_key_only_and_it_becomes_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 8, CHUNK);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    rig.store(&keys(0..3));
    rig.tier.take_events();
    let loc = rig.tier.slot_location(&key(1)).unwrap();
    flip(&loc.file, loc.payload_offset + 777, 0x10);
    let (r, rows) = rig.load(&keys(0..3));
    assert_eq!(r.outcome, JobOutcome::Partial(vec![key(0), key(2)]));
    assert_eq!(rows[0], content(&key(0), CHUNK));
    assert_eq!(rows[2], content(&key(2), CHUNK));
    assert!(!rig.hit(&key(1)), "a corrupt chunk is dropped");
    assert_eq!(removed_keys(&rig.tier.take_events()), vec![key(1)]);
    let s = rig.tier.stats();
    assert_eq!(s.extra["corrupt_slots"], 1.0);
    assert_eq!(s.resident_chunks, 2);
    assert_eq!(rig.load(&[key(1)]).0.outcome, JobOutcome::Failed);
    drop(rig);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    assert!(
        !rig.hit(&key(1)),
        "the bad slot was erased, so it does not come back"
    );
    assert_eq!(rig.tier.recovery().recovered, 2);
    // The freed slot is usable again.
    rig.store(&[key(1)]);
    rig.assert_loads(&keys(0..3));
}

#[test]
fn a_damaged_seal_is_caught_at_load_and_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 8, CHUNK);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    rig.store(&keys(0..4));
    let zero = rig.tier.slot_location(&key(0)).unwrap();
    let one = rig.tier.slot_location(&key(1)).unwrap();
    // While the tier runs, the load path verifies the seal too.
    flip(&zero.file, zero.seal_offset + 30, 0x01);
    flip(&one.file, one.seal_offset + 9, 0x01);
    let (r, _) = rig.load(&keys(0..4));
    assert_eq!(r.outcome, JobOutcome::Partial(vec![key(2), key(3)]));
    assert!(!rig.hit(&key(0)) && !rig.hit(&key(1)));
    let key2 = rig.tier.slot_location(&key(2)).unwrap();
    drop(rig);
    // Offline damage to key 2's seal is caught by the start-up scan.
    flip(&key2.file, key2.seal_offset + 70, 0x40);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    let rec = rig.tier.recovery();
    assert_eq!((rec.recovered, rec.discarded), (1, 1));
    assert!(!rig.hit(&key(2)));
    rig.assert_loads(&[key(3)]);
}

#[test]
fn torn_writes_are_discarded_at_reopen() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 8, CHUNK);
    let mut rig = Rig::open(&opts, CHUNK, 6);
    rig.store(&keys(0..6));
    let loc: Vec<_> = keys(0..6)
        .iter()
        .map(|k| rig.tier.slot_location(k).unwrap())
        .collect();
    drop(rig);
    let file = loc[0].file.clone();
    let read_block = |off: u64| {
        let mut b = vec![0u8; 4096];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    // 0: the first write into a fresh slot stopped before its seal: the slot is empty.
    poke(&file, loc[0].seal_offset, &[0u8; 4096]);
    // 1: a write stopped before its seal, over an older write's seal (another key's).
    let older_seal = read_block(loc[4].seal_offset);
    poke(&file, loc[1].seal_offset, &older_seal);
    // 2: the seal was cut halfway through.
    poke(&file, loc[2].seal_offset + 40, &[0u8; 4096 - 40]);
    // 3: the new payload's first block landed, the seal is still the one of the older write.
    poke(&file, loc[3].payload_offset, &[0xA5u8; 4096]);
    let mut rig = Rig::open(&opts, CHUNK, 6);
    let rec = rig.tier.recovery();
    assert_eq!(rec.recovered, 2, "{rec:?}");
    assert_eq!(
        rec.discarded, 3,
        "a foreign seal, a half seal and a seal of an older payload; a zeroed seal is empty"
    );
    for k in keys(0..4) {
        assert!(!rig.hit(&k), "{k} was torn and must be a miss");
    }
    rig.assert_loads(&keys(4..6));
    // The slots are free again and hold new data correctly.
    assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(0..6));
}

#[test]
fn a_truncated_slab_is_a_short_read_and_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 4, CHUNK), CHUNK, 4);
    rig.store(&keys(0..4));
    let last = keys(0..4)
        .into_iter()
        .max_by_key(|k| rig.tier.slot_location(k).unwrap().slot)
        .unwrap();
    let loc = rig.tier.slot_location(&last).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&loc.file)
        .unwrap()
        .set_len(loc.payload_offset + 100)
        .unwrap();
    let (r, _) = rig.load(&[last]);
    assert_eq!(r.outcome, JobOutcome::Failed);
    assert!(!rig.hit(&last));
    let others: Vec<_> = keys(0..4).into_iter().filter(|k| *k != last).collect();
    rig.assert_loads(&others);
}

#[test]
fn writing_three_times_the_capacity_stays_bounded_and_evicts_least_recent_first() {
    let dir = tempfile::tempdir().unwrap();
    let slots = 8;
    let mut opts = options(dir.path(), slots, CHUNK);
    // One I/O thread: the keys of a job land (and enter the LRU order) in job order.
    opts.io_threads = 1;
    let mut rig = Rig::open(&opts, CHUNK, 4);
    let file_len = || std::fs::metadata(dir.path().join(SLAB_FILE)).unwrap().len();
    let mut evicted = Vec::new();
    for batch in keys(0..3 * slots).chunks(4) {
        assert_eq!(rig.store(batch).outcome, JobOutcome::Ok);
        // Key 0 is read again and again: it must survive every eviction.
        rig.tier.touch(&[key(0)], &tiering_core::ReqContext::local("t"));
        let s = rig.tier.stats();
        assert!(
            s.resident_chunks <= slots,
            "{} resident of {slots}",
            s.resident_chunks
        );
        assert!(file_len() <= opts.capacity.bytes());
        evicted.extend(removed_keys(&rig.tier.take_events()));
    }
    assert_eq!(file_len(), capacity_for(slots, CHUNK));
    let expected: Vec<_> = keys(1..17).into_iter().collect();
    assert_eq!(
        evicted, expected,
        "evicted in write order, never the touched key 0"
    );
    assert_eq!(rig.tier.stats().evictions, 16);
    let mut resident = rig.tier.resident_keys();
    resident.sort();
    let mut want = keys(17..24);
    want.push(key(0));
    want.sort();
    assert_eq!(resident, want);
    rig.assert_loads(&[key(0), key(23)]);
}

#[test]
fn another_chunk_size_is_refused_unless_wiping_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 8, CHUNK);
    {
        let mut rig = Rig::open(&opts, CHUNK, 2);
        rig.store(&keys(0..2));
    }
    let err = DiskTier::open(&opts, geometry(2 * CHUNK)).unwrap_err();
    assert!(matches!(err, DiskError::Mismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("wipe_on_mismatch"),
        "the error says how to proceed: {err}"
    );
    // The refused open changed nothing.
    let rig = Rig::open(&opts, CHUNK, 2);
    assert_eq!(rig.tier.recovery().recovered, 2);
    drop(rig);
    let mut wipe = options(dir.path(), 8, 2 * CHUNK);
    wipe.wipe_on_mismatch = true;
    let mut rig = Rig::open(&wipe, 2 * CHUNK, 2);
    assert!(rig.tier.recovery().wiped);
    assert_eq!(rig.tier.recovery().recovered, 0);
    assert!(!rig.hit(&key(0)));
    rig.store(&keys(5..7));
    rig.assert_loads(&keys(5..7));
}

#[test]
fn a_foreign_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(SLAB_FILE), b"precious data that is not a slab").unwrap();
    let err = DiskTier::open(&options(dir.path(), 4, CHUNK), geometry(CHUNK)).unwrap_err();
    assert!(matches!(err, DiskError::NotASlab { .. }), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join(SLAB_FILE)).unwrap(),
        b"precious data that is not a slab",
        "a refused open leaves the file alone"
    );
}

#[test]
fn a_second_tier_on_the_same_path_is_refused_while_the_first_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), 4, CHUNK);
    let first = DiskTier::open(&opts, geometry(CHUNK)).unwrap();
    let err = DiskTier::open(&opts, geometry(CHUNK)).unwrap_err();
    assert!(matches!(err, DiskError::Locked { .. }), "{err}");
    drop(first);
    assert!(
        DiskTier::open(&opts, geometry(CHUNK)).is_ok(),
        "the lock goes with the tier"
    );
}

#[test]
fn changing_the_capacity_keeps_what_still_fits() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut rig = Rig::open(&options(dir.path(), 8, CHUNK), CHUNK, 8);
        rig.store(&keys(0..8));
    }
    {
        let mut rig = Rig::open(&options(dir.path(), 16, CHUNK), CHUNK, 8);
        assert_eq!(rig.tier.recovery().recovered, 8);
        assert_eq!(rig.tier.stats().capacity_chunks, 16);
        rig.assert_loads(&keys(0..8));
    }
    let mut rig = Rig::open(&options(dir.path(), 4, CHUNK), CHUNK, 8);
    assert_eq!(
        rig.tier.recovery().recovered,
        4,
        "slots past the new end are gone"
    );
    assert_eq!(
        std::fs::metadata(dir.path().join(SLAB_FILE)).unwrap().len(),
        capacity_for(4, CHUNK)
    );
    let left = rig.tier.resident_keys();
    rig.assert_loads(&left);
}

#[test]
fn invalid_options_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut too_small = DiskTierOptions::new(dir.path(), 8192);
    too_small.io_threads = 1;
    let err = DiskTier::open(&too_small, geometry(CHUNK)).unwrap_err();
    assert!(
        matches!(err, DiskError::InvalidOptions(_)) && err.to_string().contains("capacity"),
        "{err}"
    );
    let mut no_threads = options(dir.path(), 4, CHUNK);
    no_threads.io_threads = 0;
    assert!(matches!(
        DiskTier::open(&no_threads, geometry(CHUNK)),
        Err(DiskError::InvalidOptions(_))
    ));
    let bad_geometry = DiskGeometry {
        chunk_bytes: 8192,
        row_stride: 4096,
    };
    assert!(matches!(
        DiskTier::open(&options(dir.path(), 4, CHUNK), bad_geometry),
        Err(DiskError::InvalidOptions(_))
    ));
    let no_path = DiskTierOptions::new("", 1 << 20);
    let err = DiskTier::open(&no_path, geometry(CHUNK)).unwrap_err();
    assert!(
        matches!(err, DiskError::InvalidOptions(_)) && err.to_string().contains("path"),
        "{err}"
    );
    assert!(
        !std::path::Path::new(SLAB_FILE).exists(),
        "nothing in the current directory"
    );
}

#[test]
fn a_large_tier_reserves_disk_space_only_as_it_is_used() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    // 256 MiB of capacity: the file is reserved in 64 MiB steps as slots are first written.
    let opts = DiskTierOptions::new(dir.path(), 256 << 20);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    let file = dir.path().join(SLAB_FILE);
    let on_disk = || std::fs::metadata(&file).unwrap().blocks() * 512;
    assert!(on_disk() <= 64 << 10, "{} bytes after open", on_disk());
    rig.store(&keys(0..4));
    let after = on_disk();
    assert!(
        after > 0 && after <= (64 << 20) + (64 << 10),
        "{after} bytes after 4 chunks"
    );
    assert!(std::fs::metadata(&file).unwrap().len() <= (64 << 20) + (64 << 10));
    rig.assert_loads(&keys(0..4));
    drop(rig);
    let mut rig = Rig::open(&opts, CHUNK, 4);
    assert_eq!(
        rig.tier.recovery().recovered,
        4,
        "slots past the file's end read as empty"
    );
    rig.assert_loads(&keys(0..4));
}

#[test]
fn unaligned_chunks_fall_back_to_buffered_io_or_refuse_required_direct_io() {
    let dir = tempfile::tempdir().unwrap();
    let odd = 10_000;
    let mut rig = Rig::open(&options(dir.path(), 4, odd), odd, 2);
    assert!(!rig.tier.direct_io(), "10000-byte chunks cannot use O_DIRECT");
    rig.store(&keys(0..2));
    rig.assert_loads(&keys(0..2));
    drop(rig);
    let other = tempfile::tempdir().unwrap();
    let mut required = options(other.path(), 4, odd);
    required.direct_io = tier_disk::DirectIo::On;
    let err = DiskTier::open(&required, geometry(odd)).unwrap_err();
    assert!(matches!(err, DiskError::DirectIoUnavailable(_)), "{err}");
}

#[test]
fn jobs_after_shutdown_or_with_the_wrong_grants_fail_but_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 4, CHUNK), CHUNK, 2);
    // A load submitted through submit_store.
    let wrong = rig.load_job(&[key(1)]);
    rig.tier.submit_store(wrong);
    assert_eq!(rig.wait(1)[0].outcome, JobOutcome::Failed);
    rig.tier.shutdown().unwrap();
    let job = rig.store_job(&[key(2)]);
    rig.tier.submit_store(job);
    let r = rig.wait(1);
    assert_eq!(r[0].outcome, JobOutcome::Failed);
    assert_eq!(rig.arena.granted_rows(), 0);
    assert!(rig.tier.shutdown().is_ok(), "shutdown is idempotent");
}

/// An I/O thread reads whole seal blocks into its scratch and writes seals from the same
/// scratch: bytes a load brought in past a seal (which the seal does not cover, so the load
/// verifies) never reach a later store's seal block, whether that store follows the load or
/// another store.
#[test]
fn seal_blocks_written_after_loads_hold_nothing_past_the_seal() {
    use std::os::unix::fs::FileExt;
    use tier_disk::format::SEAL_LEN;

    let dir = tempfile::tempdir().unwrap();
    let mut rig = Rig::open(&options(dir.path(), 12, CHUNK), CHUNK, 12);
    assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok);
    for k in keys(0..4) {
        let loc = rig.tier.slot_location(&k).unwrap();
        poke(&loc.file, loc.seal_offset + SEAL_LEN as u64 + 7, &[0xEE; 2000]);
    }
    // Every I/O thread serves some of these reads (each job is split across the threads).
    for _ in 0..3 {
        rig.assert_loads(&keys(0..4));
    }
    assert_eq!(rig.store(&keys(4..8)).outcome, JobOutcome::Ok);
    assert_eq!(rig.store(&keys(8..12)).outcome, JobOutcome::Ok);
    for k in keys(4..12) {
        let loc = rig.tier.slot_location(&k).unwrap();
        let mut block = vec![0u8; 4096];
        std::fs::File::open(&loc.file)
            .unwrap()
            .read_exact_at(&mut block, loc.seal_offset)
            .unwrap();
        assert!(
            block[SEAL_LEN..].iter().all(|&b| b == 0),
            "{k}: the seal block carries bytes past the seal"
        );
    }
    rig.assert_loads(&keys(0..12));
}
