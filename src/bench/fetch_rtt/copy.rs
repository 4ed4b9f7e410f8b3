//! The producer's device→cpu copies, as every copy worker makes them (a thread of the producer's
//! process, or the worker processes of `--workers-process`; see [`super::copy_workers`]): a worker really
//! copies each chunk's bytes from its "device" buffer into the arena row, and the copy lasts
//! as long as those bytes take at the memcpy rate measured at the start of the run (a copy
//! that finished sooner, e.g. from a hot cache, waits out the rest).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tiering_core::{
    OffloadKey,
    arena::{ChunkArena, ChunkId},
};

use crate::host_buffer::{DEVICE_ALIGN, HostBuffer};
use crate::sim::fill_chunk;

/// One store for the copy workers: request `request`'s chunks go to `rows`, in key order.
#[derive(Clone, Debug)]
pub(super) struct CopyOrder {
    /// The request (index into the run's key lists).
    pub request: usize,
    /// The rows `prepare_store` handed out.
    pub rows: Vec<ChunkId>,
}

/// A worker's "copy finished" for one request: (request, rank, success, when). `when` is the
/// copy's end as this process learns it: a worker thread stamps it as it finishes, a worker
/// process's report is stamped when its line is read.
pub(super) type CopyDone = (usize, u32, bool, Instant);

/// Memcpy throughput of `chunk_bytes`-sized copies in this process, bytes per second (median
/// of repeated copies between two warm buffers).
pub(super) fn memcpy_rate(chunk_bytes: usize) -> f64 {
    let mut src = HostBuffer::filled(chunk_bytes, DEVICE_ALIGN, 0);
    for (i, b) in src.iter_mut().enumerate() {
        *b = i as u8;
    }
    // Aligned as the rows are, so the rate is that of the copies the workers make.
    let mut dst = HostBuffer::page_aligned(chunk_bytes);
    dst.copy_from_slice(&src);
    let mut samples: Vec<f64> = (0..200)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&*src));
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    let median = samples[samples.len() / 2].max(1e-9);
    chunk_bytes as f64 / median
}

/// How long `bytes` take at `rate` bytes per second.
pub(super) fn copy_duration(bytes: usize, rate: f64) -> Duration {
    Duration::from_secs_f64(bytes as f64 / rate.max(1.0))
}

/// Copies `keys[i]`'s device bytes (`sources[i]`) into `rows[i]` of `arena` for the indices
/// this rank owns (`i % ranks == rank`), then waits out the rest of the copy time of those
/// bytes. Returns whether every row could be written.
pub(super) fn copy_share(
    arena: &Arc<ChunkArena>,
    sources: &[HostBuffer],
    rows: &[ChunkId],
    rank: u32,
    ranks: u32,
    rate: f64,
) -> bool {
    let started = Instant::now();
    let mut ok = true;
    let mut bytes = 0;
    for (i, (src, &row)) in sources.iter().zip(rows).enumerate() {
        if i % ranks as usize != rank as usize {
            continue;
        }
        match arena.write_row(row) {
            Ok(mut grant) => {
                let n = src.len().min(grant.len());
                grant[..n].copy_from_slice(&src[..n]);
                bytes += n;
            }
            Err(e) => {
                tracing::error!(error = %e, row, "bench copy worker cannot write its row");
                ok = false;
            }
        }
    }
    wait_until(started + copy_duration(bytes, rate));
    ok
}

/// Below this a copy's remaining time is spun, not slept: a sleep lasts at least the timer
/// slack (50 µs) plus a wake-up, which would stretch a 7 µs copy of 256 KiB tenfold (a copy
/// worker waiting on its DMA polls the completion; it does not go to sleep for microseconds).
const SPIN_BELOW: Duration = Duration::from_micros(100);

/// Returns at `due`: asleep until shortly before it, then spinning.
fn wait_until(due: Instant) {
    loop {
        let now = Instant::now();
        let Some(left) = due.checked_duration_since(now).filter(|d| !d.is_zero()) else {
            return;
        };
        if left > SPIN_BELOW {
            std::thread::sleep(left - SPIN_BELOW);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The device buffers of a request: each key's deterministic bytes.
pub(super) fn device_bytes(keys: &[OffloadKey], chunk_bytes: usize) -> Vec<HostBuffer> {
    keys.iter()
        .map(|k| {
            let mut b = HostBuffer::filled(chunk_bytes, DEVICE_ALIGN, 0);
            fill_chunk(k, &mut b);
            b
        })
        .collect()
}
