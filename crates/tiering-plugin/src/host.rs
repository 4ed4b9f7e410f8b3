//! The host side of the boundary: [`PluginTier`], a [`SecondaryTier`] whose every call goes
//! through a loaded library's C vtable.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use parking_lot::Mutex;

use super::convert::{
    EncodedReq, ErrorText, build_context, event_from_ffi, info_from_ffi, key_from_ffi, key_to_ffi,
    panic_message, position_of, positions_of, push_error, request_id, result_from_ffi, sink, slice,
    stats_from_ffi,
};
use super::ffi::{
    ErrSink, FfiConfigError, FfiEvent, FfiFactoryCtx, FfiInfo, FfiJob, FfiJobResult, FfiKey, FfiParent,
    FfiReq, FfiSink, FfiStats, FfiStatus, FfiStr, TierState, TierVTable, job_kind, lookup, status,
};
use super::loader::LoadedLibrary;
use super::{OptionProblem, PluginError};
use tiering_core::ControlWaker;
use tiering_core::OffloadKey;
use tiering_core::OffloadingEvent;
use tiering_core::TierStats;
use tiering_core::arena::{ChunkArena, RowGrant, RowRead};
use tiering_core::registry::SecondaryContext;
use tiering_core::{JobKind, JobResult, TransferJob};
use tiering_core::{LookupResult, OffloadPolicy};
use tiering_core::{ManagerError, TierError};
use tiering_core::{ParentManager, SecondaryTier};
use tiering_core::{ReqContext, RequestId, TierInfo};

/// The waker the library's wake thread signals; boxed so its address is stable.
struct HostWaker(Mutex<ControlWaker>);

unsafe extern "C" fn host_wake(ctx: *const c_void) {
    let _ = catch_unwind(|| {
        // SAFETY: `ctx` is the `HostWaker` box of a live `PluginTier` (freed only after the
        // library's `destroy` has joined its wake thread).
        if let Some(w) = unsafe { ctx.cast::<HostWaker>().as_ref() } {
            w.0.lock().wake();
        }
    });
}

impl LoadedLibrary {
    /// Checks a tier's `options` (the chain section without `type` and `library`) with the
    /// library's validate entry, without building a tier: the library parses and checks them and
    /// allocates, opens and binds nothing (its contract, as for a linked type's validate-only
    /// hook).
    ///
    /// `None` when the library has no validate entry (ABI 4, or exported without `validate`):
    /// only building a tier checks its options then. `Some(Ok(problems))` otherwise, empty when
    /// the options are good.
    ///
    /// # Errors
    /// (Inside the `Some`) the check could not run: the options cannot be serialised, or the
    /// hook panicked (caught in the library) or failed.
    pub fn validate_options(&self, options: &toml::Table) -> Option<Result<Vec<OptionProblem>, PluginError>> {
        let validate = self.validate?;
        let failed = |message: String| PluginError::Validate {
            path: self.path().to_path_buf(),
            message,
        };
        let text = match toml::to_string(options) {
            Ok(t) => t,
            Err(e) => return Some(Err(failed(format!("cannot serialise the options: {e}")))),
        };
        let mut problems = Vec::new();
        let mut receive = |p: &FfiConfigError| {
            // SAFETY: pushed strings are valid during the push.
            let (key, message) = unsafe { (p.key.to_str(), p.message.to_str()) };
            problems.push(OptionProblem {
                key: key.filter(|k| !k.is_empty()).map(str::to_owned),
                message: message.unwrap_or("(message is not UTF-8)").to_owned(),
            });
        };
        let out = sink(&mut receive);
        let mut err = ErrorText::default();
        // SAFETY: a validate entry of a loaded library (never unloaded); `text` and the sinks'
        // closures live across the call.
        let code = err.with(|e| unsafe { validate(FfiStr::new(&text), out, e) });
        // A panic's message says so ("panicked in the validate hook: …").
        Some(if code == status::OK {
            Ok(problems)
        } else {
            Err(failed(err.or("its validate hook failed without a message")))
        })
    }
}

/// A secondary tier living in a loaded library.
///
/// A panic in the library is caught there, at the C boundary, and re-raised here once the call
/// has returned (no unwind crosses the boundary), so the manager's tier-call guard sees it as
/// it sees a panic of a linked-in tier: `TierError::Panicked` naming the call, and the tier
/// quarantined at once under the default policy. `shutdown` and `destroy` (Drop) report it as
/// an error instead. Calls that cannot return an error (`lookup`, `touch`, `on_new_request`,
/// …) answer conservatively when the library *fails* (`Miss`, chunk level, nothing) and keep
/// the failure; the next `serve_external_requests` returns it, so the manager reports it. The
/// process never aborts because of a panic in the library.
pub struct PluginTier {
    library: &'static LoadedLibrary,
    state: TierState,
    info: TierInfo,
    /// The library's tier opted in to the control thread.
    control_plane: bool,
    /// Keeps the host arena mapped for as long as the library may hold grants on it.
    arena: Arc<ChunkArena>,
    waker: Box<HostWaker>,
    failure: Mutex<Option<String>>,
    /// Host-side contexts of the peer requests the library announced while serving.
    remote: HashMap<RequestId, ReqContext>,
    /// Jobs the host had to fail itself (a grant of the wrong mode), reported at the next poll.
    host_results: Vec<JobResult>,
    /// Set when the library's shutdown or destroy failed: its threads may still use the arena.
    unclean: bool,
}

// SAFETY: `state` is only dereferenced by the library, through vtable calls made from one thread
// at a time (`&mut self`, or `&self` under the manager's lock as the `SecondaryTier` contract
// says). The library's tier is itself `Send` (the factory returns `Box<dyn SecondaryTier>`), so
// moving the pointer to another thread is sound.
unsafe impl Send for PluginTier {}

impl std::fmt::Debug for PluginTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginTier")
            .field("library", &self.library.path())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl PluginTier {
    /// Builds a tier from `library` with `options` (the chain section without `type` and
    /// `library`).
    ///
    /// # Errors
    /// The options cannot be serialised, or the library's factory failed or panicked.
    pub fn create(
        library: &'static LoadedLibrary,
        options: &toml::Table,
        ctx: &SecondaryContext,
    ) -> Result<Self, PluginError> {
        let text = toml::to_string(options).map_err(|e| PluginError::Create {
            path: library.path().to_path_buf(),
            message: format!("cannot serialise the options: {e}"),
        })?;
        let waker = Box::new(HostWaker(Mutex::new(ctx.waker.clone())));
        let fctx = FfiFactoryCtx {
            arena: ctx.arena.raw_parts(),
            chunk_bytes: ctx.arena.chunk_bytes(),
            waker_ctx: std::ptr::from_ref::<HostWaker>(&waker).cast::<c_void>(),
            wake: host_wake,
            log_ctx: super::log::host_marker(),
            log: Some(super::log::host_log),
            max_level: super::log::host_max_level(),
        };
        let mut state: TierState = std::ptr::null_mut();
        let mut err = ErrorText::default();
        // SAFETY: `text` and `fctx` live across the call; the arena and waker box are kept by
        // the returned tier until `destroy` has returned (see `Drop`).
        let code = err.with(|e| unsafe {
            (library.vtable.create)(FfiStr::new(&text), &raw const fctx, &raw mut state, e)
        });
        if code != status::OK || state.is_null() {
            return Err(PluginError::Create {
                path: library.path().to_path_buf(),
                message: err.or("the library's factory failed without a message"),
            });
        }
        let mut tier = Self {
            library,
            state,
            info: TierInfo::new(library.type_name(), None, None),
            control_plane: false,
            arena: Arc::clone(&ctx.arena),
            waker,
            failure: Mutex::new(None),
            remote: HashMap::new(),
            host_results: Vec::new(),
            unclean: false,
        };
        let mut info = None;
        let mut receive = |i: &FfiInfo| {
            // SAFETY: pushed info is valid during the push.
            info = Some(unsafe { info_from_ffi(i) });
        };
        let out = sink(&mut receive);
        // SAFETY: `state` is live; `out` borrows `receive` for the call.
        tier.call("info", |v, s, e| unsafe { (v.info)(s, out, e) })
            .map_err(|f| PluginError::Create {
                path: library.path().to_path_buf(),
                message: f.describe("info"),
            })?;
        if let Some((info, control_plane)) = info {
            tier.info = info;
            tier.control_plane = control_plane;
        }
        Ok(tier)
    }

    /// The library this tier lives in.
    #[must_use]
    pub fn library(&self) -> &'static LoadedLibrary {
        self.library
    }

    /// Makes one vtable call; a failure comes back with a message naming the tier and library.
    fn call(
        &self,
        what: &str,
        f: impl FnOnce(&TierVTable, TierState, ErrSink) -> FfiStatus,
    ) -> Result<(), CallFailure> {
        let mut err = ErrorText::default();
        let code = err.with(|e| f(&self.library.vtable, self.state, e));
        if code == status::OK {
            return Ok(());
        }
        let library = self.library.path().display();
        let text = err.or("no message");
        Err(if code == status::PANIC {
            CallFailure::Panicked(format!(
                "{text} (tier `{}`, caught in its library {library})",
                self.info.name
            ))
        } else {
            CallFailure::Failed(format!(
                "tier `{}` from {library} failed in {what}: {text}",
                self.info.name
            ))
        })
    }

    /// For the calls the manager's tier-call guard wraps: a panic the library caught is raised
    /// again here, after the FFI call returned, so the guard quarantines the tier exactly as
    /// for a linked-in tier's panic; a failure is kept for the next `serve_external_requests`
    /// (the call has no error channel).
    fn keep(&self, r: Result<(), CallFailure>) {
        match r {
            Ok(()) => {}
            Err(CallFailure::Panicked(message)) => std::panic::resume_unwind(Box::new(message)),
            Err(CallFailure::Failed(message)) => self.keep_failure(message),
        }
    }

    /// Keeps the first failure of a call that has no error channel.
    fn keep_failure(&self, message: String) {
        tracing::error!(tier = %self.info.name, %message, "tier library call failed");
        self.failure.lock().get_or_insert(message);
    }

    fn submit(&mut self, job: TransferJob, kind: JobKind) {
        let TransferJob {
            id, keys, req, rows, ..
        } = job;
        let (code, chunk_ids): (u8, Vec<u32>) = match (kind, rows) {
            (JobKind::Store, RowGrant::Read(r)) => {
                (job_kind::STORE, r.into_iter().map(RowRead::into_raw).collect())
            }
            (JobKind::Promotion, RowGrant::Write(w)) => (
                job_kind::PROMOTION,
                w.into_iter()
                    .map(tiering_core::arena::RowWrite::into_raw)
                    .collect(),
            ),
            (_, rows) => {
                // A grant of the wrong mode cannot be handed over; release it here and fail the job.
                drop(rows);
                self.keep_failure(format!("{id} was submitted with grants of the wrong mode"));
                self.host_results
                    .push(JobResult::failed(id, std::time::Duration::ZERO));
                return;
            }
        };
        let ffi_keys: Vec<FfiKey> = keys.iter().map(key_to_ffi).collect();
        let positions = positions_of(&req, &keys);
        let enc = EncodedReq::new(&req);
        let fjob = FfiJob {
            id: id.0,
            kind: code,
            n: chunk_ids.len().min(ffi_keys.len()),
            keys: ffi_keys.as_ptr(),
            positions: positions.as_ptr(),
            chunk_ids: chunk_ids.as_ptr(),
            req: enc.ffi(),
        };
        if chunk_ids.len() != ffi_keys.len() {
            self.keep_failure(format!(
                "{id} has {} keys but {} rows",
                ffi_keys.len(),
                chunk_ids.len()
            ));
        }
        let what = if code == job_kind::STORE {
            "submit_store"
        } else {
            "submit_load"
        };
        // SAFETY: the grants of `chunk_ids` were given up above for the library to adopt; every
        // array lives across the call. The library reports the job even when the call fails.
        let r = self.call(what, |v, s, e| unsafe {
            if code == job_kind::STORE {
                (v.submit_store)(s, &raw const fjob, e)
            } else {
                (v.submit_load)(s, &raw const fjob, e)
            }
        });
        self.keep(r);
    }
}

impl SecondaryTier for PluginTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        self.control_plane
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        *self.waker.0.lock() = waker;
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        let k = key_to_ffi(key);
        let position = position_of(ctx, key);
        let enc = EncodedReq::new(ctx);
        let req = enc.ffi();
        let mut out = lookup::MISS;
        // SAFETY: every argument lives across the call.
        let r = self.call("lookup", |v, s, e| unsafe {
            (v.lookup)(s, &raw const k, position, &raw const req, &raw mut out, e)
        });
        if r.is_err() {
            self.keep(r);
            return LookupResult::Miss;
        }
        match out {
            lookup::HIT => LookupResult::Hit,
            lookup::HIT_PENDING => LookupResult::HitPending,
            lookup::RETRY => LookupResult::Retry,
            _ => LookupResult::Miss,
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.submit(job, JobKind::Store);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.submit(job, JobKind::Promotion);
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.host_results);
        let mut receive = |r: &FfiJobResult| {
            // SAFETY: a pushed result is valid during the push.
            out.push(unsafe { result_from_ffi(r) });
        };
        let results = sink(&mut receive);
        // SAFETY: `results` borrows `receive` for the call.
        let r = self.call("poll_finished", |v, s, e| unsafe {
            (v.poll_finished)(s, results, e)
        });
        self.keep(r);
    }

    fn has_pending_work(&self) -> bool {
        let mut out = 0u8;
        // SAFETY: `out` lives across the call.
        let r = self.call("has_pending_work", |v, s, e| unsafe {
            (v.has_pending_work)(s, &raw mut out, e)
        });
        let failed = r.is_err();
        self.keep(r);
        // A failed library may still hold jobs; keep the engine stepping so the failure surfaces.
        failed || out != 0 || !self.host_results.is_empty()
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        let ffi_keys: Vec<FfiKey> = keys.iter().map(key_to_ffi).collect();
        let positions = positions_of(ctx, keys);
        let enc = EncodedReq::new(ctx);
        let req = enc.ffi();
        // SAFETY: every argument lives across the call.
        let r = self.call("touch", |v, s, e| unsafe {
            (v.touch)(
                s,
                ffi_keys.as_ptr(),
                positions.as_ptr(),
                ffi_keys.len(),
                &raw const req,
                e,
            )
        });
        self.keep(r);
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        let enc = EncodedReq::new(ctx);
        let req = enc.ffi();
        let mut policy = 0u8;
        // SAFETY: every argument lives across the call.
        let r = self.call("on_new_request", |v, s, e| unsafe {
            (v.on_new_request)(s, &raw const req, &raw mut policy, e)
        });
        self.keep(r);
        if policy == 1 {
            OffloadPolicy::RequestLevel
        } else {
            OffloadPolicy::ChunkLevel
        }
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        let enc = EncodedReq::new(ctx);
        let req = enc.ffi();
        // SAFETY: every argument lives across the call.
        let r = self.call("on_request_finished", |v, s, e| unsafe {
            (v.on_request_finished)(s, &raw const req, e)
        });
        self.keep(r);
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        if let Some(message) = self.failure.lock().take() {
            return Err(TierError::Other(message));
        }
        let mut bridge = ParentBridge {
            parent,
            remote: &mut self.remote,
        };
        let fparent = FfiParent {
            ctx: std::ptr::from_mut(&mut bridge).cast::<c_void>(),
            on_new_request: parent_on_new_request,
            lookup: parent_lookup,
            create_store_job: parent_create_store_job,
            on_request_finished: parent_on_request_finished,
        };
        let mut err = ErrorText::default();
        // SAFETY: `fparent` and the bridge it points to live across the call, and the library
        // may use them only during it.
        let code = err.with(|e| unsafe {
            (self.library.vtable.serve_external_requests)(self.state, &raw const fparent, e)
        });
        let library = self.library.path().display();
        if code == status::OK {
            Ok(())
        } else if code == status::PANIC {
            // Raised after the FFI call returned: the manager's guard treats it as any tier's
            // panic in `serve_external_requests`.
            std::panic::resume_unwind(Box::new(format!(
                "{} (tier `{}`, caught in its library {library})",
                err.or("no message"),
                self.info.name
            )))
        } else {
            Err(TierError::Other(format!(
                "tier `{}` from {library} failed in serve_external_requests: {}",
                self.info.name,
                err.or("no message")
            )))
        }
    }

    fn on_schedule_end(&mut self) {
        // SAFETY: plain call on a live state.
        let r = self.call("on_schedule_end", |v, s, e| unsafe { (v.on_schedule_end)(s, e) });
        self.keep(r);
    }

    fn drain_jobs(&mut self) {
        // SAFETY: plain call on a live state.
        let r = self.call("drain_jobs", |v, s, e| unsafe { (v.drain_jobs)(s, e) });
        self.keep(r);
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let mut events = Vec::new();
        let mut receive = |e: &FfiEvent| {
            // SAFETY: a pushed event is valid during the push.
            events.push(unsafe { event_from_ffi(e) });
        };
        let out = sink(&mut receive);
        // SAFETY: `out` borrows `receive` for the call.
        let r = self.call("take_events", |v, s, e| unsafe { (v.take_events)(s, out, e) });
        self.keep(r);
        events
    }

    fn stats(&self) -> TierStats {
        let mut stats = None;
        let mut receive = |s: &FfiStats| {
            // SAFETY: pushed stats are valid during the push.
            stats = Some(unsafe { stats_from_ffi(s) });
        };
        let out = sink(&mut receive);
        // SAFETY: `out` borrows `receive` for the call.
        let r = self.call("stats", |v, s, e| unsafe { (v.stats)(s, out, e) });
        self.keep(r);
        stats.unwrap_or_else(|| TierStats::named(&self.info.name))
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        // SAFETY: plain call on a live state.
        // Never re-raised: a shutdown that panicked is an unclean shutdown, reported.
        let r = self.call("shutdown", |v, s, e| unsafe { (v.shutdown)(s, e) });
        if r.is_err() {
            self.unclean = true;
        }
        r.map_err(|f| TierError::Other(f.describe("shutdown")))
    }
}

impl Drop for PluginTier {
    fn drop(&mut self) {
        // SAFETY: `state` came from `create` and is destroyed exactly once, here.
        let r = self.call("destroy", |v, s, e| unsafe { (v.destroy)(s, e) });
        if let Err(failure) = r {
            let message = failure.describe("destroy");
            tracing::error!(tier = %self.info.name, %message, "destroying a tier library's tier failed");
            self.unclean = true;
        }
        if self.unclean {
            // The library's threads may still touch the arena or call the waker: keep both.
            std::mem::forget(Arc::clone(&self.arena));
            let waker = std::mem::replace(
                &mut self.waker,
                Box::new(HostWaker(Mutex::new(ControlWaker::new()))),
            );
            std::mem::forget(waker);
        }
    }
}

/// How a vtable call went wrong.
enum CallFailure {
    /// The library caught a panic (the message, naming the tier and library).
    Panicked(String),
    /// The library reported an error (the message, naming the tier, library and call).
    Failed(String),
}

impl CallFailure {
    /// One line for a call whose failure is reported, not raised (`shutdown`, `destroy`).
    fn describe(self, call: &str) -> String {
        match self {
            Self::Panicked(m) => format!("panicked in {call}: {m}"),
            Self::Failed(m) => m,
        }
    }
}

/// What the parent callbacks reach through `FfiParent::ctx`.
struct ParentBridge<'a> {
    parent: &'a mut dyn ParentManager,
    remote: &'a mut HashMap<RequestId, ReqContext>,
}

impl ParentBridge<'_> {
    /// The host context for a request the library names (one per request id, so the manager
    /// sees the same context on every call).
    ///
    /// # Safety
    /// `req`'s pointers are valid for the call.
    unsafe fn context(&mut self, req: &FfiReq) -> Result<ReqContext, String> {
        // SAFETY: guaranteed by the caller.
        let id = unsafe { request_id(req) }?;
        if let Some(ctx) = self.remote.get(&id) {
            return Ok(ctx.clone());
        }
        // SAFETY: as above.
        let ctx = unsafe { build_context(req) }?;
        self.remote.insert(id, ctx.clone());
        Ok(ctx)
    }
}

fn manager_status(e: &ManagerError) -> FfiStatus {
    match e {
        ManagerError::UnknownRequest(_) => status::UNKNOWN_REQUEST,
        ManagerError::Primary(_) => status::PRIMARY,
        ManagerError::ShutDown => status::SHUT_DOWN,
        ManagerError::ControlPlane(_) => status::CONTROL_PLANE,
        _ => status::ERROR,
    }
}

/// Runs a parent callback body: catches panics (they must not unwind into the library) and
/// reports errors through `err`.
///
/// # Safety
/// `ctx` is the `ParentBridge` of a `serve_external_requests` call in progress.
unsafe fn bridged(
    ctx: *mut c_void,
    err: ErrSink,
    f: impl FnOnce(&mut ParentBridge<'_>) -> Result<(), (FfiStatus, String)>,
) -> FfiStatus {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: guaranteed by the caller; the library calls back from the serving thread only.
        match unsafe { ctx.cast::<ParentBridge<'_>>().as_mut() } {
            Some(bridge) => f(bridge),
            None => Err((status::ERROR, "null parent context".to_owned())),
        }
    }));
    let (code, message) = match outcome {
        Ok(Ok(())) => return status::OK,
        Ok(Err(e)) => e,
        Err(p) => (
            status::PANIC,
            format!("the manager panicked: {}", panic_message(&*p)),
        ),
    };
    push_error(err, &message);
    code
}

fn from_manager(e: &ManagerError) -> (FfiStatus, String) {
    (manager_status(e), e.to_string())
}

unsafe extern "C" fn parent_on_new_request(
    ctx: *mut c_void,
    req: *const FfiReq,
    out_policy: *mut u8,
    err: ErrSink,
) -> FfiStatus {
    // SAFETY: `FfiParent` contract: called during the serve, pointers valid for the call.
    unsafe {
        bridged(ctx, err, |b| {
            let req = req.as_ref().ok_or((status::ERROR, "null request".to_owned()))?;
            let host_ctx = b.context(req).map_err(|m| (status::ERROR, m))?;
            let policy = b.parent.on_new_request(&host_ctx).map_err(|e| from_manager(&e))?;
            if let Some(out) = out_policy.as_mut() {
                *out = u8::from(policy == OffloadPolicy::RequestLevel);
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn parent_lookup(
    ctx: *mut c_void,
    key: *const FfiKey,
    position: u64,
    req: *const FfiReq,
    out: *mut u8,
    err: ErrSink,
) -> FfiStatus {
    // SAFETY: `FfiParent` contract: called during the serve, pointers valid for the call.
    unsafe {
        bridged(ctx, err, |b| {
            let (Some(key), Some(req)) = (key.as_ref(), req.as_ref()) else {
                return Err((status::ERROR, "null argument".to_owned()));
            };
            let host_ctx = b.context(req).map_err(|m| (status::ERROR, m))?;
            let key = key_from_ffi(key);
            super::convert::apply_positions(&host_ctx, &[key], &[position]);
            let r = b.parent.lookup(&key, &host_ctx).map_err(|e| from_manager(&e))?;
            if let Some(out) = out.as_mut() {
                *out = match r {
                    LookupResult::Hit => lookup::HIT,
                    LookupResult::HitPending => lookup::HIT_PENDING,
                    LookupResult::Retry => lookup::RETRY,
                    LookupResult::Miss => lookup::MISS,
                };
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn parent_create_store_job(
    ctx: *mut c_void,
    keys: *const FfiKey,
    positions: *const u64,
    n: usize,
    req: *const FfiReq,
    job_out: FfiSink<FfiJob>,
    err: ErrSink,
) -> FfiStatus {
    // SAFETY: `FfiParent` contract: called during the serve, pointers valid for the call.
    unsafe {
        bridged(ctx, err, |b| {
            let req = req.as_ref().ok_or((status::ERROR, "null request".to_owned()))?;
            let host_ctx = b.context(req).map_err(|m| (status::ERROR, m))?;
            let keys: Vec<OffloadKey> = slice(keys, n).iter().map(key_from_ffi).collect();
            super::convert::apply_positions(&host_ctx, &keys, slice(positions, n));
            let job = b
                .parent
                .create_store_job(&keys, &host_ctx)
                .map_err(|e| from_manager(&e))?;
            let TransferJob { id, rows, .. } = job;
            let chunk_ids: Vec<u32> = match rows {
                RowGrant::Read(r) => r.into_iter().map(RowRead::into_raw).collect(),
                RowGrant::Write(_) => {
                    return Err((
                        status::ERROR,
                        "the manager returned a store job with write grants".into(),
                    ));
                }
            };
            let ffi_keys: Vec<FfiKey> = keys.iter().map(key_to_ffi).collect();
            let enc = EncodedReq::new(&host_ctx);
            let fjob = FfiJob {
                id: id.0,
                kind: job_kind::STORE,
                n: chunk_ids.len(),
                keys: ffi_keys.as_ptr(),
                positions: std::ptr::null(),
                chunk_ids: chunk_ids.as_ptr(),
                req: enc.ffi(),
            };
            // The library adopts the given-up grants during this push.
            (job_out.push)(job_out.ctx, &raw const fjob);
            Ok(())
        })
    }
}

unsafe extern "C" fn parent_on_request_finished(
    ctx: *mut c_void,
    req: *const FfiReq,
    err: ErrSink,
) -> FfiStatus {
    // SAFETY: `FfiParent` contract: called during the serve, pointers valid for the call.
    unsafe {
        bridged(ctx, err, |b| {
            let req = req.as_ref().ok_or((status::ERROR, "null request".to_owned()))?;
            let host_ctx = b.context(req).map_err(|m| (status::ERROR, m))?;
            b.remote.remove(host_ctx.id());
            b.parent
                .on_request_finished(&host_ctx)
                .map_err(|e| from_manager(&e))
        })
    }
}
