//! [`ExampleTier`]: the `SecondaryTier` implementation.
//!
//! The shape every tier should have:
//! - the manager-facing methods only touch in-memory state and return at once;
//! - copies run on the tier's own thread, a `tier_kit::WorkerPool` of one; each job travels
//!   with its `tier_kit::Ticket`, so it is reported exactly once (a panicking job as failed)
//!   and the `tier_kit::JobLedger` wakes the control plane;
//! - `drain_jobs` waits until nothing is in flight; `shutdown` stops the threads, bounded.

use std::collections::VecDeque;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;
use tier_kit::{JobLedger, LaneSpec, Ticket, TierCounters, WorkQueue, WorkerPool};
use tiering_core::options::{ByteSize, parse_options};
use tiering_core::{
    ControlWaker, JobKind, JobOutcome, JobResult, Locality, LookupResult, Medium, OffloadKey,
    OffloadingEvent, ParentManager, ReqContext, RequestId, SecondaryTier, TierError, TierInfo, TierStats,
    TransferJob, registry::SecondaryContext,
};

use crate::peer::{PeerAnswer, PeerQuery};
use crate::store::LruStore;

/// The tier's options (its chain-file section, minus `type` and `library`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExampleOptions {
    /// The tier's name (unique within a chain).
    #[serde(default = "default_name")]
    pub name: String,
    /// How much chunk data to keep; rounded down to whole chunks, at least one.
    pub capacity: ByteSize,
    /// Serve peers on a Unix datagram socket at this path (see [`crate::peer`]).
    #[serde(default)]
    pub inbox: Option<PathBuf>,
}

fn default_name() -> String {
    "example".to_owned()
}

/// State shared by the tier, its worker and its inbox reader.
struct State {
    store: LruStore,
    events: Vec<OffloadingEvent>,
    inbound: VecDeque<(PeerQuery, PathBuf)>,
}

struct Shared {
    state: Mutex<State>,
    /// The jobs' results; it also holds the control plane's waker.
    ledger: JobLedger,
    /// What `stats` reports: hits, misses, stores, loads, evictions, failures, bytes.
    counters: TierCounters,
    name: String,
}

/// A job on its way to the worker, with the obligation to report it: a job that panics is
/// reported failed by its dropped ticket, and counted abandoned, which `stats` adds to the
/// failures (the state lock does not poison, so the tier stays usable).
type Job = (TransferJob, Ticket);

struct Inbox {
    socket: Arc<UnixDatagram>,
    path: PathBuf,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

/// A bounded in-memory LRU secondary tier. See the crate docs.
pub struct ExampleTier {
    info: TierInfo,
    capacity_chunks: u64,
    shared: Arc<Shared>,
    worker: WorkerPool<Job>,
    inbox: Option<Inbox>,
}

impl ExampleTier {
    /// Builds the tier from parsed options.
    ///
    /// # Errors
    /// The worker thread cannot start, or the inbox socket cannot be bound.
    pub fn new(options: &ExampleOptions, ctx: &SecondaryContext) -> Result<Self, TierError> {
        let chunks = usize::try_from(options.capacity.bytes() / ctx.chunk_bytes.max(1) as u64)
            .unwrap_or(usize::MAX)
            .max(1);
        let ledger = JobLedger::default();
        ledger.set_waker(ctx.waker.clone());
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                store: LruStore::new(chunks),
                events: Vec::new(),
                inbound: VecDeque::new(),
            }),
            ledger,
            counters: TierCounters::default(),
            name: options.name.clone(),
        });
        let queue = Arc::new(WorkQueue::builder().lane(LaneSpec::unbounded()).build());
        let worker = WorkerPool::builder(format!("{}-worker", options.name)).start(queue, |_| {
            let shared = Arc::clone(&shared);
            Ok(move |(job, ticket)| run_job(&shared, job, ticket))
        })?;
        tracing::info!(tier = %options.name, capacity_chunks = chunks, "example tier ready");
        let inbox = match &options.inbox {
            Some(path) => Some(start_inbox(&shared, path)?),
            None => None,
        };
        Ok(Self {
            info: TierInfo::new(&options.name, Some(Medium::Cpu), Some(Locality::Local)),
            capacity_chunks: chunks as u64,
            shared,
            worker,
            inbox,
        })
    }

    fn submit(&mut self, job: TransferJob) {
        let ticket = self.shared.ledger.open(job.id);
        if let Err(refused) = self.worker.queue().submit(0, (job, ticket)) {
            // Shut down: the job still has to be reported, as a failure.
            self.shared.counters.failures.add(1);
            refused.work.1.fail();
        }
    }

    /// Answers one peer query through the manager: the whole node (primary and the other tiers)
    /// is searched, and ready chunks are sent back.
    fn serve_one(&self, parent: &mut dyn ParentManager, query: &PeerQuery, peer: &str) -> PeerAnswer {
        let ctx = ReqContext::new(RequestId::remote(peer, query.id.clone()));
        let mut answer = PeerAnswer {
            id: query.id.clone(),
            verdicts: Vec::new(),
            fetched: Vec::new(),
            error: None,
        };
        let outcome = (|| -> Result<(), tiering_core::ManagerError> {
            parent.on_new_request(&ctx)?;
            for key in &query.keys {
                answer.verdicts.push(parent.lookup(key, &ctx)?);
            }
            let ready: Vec<OffloadKey> = query
                .keys
                .iter()
                .zip(&answer.verdicts)
                .filter(|&(_, v)| *v == LookupResult::Hit)
                .map(|(k, _)| *k)
                .collect();
            if query.fetch && !ready.is_empty() {
                // The job pins the chunks; this tier moves the bytes and reports the job itself.
                let job = parent.create_store_job(&ready, &ctx)?;
                let ticket = self.shared.ledger.open(job.id);
                let mut bytes = 0u64;
                for (i, key) in job.keys.iter().enumerate() {
                    if let Some(row) = job.rows.row(i) {
                        bytes += row.len() as u64;
                        answer.fetched.push((*key, row.to_vec()));
                    }
                }
                drop(job);
                ticket.complete(JobOutcome::Ok, bytes);
            }
            Ok(())
        })();
        if let Err(e) = outcome {
            answer.error = Some(e.to_string());
        }
        // Mandatory for every remote request, even when nothing was found.
        if let Err(e) = parent.on_request_finished(&ctx) {
            answer.error.get_or_insert(e.to_string());
        }
        answer
    }

    fn stop(&mut self) -> Result<(), TierError> {
        // The worker finishes the jobs already queued, then ends (or is left behind, named).
        let stopped = self.worker.stop_and_join(Duration::from_secs(10));
        if let Some(mut inbox) = self.inbox.take() {
            inbox.stop.store(true, Ordering::Release);
            if let Some(r) = inbox.reader.take() {
                let _ = r.join();
            }
            let _ = std::fs::remove_file(&inbox.path);
        }
        stopped.into_result(&format!("{} worker", self.info.name))
    }
}

fn start_inbox(shared: &Arc<Shared>, path: &std::path::Path) -> Result<Inbox, TierError> {
    let _ = std::fs::remove_file(path);
    let socket = Arc::new(UnixDatagram::bind(path)?);
    // The timeout only bounds how long shutdown waits for the reader.
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (sock, flag, sh) = (Arc::clone(&socket), Arc::clone(&stop), Arc::clone(shared));
    let reader = std::thread::Builder::new()
        .name(format!("{}-inbox", shared.name))
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !flag.load(Ordering::Acquire) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let Some(from) = from.as_pathname().map(std::path::Path::to_path_buf) else {
                    tracing::warn!("peer query from an unnamed socket ignored (no reply address)");
                    continue;
                };
                match PeerQuery::decode(&buf[..n]) {
                    Ok(q) => {
                        sh.state.lock().inbound.push_back((q, from));
                        sh.ledger.wake();
                    }
                    Err(e) => tracing::warn!(error = %e, "malformed peer query ignored"),
                }
            }
        })?;
    Ok(Inbox {
        socket,
        path: path.to_path_buf(),
        stop,
        reader: Some(reader),
    })
}

/// Tests set this to make the worker's next job panic.
#[cfg(test)]
static PANIC_IN_NEXT_JOB: AtomicBool = AtomicBool::new(false);

/// Runs one job on the worker thread and reports it.
fn run_job(shared: &Shared, mut job: TransferJob, ticket: Ticket) {
    #[cfg(test)]
    assert!(
        !PANIC_IN_NEXT_JOB.swap(false, Ordering::SeqCst),
        "injected worker panic"
    );
    match job.kind {
        JobKind::Store => {
            // Copy outside the lock; only the map update holds it.
            let copies: Vec<(OffloadKey, Box<[u8]>)> = job
                .keys
                .iter()
                .enumerate()
                .filter_map(|(i, k)| job.rows.row(i).map(|r| (*k, Box::from(r))))
                .collect();
            // Release the rows as soon as the bytes are copied.
            drop(job);
            let mut st = shared.state.lock();
            let mut stored = Vec::new();
            let mut evicted = Vec::new();
            let mut bytes = 0u64;
            for (key, data) in copies {
                let fresh = !st.store.chunks().contains(&key);
                bytes += data.len() as u64;
                evicted.extend(st.store.insert(key, data));
                if fresh {
                    stored.push(key);
                }
            }
            // Counted before the job is reported: its result is visible at once.
            let counters = &shared.counters;
            counters.count_job(JobKind::Store, stored.len() as u64, 0, bytes);
            counters.evictions.add(evicted.len() as u64);
            if !evicted.is_empty() {
                let e = OffloadingEvent::removed(evicted, Some(Medium::Cpu), Some(Locality::Local));
                st.events.push(e.owned_by(&shared.name));
            }
            if !stored.is_empty() {
                let e = OffloadingEvent::stored(stored, Some(Medium::Cpu), Some(Locality::Local));
                st.events.push(e.owned_by(&shared.name));
            }
            drop(st);
            ticket.complete(JobOutcome::Ok, bytes);
        }
        JobKind::Promotion => {
            let mut st = shared.state.lock();
            let mut ok = Vec::with_capacity(job.keys.len());
            let mut bytes = 0u64;
            for (i, key) in job.keys.iter().enumerate() {
                let done = match job.rows.row_mut(i) {
                    Some(dst) => st.store.read_into(key, dst),
                    None => false,
                };
                if done {
                    bytes += job.rows.row(i).map_or(0, |r| r.len() as u64);
                }
                ok.push(done);
            }
            drop(st);
            let loaded = ok.iter().filter(|&&b| b).count() as u64;
            let counters = &shared.counters;
            counters.count_job(JobKind::Promotion, loaded, ok.len() as u64 - loaded, bytes);
            // The rows go back before the job is reported: once the host sees the result it may
            // grant them to the engine.
            let keys = std::mem::take(&mut job.keys);
            drop(job);
            ticket.complete_keys(&keys, &ok, bytes);
        }
    }
}

impl SecondaryTier for ExampleTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        // The tier serves peers, which must not wait for the engine's next step.
        true
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.shared.ledger.set_waker(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        if self.shared.state.lock().store.chunks().contains(key) {
            self.shared.counters.hits.add(1);
            LookupResult::Hit
        } else {
            self.shared.counters.misses.add(1);
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.submit(job);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.submit(job);
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.shared.ledger.take_finished(out);
    }

    fn has_pending_work(&self) -> bool {
        self.shared.ledger.has_pending() || !self.shared.state.lock().inbound.is_empty()
    }

    fn touch(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) {
        let mut st = self.shared.state.lock();
        for k in keys {
            st.store.touch(k);
        }
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        let Some(inbox) = &self.inbox else {
            return Ok(());
        };
        let socket = Arc::clone(&inbox.socket);
        let queries: Vec<(PeerQuery, PathBuf)> = self.shared.state.lock().inbound.drain(..).collect();
        for (query, from) in queries {
            let answer = self.serve_one(parent, &query, &from.to_string_lossy());
            // A peer that went away is not this tier's failure: log and go on.
            match answer.encode() {
                Ok(bytes) => {
                    if let Err(e) = socket.send_to(&bytes, &from) {
                        tracing::warn!(peer = %from.display(), error = %e, "cannot answer a peer");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "answer too large for one datagram"),
            }
        }
        Ok(())
    }

    fn drain_jobs(&mut self) {
        self.shared.ledger.wait_idle(None);
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut self.shared.state.lock().events)
    }

    fn stats(&self) -> TierStats {
        let mut s = self.shared.counters.stats(&self.info.name, []);
        s.failures += self.shared.ledger.counters().snapshot().abandoned;
        s.capacity_chunks = self.capacity_chunks;
        s.resident_chunks = self.shared.state.lock().store.chunks().len() as u64;
        s
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        self.stop()
    }
}

impl Drop for ExampleTier {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!(error = %e, "example tier shutdown on drop");
        }
    }
}

/// Checks the example tier's table without building it (no store, no socket).
///
/// # Errors
/// An unknown key or a bad value; an empty `name`.
pub fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let options: ExampleOptions = parse_options(options).map_err(|e| vec![e])?;
    if options.name.is_empty() {
        return Err(vec![TierError::Config("`name` must not be empty".into())]);
    }
    Ok(())
}

/// The factory registered as type `example` (statically and in the `cdylib`).
///
/// # Errors
/// Unknown or malformed options, or the tier's threads or socket cannot start.
pub fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let options: ExampleOptions = parse_options(options)?;
    Ok(Box::new(ExampleTier::new(&options, ctx)?))
}

#[cfg(test)]
mod tests {
    use tiering_core::{
        JobId,
        arena::{ChunkArena, ChunkId, RowGrant},
    };

    use super::*;

    fn store_job(arena: &Arc<ChunkArena>, id: u64, key: u64) -> TransferJob {
        let chunk: ChunkId = u32::try_from(id).unwrap();
        TransferJob {
            id: JobId(id),
            kind: JobKind::Store,
            keys: vec![OffloadKey::from_u64(key)],
            chunk_ids: vec![chunk],
            req: ReqContext::local("worker-panic-test"),
            rows: RowGrant::Read(vec![arena.read_row(chunk).unwrap()]),
        }
    }

    fn wait_for_result(tier: &mut ExampleTier) -> JobResult {
        tier.drain_jobs();
        let mut out = Vec::new();
        tier.poll_finished(&mut out);
        assert_eq!(out.len(), 1, "{out:?}");
        out.remove(0)
    }

    #[test]
    fn a_worker_panic_ends_as_a_failed_job_and_the_worker_keeps_serving() {
        let arena = ChunkArena::new(4, 4096).unwrap();
        let ctx = SecondaryContext::new(Arc::clone(&arena), ControlWaker::new());
        let options = ExampleOptions {
            name: "example".into(),
            capacity: ByteSize(1 << 20),
            inbox: None,
        };
        let mut tier = ExampleTier::new(&options, &ctx).unwrap();
        PANIC_IN_NEXT_JOB.store(true, Ordering::SeqCst);
        tier.submit_store(store_job(&arena, 1, 10));
        let failed = wait_for_result(&mut tier);
        assert_eq!(failed.id, JobId(1));
        assert!(failed.outcome == tiering_core::JobOutcome::Failed, "{failed:?}");
        assert_eq!(tier.stats().failures, 1);
        // The same worker thread runs the next job.
        tier.submit_store(store_job(&arena, 2, 11));
        let ok = wait_for_result(&mut tier);
        assert_eq!(ok.id, JobId(2));
        assert!(ok.outcome == tiering_core::JobOutcome::Ok, "{ok:?}");
        tier.shutdown().unwrap();
    }
}
