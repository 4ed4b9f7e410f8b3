//! The child process of the crash test: writes chunks into a disk tier, as fast as it can and
//! forever, until the test kills it with SIGKILL.
//!
//! Usage: `tier-disk-crash-writer DIR CAPACITY_BYTES CHUNK_BYTES FIRST_KEY DIRECT_IO [SYNC]`
//! (DIRECT_IO is `auto` or `off`; SYNC is `never` (default), `batch` or `always`). Each job stores
//! `KEYS_PER_JOB` consecutive keys; when a job succeeds the writer prints
//! `acked <first key> <slot> <slot> …`: the slot each of its keys was written to. Keys only grow,
//! so a key written after another has a larger number. Chunk contents come from
//! [`tier_disk::testing::fill_chunk`], so the test can verify every chunk it finds after the
//! crash, and check that each acknowledged chunk survived it or lost its slot to a later store.

use std::error::Error;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use tier_disk::testing::fill_chunk;
use tier_disk::{DirectIo, DiskGeometry, DiskTier, DiskTierOptions, SyncPolicy};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobOutcome, OffloadKey, ReqContext, SecondaryTier, TransferJob,
    arena::{ChunkArena, RowGrant},
};

const KEYS_PER_JOB: usize = 4;
const JOBS_IN_FLIGHT: usize = 3;

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> Result<T, Box<dyn Error>> {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("argument {i} ({what}) missing or invalid").into())
}

fn run() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir: String = arg(&args, 1, "directory")?;
    let capacity: u64 = arg(&args, 2, "capacity")?;
    let chunk: usize = arg(&args, 3, "chunk bytes")?;
    let mut next_key: u64 = arg(&args, 4, "first key")?;
    let direct: String = arg(&args, 5, "direct_io")?;

    let mut opts = DiskTierOptions::new(dir, capacity);
    opts.io_threads = 2;
    opts.direct_io = match direct.as_str() {
        "off" => DirectIo::Off,
        _ => DirectIo::Auto,
    };
    opts.sync = match args.get(6).map(String::as_str) {
        None | Some("never") => SyncPolicy::Never,
        Some("batch") => SyncPolicy::Batch,
        Some("always") => SyncPolicy::Always,
        Some(other) => {
            return Err(format!("argument 6 (sync) must be never, batch or always, not {other}").into());
        }
    };
    let geometry = DiskGeometry {
        chunk_bytes: chunk,
        row_stride: chunk.next_multiple_of(4096),
    };
    let mut tier = DiskTier::open(&opts, geometry)?;
    let arena = ChunkArena::new(KEYS_PER_JOB * JOBS_IN_FLIGHT, chunk)?;
    let waker = ControlWaker::new();
    tier.set_waker(waker.clone());
    let ctx = ReqContext::local("crash-writer");
    let mut job_id = 0u64;
    let mut first_keys = std::collections::HashMap::new();
    let mut results = Vec::new();
    loop {
        for j in 0..JOBS_IN_FLIGHT {
            let rows: Vec<u32> = (0..KEYS_PER_JOB).map(|i| (j * KEYS_PER_JOB + i) as u32).collect();
            let keys: Vec<OffloadKey> = (0..KEYS_PER_JOB as u64)
                .map(|i| OffloadKey::from_u64(next_key + i))
                .collect();
            next_key += KEYS_PER_JOB as u64;
            for (k, &r) in keys.iter().zip(&rows) {
                fill_chunk(k, &mut arena.write_row(r)?);
            }
            job_id += 1;
            first_keys.insert(JobId(job_id), next_key - KEYS_PER_JOB as u64);
            tier.submit_store(TransferJob {
                id: JobId(job_id),
                kind: JobKind::Store,
                keys,
                chunk_ids: rows.clone(),
                req: ctx.clone(),
                rows: RowGrant::Read(arena.read_rows(&rows)?),
            });
        }
        let mut finished = 0;
        while finished < JOBS_IN_FLIGHT {
            results.clear();
            tier.poll_finished(&mut results);
            let mut out = std::io::stdout().lock();
            for r in &results {
                finished += 1;
                let first = first_keys.remove(&r.id).ok_or("a result for an unknown job")?;
                if r.outcome == JobOutcome::Ok {
                    // Only this thread submits stores, so no key of the job lost its slot yet.
                    write!(out, "acked {first}")?;
                    for n in first..first + KEYS_PER_JOB as u64 {
                        let slot = tier
                            .slot_location(&OffloadKey::from_u64(n))
                            .ok_or("an acknowledged key is not readable")?
                            .slot;
                        write!(out, " {slot}")?;
                    }
                    writeln!(out)?;
                }
            }
            out.flush()?;
            drop(out);
            if finished < JOBS_IN_FLIGHT {
                waker.wait(Duration::from_millis(50));
            }
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tier-disk-crash-writer: {e}");
            ExitCode::FAILURE
        }
    }
}
