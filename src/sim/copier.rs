//! The device-copy worker: a thread that performs the engine's device↔primary copies, between
//! the simulated device blocks and the primary tier's arena rows, while the model runs.
//!
//! The rows it touches are protected by the primary's ref counts (a store's rows are "write in
//! flight", a load's rows are pinned); the arena's row grants turn a broken invariant into a
//! failed job rather than a data race.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use tiering_core::StoreCompletionSender;
use tiering_core::{
    OffloadKey,
    arena::{ChunkArena, ChunkId},
};

use super::device::DeviceMemory;
use super::error::SimError;
use super::hash::chunk_matches;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// Primary → device (a prefix hit being loaded).
    Load,
    /// Device → primary (newly computed chunks being offloaded).
    Store,
}

/// One device-copy job: `keys[i]` moves between arena row `rows[i]` and device block `blocks[i]`.
#[derive(Debug)]
pub struct CopyJob {
    /// The engine's job id.
    pub id: u64,
    /// Direction.
    pub kind: CopyKind,
    /// The chunks.
    pub keys: Vec<OffloadKey>,
    /// Their arena rows.
    pub rows: Vec<ChunkId>,
    /// Their device blocks.
    pub blocks: Vec<u32>,
}

/// What the worker reports for a job.
#[derive(Debug)]
pub struct CopyDone {
    /// The job id.
    pub id: u64,
    /// Direction.
    pub kind: CopyKind,
    /// Every chunk copied (and, for a verified load, matched its expected content).
    pub ok: bool,
    /// Bytes copied.
    pub bytes: u64,
    /// Loaded chunks whose bytes were not what the model wrote.
    pub corrupt: usize,
    /// Why the job failed.
    pub error: Option<String>,
}

/// Handle to the worker thread.
pub struct Copier {
    jobs: Option<Sender<CopyJob>>,
    done: Receiver<CopyDone>,
    handle: Option<JoinHandle<()>>,
    outstanding: usize,
}

impl Copier {
    /// Starts the worker over `arena` and the device memory. With `reporter`, the worker also
    /// reports each finished store straight to the manager (off-step mode), so the manager's
    /// control thread can complete and cascade it before the engine's next step.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn start(
        arena: Arc<ChunkArena>,
        device: Arc<DeviceMemory>,
        verify: bool,
        reporter: Option<StoreCompletionSender>,
    ) -> Result<Self, SimError> {
        let (job_tx, job_rx) = mpsc::channel::<CopyJob>();
        let (done_tx, done_rx) = mpsc::channel::<CopyDone>();
        let handle = std::thread::Builder::new()
            .name("kvtier-sim-copy".into())
            .spawn(move || {
                for job in job_rx {
                    let done = run_job(&arena, &device, verify, &job);
                    if let (Some(reporter), CopyKind::Store) = (&reporter, job.kind) {
                        reporter.report(&job.keys, done.ok);
                    }
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| SimError::Worker(format!("cannot start the copy thread: {e}")))?;
        Ok(Self {
            jobs: Some(job_tx),
            done: done_rx,
            handle: Some(handle),
            outstanding: 0,
        })
    }

    /// Hands a job to the worker.
    ///
    /// # Errors
    /// The worker is gone.
    pub fn submit(&mut self, job: CopyJob) -> Result<(), SimError> {
        let tx = self
            .jobs
            .as_ref()
            .ok_or_else(|| SimError::Worker("the copy thread was stopped".into()))?;
        tx.send(job)
            .map_err(|_| SimError::Worker("the copy thread exited".into()))?;
        self.outstanding += 1;
        Ok(())
    }

    /// Jobs submitted and not yet collected.
    #[must_use]
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Every finished job, without waiting.
    ///
    /// # Errors
    /// The worker died with jobs outstanding.
    pub fn collect(&mut self, out: &mut Vec<CopyDone>) -> Result<(), SimError> {
        loop {
            match self.done.try_recv() {
                Ok(d) => {
                    self.outstanding -= 1;
                    out.push(d);
                }
                Err(mpsc::TryRecvError::Empty) => return Ok(()),
                Err(mpsc::TryRecvError::Disconnected) if self.outstanding == 0 => return Ok(()),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(SimError::Worker(format!(
                        "the copy thread died with {} jobs outstanding",
                        self.outstanding
                    )));
                }
            }
        }
    }

    /// Waits up to `timeout` for one finished job.
    ///
    /// # Errors
    /// The worker died with jobs outstanding.
    pub fn wait_one(&mut self, timeout: Duration) -> Result<Option<CopyDone>, SimError> {
        match self.done.recv_timeout(timeout) {
            Ok(d) => {
                self.outstanding -= 1;
                Ok(Some(d))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(SimError::Worker(format!(
                "the copy thread died with {} jobs outstanding",
                self.outstanding
            ))),
        }
    }

    /// Stops the worker after the jobs already submitted.
    pub fn stop(&mut self) {
        self.jobs = None;
        if let Some(h) = self.handle.take()
            && h.join().is_err()
        {
            tracing::error!("the device-copy thread panicked");
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run_job(arena: &Arc<ChunkArena>, device: &DeviceMemory, verify: bool, job: &CopyJob) -> CopyDone {
    let mut bytes = 0u64;
    let mut corrupt = 0;
    let mut error = None;
    for ((key, &row), &block) in job.keys.iter().zip(&job.rows).zip(&job.blocks) {
        let step = match job.kind {
            CopyKind::Store => arena
                .write_row(row)
                .map_err(|e| e.to_string())
                .and_then(|mut dst| {
                    device
                        .with_block(block, |src| {
                            let n = src.len().min(dst.len());
                            dst[..n].copy_from_slice(&src[..n]);
                            n
                        })
                        .ok_or_else(|| format!("device block {block} out of range"))
                }),
            CopyKind::Load => arena.read_row(row).map_err(|e| e.to_string()).and_then(|src| {
                device
                    .with_block(block, |dst| {
                        let n = src.len().min(dst.len());
                        dst[..n].copy_from_slice(&src[..n]);
                        (n, !verify || chunk_matches(key, &dst[..n]))
                    })
                    .map(|(n, good)| {
                        if !good {
                            corrupt += 1;
                        }
                        n
                    })
                    .ok_or_else(|| format!("device block {block} out of range"))
            }),
        };
        match step {
            Ok(n) => bytes += n as u64,
            Err(e) => {
                error = Some(format!("{key}: {e}"));
                break;
            }
        }
    }
    if corrupt > 0 && error.is_none() {
        error = Some(format!("{corrupt} loaded chunks did not match what was stored"));
    }
    CopyDone {
        id: job.id,
        kind: job.kind,
        ok: error.is_none(),
        bytes,
        corrupt,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::hash::fill_chunk;

    fn wait(c: &mut Copier) -> CopyDone {
        c.wait_one(Duration::from_secs(10))
            .unwrap()
            .expect("job finished")
    }

    #[test]
    fn store_then_load_round_trips_and_verifies() {
        let arena = ChunkArena::new(4, 64).unwrap();
        let device = Arc::new(DeviceMemory::new(4, 64));
        let k = OffloadKey::from_u64(3);
        device.with_block(1, |b| fill_chunk(&k, b));
        let mut c = Copier::start(Arc::clone(&arena), Arc::clone(&device), true, None).unwrap();
        c.submit(CopyJob {
            id: 1,
            kind: CopyKind::Store,
            keys: vec![k],
            rows: vec![2],
            blocks: vec![1],
        })
        .unwrap();
        let d = wait(&mut c);
        assert!(d.ok && d.bytes == 64 && d.kind == CopyKind::Store, "{d:?}");
        c.submit(CopyJob {
            id: 2,
            kind: CopyKind::Load,
            keys: vec![k],
            rows: vec![2],
            blocks: vec![3],
        })
        .unwrap();
        let d = wait(&mut c);
        assert!(d.ok && d.corrupt == 0, "{d:?}");
        assert!(
            device
                .with_block(3, |b| crate::sim::hash::chunk_matches(&k, b))
                .unwrap()
        );
        assert_eq!(c.outstanding(), 0);
        assert_eq!(arena.granted_rows(), 0);
    }

    #[test]
    fn wrong_content_and_busy_rows_fail_the_job() {
        let arena = ChunkArena::new(2, 64).unwrap();
        let device = Arc::new(DeviceMemory::new(2, 64));
        let mut c = Copier::start(Arc::clone(&arena), device, true, None).unwrap();
        // Row 0 holds zeros, not the chunk's content.
        c.submit(CopyJob {
            id: 1,
            kind: CopyKind::Load,
            keys: vec![OffloadKey::from_u64(1)],
            rows: vec![0],
            blocks: vec![0],
        })
        .unwrap();
        let d = wait(&mut c);
        assert!(!d.ok && d.corrupt == 1, "{d:?}");
        let held = arena.read_row(1).unwrap();
        c.submit(CopyJob {
            id: 2,
            kind: CopyKind::Store,
            keys: vec![OffloadKey::from_u64(2)],
            rows: vec![1],
            blocks: vec![0],
        })
        .unwrap();
        let d = wait(&mut c);
        assert!(
            !d.ok && d.error.as_deref().is_some_and(|e| e.contains("busy")),
            "{d:?}"
        );
        drop(held);
        c.submit(CopyJob {
            id: 3,
            kind: CopyKind::Store,
            keys: vec![OffloadKey::from_u64(2)],
            rows: vec![9],
            blocks: vec![0],
        })
        .unwrap();
        assert!(!wait(&mut c).ok);
    }
}
