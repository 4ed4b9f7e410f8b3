//! Unit tests of the arena and its grants.

use std::io::{Seek, SeekFrom, Write};
use std::mem::size_of;

use super::layout::{LAYOUT_VERSION, MAGIC};
use super::*;

/// A private directory in `/dev/shm` (where engines put arenas) when there is one.
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn shared(path: &Path, num_chunks: usize, chunk_bytes: usize) -> Result<Arc<ChunkArena>, ArenaError> {
    let mut opts = ArenaOptions::new(num_chunks, chunk_bytes);
    opts.shared_memory = Some(path.to_path_buf());
    ChunkArena::with_options(&opts)
}

/// Overwrites `bytes` at `offset` of the file at `path`.
fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
}

fn header_problem(result: Result<ArenaView, ArenaError>) -> HeaderProblem {
    match result {
        Err(ArenaError::InvalidHeader { problem, .. }) => problem,
        other => panic!("expected an invalid header, got {other:?}"),
    }
}

#[test]
fn rows_are_page_aligned_and_sized() {
    let a = ChunkArena::new(4, 1000).unwrap();
    assert_eq!(a.row_stride() % page_size(), 0);
    assert!(a.row_stride() >= 1000);
    let r = a.read_row(3).unwrap();
    assert_eq!(r.len(), 1000);
    assert_eq!(r.as_ptr() as usize % page_size(), 0);
}

#[test]
fn writes_are_exclusive_and_readers_share() {
    let a = ChunkArena::new(2, 64).unwrap();
    let mut w = a.write_row(0).unwrap();
    w.fill(7);
    assert!(matches!(a.read_row(0), Err(ArenaError::RowBusy { .. })));
    assert!(matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })));
    drop(w);
    let r1 = a.read_row(0).unwrap();
    let r2 = a.read_row(0).unwrap();
    assert!(r1.iter().all(|&b| b == 7));
    assert!(matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })));
    drop((r1, r2));
    assert_eq!(a.granted_rows(), 0);
    assert!(a.write_row(0).is_ok());
}

#[test]
fn batch_grants_are_all_or_nothing() {
    let a = ChunkArena::new(3, 64).unwrap();
    assert!(a.write_rows(&[0, 1, 1]).is_err());
    assert_eq!(a.granted_rows(), 0, "a failed batch releases what it took");
    assert!(matches!(
        a.read_rows(&[0, 9]),
        Err(ArenaError::OutOfRange { chunk: 9, .. })
    ));
    assert_eq!(a.granted_rows(), 0);
    let g = RowGrant::Read(a.read_rows(&[2, 2]).unwrap());
    assert_eq!(g.len(), 2);
}

#[test]
fn a_view_shares_memory_and_row_locks() {
    let a = ChunkArena::new(3, 100).unwrap();
    // SAFETY: `a` outlives the view and every grant made from it in this test.
    let v = unsafe { ChunkArena::from_raw_parts(a.raw_parts()) }.unwrap();
    assert!(v.is_view() && !a.is_view());
    assert_eq!(
        (v.num_chunks(), v.chunk_bytes(), v.row_stride()),
        (3, 100, a.row_stride())
    );
    assert_eq!(v.mapped_bytes(), a.mapped_bytes());
    let mut w = a.write_row(1).unwrap();
    w.fill(5);
    assert!(matches!(v.read_row(1), Err(ArenaError::RowBusy { .. })));
    drop(w);
    assert!(v.read_row(1).unwrap().iter().all(|&b| b == 5));
    v.write_row(2).unwrap().fill(9);
    assert!(a.read_row(2).unwrap().iter().all(|&b| b == 9));
    drop(v);
    assert_eq!(a.granted_rows(), 0);
}

#[test]
fn grants_given_up_raw_are_adopted_with_their_lock() {
    let a = ChunkArena::new(2, 64).unwrap();
    // SAFETY: `a` outlives the view and every grant made from it in this test.
    let v = unsafe { ChunkArena::from_raw_parts(a.raw_parts()) }.unwrap();
    let strong = Arc::strong_count(&a);
    let chunk = a.write_row(0).unwrap().into_raw();
    assert_eq!(
        Arc::strong_count(&a),
        strong,
        "into_raw drops its arena reference"
    );
    assert!(a.is_row_granted(0), "the lock stays held while in transit");
    // SAFETY: the writer lock of row 0 was given up by `into_raw` above.
    let mut w = unsafe { RowWrite::from_raw(&v, chunk) };
    w.fill(3);
    drop(w);
    assert_eq!(
        a.granted_rows(),
        0,
        "dropping the adopted grant releases the shared lock"
    );
    let r = a.read_row(0).unwrap().into_raw();
    let r2 = a.read_row(0).unwrap();
    // SAFETY: one reader count of row 0 was given up by `into_raw` above.
    let adopted = unsafe { RowRead::from_raw(&v, r) };
    assert!(adopted.iter().all(|&b| b == 3));
    drop(adopted);
    assert!(
        matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })),
        "r2 still reads"
    );
    drop(r2);
    assert!(a.write_row(0).is_ok());
}

#[test]
fn views_refuse_null_or_bad_parts() {
    let a = ChunkArena::new(2, 64).unwrap();
    let mut parts = a.raw_parts();
    parts.base = std::ptr::null_mut();
    // SAFETY: refused before any use of the pointers.
    assert!(unsafe { ChunkArena::from_raw_parts(parts) }.is_err());
    let mut parts = a.raw_parts();
    parts.row_stride = 10;
    // SAFETY: as above.
    assert!(unsafe { ChunkArena::from_raw_parts(parts) }.is_err());
}

#[test]
fn bad_geometry_is_refused() {
    assert!(matches!(
        ChunkArena::new(0, 64),
        Err(ArenaError::InvalidGeometry { .. })
    ));
    assert!(matches!(
        ChunkArena::new(4, 0),
        Err(ArenaError::InvalidGeometry { .. })
    ));
    assert!(ChunkArena::new(usize::MAX / 2, 1 << 20).is_err());
}

#[test]
fn shared_memory_arena_is_visible_through_the_file() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let mut opts = ArenaOptions::new(2, 16);
    opts.shared_memory = Some(path.clone());
    opts.prefault = true;
    let a = ChunkArena::with_options(&opts).unwrap();
    a.write_row(1).unwrap().copy_from_slice(&[9u8; 16]);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), a.mapped_bytes());
    assert_eq!(a.mapped_bytes(), a.header_bytes() + 2 * a.row_stride());
    let row1 = a.header_bytes() + a.row_stride();
    assert_eq!(&bytes[row1..row1 + 16], &[9u8; 16]);
    assert_eq!(&bytes[..8], b"KVTARENA");
    drop(a);
    assert!(!path.exists(), "the owner removes the file it created");
}

#[test]
fn the_owner_keeps_a_file_it_did_not_create_and_refuses_a_second_owner() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    std::fs::write(&path, b"left over").unwrap();
    let a = shared(&path, 3, 100).unwrap();
    assert!(!a.is_view());
    assert!(matches!(
        shared(&path, 3, 100),
        Err(ArenaError::AlreadyOwned { .. })
    ));
    let err = shared(&path, 5, 64).unwrap_err().to_string();
    assert!(err.contains("already owned"), "{err}");
    a.write_row(0).unwrap().fill(1);
    drop(a);
    assert!(path.exists(), "a file that existed before is left in place");
    let b = shared(&path, 3, 100).unwrap();
    assert_eq!(b.granted_rows(), 0, "a new owner starts with every row free");
}

#[test]
fn a_view_shares_rows_and_locks_with_the_owner() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 4, 5000).unwrap();
    let view = ArenaView::open(&path).unwrap();
    assert!(view.is_view());
    assert_eq!(owner.attached_views(), 1);
    assert_eq!(
        (
            view.num_chunks(),
            view.chunk_bytes(),
            view.row_stride(),
            view.header_bytes()
        ),
        (4, 5000, owner.row_stride(), owner.header_bytes())
    );
    let mut w = owner.write_row(1).unwrap();
    w.fill(0x5a);
    assert!(matches!(view.read_row(1), Err(ArenaError::RowBusy { .. })));
    assert!(matches!(view.write_row(1), Err(ArenaError::RowBusy { .. })));
    drop(w);
    let r = view.read_row(1).unwrap();
    assert!(r.iter().all(|&b| b == 0x5a));
    assert!(matches!(owner.write_row(1), Err(ArenaError::RowBusy { .. })));
    drop(r);
    let mut vw = view.write_row(2).unwrap();
    vw.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let err = owner.read_row(2).unwrap_err().to_string();
    assert!(err.contains("view process"), "{err}");
    drop(vw);
    let back = owner.read_row(2).unwrap();
    assert!(back.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    drop(back);
    assert_eq!(owner.granted_rows(), 0);
    assert!(view.owner_alive().unwrap());
    drop(owner);
    assert!(!view.owner_alive().unwrap(), "the view notices its owner is gone");
    assert!(
        view.read_row(2)
            .unwrap()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 251) as u8)
    );
    assert!(!path.exists());
}

#[test]
fn a_dropped_view_gives_its_slot_back() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 2, 64).unwrap();
    let view = ArenaView::open(&path).unwrap();
    let slot = view.slot();
    assert_eq!(owner.attached_views(), 1);
    drop(view);
    assert_eq!(owner.attached_views(), 0, "a dropped view gives its slot back");
    assert_eq!(ArenaView::open(&path).unwrap().slot(), slot);
}

#[test]
fn a_dropped_view_releases_grants_it_gave_up_raw() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 3, 64).unwrap();
    let view = ArenaView::open(&path).unwrap();
    let _ = view.write_row(0).unwrap().into_raw();
    let _ = view.read_row(1).unwrap().into_raw();
    let _ = view.read_row(1).unwrap().into_raw();
    assert_eq!(owner.granted_rows(), 2);
    assert_eq!(
        owner.reclaim_dead_views().unwrap(),
        ReclaimedViews::default(),
        "the view is alive"
    );
    assert_eq!(owner.granted_rows(), 2);
    drop(view);
    assert_eq!(owner.granted_rows(), 0);
    assert!(owner.write_rows(&[0, 1]).is_ok());
}

#[test]
fn views_take_distinct_slots_and_run_out_cleanly() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 2, 64).unwrap();
    let views: Vec<_> = (0..MAX_VIEWS).map(|_| ArenaView::open(&path).unwrap()).collect();
    let mut slots: Vec<_> = views.iter().map(ArenaView::slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), MAX_VIEWS);
    assert!(matches!(
        ArenaView::open(&path),
        Err(ArenaError::TooManyViews { .. })
    ));
    drop(views);
    assert_eq!(owner.attached_views(), 0);
    assert!(ArenaView::open(&path).is_ok());
}

#[test]
fn a_view_refuses_an_arena_without_owner() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 2, 64).unwrap();
    // Keep a copy of the valid file, then drop the owner (which removes the original).
    let copy = dir.path().join("copy");
    std::fs::copy(&path, &copy).unwrap();
    drop(owner);
    assert!(matches!(ArenaView::open(&copy), Err(ArenaError::NoOwner { .. })));
    assert!(
        matches!(ArenaView::open(&path), Err(ArenaError::Map { .. })),
        "removed with its owner"
    );
}

#[test]
fn header_with_bad_magic_is_refused() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let _owner = shared(&path, 2, 64).unwrap();
    poke(&path, 0, b"NOTKVTIE");
    let problem = header_problem(ArenaView::open(&path));
    assert!(matches!(problem, HeaderProblem::BadMagic { .. }), "{problem}");
    let foreign = dir.path().join("foreign");
    std::fs::write(&foreign, vec![0xabu8; 8192]).unwrap();
    let problem = header_problem(ArenaView::open(&foreign));
    assert!(problem.to_string().contains("bad magic"), "{problem}");
}

#[test]
fn header_with_another_layout_version_is_refused() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let _owner = shared(&path, 2, 64).unwrap();
    poke(&path, 8, &(LAYOUT_VERSION + 1).to_ne_bytes());
    assert_eq!(
        header_problem(ArenaView::open(&path)),
        HeaderProblem::Version {
            found: LAYOUT_VERSION + 1,
            expected: LAYOUT_VERSION
        }
    );
}

#[test]
fn truncated_arena_files_are_refused() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 2, 64).unwrap();
    let full = owner.mapped_bytes() as u64;
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(full - 1).unwrap();
    assert_eq!(
        header_problem(ArenaView::open(&path)),
        HeaderProblem::Truncated {
            len: full - 1,
            expected: full
        }
    );
    f.set_len(full + 4096).unwrap();
    let problem = header_problem(ArenaView::open(&path));
    assert!(matches!(problem, HeaderProblem::Geometry(_)), "{problem}");
    let tiny = dir.path().join("tiny");
    std::fs::write(&tiny, MAGIC.to_le_bytes()).unwrap();
    assert!(matches!(
        header_problem(ArenaView::open(&tiny)),
        HeaderProblem::Truncated { len: 8, .. }
    ));
    assert!(size_of::<layout::Header>() > 8);
}

#[test]
fn inconsistent_or_unexpected_geometry_is_refused() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 3, 5000).unwrap();
    let problem = header_problem(ArenaView::open_expecting(&path, 3, 4096));
    assert_eq!(
        problem,
        HeaderProblem::Mismatch {
            found_chunks: 3,
            found_bytes: 5000,
            expected_chunks: 3,
            expected_bytes: 4096
        }
    );
    assert!(ArenaView::open_expecting(&path, 3, 5000).is_ok());
    // row_stride (offset 32) that is not chunk_bytes rounded to the page size.
    poke(&path, 32, &(owner.row_stride() as u64 + 1).to_ne_bytes());
    let problem = header_problem(ArenaView::open(&path));
    assert!(matches!(problem, HeaderProblem::Geometry(_)), "{problem}");
    // Zero rows.
    poke(&path, 32, &(owner.row_stride() as u64).to_ne_bytes());
    poke(&path, 16, &0u64.to_ne_bytes());
    let problem = header_problem(ArenaView::open(&path));
    assert!(
        problem.to_string().contains("invalid arena geometry"),
        "{problem}"
    );
}

#[test]
fn memory_locking_pins_the_rows_or_explains_the_limit() {
    let a = ChunkArena::new(2, 4096).unwrap();
    match a.lock_memory() {
        Ok(()) => {
            // Locked pages stay usable.
            a.write_row(1).unwrap().fill(4);
            assert!(a.read_row(1).unwrap().iter().all(|&b| b == 4));
        }
        Err(e @ ArenaError::LockMemory { .. }) => {
            assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn dma_registration_sees_the_whole_row_region_and_reports_refusal() {
    let a = ChunkArena::new(3, 1000).unwrap();
    let seen = std::cell::Cell::new((std::ptr::null_mut(), 0));
    a.register_for_dma(&|ptr, len| {
        seen.set((ptr, len));
        Ok(())
    })
    .unwrap();
    let (ptr, len) = seen.get();
    assert_eq!(len, 3 * a.row_stride());
    assert_eq!(ptr.cast_const(), a.read_row(0).unwrap().as_ptr());
    assert_eq!((ptr, len), a.row_region());
    let err = a
        .register_for_dma(&|_, _| Err("cudaErrorHostMemoryAlreadyRegistered".into()))
        .unwrap_err();
    assert!(matches!(err, ArenaError::DmaRegistration { .. }));
    assert!(err.to_string().contains("cudaErrorHostMemoryAlreadyRegistered"));
}

#[test]
fn a_new_owner_refuses_a_file_a_previous_owners_view_still_maps() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let mut opts = ArenaOptions::new(2, 64);
    opts.shared_memory = Some(path.clone());
    // Pre-create the file, so the first owner does not remove it when dropped (as after a crash).
    std::fs::write(&path, b"").unwrap();
    let first = ChunkArena::with_options(&opts).unwrap();
    let view = ArenaView::open(&path).unwrap();
    let mut w = view.write_row(0).unwrap();
    drop(first);
    let err = ChunkArena::with_options(&opts).unwrap_err();
    assert!(
        matches!(err, ArenaError::ViewsStillAttached { views: 1, .. }),
        "{err:?}"
    );
    w.fill(1);
    drop(w);
    drop(view);
    let second = ChunkArena::with_options(&opts).unwrap();
    assert_eq!((second.granted_rows(), second.attached_views()), (0, 0));
    assert!(ArenaView::open(&path).is_ok());
}

#[test]
fn anonymous_arenas_have_no_views_to_reclaim() {
    let a = ChunkArena::new(2, 64).unwrap();
    assert_eq!(a.attached_views(), 0);
    assert_eq!(a.reclaim_dead_views().unwrap(), ReclaimedViews::default());
    assert_eq!(a.mapped_bytes(), a.header_bytes() + 2 * a.row_stride());
    assert_eq!(a.shared_path(), None);
}

/// Threads of an owner and of a view take random grants on a few rows; a writer fills its row
/// with its own tag and checks it before releasing, a reader checks the row is uniform. Any
/// grant overlap the locks failed to prevent shows up as a torn row.
#[test]
fn concurrent_grants_from_owner_and_view_never_tear_a_row() {
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = shared(&path, 4, 4096).unwrap();
    let view = ArenaView::open(&path).unwrap();
    let arenas = [Arc::clone(&owner), Arc::clone(view.arena())];
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let arena = Arc::clone(&arenas[usize::from(t % 2)]);
            scope.spawn(move || {
                let mut x = 0x9e37_79b9_u32 ^ u32::from(t);
                let (mut wrote, mut read) = (0, 0);
                for _ in 0..3000 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let row = x % 4;
                    if x & 0x100 == 0 {
                        if let Ok(mut w) = arena.write_row(row) {
                            // In two halves with a yield between, so an overlapping grant
                            // has a window to show up in.
                            w[..2048].fill(t + 1);
                            std::thread::yield_now();
                            w[2048..].fill(t + 1);
                            assert!(w.iter().all(|&b| b == t + 1), "a writer's row changed under it");
                            wrote += 1;
                        }
                    } else if let Ok(r) = arena.read_row(row) {
                        assert!(r.iter().all(|&b| b == r[0]), "a reader saw a torn row");
                        read += 1;
                    }
                }
                assert!(wrote + read > 0);
            });
        }
    });
    assert_eq!(owner.granted_rows(), 0);
}
