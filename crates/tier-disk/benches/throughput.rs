//! Disk tier store and load throughput against raw positioned I/O of the same volume, chunk
//! size, request size and queue depth on the same filesystem, measured in the same run
//! (`O_DIRECT` for both when the filesystem accepts it). The raw reference issues, from
//! `IO_THREADS` threads (one call in flight each, as the tier's I/O threads), vectored calls of
//! as many consecutive chunks as the tier puts in one submission for a `KEYS_PER_JOB`-key job;
//! the tier additionally moves one 4 KiB seal per chunk and verifies checksums on reads, so on a
//! device-bound run the ratio is capped near `chunk / (chunk + 4 KiB)`: 0.80 for 16 KiB chunks,
//! 0.98 for 256 KiB, 0.998 for 2 MiB. On a shared virtual disk the ratios move by ±20 % between
//! runs; the paired (ABBA) median is the steadier of the two figures. Prints GB/s for each, the tier/raw ratio of the criterion runs,
//! and the median tier/raw ratio of ABBA-paired runs (robust to drift on a shared device).
//!
//! `cargo bench -p tier-disk --bench throughput`. Environment: `KVTIER_BENCH_DIR` (default: the
//! system temp dir), `KVTIER_BENCH_MIB` (volume per iteration, default 64), `KVTIER_BENCH_CHUNKS`
//! (chunk sizes in KiB, comma-separated; default 16,256,2048).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use tier_disk::{DiskGeometry, DiskTier, DiskTierOptions};
use tiering_core::{
    ChunkArena, ControlWaker, JobId, JobKind, JobOutcome, JobResult, OffloadKey, ReqContext, RowGrant,
    SecondaryTier, TransferJob,
};

const IO_THREADS: usize = 4;
const KEYS_PER_JOB: usize = 16;
const CHUNK_SIZES: [usize; 3] = [16 << 10, 256 << 10, 2 << 20];
/// Alternating raw/tier rounds per direction and chunk size for the reported ratio.
const PAIRED_ROUNDS: usize = 8;

/// Total bytes and time measured per (direction, chunk size, subject).
type Tally = BTreeMap<(String, usize, &'static str), (f64, Duration)>;

fn record(tally: &Mutex<Tally>, dir: &str, chunk: usize, who: &'static str, bytes: f64, t: Duration) {
    if let Ok(mut tally) = tally.lock() {
        let e = tally
            .entry((dir.to_owned(), chunk, who))
            .or_insert((0.0, Duration::ZERO));
        e.0 += bytes;
        e.1 += t;
    }
}

/// Raw reference: a pre-allocated file, `IO_THREADS` threads, one vectored positioned call of
/// `per_call` consecutive chunks at a time per thread.
struct Raw {
    file: File,
    direct: bool,
    per_call: usize,
}

/// One `pwritev`/`preadv` of every byte of `iov` at `off` (the bench's files are big enough
/// that a short transfer is an error).
fn vectored(file: &File, iov: &[libc::iovec], off: u64, write: bool) {
    let want: usize = iov.iter().map(|v| v.iov_len).sum();
    // SAFETY: `iov` describes `iov.len()` live buffers borrowed by the caller for the call
    // (row guards it holds), each valid for `iov_len` bytes; a write only reads them, a read
    // writes rows the caller holds write guards for.
    let n = unsafe {
        if write {
            libc::pwritev(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                off as libc::off_t,
            )
        } else {
            libc::preadv(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                off as libc::off_t,
            )
        }
    };
    assert_eq!(n, want as isize, "raw vectored I/O was short or failed");
}

impl Raw {
    fn open(dir: &Path, len: u64, per_call: usize) -> Self {
        let path = dir.join("raw-reference.bin");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(len).unwrap();
        // SAFETY: plain syscall on an open descriptor; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        assert!(rc == 0 || len == 0, "fallocate of the raw reference failed");
        let per_call = per_call.max(1);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        {
            Ok(direct) => Self {
                file: direct,
                direct: true,
                per_call,
            },
            Err(_) => Self {
                file,
                direct: false,
                per_call,
            },
        }
    }

    fn run(&self, arena: &Arc<ChunkArena>, write: bool) -> Duration {
        let rows = arena.num_chunks();
        let chunk = arena.chunk_bytes();
        let calls = rows.div_ceil(self.per_call);
        let per_call = self.per_call;
        let start = Instant::now();
        std::thread::scope(|s| {
            for t in 0..IO_THREADS {
                s.spawn(move || {
                    for c in (t..calls).step_by(IO_THREADS) {
                        let ids: Vec<u32> = (c * per_call..((c + 1) * per_call).min(rows))
                            .map(|r| r as u32)
                            .collect();
                        let off = (c * per_call * chunk) as u64;
                        if write {
                            let guards = arena.read_rows(&ids).unwrap();
                            let iov: Vec<libc::iovec> = guards
                                .iter()
                                .map(|g| libc::iovec {
                                    iov_base: g.as_ptr() as *mut libc::c_void,
                                    iov_len: g.len(),
                                })
                                .collect();
                            vectored(&self.file, &iov, off, true);
                        } else {
                            let mut guards = arena.write_rows(&ids).unwrap();
                            let iov: Vec<libc::iovec> = guards
                                .iter_mut()
                                .map(|g| libc::iovec {
                                    iov_base: g.as_mut_ptr().cast::<libc::c_void>(),
                                    iov_len: g.len(),
                                })
                                .collect();
                            vectored(&self.file, &iov, off, false);
                        }
                    }
                });
            }
        });
        start.elapsed()
    }
}

/// The tier under test and an arena holding one volume of chunks.
struct TierRig {
    tier: DiskTier,
    waker: ControlWaker,
    next_key: u64,
    next_job: u64,
    resident: Vec<OffloadKey>,
}

impl TierRig {
    fn open(dir: &Path, arena: &ChunkArena, volume: u64) -> Self {
        let mut opts = DiskTierOptions::new(dir.join("tier"), 2 * volume + (64 << 20));
        opts.io_threads = IO_THREADS;
        let mut tier = DiskTier::open(&opts, DiskGeometry::of_arena(arena)).unwrap();
        let waker = ControlWaker::new();
        tier.set_waker(waker.clone());
        Self {
            tier,
            waker,
            next_key: 0,
            next_job: 0,
            resident: Vec::new(),
        }
    }

    fn wait(&mut self, n: usize) -> Vec<JobResult> {
        let mut out = Vec::new();
        while out.len() < n {
            self.tier.poll_finished(&mut out);
            if out.len() < n {
                self.waker.wait(Duration::from_millis(10));
            }
        }
        out
    }

    fn jobs(&mut self, arena: &Arc<ChunkArena>, kind: JobKind) -> Vec<TransferJob> {
        let rows = arena.num_chunks() as u32;
        let keys: Vec<OffloadKey> = if kind == JobKind::Store {
            let first = self.next_key;
            self.next_key += u64::from(rows);
            (first..first + u64::from(rows))
                .map(OffloadKey::from_u64)
                .collect()
        } else {
            self.resident.clone()
        };
        let ctx = ReqContext::local("bench");
        (0..rows)
            .collect::<Vec<u32>>()
            .chunks(KEYS_PER_JOB)
            .map(|ids| {
                self.next_job += 1;
                let ks: Vec<OffloadKey> = ids.iter().map(|&i| keys[i as usize]).collect();
                let grant = if kind == JobKind::Store {
                    RowGrant::Read(arena.read_rows(ids).unwrap())
                } else {
                    RowGrant::Write(arena.write_rows(ids).unwrap())
                };
                TransferJob {
                    id: JobId(self.next_job),
                    kind,
                    keys: ks,
                    chunk_ids: ids.to_vec(),
                    req: ctx.clone(),
                    rows: grant,
                }
            })
            .collect()
    }

    fn store_volume(&mut self, arena: &Arc<ChunkArena>) -> Duration {
        let jobs = self.jobs(arena, JobKind::Store);
        let n = jobs.len();
        self.resident = jobs.iter().flat_map(|j| j.keys.clone()).collect();
        let start = Instant::now();
        for j in jobs {
            self.tier.submit_store(j);
        }
        let results = self.wait(n);
        let t = start.elapsed();
        assert!(
            results.iter().all(|r| r.outcome == JobOutcome::Ok),
            "a store failed"
        );
        t
    }

    fn load_volume(&mut self, arena: &Arc<ChunkArena>) -> Duration {
        let jobs = self.jobs(arena, JobKind::Promotion);
        let n = jobs.len();
        let start = Instant::now();
        for j in jobs {
            self.tier.submit_load(j);
        }
        let results = self.wait(n);
        let t = start.elapsed();
        assert!(
            results.iter().all(|r| r.outcome == JobOutcome::Ok),
            "a load failed"
        );
        t
    }
}

fn bench_chunk(
    c: &mut Criterion,
    root: &Path,
    volume: u64,
    chunk: usize,
    tally: &Arc<Mutex<Tally>>,
    paired: &Mutex<BTreeMap<(String, usize), f64>>,
) {
    let rows = (volume as usize / chunk).max(KEYS_PER_JOB);
    let volume = (rows * chunk) as u64;
    let arena = ChunkArena::new(rows, chunk).unwrap();
    for r in 0..rows as u32 {
        let mut row = arena.write_row(r).unwrap();
        for (i, b) in row.iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(r) as u8;
        }
    }
    let dir = tempfile::tempdir_in(root).unwrap();
    let mut rig = TierRig::open(dir.path(), &arena, volume);
    // The tier's request size for a KEYS_PER_JOB-key job of consecutive slots.
    let per_call = rig.tier.max_slots_per_io().min(KEYS_PER_JOB.div_ceil(IO_THREADS));
    let raw = Raw::open(dir.path(), volume, per_call);
    // Write every block of both files once before measuring: the first write into a
    // pre-allocated (unwritten) extent also converts it, which neither side should be timed on.
    raw.run(&arena, true);
    let tier_bytes = rig.tier.layout().file_len();
    for _ in 0..tier_bytes.div_ceil(volume) {
        rig.store_volume(&arena);
    }
    eprintln!(
        "chunk {} KiB: {rows} chunks per iteration, {per_call} chunk(s) per call, {IO_THREADS} calls in flight, raw O_DIRECT {}, tier O_DIRECT {}",
        chunk >> 10,
        raw.direct,
        rig.tier.direct_io()
    );
    let mut group = c.benchmark_group(format!("disk-{}KiB", chunk >> 10));
    group.throughput(Throughput::Bytes(volume));
    for (direction, write) in [("write", true), ("read", false)] {
        group.bench_function(BenchmarkId::new("raw", direction), |b| {
            b.iter_custom(|iters| {
                let t: Duration = (0..iters).map(|_| raw.run(&arena, write)).sum();
                record(tally, direction, chunk, "raw", (volume * iters) as f64, t);
                t
            });
        });
        group.bench_function(BenchmarkId::new("tier", direction), |b| {
            b.iter_custom(|iters| {
                let t: Duration = (0..iters)
                    .map(|_| {
                        if write {
                            rig.store_volume(&arena)
                        } else {
                            rig.load_volume(&arena)
                        }
                    })
                    .sum();
                record(tally, direction, chunk, "tier", (volume * iters) as f64, t);
                t
            });
        });
    }
    group.finish();
    // A second ratio comes from paired runs: raw and tier alternate (ABBA order) on the same
    // volume and the median of the per-pair ratios is reported, so drift or bursts on a shared or
    // virtual device affect both sides of a pair alike.
    for (direction, write) in [("write", true), ("read", false)] {
        let mut ratios = Vec::with_capacity(PAIRED_ROUNDS);
        for round in 0..PAIRED_ROUNDS {
            let mut run_tier = || {
                if write {
                    rig.store_volume(&arena)
                } else {
                    rig.load_volume(&arena)
                }
            };
            let (tier_t, raw_t) = if round % 2 == 0 {
                let r = raw.run(&arena, write);
                (run_tier(), r)
            } else {
                let t = run_tier();
                (t, raw.run(&arena, write))
            };
            ratios.push(raw_t.as_secs_f64() / tier_t.as_secs_f64());
        }
        ratios.sort_by(f64::total_cmp);
        let median = (ratios[(PAIRED_ROUNDS - 1) / 2] + ratios[PAIRED_ROUNDS / 2]) / 2.0;
        if let Ok(mut m) = paired.lock() {
            m.insert((direction.to_owned(), chunk), median);
        }
    }
}

fn report(tally: &Tally, paired: &BTreeMap<(String, usize), f64>, chunks: &[usize]) {
    println!(
        "\ndisk tier throughput vs raw vectored I/O ({IO_THREADS} calls in flight each, same request size, volume and filesystem)"
    );
    println!(
        "{:<6} {:>8} {:>10} {:>10} {:>8} {:>14}",
        "dir", "chunk", "raw GB/s", "tier GB/s", "ratio", "paired median"
    );
    for &chunk in chunks {
        for direction in ["write", "read"] {
            let rate = |who| {
                tally
                    .get(&(direction.to_owned(), chunk, who))
                    .map(|(bytes, t)| bytes / t.as_secs_f64() / 1e9)
            };
            let (Some(raw), Some(tier)) = (rate("raw"), rate("tier")) else {
                continue;
            };
            let pair = paired
                .get(&(direction.to_owned(), chunk))
                .map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", 100.0 * r));
            println!(
                "{direction:<6} {:>5}KiB {raw:>10.3} {tier:>10.3} {:>7.1}% {pair:>14}",
                chunk >> 10,
                100.0 * tier / raw
            );
        }
    }
}

fn main() {
    let root = std::env::var_os("KVTIER_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let mib: u64 = std::env::var("KVTIER_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let tally = Arc::new(Mutex::new(Tally::new()));
    let paired = Mutex::new(BTreeMap::new());
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let chunks: Vec<usize> = std::env::var("KVTIER_BENCH_CHUNKS")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|k| k.trim().parse::<usize>().ok())
                .map(|k| k << 10)
                .collect()
        })
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| CHUNK_SIZES.to_vec());
    for &chunk in &chunks {
        bench_chunk(&mut c, &root, mib << 20, chunk, &tally, &paired);
    }
    c.final_summary();
    if let (Ok(t), Ok(p)) = (tally.lock(), paired.lock()) {
        report(&t, &p, &chunks);
    }
}
