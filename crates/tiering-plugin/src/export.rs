//! The library side of the boundary: turns the C calls of a host back into calls of an ordinary
//! [`SecondaryTier`] built by the library's factory. [`export_tier!`](crate::export_tier)
//! expands to an entry point over these functions.
//!
//! Every function catches panics (a panic must not unwind into the host's frames, where it
//! would abort the process) and reports them as [`status::PANIC`] with the panic message.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::convert::{
    EncodedReq, ErrorText, apply_positions, build_context, key_from_ffi, key_to_ffi, names_request,
    panic_message, position_of, positions_of, push_error, push_event, push_info, push_result, push_stats,
    request_id, sink, slice,
};
use super::ffi::{
    ABI_VERSION, ErrSink, FfiConfigError, FfiEvent, FfiFactoryCtx, FfiInfo, FfiJob, FfiJobResult, FfiKey,
    FfiParent, FfiReq, FfiSink, FfiStaticStr, FfiStats, FfiStatus, FfiStr, PluginDescriptor, TierState,
    TierVTable, job_kind, lookup, status,
};
use tiering_core::ControlWaker;
use tiering_core::OffloadKey;
use tiering_core::arena::{ChunkArena, RowGrant, RowRead, RowWrite};
use tiering_core::registry::{OptionsValidator, SecondaryContext, SecondaryFactory};
use tiering_core::{ControlPlaneFailure, ManagerError, TierError};
use tiering_core::{JobId, JobKind, JobResult, TransferJob};
use tiering_core::{LookupResult, OffloadPolicy};
use tiering_core::{ParentManager, SecondaryTier};
use tiering_core::{ReqContext, RequestId};

/// The `create` function an entry point puts in its vtable.
pub type CreateFn = unsafe extern "C" fn(
    options_toml: FfiStr,
    ctx: *const FfiFactoryCtx,
    out: *mut TierState,
    err: ErrSink,
) -> FfiStatus;

/// The descriptor of a library providing `type_name`, built by `create`, without a validate
/// entry (add one with [`PluginDescriptor::with_validate`]).
#[must_use]
pub const fn descriptor(type_name: &'static str, create: CreateFn) -> PluginDescriptor {
    PluginDescriptor {
        abi_version: ABI_VERSION,
        descriptor_size: size_of::<PluginDescriptor>(),
        core_version: FfiStaticStr::new(super::CORE_VERSION),
        fingerprint: FfiStaticStr::new(super::BUILD_FINGERPRINT),
        type_name: FfiStaticStr::new(type_name),
        vtable: TierVTable {
            create,
            destroy,
            info,
            lookup: lookup_fn,
            submit_store,
            submit_load,
            poll_finished,
            has_pending_work,
            touch,
            on_new_request,
            on_request_finished,
            serve_external_requests,
            on_schedule_end,
            drain_jobs,
            take_events,
            stats,
            shutdown,
        },
        validate: None,
    }
}

/// A failed call: its status and message.
type Failure = (FfiStatus, String);

fn fail(message: impl Into<String>) -> Failure {
    (status::ERROR, message.into())
}

/// Runs `f`, turning its error or panic into a status and a message on `err`.
fn guarded(err: ErrSink, what: &str, f: impl FnOnce() -> Result<(), Failure>) -> FfiStatus {
    let (code, message) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return status::OK,
        Ok(Err(failure)) => failure,
        Err(payload) => (
            status::PANIC,
            format!("panicked in {what}: {}", panic_message(&*payload)),
        ),
    };
    push_error(err, &message);
    code
}

/// Runs a call of the wrapped tier, turning a panic into a [`status::PANIC`] failure.
fn tier_call<R>(what: &str, f: impl FnOnce() -> R) -> Result<R, Failure> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        (
            status::PANIC,
            format!("panicked in {what}: {}", panic_message(&*payload)),
        )
    })
}

/// The host's wake callback, callable from any thread while the tier lives.
struct HostWake {
    ctx: *const c_void,
    wake: unsafe extern "C" fn(*const c_void),
}

// SAFETY: the host guarantees (`FfiFactoryCtx` contract) that `wake(ctx)` may be called from any
// thread until `destroy` returns, and `destroy` joins the only thread that calls it.
unsafe impl Send for HostWake {}

/// Forwards wakes of the library's own [`ControlWaker`] (a different type from the host's: the
/// library links its own copy of this crate) to the host.
struct WakeForwarder {
    stop: Arc<AtomicBool>,
    waker: ControlWaker,
    thread: Option<JoinHandle<()>>,
}

impl WakeForwarder {
    fn start(waker: ControlWaker, host: HostWake) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (waker.clone(), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("kvtier-plugin-wake".into())
            .spawn(move || {
                let host = host;
                while !s.load(Ordering::Acquire) {
                    // The timeout only bounds how long a stop request waits; wakes end it early.
                    if w.wait(Duration::from_millis(200)) && !s.load(Ordering::Acquire) {
                        // SAFETY: see `HostWake`.
                        unsafe { (host.wake)(host.ctx) };
                    }
                }
            })?;
        Ok(Self {
            stop,
            waker,
            thread: Some(thread),
        })
    }
}

impl Drop for WakeForwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The library's state behind a [`TierState`] pointer.
struct LibraryTier {
    /// Declared first so it is dropped first: the tier's threads stop before the forwarder.
    tier: Box<dyn SecondaryTier>,
    arena: Arc<ChunkArena>,
    /// This side's context per request, so a tier's per-request scratch state survives between
    /// calls.
    requests: HashMap<RequestId, ReqContext>,
    /// The context of the last call: consecutive calls usually name the same request, and
    /// comparing in place avoids building a `RequestId` to probe `requests`.
    last: Option<ReqContext>,
    /// Jobs this shim reported failed after the tier panicked while taking them; a later report
    /// from the tier for one of them is dropped, so each job is still reported exactly once.
    abandoned: HashSet<JobId>,
    synthetic: Vec<JobResult>,
    buf: Vec<JobResult>,
    _forwarder: WakeForwarder,
}

impl LibraryTier {
    /// This side's context for `req`, creating it on first sight.
    ///
    /// # Safety
    /// `req`'s pointers must be valid for the call.
    unsafe fn context(&mut self, req: &FfiReq) -> Result<ReqContext, Failure> {
        if let Some(last) = &self.last
            // SAFETY: guaranteed by the caller.
            && unsafe { names_request(req, last.id()) }
        {
            return Ok(last.clone());
        }
        // SAFETY: guaranteed by the caller.
        let id = unsafe { request_id(req) }.map_err(fail)?;
        let ctx = match self.requests.get(&id) {
            Some(ctx) => ctx.clone(),
            None => {
                // SAFETY: as above.
                let ctx = unsafe { build_context(req) }.map_err(fail)?;
                self.requests.insert(id, ctx.clone());
                ctx
            }
        };
        self.last = Some(ctx.clone());
        Ok(ctx)
    }

    fn fail_job(&mut self, id: JobId, start: Instant) {
        self.abandoned.insert(id);
        self.synthetic.push(JobResult::failed(id, start.elapsed()));
    }

    fn check_rows(&self, chunk_ids: &[u32]) -> Result<(), Failure> {
        match chunk_ids.iter().find(|&&c| c as usize >= self.arena.num_chunks()) {
            Some(c) => Err(fail(format!(
                "arena row {c} is outside the arena of {} rows",
                self.arena.num_chunks()
            ))),
            None => Ok(()),
        }
    }

    /// Adopts the rows the host gave up for `chunk_ids`.
    ///
    /// # Safety
    /// The host gave up one grant of `kind` per entry of `chunk_ids` for this call; they have
    /// been range-checked.
    unsafe fn adopt(&self, kind: JobKind, chunk_ids: &[u32]) -> RowGrant {
        match kind {
            // SAFETY: guaranteed by the caller.
            JobKind::Store => RowGrant::Read(
                chunk_ids
                    .iter()
                    .map(|&c| unsafe { RowRead::from_raw(&self.arena, c) })
                    .collect(),
            ),
            // SAFETY: guaranteed by the caller.
            JobKind::Promotion => RowGrant::Write(
                chunk_ids
                    .iter()
                    .map(|&c| unsafe { RowWrite::from_raw(&self.arena, c) })
                    .collect(),
            ),
        }
    }
}

/// # Safety
/// `state` is null or a pointer returned by `create` and not yet destroyed.
unsafe fn tier_state<'a>(state: TierState) -> Result<&'a mut LibraryTier, Failure> {
    // SAFETY: guaranteed by the caller; the host calls one function at a time per tier.
    unsafe { state.cast::<LibraryTier>().as_mut() }.ok_or_else(|| fail("null tier state"))
}

/// `create` for a library whose tiers `factory` builds. Called by the code
/// [`export_tier!`](crate::export_tier) generates.
///
/// # Safety
/// `options_toml` is valid for the call; `ctx` points to a valid [`FfiFactoryCtx`] whose arena
/// and waker stay valid until `destroy` returns; `out` is writable.
pub unsafe fn create(
    factory: SecondaryFactory,
    options_toml: FfiStr,
    ctx: *const FfiFactoryCtx,
    out: *mut TierState,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "create", || {
        // SAFETY: guaranteed by the caller.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| fail("null factory context"))?;
        if out.is_null() {
            return Err(fail("null output pointer"));
        }
        // SAFETY: as above.
        let text = unsafe { options_toml.to_str() }.ok_or_else(|| fail("options are not UTF-8"))?;
        let options: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| fail(format!("options are not a TOML table: {e}")))?;
        // SAFETY: the host keeps its arena alive until `destroy` returns (this function's
        // contract), and `destroy` drops the tier — and with it every grant made from the view.
        let arena = unsafe { ChunkArena::from_raw_parts(ctx.arena) }.map_err(|e| fail(e.to_string()))?;
        if arena.chunk_bytes() != ctx.chunk_bytes {
            return Err(fail("chunk size does not match the arena"));
        }
        super::log::forward_to_host(ctx);
        let waker = ControlWaker::new();
        let forwarder = WakeForwarder::start(
            waker.clone(),
            HostWake {
                ctx: ctx.waker_ctx,
                wake: ctx.wake,
            },
        )
        .map_err(|e| fail(format!("cannot start the wake thread: {e}")))?;
        let sctx = SecondaryContext::new(Arc::clone(&arena), waker.clone());
        let mut tier =
            tier_call("the tier's factory", || factory(&options, &sctx))?.map_err(|e| fail(e.to_string()))?;
        tier.set_waker(waker);
        let state = Box::new(LibraryTier {
            tier,
            arena,
            requests: HashMap::new(),
            last: None,
            abandoned: HashSet::new(),
            synthetic: Vec::new(),
            buf: Vec::new(),
            _forwarder: forwarder,
        });
        // SAFETY: checked non-null above; the caller guarantees it is writable.
        unsafe { *out = Box::into_raw(state).cast() };
        Ok(())
    })
}

/// `validate` for a library whose options `validator` checks (the same hook as
/// `register_tier!`'s `validate = …`). Called by the code [`export_tier!`](crate::export_tier)
/// generates. Each problem goes out with the top-level key its message quotes in backquotes
/// (what [`parse_options`](tiering_core::options::parse_options) writes), or no key.
///
/// # Safety
/// `options_toml` is valid for the call; the sinks are callable during it.
pub unsafe fn validate(
    validator: OptionsValidator,
    options_toml: FfiStr,
    out: FfiSink<FfiConfigError>,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "the validate hook", || {
        // SAFETY: guaranteed by the caller.
        let text = unsafe { options_toml.to_str() }.ok_or_else(|| fail("options are not UTF-8"))?;
        let options: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| fail(format!("options are not a TOML table: {e}")))?;
        let Err(problems) = tier_call("the validate hook", || validator(&options))? else {
            return Ok(());
        };
        for problem in problems {
            let message = match problem {
                TierError::Config(m) => m,
                other => other.to_string(),
            };
            let key = tiering_core::options::quoted_words(&message)
                .find(|w| options.contains_key(*w))
                .unwrap_or("");
            let item = FfiConfigError {
                key: FfiStr::new(key),
                message: FfiStr::new(&message),
            };
            // SAFETY: the caller's sink, callable during this call; `item` borrows `message`,
            // which lives across the push.
            unsafe { (out.push)(out.ctx, &raw const item) };
        }
        Ok(())
    })
}

unsafe extern "C" fn destroy(state: TierState, err: ErrSink) -> FfiStatus {
    guarded(err, "destroy", || {
        if state.is_null() {
            return Ok(());
        }
        // SAFETY: `state` came from `Box::into_raw` in `create` and the host destroys it once.
        drop(unsafe { Box::from_raw(state.cast::<LibraryTier>()) });
        Ok(())
    })
}

unsafe extern "C" fn info(state: TierState, out: FfiSink<FfiInfo>, err: ErrSink) -> FfiStatus {
    guarded(err, "info", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        let info = tier_call("info", || st.tier.info())?;
        let control_plane = tier_call("needs_control_plane", || st.tier.needs_control_plane())?;
        push_info(out, &info, control_plane);
        Ok(())
    })
}

unsafe extern "C" fn lookup_fn(
    state: TierState,
    key: *const FfiKey,
    position: u64,
    req: *const FfiReq,
    out: *mut u8,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "lookup", || {
        // SAFETY: vtable contract: pointers valid for the call.
        let (st, key, req) = unsafe { (tier_state(state)?, key.as_ref(), req.as_ref()) };
        let (Some(key), Some(req)) = (key, req) else {
            return Err(fail("null argument"));
        };
        // SAFETY: as above.
        let ctx = unsafe { st.context(req) }?;
        let key = key_from_ffi(key);
        apply_positions(&ctx, &[key], &[position]);
        let r = tier_call("lookup", || st.tier.lookup(&key, &ctx))?;
        let code = match r {
            LookupResult::Hit => lookup::HIT,
            LookupResult::HitPending => lookup::HIT_PENDING,
            LookupResult::Retry => lookup::RETRY,
            LookupResult::Miss => lookup::MISS,
        };
        // SAFETY: as above (checked below for null).
        if let Some(out) = unsafe { out.as_mut() } {
            *out = code;
        }
        Ok(())
    })
}

/// Receives a job: adopts its rows first (so they are released whatever happens next), then
/// hands a real [`TransferJob`] to the tier.
///
/// # Safety
/// Vtable contract for `submit_store`/`submit_load`.
unsafe fn submit(state: TierState, job: *const FfiJob, err: ErrSink, kind: JobKind) -> FfiStatus {
    let what = match kind {
        JobKind::Store => "submit_store",
        JobKind::Promotion => "submit_load",
    };
    guarded(err, what, || {
        let start = Instant::now();
        // SAFETY: vtable contract: pointers valid for the call.
        let (st, job) = unsafe { (tier_state(state)?, job.as_ref()) };
        let job = job.ok_or_else(|| fail("null job"))?;
        let expected = match kind {
            JobKind::Store => job_kind::STORE,
            JobKind::Promotion => job_kind::PROMOTION,
        };
        let id = JobId(job.id);
        if job.kind != expected {
            // The grants' mode is unknown: leave the locks held (a leak) rather than release
            // them the wrong way.
            st.fail_job(id, start);
            return Err(fail(format!("{what} received a job of another kind")));
        }
        // SAFETY: vtable contract: `n` entries each.
        let chunk_ids = unsafe { slice(job.chunk_ids, job.n) };
        if let Err(e) = st.check_rows(chunk_ids) {
            st.fail_job(id, start);
            return Err(e);
        }
        // SAFETY: the host gave up one grant of this job's kind per row for this call, and the
        // rows are in range.
        let rows = unsafe { st.adopt(kind, chunk_ids) };
        // SAFETY: as above.
        let (keys, positions) = unsafe { (slice(job.keys, job.n), slice(job.positions, job.n)) };
        let keys: Vec<OffloadKey> = keys.iter().map(key_from_ffi).collect();
        // SAFETY: as above.
        let ctx = match unsafe { st.context(&job.req) } {
            Ok(ctx) => ctx,
            Err(e) => {
                drop(rows);
                st.fail_job(id, start);
                return Err(e);
            }
        };
        apply_positions(&ctx, &keys, positions);
        let job = TransferJob {
            id,
            kind,
            keys,
            chunk_ids: chunk_ids.to_vec(),
            req: ctx,
            rows,
        };
        let tier = &mut st.tier;
        let r = tier_call(what, || match kind {
            JobKind::Store => tier.submit_store(job),
            JobKind::Promotion => tier.submit_load(job),
        });
        if r.is_err() {
            st.fail_job(id, start);
        }
        r
    })
}

unsafe extern "C" fn submit_store(state: TierState, job: *const FfiJob, err: ErrSink) -> FfiStatus {
    // SAFETY: forwarded vtable contract.
    unsafe { submit(state, job, err, JobKind::Store) }
}

unsafe extern "C" fn submit_load(state: TierState, job: *const FfiJob, err: ErrSink) -> FfiStatus {
    // SAFETY: forwarded vtable contract.
    unsafe { submit(state, job, err, JobKind::Promotion) }
}

unsafe extern "C" fn poll_finished(state: TierState, out: FfiSink<FfiJobResult>, err: ErrSink) -> FfiStatus {
    guarded(err, "poll_finished", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        for r in st.synthetic.drain(..) {
            push_result(out, &r);
        }
        let mut buf = std::mem::take(&mut st.buf);
        buf.clear();
        let polled = tier_call("poll_finished", || st.tier.poll_finished(&mut buf));
        for r in buf.drain(..) {
            if !st.abandoned.remove(&r.id) {
                push_result(out, &r);
            }
        }
        st.buf = buf;
        polled
    })
}

unsafe extern "C" fn has_pending_work(state: TierState, out: *mut u8, err: ErrSink) -> FfiStatus {
    guarded(err, "has_pending_work", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        let busy = !st.synthetic.is_empty() || tier_call("has_pending_work", || st.tier.has_pending_work())?;
        // SAFETY: vtable contract (null-checked).
        if let Some(out) = unsafe { out.as_mut() } {
            *out = u8::from(busy);
        }
        Ok(())
    })
}

unsafe extern "C" fn touch(
    state: TierState,
    keys: *const FfiKey,
    positions: *const u64,
    n: usize,
    req: *const FfiReq,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "touch", || {
        // SAFETY: vtable contract: pointers valid for the call, `n` entries each.
        let (st, keys, positions, req) = unsafe {
            (
                tier_state(state)?,
                slice(keys, n),
                slice(positions, n),
                req.as_ref(),
            )
        };
        let req = req.ok_or_else(|| fail("null request"))?;
        // SAFETY: as above.
        let ctx = unsafe { st.context(req) }?;
        let keys: Vec<OffloadKey> = keys.iter().map(key_from_ffi).collect();
        apply_positions(&ctx, &keys, positions);
        tier_call("touch", || st.tier.touch(&keys, &ctx))
    })
}

unsafe extern "C" fn on_new_request(
    state: TierState,
    req: *const FfiReq,
    out: *mut u8,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "on_new_request", || {
        // SAFETY: vtable contract.
        let (st, req) = unsafe { (tier_state(state)?, req.as_ref()) };
        let req = req.ok_or_else(|| fail("null request"))?;
        // SAFETY: vtable contract.
        let id = unsafe { request_id(req) }.map_err(fail)?;
        // A new request under a known id starts over with a fresh context.
        st.requests.remove(&id);
        st.last = None;
        // SAFETY: as above.
        let ctx = unsafe { st.context(req) }?;
        let policy = tier_call("on_new_request", || st.tier.on_new_request(&ctx))?;
        // SAFETY: vtable contract (null-checked).
        if let Some(out) = unsafe { out.as_mut() } {
            *out = u8::from(policy == OffloadPolicy::RequestLevel);
        }
        Ok(())
    })
}

unsafe extern "C" fn on_request_finished(state: TierState, req: *const FfiReq, err: ErrSink) -> FfiStatus {
    guarded(err, "on_request_finished", || {
        // SAFETY: vtable contract.
        let (st, req) = unsafe { (tier_state(state)?, req.as_ref()) };
        let req = req.ok_or_else(|| fail("null request"))?;
        // SAFETY: as above.
        let ctx = unsafe { st.context(req) }?;
        st.requests.remove(ctx.id());
        st.last = None;
        tier_call("on_request_finished", || st.tier.on_request_finished(&ctx))
    })
}

unsafe extern "C" fn serve_external_requests(
    state: TierState,
    parent: *const FfiParent,
    err: ErrSink,
) -> FfiStatus {
    guarded(err, "serve_external_requests", || {
        // SAFETY: vtable contract: `parent` is valid for this call.
        let (st, parent) = unsafe { (tier_state(state)?, parent.as_ref()) };
        let parent = parent.ok_or_else(|| fail("null parent"))?;
        let mut adapter = ParentAdapter {
            parent,
            arena: &st.arena,
        };
        tier_call("serve_external_requests", || {
            st.tier.serve_external_requests(&mut adapter)
        })?
        .map_err(|e| fail(e.to_string()))
    })
}

unsafe extern "C" fn on_schedule_end(state: TierState, err: ErrSink) -> FfiStatus {
    guarded(err, "on_schedule_end", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        tier_call("on_schedule_end", || st.tier.on_schedule_end())
    })
}

unsafe extern "C" fn drain_jobs(state: TierState, err: ErrSink) -> FfiStatus {
    guarded(err, "drain_jobs", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        tier_call("drain_jobs", || st.tier.drain_jobs())
    })
}

unsafe extern "C" fn take_events(state: TierState, out: FfiSink<FfiEvent>, err: ErrSink) -> FfiStatus {
    guarded(err, "take_events", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        for e in tier_call("take_events", || st.tier.take_events())? {
            push_event(out, &e);
        }
        Ok(())
    })
}

unsafe extern "C" fn stats(state: TierState, out: FfiSink<FfiStats>, err: ErrSink) -> FfiStatus {
    guarded(err, "stats", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        let s = tier_call("stats", || st.tier.stats())?;
        push_stats(out, &s);
        Ok(())
    })
}

unsafe extern "C" fn shutdown(state: TierState, err: ErrSink) -> FfiStatus {
    guarded(err, "shutdown", || {
        // SAFETY: vtable contract.
        let st = unsafe { tier_state(state) }?;
        tier_call("shutdown", || st.tier.shutdown())?.map_err(|e| fail(e.to_string()))
    })
}

/// The host's `ParentManager`, seen from the library.
struct ParentAdapter<'a> {
    parent: &'a FfiParent,
    arena: &'a Arc<ChunkArena>,
}

impl ParentAdapter<'_> {
    fn error(code: FfiStatus, message: String, ctx: &ReqContext) -> ManagerError {
        match code {
            status::UNKNOWN_REQUEST => ManagerError::UnknownRequest(ctx.id().clone()),
            status::PRIMARY => ManagerError::Primary(Arc::new(TierError::Other(message))),
            status::SHUT_DOWN => ManagerError::ShutDown,
            status::CONTROL_PLANE => ManagerError::ControlPlane(Arc::new(ControlPlaneFailure { message })),
            _ => ManagerError::Tier {
                tier: "host".to_owned(),
                source: Arc::new(TierError::Other(message)),
            },
        }
    }

    fn call(
        &self,
        ctx: &ReqContext,
        f: impl FnOnce(&FfiParent, &FfiReq, ErrSink) -> FfiStatus,
    ) -> Result<(), ManagerError> {
        let enc = EncodedReq::new(ctx);
        let req = enc.ffi();
        let mut err = ErrorText::default();
        let code = err.with(|e| f(self.parent, &req, e));
        if code == status::OK {
            Ok(())
        } else {
            Err(Self::error(code, err.or("the host reported no message"), ctx))
        }
    }
}

impl ParentManager for ParentAdapter<'_> {
    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        let mut policy = 0u8;
        // SAFETY: the parent's functions are valid during `serve_external_requests`, which is
        // the only time this adapter exists; the arguments live across the call.
        self.call(ctx, |p, req, e| unsafe {
            (p.on_new_request)(p.ctx, req, &raw mut policy, e)
        })?;
        Ok(if policy == 1 {
            OffloadPolicy::RequestLevel
        } else {
            OffloadPolicy::ChunkLevel
        })
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        let k = key_to_ffi(key);
        let position = position_of(ctx, key);
        let mut out = lookup::MISS;
        // SAFETY: as in `on_new_request`.
        self.call(ctx, |p, req, e| unsafe {
            (p.lookup)(p.ctx, &raw const k, position, req, &raw mut out, e)
        })?;
        Ok(match out {
            lookup::HIT => LookupResult::Hit,
            lookup::HIT_PENDING => LookupResult::HitPending,
            lookup::RETRY => LookupResult::Retry,
            _ => LookupResult::Miss,
        })
    }

    fn create_store_job(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<TransferJob, ManagerError> {
        let ffi_keys: Vec<FfiKey> = keys.iter().map(key_to_ffi).collect();
        let positions = positions_of(ctx, keys);
        let arena = self.arena;
        let mut job: Option<TransferJob> = None;
        let mut receive = |j: &FfiJob| {
            // SAFETY: the host pushes a job valid for the push, `n` entries per array.
            let chunk_ids = unsafe { slice(j.chunk_ids, j.n) };
            if j.kind != job_kind::STORE || chunk_ids.iter().any(|&c| c as usize >= arena.num_chunks()) {
                // Not adoptable as read grants: leave the locks held rather than corrupt them.
                return;
            }
            let rows = RowGrant::Read(
                chunk_ids
                    .iter()
                    // SAFETY: the host gave up one read grant per row for this push; in range.
                    .map(|&c| unsafe { RowRead::from_raw(arena, c) })
                    .collect(),
            );
            job = Some(TransferJob {
                id: JobId(j.id),
                kind: JobKind::Store,
                keys: keys.to_vec(),
                chunk_ids: chunk_ids.to_vec(),
                req: ctx.clone(),
                rows,
            });
        };
        let job_sink = sink(&mut receive);
        // SAFETY: as in `on_new_request`; `job_sink` borrows `receive`, alive across the call.
        self.call(ctx, |p, req, e| unsafe {
            (p.create_store_job)(
                p.ctx,
                ffi_keys.as_ptr(),
                positions.as_ptr(),
                ffi_keys.len(),
                req,
                job_sink,
                e,
            )
        })?;
        job.ok_or_else(|| ManagerError::Tier {
            tier: "host".to_owned(),
            source: Arc::new(TierError::Other(
                "the host reported a store job this library could not accept".to_owned(),
            )),
        })
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        // SAFETY: as in `on_new_request`.
        self.call(ctx, |p, req, e| unsafe { (p.on_request_finished)(p.ctx, req, e) })
    }
}

/// Exports a secondary tier type from a `cdylib`, so a host can load it with
/// `library = "…"` in a chain file. The factory has the same signature as for
/// [`register_tier!`](tiering_core::register_tier), so one function serves both; so does the optional
/// validate-only hook, which lets `kvtier check` check the tier's options without building it
/// (tier ABI 5; without it, only `kvtier check --build` checks them):
///
/// ```ignore
/// tiering_core::register_tier!(secondary "my-tier" => build, validate = validate);
/// tiering_plugin::export_tier!("my-tier" => build, validate = validate);
/// ```
///
/// Use it once per library, at module level. It exports the ABI version static and the entry
/// function the loader looks for. The hook must only parse and check (no allocation of the
/// tier's storage, no files, sockets or threads); a panic in it is caught in the library and
/// reported as an error of the check.
#[macro_export]
macro_rules! export_tier {
    ($name:literal => $factory:expr $(,)?) => {
        $crate::export_tier!(@entry $name, $factory, |d| d);
    };
    ($name:literal => $factory:expr, validate = $validator:expr $(,)?) => {
        $crate::export_tier!(@entry $name, $factory, |d| {
            // Named so it cannot shadow the hook's own name in `$validator`.
            unsafe extern "C" fn __kvtier_validate_entry(
                options: $crate::ffi::FfiStr,
                out: $crate::ffi::FfiSink<$crate::ffi::FfiConfigError>,
                err: $crate::ffi::ErrSink,
            ) -> $crate::ffi::FfiStatus {
                let validator: $crate::__private::OptionsValidator = $validator;
                // SAFETY: the host calls `validate` under the descriptor's contract, which is
                // exactly `plugin::export::validate`'s.
                unsafe { $crate::export::validate(validator, options, out, err) }
            }
            d.with_validate(__kvtier_validate_entry)
        });
    };
    (@entry $name:literal, $factory:expr, |$d:ident| $finish:expr) => {
        /// The kvtier tier ABI version this library implements (read by the loader first).
        #[allow(non_upper_case_globals)]
        #[unsafe(no_mangle)]
        pub static kvtier_tier_abi_version: u32 = $crate::ffi::ABI_VERSION;

        /// The kvtier tier entry point: returns this library's descriptor.
        #[unsafe(no_mangle)]
        pub extern "C" fn kvtier_tier_entry() -> *const $crate::ffi::PluginDescriptor {
            unsafe extern "C" fn create(
                options: $crate::ffi::FfiStr,
                ctx: *const $crate::ffi::FfiFactoryCtx,
                out: *mut $crate::ffi::TierState,
                err: $crate::ffi::ErrSink,
            ) -> $crate::ffi::FfiStatus {
                let factory: $crate::__private::SecondaryFactory = $factory;
                // SAFETY: the host calls `create` under the vtable's contract, which is exactly
                // `plugin::export::create`'s.
                unsafe { $crate::export::create(factory, options, ctx, out, err) }
            }
            static DESCRIPTOR: $crate::ffi::PluginDescriptor = {
                let $d = $crate::export::descriptor($name, create);
                $finish
            };
            &DESCRIPTOR
        }
    };
}
