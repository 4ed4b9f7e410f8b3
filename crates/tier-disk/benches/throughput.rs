//! Disk tier store and load throughput against raw `O_DIRECT` positioned I/O doing the same work,
//! measured in the same run, round by round, and a verdict per direction and chunk size.
//!
//! The reference makes the tier's calls: a file laid out as the tier's slab (same length, same
//! 4 KiB header, same slot size: payload, padding and one 4 KiB block per chunk), reserved with
//! `fallocate` and written once in full before measuring, as the tier's slab is; `IO_THREADS`
//! threads taking calls from one shared queue (one call in flight each, as the tier's I/O
//! threads); each `KEYS_PER_JOB`-chunk job split into vectored calls of as many consecutive
//! slots as the tier puts in one submission ([`IoShape`]); each write round into the region of
//! the file written longest ago, as the tier's stores evict its oldest slots, and each read round
//! from the region written last, as the tier's loads read the chunks stored last. Both sides
//! move the same bytes from and into the same arena rows, on the same filesystem.
//!
//! What the ratio then prices is the tier's own work around the I/O: building seals and
//! checksums, verifying reads, index and job bookkeeping, queue hand-offs, and any call the
//! tier makes smaller than the reference's. That work is CPU time; on a machine whose load
//! average exceeds its cores it waits for a core, so the ratio falls with the machine's load
//! (the report prints it).
//!
//! A third side prices the one piece of that work no integrity-checked store can skip: a second
//! raw reference (its own file, same layout and calls) that also hashes every payload with XXH3,
//! the slot format's hash, before its write and after its read. The report gives its throughput
//! against the raw side's, and the tier's against it.
//!
//! Each side's round is also charged the CPU time and the context switches of the whole process
//! while it ran (its threads and, for the tier, the bench thread building, submitting and
//! collecting the round's jobs, as a control thread would, the building untimed on the wall
//! clock): on a machine with few cores that CPU is what the sides compete with other work for,
//! so the columns say where a low ratio under load comes from.
//!
//! A shared virtual disk moves single rounds by ±20 %: the three sides run in each of their six
//! orders in turn (the round count is rounded up to a multiple of six), and the verdict is on the
//! median of the per-round ratios, which such bursts hit on every side alike.
//!
//! `cargo bench -p tier-disk --bench throughput`. Environment: `KVTIER_BENCH_DIR` (default: the
//! system temp dir), `KVTIER_BENCH_MIB` (volume per round, default 64), `KVTIER_BENCH_CHUNKS`
//! (chunk sizes in KiB, comma-separated; default 16,256,2048), `KVTIER_BENCH_ROUNDS` (rounds
//! per direction, each running every side once; default 24).

use std::fs::{File, OpenOptions};
use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tier_disk::{DiskGeometry, DiskTier, DiskTierOptions, IoShape, SlabLayout};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobOutcome, JobResult, OffloadKey, ReqContext, SecondaryTier, TransferJob,
    arena::{ChunkArena, RowGrant},
};
use twox_hash::XxHash3_64;

const IO_THREADS: usize = 4;
const KEYS_PER_JOB: usize = 16;
const CHUNK_SIZES: [usize; 3] = [16 << 10, 256 << 10, 2 << 20];
/// Rounds per direction and chunk size (each runs every side once), unless `KVTIER_BENCH_ROUNDS`
/// says otherwise; a multiple of six, the number of orders of the three sides.
const ROUNDS: usize = 24;
/// The tier must reach this share of the reference's throughput.
const TARGET: f64 = 0.9;

/// One `pwritev`/`preadv` of every byte of `iov` at `off` (the files are big enough that a
/// short transfer is an error).
fn vectored(file: &File, iov: &[libc::iovec], off: u64, write: bool) {
    let want: usize = iov.iter().map(|v| v.iov_len).sum();
    // SAFETY: `iov` describes `iov.len()` live buffers the caller holds for the call (row
    // guards and its own tail buffer), each valid for `iov_len` bytes; a write only reads them,
    // a read writes buffers the caller holds exclusively (write guards, its own tails).
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

/// The raw reference: a file of the tier's layout, moved with the tier's calls.
struct Raw {
    file: File,
    direct: bool,
    layout: SlabLayout,
    /// One round's calls: (first row, rows), each row into the slot of the same number within
    /// the round's region.
    calls: Vec<(usize, usize)>,
    rows: usize,
    /// Volume-sized regions of slots in the file.
    regions: usize,
    /// The region written last.
    current: usize,
    /// Page-aligned padding + seal block for every slot one call moves, per thread.
    tails: Arc<ChunkArena>,
    tail_len: usize,
}

impl Raw {
    fn open(path: &Path, layout: SlabLayout, rows: usize, shape: IoShape) -> Self {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap();
        let len = layout.file_len();
        // SAFETY: plain syscall on an open descriptor; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        assert_eq!(rc, 0, "fallocate of the raw reference failed");
        let (file, direct) = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(direct) => (direct, true),
            Err(_) => (file, false),
        };
        // The tier splits each job on its own: calls never span two jobs.
        let per_call = shape.slots_per_call.max(1);
        let mut calls = Vec::new();
        for job in (0..rows).step_by(KEYS_PER_JOB) {
            let end = (job + KEYS_PER_JOB).min(rows);
            for first in (job..end).step_by(per_call) {
                calls.push((first, per_call.min(end - first)));
            }
        }
        let tail_len = layout.pad() + 4096;
        let tails = ChunkArena::new(IO_THREADS * per_call, tail_len).unwrap();
        Self {
            file,
            direct,
            layout,
            calls,
            rows,
            regions: (layout.num_slots as usize / rows).max(1),
            current: 0,
            tails,
            tail_len,
        }
    }

    /// Writes every region once (untimed): the first write into a reserved extent also
    /// converts it, which the tier's warm-up pays too.
    fn fill(&mut self, arena: &Arc<ChunkArena>) {
        for _ in 0..self.regions {
            self.run(arena, true, false);
        }
    }

    /// One round: a write into the region written longest ago, or a read of the region written
    /// last; with `checksum`, each payload is hashed before its write or after its read.
    fn run(&mut self, arena: &Arc<ChunkArena>, write: bool, checksum: bool) -> Duration {
        if write {
            self.current = (self.current + 1) % self.regions;
        }
        let base = (self.current * self.rows) as u32;
        let next = AtomicUsize::new(0);
        let start = Instant::now();
        std::thread::scope(|s| {
            for t in 0..IO_THREADS {
                let (next, this) = (&next, &*self);
                s.spawn(move || this.serve(arena, t, base, next, write, checksum));
            }
        });
        start.elapsed()
    }

    /// One thread: takes calls off the shared list until none is left.
    fn serve(
        &self,
        arena: &Arc<ChunkArena>,
        thread: usize,
        base: u32,
        next: &AtomicUsize,
        write: bool,
        checksum: bool,
    ) {
        let per_thread = self.tails.num_chunks() / IO_THREADS;
        let tail_rows: Vec<u32> = (0..per_thread)
            .map(|i| (thread * per_thread + i) as u32)
            .collect();
        let mut tails = self.tails.write_rows(&tail_rows).unwrap();
        loop {
            let Some(&(first, n)) = self.calls.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            let ids: Vec<u32> = (first..first + n).map(|r| r as u32).collect();
            let off = self.layout.slot_offset(base + first as u32);
            let mut iov = Vec::with_capacity(2 * n);
            if write {
                let rows = arena.read_rows(&ids).unwrap();
                for (row, tail) in rows.iter().zip(tails.iter_mut()) {
                    if checksum {
                        // Kept in the slot's tail, as a seal keeps it.
                        tail[..8].copy_from_slice(&XxHash3_64::oneshot(row).to_le_bytes());
                    }
                    iov.push(libc::iovec {
                        iov_base: row.as_ptr() as *mut libc::c_void,
                        iov_len: row.len(),
                    });
                    iov.push(libc::iovec {
                        iov_base: tail.as_mut_ptr().cast(),
                        iov_len: self.tail_len,
                    });
                }
                vectored(&self.file, &iov, off, true);
            } else {
                let mut rows = arena.write_rows(&ids).unwrap();
                for (row, tail) in rows.iter_mut().zip(tails.iter_mut()) {
                    iov.push(libc::iovec {
                        iov_base: row.as_mut_ptr().cast(),
                        iov_len: row.len(),
                    });
                    iov.push(libc::iovec {
                        iov_base: tail.as_mut_ptr().cast(),
                        iov_len: self.tail_len,
                    });
                }
                vectored(&self.file, &iov, off, false);
                if checksum {
                    for row in &rows {
                        black_box(XxHash3_64::oneshot(row));
                    }
                }
            }
        }
    }
}

/// The tier under test.
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
            // New keys every round: every store writes new slots.
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

    /// One round: every row stored under new keys, or the keys stored last loaded back.
    fn run(&mut self, arena: &Arc<ChunkArena>, store: bool) -> Duration {
        let kind = if store { JobKind::Store } else { JobKind::Promotion };
        let jobs = self.jobs(arena, kind);
        let n = jobs.len();
        if store {
            self.resident = jobs.iter().flat_map(|j| j.keys.clone()).collect();
        }
        let start = Instant::now();
        for j in jobs {
            if store {
                self.tier.submit_store(j);
            } else {
                self.tier.submit_load(j);
            }
        }
        let results = self.wait(n);
        let t = start.elapsed();
        assert!(
            results.iter().all(|r| r.outcome == JobOutcome::Ok),
            "a {kind:?} job failed"
        );
        t
    }

    /// I/O submissions made so far in one direction.
    fn submissions(&self, store: bool) -> u64 {
        let cost = self.tier.io_cost();
        if store {
            cost.stores.samples
        } else {
            cost.loads.samples
        }
    }
}

/// The figures of one direction and chunk size.
struct Figures {
    direction: &'static str,
    chunk: usize,
    raw_gbps: f64,
    tier_gbps: f64,
    /// Per-round tier/raw ratios, sorted.
    ratios: Vec<f64>,
    /// Per-round (raw + checksums)/raw ratios, sorted.
    checksummed: Vec<f64>,
    /// Per-round tier/(raw + checksums) ratios, sorted.
    tier_vs_checksummed: Vec<f64>,
    raw_calls: usize,
    tier_calls: f64,
    /// Median CPU time of the whole process per round, in ms: raw, raw + checksums, tier.
    cpu_ms: [f64; 3],
    /// Median context switches of the whole process per round: raw, raw + checksums, tier.
    switches: [f64; 3],
}

impl Figures {
    fn median(&self) -> f64 {
        median_of(&self.ratios)
    }
}

/// The median of sorted `v`.
fn median_of(v: &[f64]) -> f64 {
    let n = v.len();
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

/// CPU time used so far by every thread of this process (the bench's own and the tier's), and
/// their context switches (voluntary and not).
fn process_usage() -> (Duration, u64) {
    // SAFETY: `rusage` is plain old data: all zeroes is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the call's duration.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut ru) };
    assert_eq!(rc, 0, "getrusage failed");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (
        tv(ru.ru_utime) + tv(ru.ru_stime),
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
    )
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_owned(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

fn bench_chunk(root: &Path, volume: u64, chunk: usize, rounds: usize) -> Vec<Figures> {
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
    let layout = rig.tier.layout();
    let shape = IoShape::for_job(chunk, IO_THREADS, KEYS_PER_JOB).unwrap();
    assert_eq!(
        shape.slot_bytes, layout.slot_bytes,
        "the reference's slots are the tier's"
    );
    let mut raw = Raw::open(&dir.path().join("raw-reference.bin"), layout, rows, shape);
    let mut summed = Raw::open(&dir.path().join("raw-checksummed.bin"), layout, rows, shape);
    // Every slot of the three files written once before measuring.
    raw.fill(&arena);
    summed.fill(&arena);
    for _ in 0..=(layout.num_slots as usize).div_ceil(rows) {
        rig.run(&arena, true);
    }
    eprintln!(
        "chunk {} KiB: {rows} chunks per round in jobs of {KEYS_PER_JOB}, {} slot(s) of {} KiB per call, \
         {IO_THREADS} calls in flight, {} regions of file; raw O_DIRECT {}, tier O_DIRECT {}",
        chunk >> 10,
        shape.slots_per_call,
        layout.slot_bytes >> 10,
        raw.regions,
        raw.direct,
        rig.tier.direct_io()
    );
    let mut out = Vec::new();
    for (direction, write) in [("store", true), ("load", false)] {
        let mut ratios = Vec::with_capacity(rounds);
        let mut checksummed = Vec::with_capacity(rounds);
        let mut tier_vs_checksummed = Vec::with_capacity(rounds);
        let (mut raw_total, mut tier_total) = (Duration::ZERO, Duration::ZERO);
        let before = rig.submissions(write);
        let mut cpu: [Vec<f64>; 3] = Default::default();
        let mut switches: [Vec<f64>; 3] = Default::default();
        for round in 0..rounds {
            // The three sides (raw, raw + checksums, tier) go in each of their six orders in
            // turn, so a burst of the shared disk lands on every side alike.
            let mut order = [0, 1, 2];
            order.rotate_left(round % 3);
            if (round / 3) % 2 == 1 {
                order.reverse();
            }
            let mut took = [Duration::ZERO; 3];
            for side in order {
                let (cpu_before, switches_before) = process_usage();
                took[side] = match side {
                    0 => raw.run(&arena, write, false),
                    1 => summed.run(&arena, write, true),
                    _ => rig.run(&arena, write),
                };
                let (cpu_after, switches_after) = process_usage();
                cpu[side].push((cpu_after - cpu_before).as_secs_f64());
                switches[side].push((switches_after - switches_before) as f64);
            }
            let [raw_t, sum_t, tier_t] = took.map(|t| t.as_secs_f64());
            raw_total += took[0];
            tier_total += took[2];
            ratios.push(raw_t / tier_t);
            checksummed.push(raw_t / sum_t);
            tier_vs_checksummed.push(sum_t / tier_t);
        }
        for v in [&mut ratios, &mut checksummed, &mut tier_vs_checksummed]
            .into_iter()
            .chain(cpu.iter_mut())
            .chain(switches.iter_mut())
        {
            v.sort_by(f64::total_cmp);
        }
        let moved = (volume * rounds as u64) as f64;
        out.push(Figures {
            direction,
            chunk,
            raw_gbps: moved / raw_total.as_secs_f64() / 1e9,
            tier_gbps: moved / tier_total.as_secs_f64() / 1e9,
            ratios,
            checksummed,
            tier_vs_checksummed,
            raw_calls: raw.calls.len(),
            tier_calls: (rig.submissions(write) - before) as f64 / rounds as f64,
            cpu_ms: cpu.map(|v| 1e3 * median_of(&v)),
            switches: switches.map(|v| median_of(&v)),
        });
    }
    out
}

fn report(figures: &[Figures], rounds: usize) -> bool {
    println!(
        "\ndisk tier vs raw O_DIRECT doing the same calls ({IO_THREADS} in flight, same slots, new slots every store round), {rounds} rounds of the three sides"
    );
    println!(
        "{:<6} {:>8} {:>9} {:>10} {:>7} {:>7} {:>15} {:>12} {:>8} {:>10} {:>10} {:>20} {:>18}",
        "dir",
        "chunk",
        "raw GB/s",
        "tier GB/s",
        "total",
        "median",
        "min-max",
        "calls/round",
        "verdict",
        "+xxh3/raw",
        "tier/+xxh3",
        "CPU ms raw/+x/tier",
        "switches r/+x/tier"
    );
    let mut all = true;
    for f in figures {
        let median = f.median();
        let pass = median >= TARGET;
        all &= pass;
        println!(
            "{:<6} {:>5}KiB {:>9.3} {:>10.3} {:>6.1}% {:>6.1}% {:>6.1}%-{:>5.1}% {:>5}/{:<6.0} {:>8} {:>9.1}% {:>9.1}% {:>6.1}/{:>5.1}/{:>5.1} {:>6.0}/{:>5.0}/{:>5.0}",
            f.direction,
            f.chunk >> 10,
            f.raw_gbps,
            f.tier_gbps,
            100.0 * f.tier_gbps / f.raw_gbps,
            100.0 * median,
            100.0 * f.ratios[0],
            100.0 * f.ratios[f.ratios.len() - 1],
            f.raw_calls,
            f.tier_calls,
            if pass { "PASS" } else { "FAIL" },
            100.0 * median_of(&f.checksummed),
            100.0 * median_of(&f.tier_vs_checksummed),
            f.cpu_ms[0],
            f.cpu_ms[1],
            f.cpu_ms[2],
            f.switches[0],
            f.switches[1],
            f.switches[2]
        );
    }
    println!(
        "verdict: {} (target: median per-round tier/raw >= {:.0}% for every row). calls/round: raw/tier; \
         the ratio prices the tier's CPU work per call (seals, checksums, bookkeeping, hand-offs) and any \
         call it makes smaller, so it falls when the machine's load exceeds its cores. +xxh3/raw: median \
         per-round throughput of the raw reference hashing every payload (the part of that work an \
         integrity-checked store cannot skip) against the raw one; tier/+xxh3: the tier against it. \
         CPU ms and switches: each side's median CPU time and context switches of the whole \
         process per round (the tier's include the bench thread building, submitting and \
         collecting its jobs).",
        if all { "PASS" } else { "FAIL" },
        100.0 * TARGET
    );
    all
}

fn main() {
    let root = std::env::var_os("KVTIER_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let mib = env("KVTIER_BENCH_MIB", 64);
    let rounds = usize::try_from(env("KVTIER_BENCH_ROUNDS", ROUNDS as u64))
        .unwrap_or(ROUNDS)
        .max(1)
        .next_multiple_of(6);
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
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    let load_before = load_average();
    let figures: Vec<Figures> = chunks
        .iter()
        .flat_map(|&chunk| bench_chunk(&root, mib << 20, chunk, rounds))
        .collect();
    report(&figures, rounds);
    println!(
        "machine: {} cores, load average (1/5/15 min) {load_before} before, {} after",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        load_average()
    );
}
