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

/// Starts the threads (named `kvtier-disk-io-<i>`) for `io_threads` calls in flight: twice as
/// many, or one for `io_threads = 1`, whose single thread keeps dispatch order and completion
/// order equal. Runs are weighed in chunks and bytes, so the lanes' depths are the meters'
/// queued and in-flight chunks.
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
    let threads = if io_threads > 1 { 2 * io_threads } else { 1 };
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
