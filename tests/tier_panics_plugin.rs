//! A tier loaded from a shared library (examples/tier-example's `fault_panicky`, whose `lookup`
//! panics) in a chain with a linked-in disk tier behind it: the panic is caught in the library,
//! raised again by the host after the call returned, and quarantines the tier at the lookup that
//! met it, as a linked-in tier's panic does — never an unwind into the engine nor an engine
//! error; the step lock is free afterwards and the disk tier keeps serving (a chunk evicted from
//! the primary comes back from it bit-exact).

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use tiering_config::ChainConfig;
use tiering_core::{
    LookupResult, OffloadKey, OffloadingManager, ReqContext, ScheduleEndContext, TieringManager,
};

use tier_disk as _;

const CHUNK: usize = 4096;
const PATIENCE: Duration = Duration::from_secs(60);

fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

fn bytes_for(n: u64) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (n as u8).wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

fn lock_is_free(m: &TieringManager) -> bool {
    tiering_core::testing::lock_is_free(m, PATIENCE)
}

/// Steps until no job is in flight (the cascades' pins are released).
fn settle(m: &mut TieringManager) {
    let deadline = Instant::now() + PATIENCE;
    while m.has_pending_work().unwrap() {
        assert!(Instant::now() < deadline, "the cascades never finished");
        let mut s = m.step();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        drop(s);
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_library_tier_that_panics_is_quarantined_and_the_disk_tier_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[primary]\ntype = \"itest-memory\"\nchunks = 8\n\n\
         [[secondary]]\ntype = \"panicky\"\nlibrary = \"{}\"\n\n\
         [[secondary]]\ntype = \"disk\"\nname = \"disk\"\npath = \"{}\"\ncapacity = \"4MiB\"\nadmission = \"always\"\n\n\
         [control_plane]\nthread = false\n",
        common::fault_library("fault_panicky").display(),
        dir.path().join("disk").display()
    );
    let mut m = ChainConfig::parse("panics.toml", &text)
        .unwrap()
        .build(tiering_core::registry::Registry::global().unwrap(), CHUNK)
        .unwrap();
    let arena = m.arena().clone();
    let ctx = ReqContext::local("r");
    // Twelve chunks through an eight-chunk primary: the first ones are evicted, and every one
    // is cascaded to both secondary tiers.
    for batch in 0..3u64 {
        let mut s = m.step();
        if batch == 0 {
            s.on_new_request(&ctx).unwrap();
        }
        let keys: Vec<OffloadKey> = (batch * 4 + 1..=batch * 4 + 4).map(key).collect();
        let out = s.prepare_store(&keys, &ctx).unwrap().expect("room");
        for (k, row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            let n = (1..=12).find(|&n| key(n) == *k).unwrap();
            arena.write_row(*row).unwrap().copy_from_slice(&bytes_for(n));
        }
        s.complete_store(&out.keys_to_store, &ctx, true).unwrap();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        drop(s);
        settle(&mut m);
    }
    // The library's lookup panics: the manager's guard quarantines the tier at once and the
    // walk goes on, so the disk tier's hit is the answer and the step ends without an error.
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut s = m.step();
        let verdict = s.lookup(&key(1), &ctx).unwrap();
        let end = s.on_schedule_end(&ScheduleEndContext::default());
        (verdict, end)
    }));
    let Ok((verdict, end)) = outcome else {
        panic!("the library's panic unwound into the engine");
    };
    assert_eq!(verdict, LookupResult::HitPending, "the disk tier answered");
    end.unwrap_or_else(|e| panic!("a quarantined panic is no engine error: {e}"));
    assert_eq!(m.stats().unwrap().manager.tier_panics, 1, "counted as a panic");
    assert!(lock_is_free(&m), "the step lock is free");
    let quarantined = m.inspect(|s| s.quarantined_tiers());
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert!(quarantined[0].1.contains("panicked in lookup"), "{quarantined:?}");
    assert_eq!(m.stats().unwrap().manager.tiers_quarantined, 1);
    // The promotion from disk lands: key 1 is a hit again, with its bytes.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut s = m.step();
        let r = s.lookup(&key(1), &ctx).unwrap();
        if r == LookupResult::Hit {
            let rows = s.prepare_load(&[key(1)], &ctx).unwrap();
            assert_eq!(arena.read_row(rows[0]).unwrap().to_vec(), bytes_for(1));
            s.complete_load(&[key(1)], &ctx).unwrap();
            s.on_request_finished(&ctx).unwrap();
            s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
            break;
        }
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
        drop(s);
        assert!(
            Instant::now() < deadline,
            "the promotion from disk never landed ({r:?})"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let disk = m.stats().unwrap().secondaries[1].clone();
    assert!(disk.hits >= 1 && disk.loads >= 1, "{disk:?}");
    m.shutdown().unwrap();
}
