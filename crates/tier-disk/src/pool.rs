//! The I/O threads and their two lanes, loads (promotions) and stores, on `tier-kit`.
//!
//! Loads go first, because a request is waiting for them, while a store only frees primary
//! memory later. So that stores still progress under a steady stream of loads, a thread takes
//! the oldest store after [`LOADS_PER_STORE`] loads were taken in a row while a store was
//! waiting (`tier_kit::LaneSpec::served_after`): a queued store waits behind at most
//! `LOADS_PER_STORE` load submissions for each store submission ahead of it.
//!
//! The queue, the threads, the panic guard, the queued and in-flight depths and the bounded
//! join are `tier_kit`'s [`WorkQueue`] and [`WorkerPool`]. What is the disk's: how many threads
//! serve how many calls in flight (the [`IoGate`](crate::gate::IoGate) in [`Shared`]), each
//! thread's scratch space for seals, and what a thread does with a run ([`crate::exec`]).

use std::sync::Arc;

use tier_kit::{KitCounters, LaneSpec, Weight, WorkQueue, Worker, WorkerPool};

use crate::exec::{self, Scratch};
use crate::meter::DirectionCost;
use crate::shared::{Run, Shared};

/// Load submissions taken in a row, while a store waits, before one store submission goes.
pub const LOADS_PER_STORE: usize = 8;

/// The lane of promotions (served first).
pub(crate) const LOADS: usize = 0;
/// The lane of stores (served after [`LOADS_PER_STORE`] loads passed a waiting one).
pub(crate) const STORES: usize = 1;

/// One I/O thread: its scratch space for seals, and the state it shares with the handle.
struct IoThread {
    shared: Arc<Shared>,
    scratch: Scratch,
}

impl Worker<Run> for IoThread {
    fn run(&mut self, run: Run) {
        let load = run.is_load();
        let waited = run.queued.elapsed();
        let sample = exec::run(&self.shared, &mut self.scratch, run);
        self.shared.record_io(load, sample, waited);
    }
}

/// Chunks from this size up get spare I/O threads (see [`thread_count`]).
pub(crate) const SPARE_THREADS_FROM_CHUNK: usize = 128 << 10;

/// How many threads serve `io_threads` calls in flight of chunks of `chunk_bytes`.
///
/// One for `io_threads = 1`, whose single thread keeps dispatch order and completion order
/// equal. For chunks of [`SPARE_THREADS_FROM_CHUNK`] and more, twice `io_threads`: the spare
/// threads seal the next stores and verify finished loads while the others hold the device, which
/// matters when hashing a call's slots takes tens of microseconds (on the 2-core dev VM, 2 MiB
/// stores lost 2–10 % of their throughput without them). Below, exactly `io_threads`: hashing a
/// small call takes a few microseconds, less than the two context switches every call then
/// costs at the gate, a spare thread going to sleep for a permit and being woken for it (16 KiB
/// chunks: 2.6 switches per call and 2.0× the raw reference's CPU per round with spares, 1.3
/// and 1.6× without, throughput no lower).
pub(crate) fn thread_count(io_threads: usize, chunk_bytes: usize) -> usize {
    match io_threads {
        0 | 1 => 1,
        n if chunk_bytes >= SPARE_THREADS_FROM_CHUNK => 2 * n,
        n => n,
    }
}

/// Starts the threads (named `kvtier-disk-io-<i>`) for `io_threads` calls in flight, as many as
/// [`thread_count`] says. Runs are weighed in chunks and bytes, so the lanes' depths are the
/// meters' queued and in-flight chunks.
pub(crate) fn start(
    shared: &Arc<Shared>,
    io_threads: usize,
    counters: &Arc<KitCounters>,
) -> std::io::Result<WorkerPool<Run>> {
    let chunk_bytes = shared.slab.layout().chunk_bytes as u64;
    let queue = WorkQueue::builder()
        .lane(LaneSpec::unbounded())
        .lane(LaneSpec::unbounded().served_after(LOADS_PER_STORE))
        .weigh(move |run: &Run| {
            let n = run.items.len() as u64;
            Weight::new(n, n * chunk_bytes)
        })
        .counters(Arc::clone(counters))
        .build();
    let threads = thread_count(io_threads, shared.slab.layout().chunk_bytes);
    WorkerPool::builder("kvtier-disk-io")
        .threads(threads)
        .counters(Arc::clone(counters))
        .start(Arc::new(queue), |_| {
            Ok(IoThread {
                shared: Arc::clone(shared),
                scratch: Scratch::new(shared.slab.layout(), shared.max_run)?,
            })
        })
}

/// What `lane` holds and runs (the averages are the caller's to fill in).
pub(crate) fn depth(queue: &WorkQueue<Run>, lane: usize) -> DirectionCost {
    let d = queue.depth(lane);
    DirectionCost {
        queued_chunks: d.queued.items,
        queued_bytes: d.queued.bytes,
        in_flight_chunks: d.in_flight.items,
        ..DirectionCost::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_threads_serve_only_large_chunks() {
        assert_eq!(thread_count(1, 2 << 20), 1, "one thread keeps completion order");
        assert_eq!(thread_count(0, 16 << 10), 1);
        assert_eq!(thread_count(4, 16 << 10), 4);
        assert_eq!(thread_count(4, SPARE_THREADS_FROM_CHUNK - 1), 4);
        assert_eq!(thread_count(4, SPARE_THREADS_FROM_CHUNK), 8);
        assert_eq!(thread_count(4, 2 << 20), 8);
    }
}
