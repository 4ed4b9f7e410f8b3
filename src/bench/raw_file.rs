//! The storage reference of `kvtier bench tiers`: one job's bytes written to and read from a
//! scratch file with plain positioned calls (`O_DIRECT` where the filesystem accepts it,
//! buffered otherwise, and the label says which).
//!
//! For a disk tier the reference makes the calls the tier makes ([`IoShape`]): as many calls in
//! flight as the tier has I/O threads, each moving as many whole slots (payload, padding and
//! seal block) as one of the tier's submissions, from threads that wait for work as the tier's
//! do. The ratio then prices what the tier adds to the same I/O — dispatch, seals, checksums,
//! bookkeeping, hand-offs — not a different request size or queue depth. For any other storage
//! tier, whose calls are unknown, it is one call per job, the device's best case.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tier_disk::IoShape;

use super::BenchError;
use crate::host_buffer::HostBuffer;

const ALIGN: usize = 4096;

/// The calls of one job: each `(file offset, bytes)`.
#[derive(Clone, Debug)]
struct Plan {
    calls: Vec<(u64, usize)>,
    threads: usize,
}

impl Plan {
    /// One call of the whole job on the measuring thread.
    fn one_call(bytes: usize) -> Self {
        Self {
            calls: vec![(0, bytes)],
            threads: 1,
        }
    }

    /// The tier's calls for a job of `chunks` consecutive slots.
    fn matched(shape: &IoShape, chunks: usize) -> Self {
        let slot = usize::try_from(shape.slot_bytes).unwrap_or(usize::MAX);
        let per_call = shape.slots_per_call.max(1);
        let calls = (0..chunks)
            .step_by(per_call)
            .map(|first| {
                let slots = per_call.min(chunks - first);
                ((first * slot) as u64, slots * slot)
            })
            .collect();
        Self {
            calls,
            threads: shape.calls_in_flight.max(1),
        }
    }

    fn file_len(&self) -> u64 {
        self.calls.iter().map(|&(o, n)| o + n as u64).max().unwrap_or(0)
    }

    fn longest_call(&self) -> usize {
        self.calls.iter().map(|&(_, n)| n).max().unwrap_or(0)
    }
}

/// A buffer for direct I/O calls of up to `len` bytes (direct I/O needs aligned memory).
fn direct_io_buffer(len: usize) -> HostBuffer {
    HostBuffer::filled(len, ALIGN, 0xA5)
}

/// Runs `call` of `plan` on `file` with `buf`.
fn run_call(
    file: &File,
    buf: &mut HostBuffer,
    (offset, len): (u64, usize),
    write: bool,
) -> std::io::Result<()> {
    let len = len.min(buf.len());
    if write {
        file.write_all_at(&buf[..len], offset)
    } else {
        file.read_exact_at(&mut buf[..len], offset)
    }
}

/// One job handed to the reference's threads.
#[derive(Default)]
struct Round {
    generation: u64,
    write: bool,
    /// File offset of this job's region.
    base: u64,
    next_call: usize,
    threads_done: usize,
    error: Option<std::io::Error>,
    stop: bool,
}

struct PoolShared {
    file: File,
    plan: Plan,
    round: Mutex<Round>,
    start: Condvar,
    finished: Condvar,
}

/// Threads that each keep one call in flight, woken per job like the tier's I/O threads.
struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    fn start(file: File, plan: Plan) -> std::io::Result<Self> {
        let n = plan.threads;
        let longest = plan.longest_call();
        let shared = Arc::new(PoolShared {
            file,
            plan,
            round: Mutex::new(Round::default()),
            start: Condvar::new(),
            finished: Condvar::new(),
        });
        let mut pool = Self {
            shared,
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("kvtier-bench-raw-{i}"))
                .spawn(move || serve(&shared, direct_io_buffer(longest)))?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    fn run(&self, write: bool, base: u64) -> std::io::Result<()> {
        let mut r = self.shared.round.lock();
        r.generation += 1;
        r.write = write;
        r.base = base;
        r.next_call = 0;
        r.threads_done = 0;
        r.error = None;
        self.shared.start.notify_all();
        while r.threads_done < self.threads.len() {
            self.shared.finished.wait(&mut r);
        }
        r.error.take().map_or(Ok(()), Err)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.round.lock().stop = true;
        self.shared.start.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A reference thread: per job, takes calls until none is left.
fn serve(shared: &PoolShared, mut buf: HostBuffer) {
    let mut seen = 0;
    loop {
        let (write, base) = {
            let mut r = shared.round.lock();
            while r.generation == seen && !r.stop {
                shared.start.wait(&mut r);
            }
            if r.stop {
                return;
            }
            seen = r.generation;
            (r.write, r.base)
        };
        loop {
            let call = {
                let mut r = shared.round.lock();
                let i = r.next_call;
                r.next_call += 1;
                shared.plan.calls.get(i).copied()
            };
            let Some((offset, len)) = call else { break };
            let call = (base + offset, len);
            if let Err(e) = run_call(&shared.file, &mut buf, call, write) {
                shared.round.lock().error.get_or_insert(e);
            }
        }
        let mut r = shared.round.lock();
        r.threads_done += 1;
        shared.finished.notify_one();
    }
}

/// How the reference issues its calls.
enum Runner {
    /// On the measuring thread.
    Inline { file: File, buf: HostBuffer },
    /// On threads of its own.
    Pool(Pool),
}

/// The storage reference for one tier (see the module documentation). Its scratch file is
/// removed on drop.
pub(super) struct RawFile {
    path: PathBuf,
    plan_text: String,
    direct: bool,
    runner: Runner,
    calls: Vec<(u64, usize)>,
    /// Bytes of file one job covers.
    region: u64,
    /// Regions written in turn (the file grows to `regions × region`).
    regions: u64,
    /// The region of the last write (a read reads it back).
    current: u64,
    written: bool,
}

impl RawFile {
    /// A reference for jobs of `chunks` chunks of `chunk_bytes`: the tier's calls when `shape`
    /// is known, one call per job otherwise; the scratch file lives in `dir`. Each write goes
    /// to the next job-sized region of a file of up to `spread` bytes, as the tier writes each
    /// job into fresh slots: a virtual disk (or a thin-provisioned one) writes a block it has
    /// never held slower than one it holds, and rewriting one region would hide that. With
    /// `reserve`, the file is reserved with `fallocate` first, as a disk tier reserves its slab,
    /// so both sides write into reserved, never-written blocks.
    pub(super) fn open(
        dir: &Path,
        chunks: usize,
        chunk_bytes: usize,
        shape: Option<&IoShape>,
        (spread, reserve): (u64, bool),
    ) -> Result<Self, BenchError> {
        let path = dir.join(format!("kvtier-bench-raw-{}.tmp", std::process::id()));
        let err = |error| BenchError::Reference {
            reference: format!("scratch file {}", path.display()),
            error,
        };
        let (plan, plan_text) = match shape {
            Some(s) => (
                Plan::matched(s, chunks),
                format!("{}×{} slots", s.calls_in_flight, s.slots_per_call),
            ),
            None => (Plan::one_call(chunks * chunk_bytes), "1 call/job".to_owned()),
        };
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(flags)
                .open(&path)
        };
        // Direct I/O needs block-aligned offsets and lengths as well as aligned buffers.
        let aligned = plan
            .calls
            .iter()
            .all(|&(o, n)| o % ALIGN as u64 == 0 && n % ALIGN == 0);
        let (file, direct) = match open(if aligned { libc::O_DIRECT } else { 0 }) {
            Ok(f) => (f, aligned),
            Err(e) if aligned && e.raw_os_error() == Some(libc::EINVAL) => (open(0).map_err(err)?, false),
            Err(e) => return Err(err(e)),
        };
        debug_assert!(plan.file_len() > 0 || chunks == 0);
        let calls = plan.calls.clone();
        let region = plan.file_len().max(1);
        let regions = (spread / region).max(1);
        if reserve {
            let len = libc::off_t::try_from(regions * region).unwrap_or(libc::off_t::MAX);
            // SAFETY: `fallocate` only reads the descriptor number, which `file` keeps open for
            // the call; no memory is passed.
            let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, len) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                // A filesystem without `fallocate` grows the file as it is written, as the
                // tier's slab does there.
                if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                    return Err(err(e));
                }
            }
        }
        let runner = if plan.threads <= 1 {
            let buf = direct_io_buffer(plan.longest_call());
            Runner::Inline { file, buf }
        } else {
            Runner::Pool(Pool::start(file, plan).map_err(err)?)
        };
        Ok(Self {
            path,
            plan_text,
            direct,
            runner,
            calls,
            region,
            regions,
            current: 0,
            written: false,
        })
    }

    /// What the reference does, for the report: `raw O_DIRECT write, 4×8 slots`.
    pub(super) fn label(&self, op: &str) -> String {
        let how = if self.direct {
            "raw O_DIRECT"
        } else {
            "raw buffered"
        };
        format!("{how} {op}, {}", self.plan_text)
    }

    fn io_err(&self, error: std::io::Error) -> BenchError {
        BenchError::Reference {
            reference: format!("{} on {}", self.label("I/O"), self.path.display()),
            error,
        }
    }

    fn run(&mut self, write: bool) -> Result<Duration, BenchError> {
        if write && self.written {
            self.current = (self.current + 1) % self.regions;
        }
        self.written |= write;
        let base = self.current * self.region;
        let t = Instant::now();
        let result = match &mut self.runner {
            Runner::Inline { file, buf } => self
                .calls
                .iter()
                .try_for_each(|&(offset, len)| run_call(file, buf, (base + offset, len), write)),
            Runner::Pool(pool) => pool.run(write, base),
        };
        let elapsed = t.elapsed();
        result.map_err(|e| self.io_err(e))?;
        Ok(elapsed)
    }

    /// Writes one job's bytes; returns the time taken.
    pub(super) fn write_batch(&mut self) -> Result<Duration, BenchError> {
        self.run(true)
    }

    /// Reads one job's bytes back; returns the time taken.
    pub(super) fn read_batch(&mut self) -> Result<Duration, BenchError> {
        self.run(false)
    }
}

impl Drop for RawFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the benchmark scratch file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matched_plan_makes_the_tiers_calls() {
        let shape = IoShape::for_job(64 << 10, 4, 30).unwrap();
        let plan = Plan::matched(&shape, 30);
        assert_eq!(plan.threads, 4);
        let slot = 68 << 10;
        // 8 slots per call (ceil(30 / 4)), the last call the remaining 6.
        assert_eq!(
            plan.calls,
            vec![
                (0, 8 * slot),
                (8 * slot as u64, 8 * slot),
                (16 * slot as u64, 8 * slot),
                (24 * slot as u64, 6 * slot)
            ]
        );
        assert_eq!(plan.file_len(), 30 * slot as u64);
    }

    #[test]
    fn the_reference_moves_its_bytes_and_removes_its_file() {
        let dir = tempfile::tempdir().unwrap();
        for shape in [IoShape::for_job(16 << 10, 3, 10), None] {
            let region = shape.map_or(10 * (16 << 10), |s| 10 * s.slot_bytes);
            // Room for three jobs: the writes cycle through three regions.
            let mut raw =
                RawFile::open(dir.path(), 10, 16 << 10, shape.as_ref(), (3 * region + 1, false)).unwrap();
            let path = raw.path.clone();
            for n in 1..=4u64 {
                raw.write_batch().unwrap();
                raw.read_batch().unwrap();
                let len = std::fs::metadata(&path).unwrap().len();
                assert_eq!(len, n.min(3) * region);
            }
            drop(raw);
            // Reserved up front: the file holds every region before the first write.
            let raw =
                RawFile::open(dir.path(), 10, 16 << 10, shape.as_ref(), (3 * region + 1, true)).unwrap();
            assert_eq!(std::fs::metadata(&raw.path).unwrap().len(), 3 * region);
            drop(raw);
            assert!(!path.exists());
        }
    }
}
