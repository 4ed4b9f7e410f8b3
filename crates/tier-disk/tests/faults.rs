//! Failure paths with injected faults (feature `test-utils`) and with a real, tiny tmpfs: full
//! disk, I/O errors, queued jobs under `drain_jobs` and `shutdown`, slots under read.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{PATIENCE, Rig, capacity_for, content, flip, key, keys, options};
use tier_disk::{DiskGeometry, DiskTier, DiskTierOptions, FaultInjector, SyncPolicy};
use tiering_core::{JobId, JobOutcome, SecondaryTier};

const CHUNK: usize = 16 * 1024;

fn geometry() -> DiskGeometry {
    DiskGeometry {
        chunk_bytes: CHUNK,
        row_stride: CHUNK,
    }
}

fn rig_with_faults(opts: &DiskTierOptions, rows: usize) -> (Rig, FaultInjector) {
    let faults = FaultInjector::new();
    let tier = DiskTier::open_with_faults(opts, geometry(), faults.clone()).unwrap();
    (Rig::new(tier, rows), faults)
}

/// The bytes one slot write takes (payload + seal block).
const SLOT_WRITE: u64 = CHUNK as u64 + 4096;

/// Stores until the "filesystem" is full, then checks that stores fail cleanly, the tier keeps
/// loading what it has, and recovers once space is back.
fn fill_up_and_check(rig: &mut Rig) -> Vec<tiering_core::OffloadKey> {
    let mut stored = Vec::new();
    let mut n = 0;
    loop {
        let batch = keys(n..n + 2);
        n += 2;
        let r = rig.store(&batch);
        match r.outcome {
            JobOutcome::Ok => stored.extend(batch),
            JobOutcome::Partial(ok) => {
                stored.extend(ok);
                break;
            }
            JobOutcome::Failed => break,
        }
        assert!(n < 10_000, "the filesystem never filled up");
    }
    assert!(!stored.is_empty(), "something fit before the disk was full");
    // Later stores keep failing cleanly, and their keys are misses.
    let r = rig.store(&keys(50_000..50_002));
    assert_eq!(r.outcome, JobOutcome::Failed);
    assert!(!rig.hit(&key(50_000)));
    // Everything stored before is still served.
    for batch in stored.chunks(4) {
        rig.assert_loads(batch);
    }
    let s = rig.tier.stats();
    assert!(s.failures >= 2);
    assert!(s.extra["io_errors"] >= 2.0);
    assert_eq!(rig.arena.granted_rows(), 0);
    stored
}

#[test]
fn a_full_disk_fails_stores_cleanly_and_loads_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = rig_with_faults(&options(dir.path(), 32, CHUNK), 4);
    faults.limit_write_bytes(Some(5 * SLOT_WRITE));
    let stored = fill_up_and_check(&mut rig);
    assert_eq!(stored.len(), 5);
    // Space comes back: stores work again.
    faults.limit_write_bytes(None);
    assert_eq!(rig.store(&keys(60_000..60_002)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(60_000..60_002));
}

/// A tmpfs mounted for the test, unmounted on drop.
struct SmallFs {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    /// Mounts a tmpfs of `bytes` bytes; `None` when this environment does not permit it.
    fn mount(bytes: u64) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let mount = dir.path().join("fs");
        std::fs::create_dir(&mount).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&mount)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Self { mount, _dir: dir })
    }

    fn path(&self) -> &Path {
        &self.mount
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

#[test]
fn a_really_full_small_filesystem_fails_stores_cleanly() {
    // A 256 KiB tmpfs under a slab that claims 64 slots (sparse): real ENOSPC from the kernel.
    // Where mounting is not permitted, the fault layer plays the small filesystem instead.
    let fs = SmallFs::mount(256 * 1024);
    let fallback = tempfile::tempdir().unwrap();
    let path = fs.as_ref().map_or(fallback.path(), SmallFs::path);
    let mut opts = options(path, 64, CHUNK);
    opts.preallocate = false;
    let (mut rig, faults) = rig_with_faults(&opts, 4);
    if fs.is_none() {
        eprintln!("cannot mount a tmpfs here; emulating a 256 KiB filesystem with the fault layer");
        faults.limit_write_bytes(Some(256 * 1024));
    }
    let stored = fill_up_and_check(&mut rig);
    eprintln!(
        "{} chunks fit before ENOSPC (real tmpfs: {})",
        stored.len(),
        fs.is_some()
    );
    assert!(
        stored.len() < 64,
        "the small filesystem held fewer chunks than the slab has slots"
    );
    drop(rig);
    // With pre-allocation the same capacity is refused up front with a clear error.
    if let Some(fs) = &fs {
        let other = fs.path().join("prealloc");
        let err = DiskTier::open(&options(&other, 64, CHUNK), geometry()).unwrap_err();
        assert!(matches!(err, tier_disk::DiskError::NoSpace { .. }), "{err}");
        assert!(!other.exists(), "the failed open removed what it created");
    }
}

fn blocks_of(file: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(file).unwrap().blocks() * 512
}

#[test]
fn a_failed_preallocation_leaves_nothing_behind() {
    let Some(fs) = SmallFs::mount(1 << 20) else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (not root, or no mount permission)");
        return;
    };
    // A capacity bigger than the filesystem, in directories the open has to create.
    let nested = fs.path().join("a").join("b");
    let err = DiskTier::open(&options(&nested, 256, CHUNK), geometry()).unwrap_err();
    assert!(matches!(err, tier_disk::DiskError::NoSpace { .. }), "{err}");
    assert!(!fs.path().join("a").exists(), "no file, no directory left");
    // In an existing directory: the directory stays, the slab file goes.
    let err = DiskTier::open(&options(fs.path(), 256, CHUNK), geometry()).unwrap_err();
    assert!(err.to_string().contains(tier_disk::SLAB_FILE), "{err}");
    assert_eq!(std::fs::read_dir(fs.path()).unwrap().count(), 0);
    // An existing slab is never deleted by a failed open, only left as it was.
    let mut rig = Rig::open(&options(fs.path(), 8, CHUNK), CHUNK, 2);
    rig.store(&keys(0..2));
    drop(rig);
    let slab = fs.path().join(tier_disk::SLAB_FILE);
    let before = std::fs::metadata(&slab).unwrap().len();
    let mut wide = options(fs.path(), 256, CHUNK);
    wide.wipe_on_mismatch = false;
    assert!(DiskTier::open(&wide, geometry()).is_err());
    assert_eq!(std::fs::metadata(&slab).unwrap().len(), before);
    let mut rig = Rig::open(&options(fs.path(), 8, CHUNK), CHUNK, 2);
    rig.assert_loads(&keys(0..2));
}

#[test]
fn a_reservation_that_fails_while_running_is_undone() {
    let Some(fs) = SmallFs::mount(2 << 20) else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (not root, or no mount permission)");
        return;
    };
    let opts = options(fs.path(), 64, CHUNK);
    let (mut rig, _faults) = rig_with_faults(&opts, 4);
    let slab = fs.path().join(tier_disk::SLAB_FILE);
    assert!(
        blocks_of(&slab) < opts.capacity.bytes() / 4,
        "nothing is reserved before a slot is used"
    );
    // Someone else fills the filesystem, leaving less than the slab's next step.
    let filler = fs.path().join("filler");
    let free = 2 * 1024 * 1024 - blocks_of(&slab);
    std::fs::write(&filler, vec![1u8; (free - 64 * 1024) as usize]).unwrap();
    let held = blocks_of(&slab);
    let r = rig.store(&keys(0..2));
    assert_eq!(r.outcome, JobOutcome::Failed, "no room to reserve the slots");
    assert_eq!(blocks_of(&slab), held, "the failed reservation was undone");
    assert!(!rig.hit(&key(0)));
    // Space comes back: stores work.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(rig.store(&keys(0..2)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(0..2));
}

#[test]
fn write_errors_fail_the_job_and_the_tier_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = rig_with_faults(&options(dir.path(), 16, CHUNK), 4);
    rig.store(&keys(0..2));
    for errno in [libc::EIO, libc::EACCES, libc::EROFS, libc::ENOSPC] {
        faults.fail_writes(Some(errno));
        let batch = keys(100 + errno as u64 * 10..102 + errno as u64 * 10);
        assert_eq!(rig.store(&batch).outcome, JobOutcome::Failed, "errno {errno}");
        assert!(!rig.hit(&batch[0]), "a failed store leaves nothing behind");
        rig.assert_loads(&keys(0..2));
    }
    faults.fail_writes(None);
    assert_eq!(rig.store(&keys(2..4)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(0..4));
    assert_eq!(
        rig.tier.stats().resident_chunks,
        4,
        "failed writes freed their slots"
    );
}

#[test]
fn a_read_error_fails_that_key_and_drops_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = rig_with_faults(&options(dir.path(), 8, CHUNK), 4);
    rig.store(&keys(0..3));
    rig.tier.take_events();
    faults.fail_reads(Some(libc::EIO));
    let (r, _) = rig.load(&keys(0..2));
    assert_eq!(r.outcome, JobOutcome::Failed);
    faults.fail_reads(None);
    assert!(
        !rig.hit(&key(0)) && !rig.hit(&key(1)),
        "unreadable chunks become misses"
    );
    let removed: Vec<_> = rig.tier.take_events().into_iter().flat_map(|e| e.keys).collect();
    assert_eq!(removed.len(), 2);
    rig.assert_loads(&[key(2)]);
}

#[test]
fn a_panic_while_settling_a_load_releases_its_pins() {
    let dir = tempfile::tempdir().unwrap();
    let (mut rig, faults) = rig_with_faults(&options(dir.path(), 4, CHUNK), 4);
    assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok);
    faults.panic_settling_loads(true);
    let (r, _) = rig.load(&keys(0..2));
    assert_eq!(r.outcome, JobOutcome::Failed, "the panicked job fails, once");
    faults.panic_settling_loads(false);
    rig.assert_loads(&keys(0..2));
    // A pinned slot is never evicted: four new keys fit only if no pin of the panicked run is
    // left.
    assert_eq!(rig.store(&keys(4..8)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(4..8));
    assert!(!rig.hit(&key(0)) && !rig.hit(&key(1)));
    assert!(!rig.tier.has_pending_work());
}

#[test]
fn a_panic_while_dropping_an_unreadable_key_releases_the_pins_still_held() {
    let dir = tempfile::tempdir().unwrap();
    // One I/O thread: a job's consecutive slots go in one run, so the run holds a good slot
    // (released before the panic) and the bad one (left to the guard).
    let mut opts = options(dir.path(), 4, CHUNK);
    opts.io_threads = 1;
    let (mut rig, faults) = rig_with_faults(&opts, 4);
    assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok);
    let loc = rig.tier.slot_location(&key(1)).unwrap();
    flip(&loc.file, loc.payload_offset + 777, 0x10);
    faults.panic_dropping_unreadable(true);
    let (r, _) = rig.load(&keys(0..2));
    assert_eq!(r.outcome, JobOutcome::Failed, "the panicked job fails, once");
    faults.panic_dropping_unreadable(false);
    rig.assert_loads(&[key(0)]);
    // The bad key was not dropped before the panic: its next load finds it bad again.
    assert_eq!(rig.load(&[key(1)]).0.outcome, JobOutcome::Failed);
    assert!(!rig.hit(&key(1)));
    // No pin of the panicked run is left: four new keys take the four slots.
    assert_eq!(rig.store(&keys(4..8)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(4..8));
    assert!(!rig.tier.has_pending_work());
}

/// `drain_jobs` on a tier whose I/O `faults` hold (released once the queued jobs are cancelled);
/// every job's outcome, by job id.
fn drain_held(tier: &mut DiskTier, faults: &FaultInjector) -> Vec<(JobId, JobOutcome)> {
    faults.release_io_on_drain();
    tier.drain_jobs();
    let mut results = Vec::new();
    tier.poll_finished(&mut results);
    results.sort_by_key(|r| r.id);
    results.into_iter().map(|r| (r.id, r.outcome)).collect()
}

#[test]
fn drain_jobs_cancels_queued_jobs_and_finishes_the_running_copy() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), 16, CHUNK);
    opts.io_threads = 1;
    let faults = FaultInjector::new();
    let mut tier = DiskTier::open_with_faults(&opts, geometry(), faults.clone()).unwrap();
    let arena = tiering_core::arena::ChunkArena::new(8, CHUNK).unwrap();
    let waker = tiering_core::ControlWaker::new();
    tier.set_waker(waker.clone());
    faults.hold_io();
    let mut ids = Vec::new();
    for (j, pair) in [[0u32, 1], [2, 3], [4, 5]].iter().enumerate() {
        let ks: Vec<_> = pair.iter().map(|&r| key(u64::from(r))).collect();
        for (k, &r) in ks.iter().zip(pair) {
            let bytes = content(k, CHUNK);
            arena.write_row(r).unwrap().copy_from_slice(&bytes);
        }
        let id = tiering_core::JobId(j as u64 + 10);
        ids.push(id);
        tier.submit_store(tiering_core::TransferJob {
            id,
            kind: tiering_core::JobKind::Store,
            keys: ks,
            chunk_ids: pair.to_vec(),
            req: tiering_core::ReqContext::local("drain"),
            rows: tiering_core::arena::RowGrant::Read(arena.read_rows(pair).unwrap()),
        });
    }
    assert!(
        faults.wait_until_held(1, PATIENCE),
        "the one I/O thread holds the first write"
    );
    assert!(tier.has_pending_work());
    // The first job's two consecutive slots are one write, held at the gate.
    assert_eq!(tier.stats().extra["queued_chunks"], 4.0);
    let outcomes = drain_held(&mut tier, &faults);
    assert_eq!(
        outcomes,
        vec![
            (ids[0], JobOutcome::Ok),
            (ids[1], JobOutcome::Failed),
            (ids[2], JobOutcome::Failed),
        ],
        "the write in progress completed; everything queued was cancelled and reported"
    );
    assert_eq!(arena.granted_rows(), 0);
    assert!(!tier.has_pending_work());
    assert_eq!(tier.stats().extra["cancelled_keys"], 4.0);
    let ctx = tiering_core::ReqContext::local("drain");
    for n in 0..2 {
        assert_eq!(tier.lookup(&key(n), &ctx), tiering_core::LookupResult::Hit);
    }
    for n in 2..6 {
        assert_eq!(tier.lookup(&key(n), &ctx), tiering_core::LookupResult::Miss);
    }
    // The cancelled slots are free again.
    assert_eq!(tier.stats().resident_chunks, 2);
    let mut rig = Rig::new(tier, 4);
    assert_eq!(rig.store(&keys(1..4)).outcome, JobOutcome::Ok);
    rig.assert_loads(&keys(0..4));
}

#[test]
fn shutdown_with_queued_jobs_reports_them_failed() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), 8, CHUNK);
    opts.io_threads = 1;
    let (mut rig, faults) = rig_with_faults(&opts, 4);
    rig.store(&keys(0..4));
    faults.hold_io();
    let a = rig.load_job(&keys(0..2));
    rig.tier.submit_load(a);
    assert!(faults.wait_until_held(1, PATIENCE));
    // Rows 0 and 1 are granted to the load: this store reads rows 2 and 3.
    let job = rig.store_job_in_rows(&keys(10..12), &[2, 3]);
    let store_id = job.id;
    rig.tier.submit_store(job);
    faults.release_io_on_drain();
    rig.tier.shutdown().unwrap();
    let mut results = Vec::new();
    rig.tier.poll_finished(&mut results);
    results.sort_by_key(|r| r.id);
    assert_eq!(results.len(), 2, "every job is reported once, {results:?}");
    assert_eq!(results[1].id, store_id);
    assert_eq!(
        results[1].outcome,
        JobOutcome::Failed,
        "the queued store was cancelled"
    );
    assert_eq!(
        results[0].outcome,
        JobOutcome::Ok,
        "the running read (both slots in one call) finished"
    );
    assert_eq!(rig.arena.granted_rows(), 0);
}

#[test]
fn a_slot_under_read_is_never_evicted_and_a_store_with_no_room_fails() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), 2, CHUNK);
    opts.io_threads = 1;
    let (mut rig, faults) = rig_with_faults(&opts, 4);
    rig.store(&[key(0)]);
    rig.store(&[key(1)]);
    // Key 0 is least recent; a load of it is held in progress.
    faults.hold_io();
    let load = rig.load_job(&[key(0)]);
    rig.tier.submit_load(load);
    assert!(faults.wait_until_held(1, PATIENCE));
    // A store needs a slot: it must evict key 1, never key 0 under read.
    let rows = [1u32];
    let store = |id, k| tiering_core::TransferJob {
        id: tiering_core::JobId(id),
        kind: tiering_core::JobKind::Store,
        keys: vec![k],
        chunk_ids: rows.to_vec(),
        req: tiering_core::ReqContext::local("t"),
        rows: tiering_core::arena::RowGrant::Read(rig.arena.read_rows(&rows).unwrap()),
    };
    {
        let bytes = content(&key(2), CHUNK);
        rig.arena.write_row(1).unwrap().copy_from_slice(&bytes);
    }
    let s2 = store(100, key(2));
    let s3 = store(101, key(3));
    rig.tier.submit_store(s2);
    assert!(rig.hit(&key(0)), "the chunk under read stays");
    assert!(!rig.hit(&key(1)), "the other chunk was evicted for the store");
    // Now one slot is read and the other written: nothing can be admitted.
    rig.tier.submit_store(s3);
    faults.release_io();
    let mut results = rig.wait(3);
    results.sort_by_key(|r| r.id);
    assert_eq!(results[0].outcome, JobOutcome::Ok, "the load of key 0 completed");
    assert_eq!(results[1].outcome, JobOutcome::Ok, "key 2 was stored");
    assert_eq!(
        results[2].outcome,
        JobOutcome::Failed,
        "key 3 could not be admitted"
    );
    assert_eq!(rig.tier.stats().extra["not_admitted_keys"], 1.0);
    assert_eq!(*rig.arena.read_row(0).unwrap(), content(&key(0), CHUNK)[..]);
    rig.assert_loads(&[key(2)]);
    assert!(rig.tier.stats().resident_chunks <= 2);
    let file = std::fs::metadata(rig.tier.slab_path()).unwrap().len();
    assert!(file <= capacity_for(2, CHUNK));
}

#[test]
fn a_store_of_a_key_another_job_is_writing_ends_as_that_write_does() {
    for sync in [SyncPolicy::Always, SyncPolicy::Batch] {
        for write_fails in [false, true] {
            let case = format!("sync {sync:?}, the first write fails: {write_fails}");
            let dir = tempfile::tempdir().unwrap();
            let mut opts = options(dir.path(), 8, CHUNK);
            opts.sync = sync;
            let (mut rig, faults) = rig_with_faults(&opts, 4);
            faults.hold_io();
            if write_fails {
                faults.fail_writes(Some(libc::EIO));
            }
            let first = rig.store_job_in_rows(&keys(0..1), &[0]);
            rig.tier.submit_store(first);
            assert!(faults.wait_until_held(1, PATIENCE), "{case}");
            // The same key from another job (another row, same content) while the write is held.
            let second = rig.store_job_in_rows(&keys(0..1), &[1]);
            rig.tier.submit_store(second);
            let mut early = Vec::new();
            rig.tier.poll_finished(&mut early);
            let pending = rig.tier.has_pending_work();
            let writes_while_held = faults.write_calls();
            // Released before asserting, so a failure does not leave the I/O thread held.
            faults.release_io();
            assert!(
                early.is_empty(),
                "{case}: neither store may report the key before its one write ended: {early:?}"
            );
            assert!(pending, "{case}");
            assert_eq!(writes_while_held, 0, "{case}: nothing written while held");
            let mut results = rig.wait(2);
            results.sort_by_key(|r| r.id);
            let want = if write_fails {
                JobOutcome::Failed
            } else {
                JobOutcome::Ok
            };
            assert_eq!(results[0].outcome, want, "{case}: the writing job");
            assert_eq!(
                results[1].outcome, want,
                "{case}: the job that found the key being written ends as that write did"
            );
            assert_eq!(faults.write_calls(), 1, "{case}: one write of the key");
            assert_eq!(rig.hit(&key(0)), !write_fails, "{case}");
            if !write_fails {
                rig.assert_loads(&keys(0..1));
            }
            assert_eq!(rig.tier.stats().extra["deduplicated_keys"], 1.0, "{case}");
            assert!(!rig.tier.has_pending_work(), "{case}");
        }
    }
}

#[test]
fn a_store_waiting_for_a_cancelled_write_fails_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), 8, CHUNK);
    opts.io_threads = 1;
    let (mut rig, faults) = rig_with_faults(&opts, 4);
    faults.hold_io();
    // One I/O thread: key 0's write is held, key 1's queued behind it.
    let first = rig.store_job_in_rows(&keys(0..1), &[0]);
    let ids = [first.id, JobId(first.id.0 + 1), JobId(first.id.0 + 2)];
    rig.tier.submit_store(first);
    assert!(faults.wait_until_held(1, PATIENCE));
    let second = rig.store_job_in_rows(&keys(1..2), &[1]);
    rig.tier.submit_store(second);
    // A third job stores both keys: it follows the held write and the queued one.
    let third = rig.store_job_in_rows(&keys(0..2), &[2, 3]);
    assert_eq!(third.id, ids[2], "job ids follow each other");
    rig.tier.submit_store(third);
    let outcomes = drain_held(&mut rig.tier, &faults);
    assert_eq!(
        outcomes,
        vec![
            (ids[0], JobOutcome::Ok),
            (ids[1], JobOutcome::Failed),
            (ids[2], JobOutcome::Partial(keys(0..1))),
        ],
        "the follower of the cancelled write fails with it, the other key is stored"
    );
    assert!(rig.hit(&key(0)));
    assert!(!rig.hit(&key(1)));
    assert_eq!(rig.arena.granted_rows(), 0);
    assert!(!rig.tier.has_pending_work());
}

#[test]
fn a_panic_while_settling_a_write_frees_its_slots_and_later_stores_of_the_key_work() {
    for sync in [SyncPolicy::Always, SyncPolicy::Batch] {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = options(dir.path(), 8, CHUNK);
        opts.sync = sync;
        let (mut rig, faults) = rig_with_faults(&opts, 4);
        faults.panic_settling_writes(true);
        let r = rig.store(&keys(0..2));
        assert_eq!(
            r.outcome,
            JobOutcome::Failed,
            "{sync:?}: the panicked job fails, once"
        );
        faults.panic_settling_writes(false);
        assert!(!rig.hit(&key(0)), "{sync:?}");
        // The slots were freed, not left being written: the keys store again (no store waits
        // for the write that never settled) and every slot is usable.
        assert_eq!(rig.store(&keys(0..2)).outcome, JobOutcome::Ok, "{sync:?}");
        rig.assert_loads(&keys(0..2));
        assert_eq!(rig.store(&keys(2..4)).outcome, JobOutcome::Ok, "{sync:?}");
        assert_eq!(rig.store(&keys(4..8)).outcome, JobOutcome::Ok, "{sync:?}");
        assert_eq!(
            rig.tier.stats().resident_chunks,
            8,
            "{sync:?}: all 8 slots hold a chunk"
        );
        assert!(!rig.tier.has_pending_work(), "{sync:?}");
    }
}
