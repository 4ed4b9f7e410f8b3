//! The C ABI between a host and a tier library: plain `#[repr(C)]` data and `extern "C"`
//! function pointers only. Nothing here owns memory across the boundary: every pointer handed
//! over is borrowed for the duration of the call that carries it, and data going back travels
//! through *sinks* — a callback the receiver provides, which copies what it needs.
//!
//! Versioning: [`ABI_VERSION`] changes whenever any type or function signature of this module
//! changes. The loader reads it from the exported static [`ABI_SYMBOL`] before it calls any code
//! of the library, and accepts [`MIN_ABI_VERSION`] to [`ABI_VERSION`].
//!
//! History of what a host still reads:
//! - 5: the descriptor ends with an optional [`ValidateFn`] (`validate`, null when the library
//!   has none), which checks a tier's options without building it (`kvtier check`).
//! - 4: the descriptor ends with the vtable ([`PluginDescriptorV4`]); every other type and
//!   function of this module is as in version 5, so a version-5 host reads a version-4
//!   descriptor through that prefix and uses the library as before, without a validate entry.
//!
//! A library declares the version it was built for; a host older than that version refuses it
//! (it cannot know the fields it would ignore were optional).

use std::ffi::c_void;
use std::marker::PhantomData;

use tiering_core::arena::ArenaRawParts;

/// The version of this ABI, which libraries built against this crate declare. A host accepts
/// libraries of [`MIN_ABI_VERSION`] up to this version and refuses any other.
pub const ABI_VERSION: u32 = 5;

/// The oldest library ABI version this host still loads (see the module's history).
pub const MIN_ABI_VERSION: u32 = 4;

/// Name of the exported `u32` static holding the library's [`ABI_VERSION`].
pub const ABI_SYMBOL: &str = "kvtier_tier_abi_version";

/// Name of the exported entry function returning the library's [`PluginDescriptor`].
pub const ENTRY_SYMBOL: &str = "kvtier_tier_entry";

/// The entry function's signature.
pub type EntryFn = unsafe extern "C" fn() -> *const PluginDescriptor;

/// Status of a call. Anything but [`status::OK`] comes with a message through the call's error
/// sink (when the callee could produce one).
pub type FfiStatus = i32;

/// The values of [`FfiStatus`].
pub mod status {
    use super::FfiStatus;

    /// Success.
    pub const OK: FfiStatus = 0;
    /// A failure described by the message.
    pub const ERROR: FfiStatus = 1;
    /// The callee panicked; the panic was caught at the boundary.
    pub const PANIC: FfiStatus = 2;
    /// (Parent calls) the request is unknown to the manager.
    pub const UNKNOWN_REQUEST: FfiStatus = 3;
    /// (Parent calls) the primary tier refused (e.g. a key that is not a ready hit).
    pub const PRIMARY: FfiStatus = 4;
    /// (Parent calls) the manager is shut down.
    pub const SHUT_DOWN: FfiStatus = 5;
    /// (Parent calls) the control plane failed earlier.
    pub const CONTROL_PLANE: FfiStatus = 6;
}

/// A borrowed UTF-8 string.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiStr {
    /// First byte (may dangle when `len == 0`).
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl FfiStr {
    /// Borrows `s` (valid as long as `s` is).
    #[must_use]
    pub const fn new(s: &str) -> Self {
        Self {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// The empty string.
    #[must_use]
    pub const fn empty() -> Self {
        Self::new("")
    }

    /// Reads the string.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that stay valid and unchanged for `'a`.
    #[must_use]
    pub unsafe fn to_str<'a>(self) -> Option<&'a str> {
        if self.len == 0 {
            return Some("");
        }
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: guaranteed by the caller.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        std::str::from_utf8(bytes).ok()
    }
}

/// A string in a `static` descriptor (points to static data, so it may be shared).
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct FfiStaticStr(pub FfiStr);

// SAFETY: an `FfiStaticStr` is only built from `&'static str` (see `new`), which is immutable and
// valid for the program's life, so sharing the pointer between threads is sound.
unsafe impl Sync for FfiStaticStr {}

impl FfiStaticStr {
    /// Wraps a static string.
    #[must_use]
    pub const fn new(s: &'static str) -> Self {
        Self(FfiStr::new(s))
    }
}

/// A chunk key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FfiKey {
    /// The chained prefix hash.
    pub hash: [u8; 32],
    /// The KV-group index.
    pub group: u32,
}

/// "No position recorded" in a positions array.
pub const NO_POSITION: u64 = u64::MAX;

/// A medium or locality code: 0 = unspecified, then the enum's variants from 1.
pub type FfiEnum = u8;

/// One filter matcher.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiMatcher {
    /// 0 any, 1 CPU, 2 storage.
    pub medium: FfiEnum,
    /// 0 any, 1 local, 2 remote.
    pub locality: FfiEnum,
}

/// A request context.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiReq {
    /// 1 for a remote (peer-originated) request.
    pub remote: u8,
    /// The peer of a remote request (empty for a local one).
    pub peer: FfiStr,
    /// The request id.
    pub id: FfiStr,
    /// The transfer parameters as a JSON object; empty means none.
    pub params_json: FfiStr,
    /// 1 when the filter allows every tier (`matchers` is then ignored).
    pub filter_all: u8,
    /// The filter's matchers.
    pub matchers: *const FfiMatcher,
    /// Number of matchers.
    pub n_matchers: usize,
}

/// Job kinds.
pub mod job_kind {
    /// Primary → tier (rows are read grants).
    pub const STORE: u8 = 0;
    /// Tier → primary (rows are write grants).
    pub const PROMOTION: u8 = 1;
}

/// A transfer job. The row grants of `chunk_ids` were given up by the sender (their locks stay
/// held) and must be adopted by the receiver exactly once, on its view of the arena.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiJob {
    /// The job id.
    pub id: u64,
    /// [`job_kind::STORE`] or [`job_kind::PROMOTION`].
    pub kind: u8,
    /// Number of keys (and rows).
    pub n: usize,
    /// The keys.
    pub keys: *const FfiKey,
    /// Each key's end-token position in the request, or [`NO_POSITION`].
    pub positions: *const u64,
    /// Each key's arena row.
    pub chunk_ids: *const u32,
    /// The request.
    pub req: FfiReq,
}

/// Job outcomes.
pub mod outcome {
    /// Every key succeeded.
    pub const OK: u8 = 0;
    /// Every key failed.
    pub const FAILED: u8 = 1;
    /// Only `ok_keys` succeeded.
    pub const PARTIAL: u8 = 2;
}

/// A finished job.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiJobResult {
    /// The job id.
    pub id: u64,
    /// An [`outcome`] code.
    pub outcome: u8,
    /// The successful keys of a partial result.
    pub ok_keys: *const FfiKey,
    /// Number of `ok_keys`.
    pub n_ok: usize,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Submission to completion, in nanoseconds.
    pub elapsed_nanos: u64,
}

/// A cache event.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiEvent {
    /// The keys.
    pub keys: *const FfiKey,
    /// Number of keys.
    pub n: usize,
    /// Medium code.
    pub medium: FfiEnum,
    /// Locality code.
    pub locality: FfiEnum,
    /// 1 for a removal.
    pub removed: u8,
    /// 1 for a metadata-only removal.
    pub metadata_only: u8,
    /// 1 for a store whose removal the tier will report too (it evicts on its own).
    pub removal_expected: u8,
    /// 1 when `ownership` is set.
    pub has_ownership: u8,
    /// The owning tier's name.
    pub ownership: FfiStr,
}

/// A tier's name, medium and locality.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiInfo {
    /// The tier's name.
    pub name: FfiStr,
    /// Medium code.
    pub medium: FfiEnum,
    /// Locality code.
    pub locality: FfiEnum,
    /// 1 when the tier opts in to the manager's control thread (`needs_control_plane`).
    pub control_plane: u8,
}

/// A tier's stats.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiStats {
    /// The tier's name.
    pub name: FfiStr,
    /// `[hits, misses, stores, loads, evictions, failures, bytes_written, bytes_read,
    /// resident_chunks, capacity_chunks]`.
    pub counters: [u64; 10],
    /// Names of the tier-specific figures.
    pub extra_names: *const FfiStr,
    /// Values of the tier-specific figures.
    pub extra_values: *const f64,
    /// Number of tier-specific figures.
    pub n_extra: usize,
}

/// A callback through which the callee hands data back: `push(ctx, item)` with `item` valid only
/// during the call.
#[repr(C)]
pub struct FfiSink<T> {
    /// The receiver's state.
    pub ctx: *mut c_void,
    /// Receives one item.
    pub push: unsafe extern "C" fn(ctx: *mut c_void, item: *const T),
    /// Ties the sink to its item type.
    pub _item: PhantomData<*const T>,
}

impl<T> Clone for FfiSink<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for FfiSink<T> {}

/// What a library's `create` receives besides its options.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiFactoryCtx {
    /// The host arena (the library builds a view of it).
    pub arena: ArenaRawParts,
    /// Chunk payload bytes.
    pub chunk_bytes: usize,
    /// The host's control-plane waker.
    pub waker_ctx: *const c_void,
    /// Wakes the host's control plane.
    pub wake: unsafe extern "C" fn(ctx: *const c_void),
    /// Context for `log`: identifies the host's copy of `tiering-core` (a library that finds its
    /// own copy here is linked into the host and logs through the host's subscriber directly).
    pub log_ctx: *const c_void,
    /// Re-emits one of the library's `tracing` events through the host's subscriber; the
    /// library installs a subscriber forwarding to it (`None`: the library's events are dropped).
    /// May be called from any thread, at any time until the process exits.
    pub log: Option<unsafe extern "C" fn(ctx: *const c_void, record: *const FfiLogRecord)>,
    /// The most verbose level the host's subscriber may enable (0 off, 1 error, 2 warn, 3 info,
    /// 4 debug, 5 trace), so the library skips the rest cheaply.
    pub max_level: u8,
}

/// One `tracing` event of a library, as the host re-emits it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiLogRecord {
    /// 1 error, 2 warn, 3 info, 4 debug, 5 trace.
    pub level: u8,
    /// The event's target (the module path in the library).
    pub target: FfiStr,
    /// The message, then the event's other fields as `key=value`.
    pub message: FfiStr,
}

/// The manager, as a tier sees it while serving peers (valid only during
/// `serve_external_requests`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiParent {
    /// The host's state.
    pub ctx: *mut c_void,
    /// `ParentManager::on_new_request`; `out_policy` receives 0 (chunk level) or 1 (request
    /// level).
    pub on_new_request: unsafe extern "C" fn(
        ctx: *mut c_void,
        req: *const FfiReq,
        out_policy: *mut u8,
        err: FfiSink<FfiStr>,
    ) -> FfiStatus,
    /// `ParentManager::lookup`; `out` receives a lookup code.
    pub lookup: unsafe extern "C" fn(
        ctx: *mut c_void,
        key: *const FfiKey,
        position: u64,
        req: *const FfiReq,
        out: *mut u8,
        err: FfiSink<FfiStr>,
    ) -> FfiStatus,
    /// `ParentManager::create_store_job`: on success the job is pushed into `job` (whose rows the
    /// receiver adopts).
    pub create_store_job: unsafe extern "C" fn(
        ctx: *mut c_void,
        keys: *const FfiKey,
        positions: *const u64,
        n: usize,
        req: *const FfiReq,
        job: FfiSink<FfiJob>,
        err: FfiSink<FfiStr>,
    ) -> FfiStatus,
    /// `ParentManager::on_request_finished`.
    pub on_request_finished:
        unsafe extern "C" fn(ctx: *mut c_void, req: *const FfiReq, err: FfiSink<FfiStr>) -> FfiStatus,
}

/// Lookup codes.
pub mod lookup {
    /// `Hit`.
    pub const HIT: u8 = 0;
    /// `HitPending`.
    pub const HIT_PENDING: u8 = 1;
    /// `Retry`.
    pub const RETRY: u8 = 2;
    /// `Miss`.
    pub const MISS: u8 = 3;
}

/// Opaque tier state owned by the library.
pub type TierState = *mut c_void;

/// The error sink every call takes.
pub type ErrSink = FfiSink<FfiStr>;

/// The whole `SecondaryTier` contract as C functions over the library's tier state.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TierVTable {
    /// Builds a tier from its options (a TOML table, serialised) into `*out`.
    pub create: unsafe extern "C" fn(
        options_toml: FfiStr,
        ctx: *const FfiFactoryCtx,
        out: *mut TierState,
        err: ErrSink,
    ) -> FfiStatus,
    /// Drops the tier and everything the library made for it.
    pub destroy: unsafe extern "C" fn(state: TierState, err: ErrSink) -> FfiStatus,
    /// `info`.
    pub info: unsafe extern "C" fn(state: TierState, out: FfiSink<FfiInfo>, err: ErrSink) -> FfiStatus,
    /// `lookup`; `out` receives a [`lookup`] code.
    pub lookup: unsafe extern "C" fn(
        state: TierState,
        key: *const FfiKey,
        position: u64,
        req: *const FfiReq,
        out: *mut u8,
        err: ErrSink,
    ) -> FfiStatus,
    /// `submit_store`. The job is reported through `poll_finished` even when this fails.
    pub submit_store: unsafe extern "C" fn(state: TierState, job: *const FfiJob, err: ErrSink) -> FfiStatus,
    /// `submit_load`. The job is reported through `poll_finished` even when this fails.
    pub submit_load: unsafe extern "C" fn(state: TierState, job: *const FfiJob, err: ErrSink) -> FfiStatus,
    /// `poll_finished`.
    pub poll_finished:
        unsafe extern "C" fn(state: TierState, out: FfiSink<FfiJobResult>, err: ErrSink) -> FfiStatus,
    /// `has_pending_work`; `out` receives 0 or 1.
    pub has_pending_work: unsafe extern "C" fn(state: TierState, out: *mut u8, err: ErrSink) -> FfiStatus,
    /// `touch`.
    pub touch: unsafe extern "C" fn(
        state: TierState,
        keys: *const FfiKey,
        positions: *const u64,
        n: usize,
        req: *const FfiReq,
        err: ErrSink,
    ) -> FfiStatus,
    /// `on_new_request`; `out_policy` receives 0 (chunk level) or 1 (request level).
    pub on_new_request: unsafe extern "C" fn(
        state: TierState,
        req: *const FfiReq,
        out_policy: *mut u8,
        err: ErrSink,
    ) -> FfiStatus,
    /// `on_request_finished`.
    pub on_request_finished:
        unsafe extern "C" fn(state: TierState, req: *const FfiReq, err: ErrSink) -> FfiStatus,
    /// `serve_external_requests`.
    pub serve_external_requests:
        unsafe extern "C" fn(state: TierState, parent: *const FfiParent, err: ErrSink) -> FfiStatus,
    /// `on_schedule_end`.
    pub on_schedule_end: unsafe extern "C" fn(state: TierState, err: ErrSink) -> FfiStatus,
    /// `drain_jobs`.
    pub drain_jobs: unsafe extern "C" fn(state: TierState, err: ErrSink) -> FfiStatus,
    /// `take_events`.
    pub take_events:
        unsafe extern "C" fn(state: TierState, out: FfiSink<FfiEvent>, err: ErrSink) -> FfiStatus,
    /// `stats`.
    pub stats: unsafe extern "C" fn(state: TierState, out: FfiSink<FfiStats>, err: ErrSink) -> FfiStatus,
    /// `shutdown`.
    pub shutdown: unsafe extern "C" fn(state: TierState, err: ErrSink) -> FfiStatus,
}

/// One problem a library's validate entry found in a tier's options.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FfiConfigError {
    /// The top-level option key the problem is about; empty when it is about no one key (a
    /// missing key is named in the message).
    pub key: FfiStr,
    /// What is wrong, in words (it may quote the key in backquotes too).
    pub message: FfiStr,
}

/// A library's validate entry (ABI 5): checks `options_toml` (a TOML table, serialised, as
/// `create` receives it) without building anything — no allocation of the tier's storage, no
/// files, no sockets, no threads. It pushes one [`FfiConfigError`] per problem into `out` and
/// returns [`status::OK`] whether or not it found any; any other status means the check itself
/// could not run (the options are not TOML, or the hook panicked: [`status::PANIC`]), with a
/// message on `err`.
pub type ValidateFn =
    unsafe extern "C" fn(options_toml: FfiStr, out: FfiSink<FfiConfigError>, err: ErrSink) -> FfiStatus;

/// What the entry function returns. Lives in a `static` of the library.
#[repr(C)]
#[derive(Debug)]
pub struct PluginDescriptor {
    /// The library's ABI version ([`ABI_VERSION`] when built against this crate).
    pub abi_version: u32,
    /// `size_of::<PluginDescriptor>()` in the library, a second layout check.
    pub descriptor_size: usize,
    /// The tiering-core version the library was built against.
    pub core_version: FfiStaticStr,
    /// The library's build fingerprint (see [`super::BUILD_FINGERPRINT`]).
    pub fingerprint: FfiStaticStr,
    /// The tier type the library provides.
    pub type_name: FfiStaticStr,
    /// The functions.
    pub vtable: TierVTable,
    /// Checks options without building a tier (ABI 5); `None` (a null pointer) when the library
    /// has no validate-only hook.
    pub validate: Option<ValidateFn>,
}

impl PluginDescriptor {
    /// This descriptor with a validate entry.
    #[must_use]
    pub const fn with_validate(mut self, validate: ValidateFn) -> Self {
        self.validate = Some(validate);
        self
    }
}

/// The descriptor of an ABI-4 library: [`PluginDescriptor`] without its trailing `validate`
/// field. A host reads it only after reading `abi_version == 4`.
#[repr(C)]
#[derive(Debug)]
pub struct PluginDescriptorV4 {
    /// 4.
    pub abi_version: u32,
    /// `size_of::<PluginDescriptorV4>()` in the library.
    pub descriptor_size: usize,
    /// The tiering-core version the library was built against.
    pub core_version: FfiStaticStr,
    /// The library's build fingerprint.
    pub fingerprint: FfiStaticStr,
    /// The tier type the library provides.
    pub type_name: FfiStaticStr,
    /// The functions (the same table as in ABI 5).
    pub vtable: TierVTable,
}
