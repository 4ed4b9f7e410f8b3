//! The producer's copy workers, whichever kind: one thread of the producer's process, or the
//! worker processes of `--workers-process` ([`super::worker_process`]); both copy with
//! [`super::copy`].

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Instant;

use tiering_core::{OffloadKey, StoreCompletionSender, arena::ChunkArena};

use super::copy::{CopyDone, CopyOrder, copy_share, device_bytes};
use super::worker_process::WorkerProcesses;
use crate::bench::BenchError;
use crate::host_buffer::HostBuffer;

/// The producer's copy workers, whichever kind.
pub(super) enum CopyWorkers {
    /// One thread of this process (rank 0 of 1).
    Thread {
        orders: Sender<CopyOrder>,
        handle: JoinHandle<()>,
    },
    /// Worker processes, one per rank.
    Processes(WorkerProcesses),
}

impl CopyWorkers {
    /// A copy thread over `arena`. `reporter`: off-step mode's in-process completion sender.
    pub(super) fn thread(
        arena: Arc<ChunkArena>,
        keys: &[Vec<OffloadKey>],
        chunk_bytes: usize,
        rate: f64,
        reporter: Option<StoreCompletionSender>,
        done: Sender<CopyDone>,
    ) -> Result<Self, BenchError> {
        let sources: Vec<Vec<HostBuffer>> = keys.iter().map(|k| device_bytes(k, chunk_bytes)).collect();
        let keys = keys.to_vec();
        let (orders, rx): (Sender<CopyOrder>, Receiver<CopyOrder>) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kvtier-bench-copy".into())
            .spawn(move || {
                for order in rx {
                    let Some(src) = sources.get(order.request) else {
                        tracing::error!(request = order.request, "copy order for an unknown request");
                        return;
                    };
                    let ok = copy_share(&arena, src, &order.rows, 0, 1, rate);
                    if let Some(r) = &reporter {
                        r.report(&keys[order.request], ok);
                    }
                    if done.send((order.request, 0, ok, Instant::now())).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| BenchError::Tier {
                tier: "copier".into(),
                message: format!("cannot start the copy thread: {e}"),
            })?;
        Ok(Self::Thread { orders, handle })
    }

    /// Ranks that each report every store.
    pub(super) fn ranks(&self) -> u32 {
        match self {
            Self::Thread { .. } => 1,
            Self::Processes(p) => p.ranks(),
        }
    }

    /// Hands a store to every worker.
    pub(super) fn order(&mut self, order: &CopyOrder) -> Result<(), BenchError> {
        match self {
            Self::Thread { orders, .. } => orders.send(order.clone()).map_err(|_| BenchError::Tier {
                tier: "copier".into(),
                message: "the copy thread stopped".into(),
            }),
            Self::Processes(p) => p.order(order),
        }
    }

    /// Stops the workers and waits for them.
    pub(super) fn finish(self) -> Result<(), BenchError> {
        match self {
            Self::Thread { orders, handle } => {
                drop(orders);
                handle.join().map_err(|_| BenchError::Tier {
                    tier: "copier".into(),
                    message: "the copy thread panicked".into(),
                })
            }
            Self::Processes(p) => p.finish(),
        }
    }
}
