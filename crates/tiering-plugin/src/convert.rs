//! Conversions between kvtier's Rust types and the C ABI's plain data, used by both sides of the
//! boundary, and the closure-backed sinks.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use super::ffi::{
    FfiEnum, FfiEvent, FfiInfo, FfiJobResult, FfiKey, FfiMatcher, FfiReq, FfiSink, FfiStats, FfiStr,
    NO_POSITION, outcome,
};
use tiering_core::OffloadKey;
use tiering_core::OffloadingEvent;
use tiering_core::TierStats;
use tiering_core::{JobId, JobOutcome, JobResult};
use tiering_core::{
    Locality, Medium, ReqContext, RequestId, TierFilter, TierInfo, TierMatcher, TransferParams,
};

pub(crate) use tiering_core::panic_message;

/// A sink that hands every item to `f`. The sink borrows `f`: use it only while `f` lives.
/// A panic inside `f` is caught here, so it never unwinds into the caller's frames.
pub(crate) fn sink<T, F: FnMut(&T)>(f: &mut F) -> FfiSink<T> {
    unsafe extern "C" fn push<T, F: FnMut(&T)>(ctx: *mut c_void, item: *const T) {
        // SAFETY: `ctx` is the `&mut F` this sink was made from, alive for the sink's use, and
        // the callee calls sinks from the calling thread only, never concurrently.
        let f = unsafe { &mut *ctx.cast::<F>() };
        // SAFETY: the pusher passes a pointer valid for the duration of this call (or null).
        if let Some(item) = unsafe { item.as_ref() } {
            // A panic here would cross the C boundary, which aborts; drop it instead (the
            // item is lost, which the caller sees as missing data, not as memory damage).
            let _ = catch_unwind(AssertUnwindSafe(|| f(item)));
        }
    }
    FfiSink {
        ctx: std::ptr::from_mut(f).cast::<c_void>(),
        push: push::<T, F>,
        _item: PhantomData,
    }
}

/// Collects the message of a failed call.
#[derive(Default)]
pub(crate) struct ErrorText(pub(crate) Option<String>);

impl ErrorText {
    /// Runs `call` with an error sink writing into `self`.
    pub(crate) fn with<R>(&mut self, call: impl FnOnce(FfiSink<FfiStr>) -> R) -> R {
        let mut record = |s: &FfiStr| {
            // SAFETY: the pusher's string is valid during the push.
            let text = unsafe { s.to_str() }.unwrap_or("(error message is not UTF-8)");
            self.0 = Some(text.to_owned());
        };
        call(sink(&mut record))
    }

    /// The message, or `fallback`.
    pub(crate) fn or(self, fallback: &str) -> String {
        self.0.unwrap_or_else(|| fallback.to_owned())
    }
}

/// Pushes `message` into an error sink.
pub(crate) fn push_error(err: FfiSink<FfiStr>, message: &str) {
    let s = FfiStr::new(message);
    // SAFETY: the sink was provided by the caller for this call; `s` borrows `message`, which
    // lives across the push.
    unsafe { (err.push)(err.ctx, &raw const s) };
}

pub(crate) fn key_to_ffi(k: &OffloadKey) -> FfiKey {
    FfiKey {
        hash: *k.hash_bytes(),
        group: k.group(),
    }
}

pub(crate) fn key_from_ffi(k: &FfiKey) -> OffloadKey {
    OffloadKey::new(k.hash, k.group)
}

/// Reads `n` items from `ptr`.
///
/// # Safety
/// `ptr` must point to `n` initialised items valid for `'a` (it may dangle when `n == 0`).
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, n: usize) -> &'a [T] {
    if n == 0 || ptr.is_null() {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

pub(crate) fn medium_code(m: Option<Medium>) -> FfiEnum {
    match m {
        None => 0,
        Some(Medium::Cpu) => 1,
        Some(Medium::Storage) => 2,
    }
}

pub(crate) fn medium_from(c: FfiEnum) -> Option<Medium> {
    match c {
        1 => Some(Medium::Cpu),
        2 => Some(Medium::Storage),
        _ => None,
    }
}

pub(crate) fn locality_code(l: Option<Locality>) -> FfiEnum {
    match l {
        None => 0,
        Some(Locality::Local) => 1,
        Some(Locality::Remote) => 2,
    }
}

pub(crate) fn locality_from(c: FfiEnum) -> Option<Locality> {
    match c {
        1 => Some(Locality::Local),
        2 => Some(Locality::Remote),
        _ => None,
    }
}

/// A request context laid out for the C ABI; [`EncodedReq::ffi`] borrows it (and the context).
/// The id strings are borrowed, so encoding allocates only for parameters and matchers.
pub(crate) struct EncodedReq<'a> {
    remote: bool,
    peer: &'a str,
    id: &'a str,
    params: String,
    filter_all: bool,
    matchers: Vec<FfiMatcher>,
}

impl<'a> EncodedReq<'a> {
    pub(crate) fn new(ctx: &'a ReqContext) -> Self {
        let (remote, peer, id) = match ctx.id() {
            RequestId::Local(id) => (false, "", id.as_str()),
            RequestId::Remote { peer, id } => (true, peer.as_str(), id.as_str()),
        };
        let params = if ctx.params().is_empty() {
            String::new()
        } else {
            serde_json::to_string(ctx.params()).unwrap_or_default()
        };
        let (filter_all, matchers) = match ctx.load_filter() {
            TierFilter::All => (true, Vec::new()),
            TierFilter::Matchers(ms) => (
                false,
                ms.iter()
                    .map(|m| FfiMatcher {
                        medium: medium_code(m.medium),
                        locality: locality_code(m.locality),
                    })
                    .collect(),
            ),
        };
        Self {
            remote,
            peer,
            id,
            params,
            filter_all,
            matchers,
        }
    }

    pub(crate) fn ffi(&self) -> FfiReq {
        FfiReq {
            remote: u8::from(self.remote),
            peer: FfiStr::new(self.peer),
            id: FfiStr::new(self.id),
            params_json: FfiStr::new(&self.params),
            filter_all: u8::from(self.filter_all),
            matchers: self.matchers.as_ptr(),
            n_matchers: self.matchers.len(),
        }
    }
}

/// Whether `req` names the request `id` (compared in place, without allocating).
///
/// # Safety
/// The strings of `req` must be valid for the call.
pub(crate) unsafe fn names_request(req: &FfiReq, id: &RequestId) -> bool {
    // SAFETY: guaranteed by the caller.
    let (peer, rid) = unsafe { (req.peer.to_str(), req.id.to_str()) };
    match id {
        RequestId::Local(l) => req.remote == 0 && rid == Some(l.as_str()),
        RequestId::Remote { peer: p, id: i } => {
            req.remote != 0 && peer == Some(p.as_str()) && rid == Some(i.as_str())
        }
    }
}

/// The position `ctx` records for `key`, or [`NO_POSITION`].
pub(crate) fn position_of(ctx: &ReqContext, key: &OffloadKey) -> u64 {
    ctx.key_position(key).unwrap_or(NO_POSITION)
}

/// The request id an [`FfiReq`] names.
///
/// # Safety
/// The strings of `req` must be valid for the call.
pub(crate) unsafe fn request_id(req: &FfiReq) -> Result<RequestId, String> {
    // SAFETY: guaranteed by the caller.
    let id = unsafe { req.id.to_str() }.ok_or("request id is not UTF-8")?;
    if req.remote != 0 {
        // SAFETY: as above.
        let peer = unsafe { req.peer.to_str() }.ok_or("peer name is not UTF-8")?;
        Ok(RequestId::remote(peer, id))
    } else {
        Ok(RequestId::local(id))
    }
}

/// Builds a fresh context from an [`FfiReq`].
///
/// # Safety
/// Every pointer of `req` must be valid for the call.
pub(crate) unsafe fn build_context(req: &FfiReq) -> Result<ReqContext, String> {
    // SAFETY: guaranteed by the caller.
    let id = unsafe { request_id(req) }?;
    // SAFETY: as above.
    let params_text = unsafe { req.params_json.to_str() }.ok_or("parameters are not UTF-8")?;
    let params: TransferParams = if params_text.is_empty() {
        TransferParams::new()
    } else {
        serde_json::from_str(params_text).map_err(|e| format!("bad request parameters: {e}"))?
    };
    let filter = if req.filter_all != 0 {
        TierFilter::All
    } else {
        // SAFETY: as above.
        let ms = unsafe { slice(req.matchers, req.n_matchers) };
        TierFilter::Matchers(
            ms.iter()
                .map(|m| TierMatcher {
                    medium: medium_from(m.medium),
                    locality: locality_from(m.locality),
                })
                .collect(),
        )
    };
    Ok(ReqContext::builder(id).params(params).filter(filter).build())
}

/// Records the positions of `keys` (parallel arrays) on `ctx`.
pub(crate) fn apply_positions(ctx: &ReqContext, keys: &[OffloadKey], positions: &[u64]) {
    for (k, &p) in keys.iter().zip(positions) {
        if p != NO_POSITION {
            ctx.set_key_position(*k, p);
        }
    }
}

/// The positions `ctx` records for `keys`.
pub(crate) fn positions_of(ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<u64> {
    keys.iter()
        .map(|k| ctx.key_position(k).unwrap_or(NO_POSITION))
        .collect()
}

pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Pushes one job result into a sink.
pub(crate) fn push_result(out: FfiSink<FfiJobResult>, r: &JobResult) {
    let (code, ok): (u8, Vec<FfiKey>) = match &r.outcome {
        JobOutcome::Ok => (outcome::OK, Vec::new()),
        JobOutcome::Failed => (outcome::FAILED, Vec::new()),
        JobOutcome::Partial(keys) => (outcome::PARTIAL, keys.iter().map(key_to_ffi).collect()),
    };
    let item = FfiJobResult {
        id: r.id.0,
        outcome: code,
        ok_keys: ok.as_ptr(),
        n_ok: ok.len(),
        bytes: r.bytes,
        elapsed_nanos: nanos(r.elapsed),
    };
    // SAFETY: the sink was provided for this call; `item` and `ok` live across the push.
    unsafe { (out.push)(out.ctx, &raw const item) };
}

/// Reads a pushed job result.
///
/// # Safety
/// `r`'s pointers must be valid for the call.
pub(crate) unsafe fn result_from_ffi(r: &FfiJobResult) -> JobResult {
    let outcome = match r.outcome {
        outcome::OK => JobOutcome::Ok,
        outcome::PARTIAL => {
            // SAFETY: guaranteed by the caller.
            let keys = unsafe { slice(r.ok_keys, r.n_ok) };
            JobOutcome::Partial(keys.iter().map(key_from_ffi).collect())
        }
        // An unknown code is treated as a failure: never report data that may not be there.
        _ => JobOutcome::Failed,
    };
    JobResult {
        id: JobId(r.id),
        outcome,
        bytes: r.bytes,
        elapsed: Duration::from_nanos(r.elapsed_nanos),
    }
}

/// Pushes one event into a sink.
pub(crate) fn push_event(out: FfiSink<FfiEvent>, e: &OffloadingEvent) {
    let keys: Vec<FfiKey> = e.keys.iter().map(key_to_ffi).collect();
    let owner = e.ownership.as_deref().unwrap_or("");
    let item = FfiEvent {
        keys: keys.as_ptr(),
        n: keys.len(),
        medium: medium_code(e.medium),
        locality: locality_code(e.locality),
        removed: u8::from(e.removed),
        metadata_only: u8::from(e.metadata_only),
        removal_expected: u8::from(e.removal_expected),
        has_ownership: u8::from(e.ownership.is_some()),
        ownership: FfiStr::new(owner),
    };
    // SAFETY: the sink was provided for this call; `item`, `keys` and `owner` outlive the push.
    unsafe { (out.push)(out.ctx, &raw const item) };
}

/// Reads a pushed event.
///
/// # Safety
/// `e`'s pointers must be valid for the call.
pub(crate) unsafe fn event_from_ffi(e: &FfiEvent) -> OffloadingEvent {
    // SAFETY: guaranteed by the caller.
    let keys = unsafe { slice(e.keys, e.n) };
    OffloadingEvent {
        keys: keys.iter().map(key_from_ffi).collect(),
        medium: medium_from(e.medium),
        locality: locality_from(e.locality),
        removed: e.removed != 0,
        metadata_only: e.metadata_only != 0,
        removal_expected: e.removal_expected != 0,
        ownership: if e.has_ownership != 0 {
            // SAFETY: as above.
            Some(unsafe { e.ownership.to_str() }.unwrap_or("").to_owned())
        } else {
            None
        },
    }
}

/// Pushes a tier's info into a sink.
pub(crate) fn push_info(out: FfiSink<FfiInfo>, info: &TierInfo, control_plane: bool) {
    let item = FfiInfo {
        name: FfiStr::new(&info.name),
        medium: medium_code(info.medium),
        locality: locality_code(info.locality),
        control_plane: u8::from(control_plane),
    };
    // SAFETY: the sink was provided for this call; `item` and `info` outlive the push.
    unsafe { (out.push)(out.ctx, &raw const item) };
}

/// Reads pushed info and the control-plane opt-in.
///
/// # Safety
/// `i`'s pointers must be valid for the call.
pub(crate) unsafe fn info_from_ffi(i: &FfiInfo) -> (TierInfo, bool) {
    let info = TierInfo::new(
        // SAFETY: guaranteed by the caller.
        unsafe { i.name.to_str() }.unwrap_or("(unnamed plugin tier)"),
        medium_from(i.medium),
        locality_from(i.locality),
    );
    (info, i.control_plane != 0)
}

/// Pushes stats into a sink.
pub(crate) fn push_stats(out: FfiSink<FfiStats>, s: &TierStats) {
    let names: Vec<FfiStr> = s.extra.keys().map(|k| FfiStr::new(k)).collect();
    let values: Vec<f64> = s.extra.values().copied().collect();
    let item = FfiStats {
        name: FfiStr::new(&s.name),
        counters: [
            s.hits,
            s.misses,
            s.stores,
            s.loads,
            s.evictions,
            s.failures,
            s.bytes_written,
            s.bytes_read,
            s.resident_chunks,
            s.capacity_chunks,
        ],
        extra_names: names.as_ptr(),
        extra_values: values.as_ptr(),
        n_extra: names.len(),
    };
    // SAFETY: the sink was provided for this call; everything `item` points to outlives the push.
    unsafe { (out.push)(out.ctx, &raw const item) };
}

/// Reads pushed stats.
///
/// # Safety
/// `s`'s pointers must be valid for the call.
pub(crate) unsafe fn stats_from_ffi(s: &FfiStats) -> TierStats {
    let [
        hits,
        misses,
        stores,
        loads,
        evictions,
        failures,
        bytes_written,
        bytes_read,
        resident,
        capacity,
    ] = s.counters;
    // SAFETY: guaranteed by the caller.
    let (names, values) = unsafe { (slice(s.extra_names, s.n_extra), slice(s.extra_values, s.n_extra)) };
    TierStats {
        // SAFETY: as above.
        name: unsafe { s.name.to_str() }.unwrap_or("").to_owned(),
        hits,
        misses,
        stores,
        loads,
        evictions,
        failures,
        bytes_written,
        bytes_read,
        resident_chunks: resident,
        capacity_chunks: capacity,
        extra: names
            .iter()
            .zip(values)
            // SAFETY: as above.
            .filter_map(|(n, &v)| unsafe { n.to_str() }.map(|n| (n.to_owned(), v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_contexts_round_trip() {
        let mut params = TransferParams::new();
        params.insert("peer_hint".into(), serde_json::json!("h:1"));
        let ctx = ReqContext::builder(RequestId::remote("node-b:5555", "r7"))
            .params(params.clone())
            .filter(TierFilter::Matchers(vec![TierMatcher {
                medium: Some(Medium::Storage),
                locality: None,
            }]))
            .build();
        let enc = EncodedReq::new(&ctx);
        // SAFETY: `enc` outlives the FfiReq.
        let back = unsafe { build_context(&enc.ffi()) }.unwrap();
        assert_eq!(back.id(), ctx.id());
        assert_eq!(back.params(), &params);
        assert_eq!(back.load_filter(), ctx.load_filter());
        let local = ReqContext::local("plain");
        let enc = EncodedReq::new(&local);
        // SAFETY: as above.
        let back = unsafe { build_context(&enc.ffi()) }.unwrap();
        assert_eq!(back.id(), &RequestId::local("plain"));
        assert_eq!(back.load_filter(), &TierFilter::All);
    }

    #[test]
    fn results_events_and_stats_round_trip_through_sinks() {
        let k = |n| OffloadKey::from_u64(n).with_group(2);
        let results = vec![
            JobResult::ok(JobId(1), 10, Duration::from_micros(3)),
            JobResult::failed(JobId(2), Duration::ZERO),
            JobResult::from_key_outcomes(JobId(3), &[k(1), k(2)], &[true, false], 5, Duration::ZERO),
        ];
        let mut got = Vec::new();
        // SAFETY: items pushed by `push_result` are valid during the push.
        let mut collect = |r: &FfiJobResult| got.push(unsafe { result_from_ffi(r) });
        let s = sink(&mut collect);
        for r in &results {
            push_result(s, r);
        }
        assert_eq!(got, results);

        let ev = OffloadingEvent::removed(vec![k(4)], Some(Medium::Cpu), Some(Locality::Remote))
            .owned_by("t")
            .metadata_only();
        let stored = OffloadingEvent::stored(vec![k(5), k(6)], Some(Medium::Storage), Some(Locality::Local))
            .owned_by("disk")
            .expecting_removal();
        let mut events = Vec::new();
        // SAFETY: as above.
        let mut collect = |e: &FfiEvent| events.push(unsafe { event_from_ffi(e) });
        push_event(sink(&mut collect), &ev);
        push_event(sink(&mut collect), &stored);
        assert_eq!(events, vec![ev, stored]);

        let mut stats = TierStats::named("s");
        stats.hits = 4;
        stats.capacity_chunks = 9;
        stats.extra.insert("ratio".into(), 0.5);
        let mut got = None;
        // SAFETY: as above.
        let mut collect = |s: &FfiStats| got = Some(unsafe { stats_from_ffi(s) });
        push_stats(sink(&mut collect), &stats);
        assert_eq!(got, Some(stats));
    }

    #[test]
    fn a_panicking_sink_consumer_is_contained() {
        let mut boom = |_: &FfiInfo| panic!("consumer bug");
        push_info(sink(&mut boom), &TierInfo::new("x", None, None), false);
        let mut err = ErrorText::default();
        err.with(|e| push_error(e, "bad thing"));
        assert_eq!(err.or("none"), "bad thing");
    }
}
