//! A scriptable secondary tier for tests: an in-memory store that records every call (with the
//! calling thread), completes jobs immediately or on command, answers scripted lookups, serves
//! scripted peer requests through the `ParentManager`, and fails on demand.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::TierError;
use crate::job::{JobId, JobKind, JobOutcome, JobResult, TransferJob};
use crate::key::{KeyMap, KeySet, OffloadKey};
use crate::outcome::{LookupResult, OffloadPolicy};
use crate::request::{Locality, Medium, ReqContext, RequestId, TierInfo};
use crate::stats::TierStats;
use crate::tier::{ParentManager, SecondaryTier, TierHealth};
use crate::waker::ControlWaker;

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// A global, monotonically increasing sequence number shared by every scripted tier, so tests
/// can order tier calls against their own marks.
pub fn next_sequence() -> u64 {
    SEQUENCE.fetch_add(1, Ordering::SeqCst)
}

/// When a scripted tier finishes the jobs submitted to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Copies at submission and reports at the next poll.
    Immediate,
    /// Holds jobs until the test calls [`ScriptedTierHandle::complete`].
    Manual,
}

/// One recorded call.
#[derive(Clone, Debug)]
pub struct Call {
    /// The method (`"lookup"`, `"poll"`, `"serve"`, `"submit_store"`, …).
    pub op: &'static str,
    /// The calling thread.
    pub thread: ThreadId,
    /// Global order (see [`next_sequence`]).
    pub seq: u64,
    /// The request concerned, if any.
    pub req: Option<RequestId>,
}

/// A scripted inbound peer request.
#[derive(Clone, Debug)]
pub struct PeerRequest {
    /// The remote request's context (use a `RequestId::Remote` id).
    pub ctx: ReqContext,
    /// The keys the peer asks about.
    pub keys: Vec<OffloadKey>,
    /// Whether to fetch the keys that are primary hits (through `create_store_job`).
    pub fetch: bool,
    /// Whether to keep the request queued (asking again at the next serve) while any key is
    /// `HitPending`, as a peer tier parks a fetch until the producer's store lands.
    pub wait_for_pending: bool,
}

/// What serving one peer request produced.
#[derive(Clone, Debug)]
pub struct ServedPeer {
    /// The remote request.
    pub req: RequestId,
    /// The manager's verdicts, parallel to the request's keys.
    pub lookups: Vec<LookupResult>,
    /// Keys fetched, with their bytes.
    pub fetched: Vec<(OffloadKey, Vec<u8>)>,
    /// The serving thread.
    pub thread: ThreadId,
    /// An error from the parent, if any.
    pub error: Option<String>,
}

struct Inner {
    info: TierInfo,
    data: KeyMap<Vec<u8>>,
    lookup_override: KeyMap<LookupResult>,
    policy: OffloadPolicy,
    completion: Completion,
    held: Vec<TransferJob>,
    finished: Vec<JobResult>,
    inbound: VecDeque<PeerRequest>,
    served: Vec<ServedPeer>,
    calls: Vec<Call>,
    serve_error: Option<String>,
    serve_panic: bool,
    serve_delay: Duration,
    fail_load_keys: KeySet,
    /// Every promotion fails (a tier whose server is gone).
    fail_loads: bool,
    /// What `health` answers.
    health: TierHealth,
    fail_stores: bool,
    report_unknown: Vec<JobResult>,
    finished_requests: Vec<RequestId>,
    shutdown_error: Option<String>,
    waker: Option<ControlWaker>,
    stats: TierStats,
    /// Operations that panic the next time they are called.
    panic_next: Vec<&'static str>,
    /// `drain_jobs` blocks while this is set.
    drain_blocked: bool,
    /// The duration store jobs report instead of the time the copy took (`None`: the real one).
    store_latency: Option<Duration>,
    /// How long each promotion takes (an injected load latency).
    load_delay: Duration,
}

type SharedInner = Arc<(Mutex<Inner>, Condvar)>;

/// The tier half: hand it to the manager.
pub struct ScriptedTier {
    shared: SharedInner,
    control_plane: bool,
}

/// The test's half: script the tier and read what happened.
#[derive(Clone)]
pub struct ScriptedTierHandle {
    shared: SharedInner,
}

impl ScriptedTier {
    /// A tier named `name` (medium `Storage`, locality `Local`), completing immediately.
    #[must_use]
    pub fn new(name: &str) -> (Self, ScriptedTierHandle) {
        Self::with_info(TierInfo::new(name, Some(Medium::Storage), Some(Locality::Local)))
    }

    /// A tier that does not opt in to the control thread (`needs_control_plane` is false): the
    /// manager must call it from the scheduler thread only.
    #[must_use]
    pub fn quiet(name: &str) -> (Self, ScriptedTierHandle) {
        let (mut t, h) = Self::new(name);
        t.control_plane = false;
        (t, h)
    }

    /// A tier with the given description (opted in to the control thread, like a peer tier).
    #[must_use]
    pub fn with_info(info: TierInfo) -> (Self, ScriptedTierHandle) {
        let inner = Inner {
            stats: TierStats::named(&info.name),
            info,
            data: KeyMap::default(),
            lookup_override: KeyMap::default(),
            policy: OffloadPolicy::ChunkLevel,
            completion: Completion::Immediate,
            held: Vec::new(),
            finished: Vec::new(),
            inbound: VecDeque::new(),
            served: Vec::new(),
            calls: Vec::new(),
            serve_error: None,
            serve_panic: false,
            serve_delay: Duration::ZERO,
            fail_load_keys: KeySet::default(),
            fail_loads: false,
            health: TierHealth::default(),
            fail_stores: false,
            report_unknown: Vec::new(),
            finished_requests: Vec::new(),
            shutdown_error: None,
            waker: None,
            panic_next: Vec::new(),
            drain_blocked: false,
            store_latency: None,
            load_delay: Duration::ZERO,
        };
        let shared = Arc::new((Mutex::new(inner), Condvar::new()));
        (
            Self {
                shared: Arc::clone(&shared),
                control_plane: true,
            },
            ScriptedTierHandle { shared },
        )
    }

    fn record(&self, inner: &mut Inner, op: &'static str, req: Option<&RequestId>) {
        inner.calls.push(Call {
            op,
            thread: std::thread::current().id(),
            seq: next_sequence(),
            req: req.cloned(),
        });
        self.shared.1.notify_all();
        maybe_panic(inner, op);
    }
}

/// Panics if the test asked `op` to panic next (read-only calls use this without recording).
fn maybe_panic(inner: &mut Inner, op: &'static str) {
    if let Some(pos) = inner.panic_next.iter().position(|o| *o == op) {
        inner.panic_next.swap_remove(pos);
        panic!("scripted panic in {op}");
    }
}

fn run_job(inner: &mut Inner, mut job: TransferJob) -> JobResult {
    let start = Instant::now();
    match job.kind {
        JobKind::Store => {
            if inner.fail_stores {
                return JobResult::failed(job.id, start.elapsed());
            }
            let mut bytes = 0;
            for (i, key) in job.keys.iter().enumerate() {
                if let Some(row) = job.rows.row(i) {
                    bytes += row.len() as u64;
                    inner.data.insert(*key, row.to_vec());
                }
            }
            inner.stats.stores += job.keys.len() as u64;
            JobResult::ok(
                job.id,
                bytes,
                inner.store_latency.unwrap_or_else(|| start.elapsed()),
            )
        }
        JobKind::Promotion => {
            if inner.fail_loads {
                inner.stats.failures += 1;
                return JobResult::failed(job.id, start.elapsed());
            }
            let mut ok = Vec::with_capacity(job.keys.len());
            let mut bytes = 0;
            for (i, key) in job.keys.iter().enumerate() {
                let src = inner
                    .data
                    .get(key)
                    .filter(|_| !inner.fail_load_keys.contains(key));
                let done = match (src, job.rows.row_mut(i)) {
                    (Some(src), Some(dst)) if src.len() == dst.len() => {
                        dst.copy_from_slice(src);
                        bytes += src.len() as u64;
                        true
                    }
                    _ => false,
                };
                ok.push(done);
            }
            inner.stats.loads += ok.iter().filter(|&&b| b).count() as u64;
            JobResult::from_key_outcomes(job.id, &job.keys, &ok, bytes, start.elapsed())
        }
    }
}

impl SecondaryTier for ScriptedTier {
    fn info(&self) -> TierInfo {
        self.shared.0.lock().info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        self.control_plane
    }

    fn on_schedule_end(&mut self) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "on_schedule_end", None);
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.shared.0.lock().waker = Some(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "lookup", Some(ctx.id()));
        if let Some(r) = inner.lookup_override.get(key) {
            return *r;
        }
        if inner.data.contains_key(key) {
            inner.stats.hits += 1;
            LookupResult::Hit
        } else {
            inner.stats.misses += 1;
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "submit_store", Some(job.req.id()));
        if inner.completion == Completion::Manual {
            inner.held.push(job);
        } else {
            let r = run_job(&mut inner, job);
            inner.finished.push(r);
        }
    }

    fn submit_load(&mut self, job: TransferJob) {
        let delay = self.shared.0.lock().load_delay;
        if !delay.is_zero() {
            // A slow medium: the load finishes this much later (the test's stand-in for I/O).
            std::thread::sleep(delay);
        }
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "submit_load", Some(job.req.id()));
        if inner.completion == Completion::Manual {
            inner.held.push(job);
        } else {
            let r = run_job(&mut inner, job);
            inner.finished.push(r);
        }
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "poll", None);
        out.append(&mut inner.finished);
        out.append(&mut inner.report_unknown);
    }

    fn has_pending_work(&self) -> bool {
        let mut inner = self.shared.0.lock();
        maybe_panic(&mut inner, "has_pending_work");
        !inner.held.is_empty() || !inner.finished.is_empty() || !inner.inbound.is_empty()
    }

    fn touch(&mut self, _keys: &[OffloadKey], ctx: &ReqContext) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "touch", Some(ctx.id()));
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "on_new_request", Some(ctx.id()));
        inner.policy
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "on_request_finished", Some(ctx.id()));
        inner.finished_requests.push(ctx.id().clone());
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        let (requests, fail, panic, delay) = {
            let mut inner = self.shared.0.lock();
            self.record(&mut inner, "serve", None);
            let reqs: Vec<PeerRequest> = inner.inbound.drain(..).collect();
            (
                reqs,
                inner.serve_error.take(),
                std::mem::take(&mut inner.serve_panic),
                inner.serve_delay,
            )
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        if panic {
            panic!("scripted panic while serving");
        }
        if let Some(message) = fail {
            return Err(TierError::Other(message));
        }
        for req in requests {
            if req.wait_for_pending && pending_somewhere(parent, &req) {
                self.shared.0.lock().inbound.push_back(req);
                continue;
            }
            let served = serve_one(parent, &req);
            let mut inner = self.shared.0.lock();
            if let Some(r) = served.1 {
                inner.finished.push(r);
            }
            inner.served.push(served.0);
            self.shared.1.notify_all();
        }
        Ok(())
    }

    fn drain_jobs(&mut self) {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "drain", None);
        while inner.drain_blocked {
            self.shared.1.wait(&mut inner);
        }
        // Held jobs have not started: cancel them, reporting each as failed.
        let held: Vec<TransferJob> = inner.held.drain(..).collect();
        for job in held {
            inner.finished.push(JobResult::failed(job.id, Duration::ZERO));
        }
    }

    fn take_events(&mut self) -> Vec<crate::event::OffloadingEvent> {
        maybe_panic(&mut self.shared.0.lock(), "take_events");
        Vec::new()
    }

    fn stats(&self) -> TierStats {
        let mut inner = self.shared.0.lock();
        maybe_panic(&mut inner, "stats");
        let mut s = inner.stats.clone();
        s.name.clone_from(&inner.info.name);
        s.resident_chunks = inner.data.len() as u64;
        s
    }

    fn health(&self) -> TierHealth {
        self.shared.0.lock().health
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        let mut inner = self.shared.0.lock();
        self.record(&mut inner, "shutdown", None);
        match inner.shutdown_error.clone() {
            Some(m) => Err(TierError::Other(m)),
            None => Ok(()),
        }
    }
}

/// Asks the manager about the request's keys (as a throw-away remote request) and says whether
/// any is still being written.
fn pending_somewhere(parent: &mut dyn ParentManager, req: &PeerRequest) -> bool {
    let probe = ReqContext::new(RequestId::remote("probe", req.ctx.id().to_string()));
    if parent.on_new_request(&probe).is_err() {
        return false;
    }
    let pending = req
        .keys
        .iter()
        .any(|k| matches!(parent.lookup(k, &probe), Ok(LookupResult::HitPending)));
    let _ = parent.on_request_finished(&probe);
    pending
}

fn serve_one(parent: &mut dyn ParentManager, req: &PeerRequest) -> (ServedPeer, Option<JobResult>) {
    let mut served = ServedPeer {
        req: req.ctx.id().clone(),
        lookups: Vec::new(),
        fetched: Vec::new(),
        thread: std::thread::current().id(),
        error: None,
    };
    let mut result = None;
    let outcome = (|| -> Result<(), crate::error::ManagerError> {
        parent.on_new_request(&req.ctx)?;
        for key in &req.keys {
            served.lookups.push(parent.lookup(key, &req.ctx)?);
        }
        let hits: Vec<OffloadKey> = req
            .keys
            .iter()
            .zip(&served.lookups)
            .filter(|&(_, r)| *r == LookupResult::Hit)
            .map(|(k, _)| *k)
            .collect();
        if req.fetch && !hits.is_empty() {
            let job = parent.create_store_job(&hits, &req.ctx)?;
            for (i, key) in job.keys.iter().enumerate() {
                if let Some(row) = job.rows.row(i) {
                    served.fetched.push((*key, row.to_vec()));
                }
            }
            result = Some(JobResult::ok(job.id, 0, Duration::ZERO));
        }
        Ok(())
    })();
    if let Err(e) = outcome {
        served.error = Some(e.to_string());
    }
    // Mandatory, even when nothing was found or something failed.
    if let Err(e) = parent.on_request_finished(&req.ctx) {
        served.error.get_or_insert(e.to_string());
    }
    (served, result)
}

impl ScriptedTierHandle {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.shared.0.lock()
    }

    /// Makes the next call of `op` (`"submit_store"`, `"drain"`, `"on_schedule_end"`, `"poll"`,
    /// …, as recorded in [`Call::op`]; also `"has_pending_work"`, `"stats"` and `"take_events"`,
    /// which are not recorded) panic.
    pub fn panic_next(&self, op: &'static str) {
        self.lock().panic_next.push(op);
    }

    /// Makes every promotion take `delay` before it finishes (an injected load latency).
    pub fn set_load_delay(&self, delay: Duration) {
        self.lock().load_delay = delay;
    }

    /// Makes `drain_jobs` block until [`ScriptedTierHandle::release_drain`].
    pub fn block_drain(&self) {
        self.lock().drain_blocked = true;
    }

    /// Lets a blocked `drain_jobs` return.
    pub fn release_drain(&self) {
        self.lock().drain_blocked = false;
        self.shared.1.notify_all();
    }

    /// Stores `bytes` under `key` as if a cascade had landed.
    pub fn insert(&self, key: OffloadKey, bytes: Vec<u8>) {
        self.lock().data.insert(key, bytes);
    }

    /// The bytes stored under `key`.
    #[must_use]
    pub fn get(&self, key: &OffloadKey) -> Option<Vec<u8>> {
        self.lock().data.get(key).cloned()
    }

    /// Whether `key` is stored.
    #[must_use]
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.lock().data.contains_key(key)
    }

    /// Forces the lookup verdict for `key`.
    pub fn set_lookup(&self, key: OffloadKey, verdict: LookupResult) {
        self.lock().lookup_override.insert(key, verdict);
    }

    /// The policy `on_new_request` answers.
    pub fn set_policy(&self, policy: OffloadPolicy) {
        self.lock().policy = policy;
    }

    /// Immediate or manual completion.
    pub fn set_completion(&self, completion: Completion) {
        self.lock().completion = completion;
    }

    /// Makes loads of `key` fail.
    pub fn fail_loads_of(&self, key: OffloadKey) {
        self.lock().fail_load_keys.insert(key);
    }

    /// Makes every promotion fail (`true`) or work again (`false`).
    pub fn set_fail_loads(&self, fail: bool) {
        self.lock().fail_loads = fail;
    }

    /// What the tier's `health` answers from now on.
    pub fn set_health(&self, health: TierHealth) {
        self.lock().health = health;
    }

    /// Makes every store fail.
    pub fn set_fail_stores(&self, fail: bool) {
        self.lock().fail_stores = fail;
    }

    /// Makes the next serve return this error.
    pub fn fail_next_serve(&self, message: &str) {
        self.lock().serve_error = Some(message.to_owned());
    }

    /// Makes the next serve panic.
    pub fn panic_next_serve(&self) {
        self.lock().serve_panic = true;
    }

    /// Makes store jobs report `latency` as their submission-to-completion time (`None`: the
    /// time the copy really took): a slow device, for backpressure.
    pub fn set_store_latency(&self, latency: Option<Duration>) {
        self.lock().store_latency = latency;
    }

    /// Makes every serve block for `delay` (a wedged transport).
    pub fn set_serve_delay(&self, delay: Duration) {
        self.lock().serve_delay = delay;
    }

    /// Makes `shutdown` fail.
    pub fn fail_shutdown(&self, message: &str) {
        self.lock().shutdown_error = Some(message.to_owned());
    }

    /// Makes the next poll report a result for a job this tier never received.
    pub fn report_bogus_job(&self, id: JobId) {
        self.lock()
            .report_unknown
            .push(JobResult::ok(id, 0, Duration::ZERO));
    }

    /// Queues an inbound peer request and wakes the control plane.
    pub fn push_peer_request(&self, req: PeerRequest) {
        let waker = {
            let mut inner = self.lock();
            inner.inbound.push_back(req);
            inner.waker.clone()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Queues an inbound peer request without waking anyone.
    pub fn push_peer_request_quietly(&self, req: PeerRequest) {
        self.lock().inbound.push_back(req);
    }

    /// Ids of the jobs held (manual completion), in submission order.
    #[must_use]
    pub fn held_jobs(&self) -> Vec<(JobId, JobKind, Vec<OffloadKey>)> {
        self.lock()
            .held
            .iter()
            .map(|j| (j.id, j.kind, j.keys.clone()))
            .collect()
    }

    /// Finishes a held job: runs its copy (for `Ok`/`Partial`) and queues `outcome` for the next
    /// poll. Returns false if no such job is held.
    pub fn complete(&self, id: JobId, outcome: JobOutcome) -> bool {
        let waker = {
            let mut inner = self.lock();
            let Some(pos) = inner.held.iter().position(|j| j.id == id) else {
                return false;
            };
            let job = inner.held.remove(pos);
            let mut result = match outcome {
                JobOutcome::Failed => JobResult::failed(job.id, Duration::ZERO),
                _ => run_job(&mut inner, job),
            };
            if let JobOutcome::Partial(keys) = outcome {
                result.outcome = JobOutcome::Partial(keys);
            }
            inner.finished.push(result);
            inner.waker.clone()
        };
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    /// Completes every held job successfully.
    pub fn complete_all(&self) {
        for (id, _, _) in self.held_jobs() {
            self.complete(id, JobOutcome::Ok);
        }
    }

    /// Every recorded call.
    #[must_use]
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Recorded calls of one kind.
    #[must_use]
    pub fn calls_of(&self, op: &str) -> Vec<Call> {
        self.lock().calls.iter().filter(|c| c.op == op).cloned().collect()
    }

    /// Number of recorded calls of one kind.
    #[must_use]
    pub fn count(&self, op: &str) -> usize {
        self.lock().calls.iter().filter(|c| c.op == op).count()
    }

    /// Clears the call log.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Peer requests served so far.
    #[must_use]
    pub fn served(&self) -> Vec<ServedPeer> {
        self.lock().served.clone()
    }

    /// Requests this tier was told have finished.
    #[must_use]
    pub fn finished_requests(&self) -> Vec<RequestId> {
        self.lock().finished_requests.clone()
    }

    /// Waits until `pred` holds for the recorded state or `timeout` passes; returns whether it
    /// held. Used to wait for the control thread without sleeping blindly.
    pub fn wait_until(&self, timeout: Duration, mut pred: impl FnMut(&ScriptedTierView<'_>) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut inner = self.shared.0.lock();
        loop {
            if pred(&ScriptedTierView { inner: &inner }) {
                return true;
            }
            if self.shared.1.wait_until(&mut inner, deadline).timed_out() {
                return pred(&ScriptedTierView { inner: &inner });
            }
        }
    }
}

/// A read-only view of a scripted tier's record, for [`ScriptedTierHandle::wait_until`].
pub struct ScriptedTierView<'a> {
    inner: &'a Inner,
}

impl ScriptedTierView<'_> {
    /// Number of recorded calls of one kind.
    #[must_use]
    pub fn count(&self, op: &str) -> usize {
        self.inner.calls.iter().filter(|c| c.op == op).count()
    }

    /// Number of peer requests served.
    #[must_use]
    pub fn served(&self) -> usize {
        self.inner.served.len()
    }
}
