//! Helpers shared by the integration tests: a tier plus an arena, jobs built by hand, waiting
//! for results, and deterministic chunk contents.

#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tier_disk::{DiskGeometry, DiskTier, DiskTierOptions};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobOutcome, JobResult, OffloadKey, ReqContext, SecondaryTier, TransferJob,
    arena::{ChunkArena, RowGrant},
};

/// How long a test waits for something that should happen promptly.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The file capacity that holds exactly `slots` chunks of `chunk_bytes`.
pub fn capacity_for(slots: u64, chunk_bytes: usize) -> u64 {
    let span = chunk_bytes.next_multiple_of(4096) as u64;
    4096 + slots * (span + 4096)
}

/// Options for a tier of `slots` slots under `dir`.
pub fn options(dir: &Path, slots: u64, chunk_bytes: usize) -> DiskTierOptions {
    let mut o = DiskTierOptions::new(dir, capacity_for(slots, chunk_bytes));
    o.io_threads = 2;
    o
}

/// The deterministic content of `key` (different for every key and byte position).
pub use tiering_core::testing::chunk_content as content;

pub fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

pub fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(key).collect()
}

/// A tier with an arena of its own, driven by hand-made jobs.
pub struct Rig {
    pub arena: Arc<ChunkArena>,
    pub tier: DiskTier,
    pub waker: ControlWaker,
    next_job: u64,
}

impl Rig {
    /// Wraps `tier` with an arena of `rows` rows of its chunk size.
    pub fn new(mut tier: DiskTier, rows: usize) -> Self {
        let arena = ChunkArena::new(rows, tier.layout().chunk_bytes).unwrap();
        let waker = ControlWaker::new();
        tier.set_waker(waker.clone());
        Self {
            arena,
            tier,
            waker,
            next_job: 1,
        }
    }

    /// Opens a tier with `opts` for `chunk_bytes` chunks, and an arena of `rows` rows.
    pub fn open(opts: &DiskTierOptions, chunk_bytes: usize, rows: usize) -> Self {
        let geometry = DiskGeometry {
            chunk_bytes,
            row_stride: chunk_bytes.next_multiple_of(4096),
        };
        Self::new(DiskTier::open(opts, geometry).unwrap(), rows)
    }

    pub fn chunk_bytes(&self) -> usize {
        self.arena.chunk_bytes()
    }

    fn job_id(&mut self) -> JobId {
        self.next_job += 1;
        JobId(self.next_job)
    }

    /// A store job of `keys`, key `i` in arena row `i`, whose rows are filled with the keys'
    /// contents.
    pub fn store_job(&mut self, keys: &[OffloadKey]) -> TransferJob {
        let rows: Vec<u32> = (0..keys.len() as u32).collect();
        self.store_job_in_rows(keys, &rows)
    }

    /// A store job of `keys`, key `i` in arena row `rows[i]` (filled with the key's contents): for
    /// a job whose rows must differ from another's still in flight.
    pub fn store_job_in_rows(&mut self, keys: &[OffloadKey], rows: &[u32]) -> TransferJob {
        for (k, &r) in keys.iter().zip(rows) {
            let mut w = self.arena.write_row(r).unwrap();
            let bytes = content(k, w.len());
            w.copy_from_slice(&bytes);
        }
        TransferJob {
            id: self.job_id(),
            kind: JobKind::Store,
            keys: keys.to_vec(),
            chunk_ids: rows.to_vec(),
            req: ReqContext::local("test"),
            rows: RowGrant::Read(self.arena.read_rows(rows).unwrap()),
        }
    }

    /// A promotion job of `keys` into arena rows `0..keys.len()` (zeroed first).
    pub fn load_job(&mut self, keys: &[OffloadKey]) -> TransferJob {
        let rows: Vec<u32> = (0..keys.len() as u32).collect();
        for &r in &rows {
            self.arena.write_row(r).unwrap().fill(0);
        }
        TransferJob {
            id: self.job_id(),
            kind: JobKind::Promotion,
            keys: keys.to_vec(),
            chunk_ids: rows.clone(),
            req: ReqContext::local("test"),
            rows: RowGrant::Write(self.arena.write_rows(&rows).unwrap()),
        }
    }

    /// Waits until `n` results are reported and returns them (in report order).
    pub fn wait(&mut self, n: usize) -> Vec<JobResult> {
        wait_results(&mut self.tier, &self.waker, n)
    }

    /// Stores `keys` in one job and waits for its result.
    pub fn store(&mut self, keys: &[OffloadKey]) -> JobResult {
        let job = self.store_job(keys);
        self.tier.submit_store(job);
        self.wait(1).remove(0)
    }

    /// Loads `keys` in one job; returns the result and each row's bytes.
    pub fn load(&mut self, keys: &[OffloadKey]) -> (JobResult, Vec<Vec<u8>>) {
        let job = self.load_job(keys);
        self.tier.submit_load(job);
        let r = self.wait(1).remove(0);
        let rows = (0..keys.len() as u32)
            .map(|i| self.arena.read_row(i).unwrap().to_vec())
            .collect();
        (r, rows)
    }

    /// Loads `keys` and asserts that every one succeeded with its exact content.
    pub fn assert_loads(&mut self, keys: &[OffloadKey]) {
        let (r, rows) = self.load(keys);
        assert_eq!(r.outcome, JobOutcome::Ok, "loading {keys:?}");
        for (k, row) in keys.iter().zip(rows) {
            assert!(row == content(k, row.len()), "{k} came back with other bytes");
        }
    }

    /// Whether the tier answers `Hit` for `key`.
    pub fn hit(&mut self, key: &OffloadKey) -> bool {
        self.tier.lookup(key, &ReqContext::local("test")) == tiering_core::LookupResult::Hit
    }
}

/// Polls `tier` until `n` results arrived (panics after [`PATIENCE`]).
pub fn wait_results(tier: &mut dyn SecondaryTier, waker: &ControlWaker, n: usize) -> Vec<JobResult> {
    let deadline = Instant::now() + PATIENCE;
    let mut out = Vec::new();
    loop {
        tier.poll_finished(&mut out);
        if out.len() >= n {
            assert_eq!(out.len(), n, "more results than jobs: {out:?}");
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} results after {PATIENCE:?}",
            out.len()
        );
        waker.wait(Duration::from_millis(100));
    }
}

/// Overwrites bytes of `file` at `offset`.
pub fn poke(file: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

/// XORs one byte of `file` at `offset` with `mask`.
pub fn flip(file: &Path, offset: u64, mask: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= mask;
    f.write_all_at(&b, offset).unwrap();
    f.sync_all().unwrap();
}
