//! Unit tests of the arena and its grants.

use super::*;

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
    let dir = std::env::temp_dir().join(format!("kvtier-arena-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("arena");
    let mut opts = ArenaOptions::new(2, 16);
    opts.shared_memory = Some(path.clone());
    opts.prefault = true;
    let a = ChunkArena::with_options(&opts).unwrap();
    a.write_row(1).unwrap().copy_from_slice(&[9u8; 16]);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[a.row_stride()..a.row_stride() + 16], &[9u8; 16]);
    std::fs::remove_dir_all(dir).unwrap();
}
