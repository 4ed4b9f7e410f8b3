//! The bounded pool of I/O threads and its two queues: loads (promotions) and stores.
//!
//! Loads go first, because a request is waiting for them, while a store only frees primary
//! memory later. So that stores still progress under a steady stream of loads, a thread takes
//! the oldest store after [`LOADS_PER_STORE`] loads were taken in a row while a store was
//! waiting: a queued store waits behind at most `LOADS_PER_STORE` load submissions for each
//! store submission ahead of it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::exec::{self, Scratch};
use crate::gate::IoGate;
use crate::meter::DirectionCost;
use crate::shared::{Run, Shared};

/// Load submissions taken in a row, while a store waits, before one store submission goes.
pub const LOADS_PER_STORE: usize = 8;

#[derive(Default)]
struct Lane {
    runs: VecDeque<Run>,
    chunks: u64,
    bytes: u64,
    in_flight: u64,
}

impl Lane {
    fn push(&mut self, run: Run, chunk_bytes: u64) {
        let n = run.items.len() as u64;
        self.chunks += n;
        self.bytes += n * chunk_bytes;
        self.runs.push_back(run);
    }

    fn pop(&mut self, chunk_bytes: u64) -> Option<Run> {
        let run = self.runs.pop_front()?;
        let n = run.items.len() as u64;
        self.chunks -= n;
        self.bytes -= n * chunk_bytes;
        self.in_flight += n;
        Some(run)
    }

    fn take_all(&mut self) -> impl Iterator<Item = Run> + '_ {
        self.chunks = 0;
        self.bytes = 0;
        self.runs.drain(..)
    }

    fn cost(&self) -> DirectionCost {
        DirectionCost {
            queued_chunks: self.chunks,
            queued_bytes: self.bytes,
            in_flight_chunks: self.in_flight,
            ..DirectionCost::default()
        }
    }
}

#[derive(Default)]
struct QueueState {
    loads: Lane,
    stores: Lane,
    /// Loads taken in a row while a store was waiting.
    loads_in_a_row: usize,
    stop: bool,
}

impl QueueState {
    /// The next run: loads first, with the fairness bound for stores.
    fn next(&mut self, chunk_bytes: u64) -> Option<Run> {
        let store_waits = !self.stores.runs.is_empty();
        let store_turn =
            store_waits && (self.loads.runs.is_empty() || self.loads_in_a_row >= LOADS_PER_STORE);
        if store_turn {
            self.loads_in_a_row = 0;
            return self.stores.pop(chunk_bytes);
        }
        let run = self.loads.pop(chunk_bytes)?;
        if store_waits {
            self.loads_in_a_row += 1;
        }
        Some(run)
    }
}

struct Queue {
    state: Mutex<QueueState>,
    cond: Condvar,
    /// At most `io_threads` of the threads' calls in flight.
    gate: IoGate,
}

/// Threads taking submissions from the load and store queues: `io_threads` calls in flight at
/// most (see [`IoGate`]), served by twice as many threads when there are several, so one
/// thread's checksums overlap another's call.
pub(crate) struct Pool {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
    chunk_bytes: u64,
}

impl Pool {
    /// Starts the threads (named `kvtier-disk-io-<i>`) for `n` calls in flight: `2n` of them,
    /// or one for `n = 1`, whose single thread keeps dispatch order and completion order equal.
    pub(crate) fn start(shared: &Arc<Shared>, n: usize) -> std::io::Result<Self> {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            cond: Condvar::new(),
            gate: IoGate::new(n),
        });
        let n = if n > 1 { 2 * n } else { n };
        let chunk_bytes = shared.slab.layout().chunk_bytes as u64;
        let mut pool = Self {
            queue,
            threads: Vec::with_capacity(n),
            chunk_bytes,
        };
        for i in 0..n {
            let scratch = Scratch::new(shared.slab.layout(), shared.max_run)?;
            let shared = Arc::clone(shared);
            let queue = Arc::clone(&pool.queue);
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-disk-io-{i}"))
                .spawn(move || worker(&shared, &queue, scratch, chunk_bytes));
            match spawned {
                Ok(handle) => pool.threads.push(handle),
                Err(e) => {
                    pool.stop_and_join();
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }

    /// Queues runs, each on its direction's queue (FIFO within a direction).
    pub(crate) fn push(&self, runs: impl IntoIterator<Item = Run>) {
        let mut q = self.queue.state.lock();
        let mut added = 0;
        for run in runs {
            if run.is_load() {
                q.loads.push(run, self.chunk_bytes);
            } else {
                q.stores.push(run, self.chunk_bytes);
            }
            added += 1;
        }
        drop(q);
        if added == 1 {
            self.queue.cond.notify_one();
        } else if added > 1 {
            self.queue.cond.notify_all();
        }
    }

    /// Removes every run not yet started; runs taken by a thread that still waits for its
    /// permit are cancelled by that thread.
    pub(crate) fn take_queued(&self) -> Vec<Run> {
        let mut q = self.queue.state.lock();
        let mut out: Vec<Run> = q.loads.take_all().collect();
        out.extend(q.stores.take_all());
        // Under the queue lock: a run taken from now on waits in the new epoch.
        self.queue.gate.cancel_waiting();
        out
    }

    /// Chunks waiting for a thread.
    pub(crate) fn queued(&self) -> u64 {
        let q = self.queue.state.lock();
        q.loads.chunks + q.stores.chunks
    }

    /// What is queued and in flight, per direction (the averages are filled in by the caller).
    pub(crate) fn depths(&self) -> (DirectionCost, DirectionCost) {
        let q = self.queue.state.lock();
        (q.loads.cost(), q.stores.cost())
    }

    /// Stops the threads once the queues are empty and joins them; returns how many panicked.
    pub(crate) fn stop_and_join(&mut self) -> usize {
        self.queue.state.lock().stop = true;
        self.queue.cond.notify_all();
        self.threads
            .drain(..)
            .map(JoinHandle::join)
            .filter(Result::is_err)
            .count()
    }
}

fn worker(shared: &Shared, queue: &Queue, mut scratch: Scratch, chunk_bytes: u64) {
    loop {
        let (run, epoch) = {
            let mut q = queue.state.lock();
            loop {
                if let Some(r) = q.next(chunk_bytes) {
                    break (r, queue.gate.epoch());
                }
                if q.stop {
                    return;
                }
                queue.cond.wait(&mut q);
            }
        };
        let load = run.is_load();
        let n = run.items.len() as u64;
        let waited = run.queued.elapsed();
        let sample = exec::run(shared, &mut scratch, run, (&queue.gate, epoch));
        shared.record_io(load, sample, waited);
        let mut q = queue.state.lock();
        let lane = if load { &mut q.loads } else { &mut q.stores };
        lane.in_flight -= n;
    }
}
