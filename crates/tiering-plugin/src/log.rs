//! A tier library's `tracing` events, re-emitted by the host (`docs/ARCHITECTURE.md`, "Plugins
//! and chains").
//!
//! A `cdylib` has its own copy of `tracing` and so its own (empty) global dispatcher: without
//! help, everything a library tier logs is dropped. The host passes a `log` callback in the
//! factory context; the library's `create` installs, once, a global subscriber that formats each
//! event (message and fields) and hands it to that callback, and the host re-emits it through
//! its own subscriber under the target `kvtier::plugin`, with the library's target as a field —
//! so `RUST_LOG` filters it like any other host event.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::sync::OnceLock;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use super::ffi::{FfiFactoryCtx, FfiLogRecord, FfiStr};

/// A static whose address identifies this copy of `tiering-core`.
static MARKER: u8 = 0;

/// The host's `log_ctx`: the address of this copy's marker.
pub(super) fn host_marker() -> *const c_void {
    std::ptr::from_ref(&MARKER).cast()
}

fn level_code(level: Level) -> u8 {
    match level {
        Level::ERROR => 1,
        Level::WARN => 2,
        Level::INFO => 3,
        Level::DEBUG => 4,
        Level::TRACE => 5,
    }
}

fn filter_of(code: u8) -> LevelFilter {
    match code {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The host subscriber's most verbose level, as the factory context carries it.
pub(super) fn host_max_level() -> u8 {
    LevelFilter::current().into_level().map_or(0, level_code)
}

/// The host's `log` callback: re-emits a library's event.
///
/// # Safety
/// `record` points to a valid record whose strings stay valid for the call.
pub(super) unsafe extern "C" fn host_log(_ctx: *const c_void, record: *const FfiLogRecord) {
    // SAFETY: guaranteed by the caller.
    let Some(record) = (unsafe { record.as_ref() }) else {
        return;
    };
    // SAFETY: as above.
    let target = unsafe { record.target.to_str() }.unwrap_or("?");
    // SAFETY: as above.
    let message = unsafe { record.message.to_str() }.unwrap_or("(message not UTF-8)");
    match record.level {
        1 => tracing::error!(target: "kvtier::plugin", library_target = target, "{message}"),
        2 => tracing::warn!(target: "kvtier::plugin", library_target = target, "{message}"),
        3 => tracing::info!(target: "kvtier::plugin", library_target = target, "{message}"),
        4 => tracing::debug!(target: "kvtier::plugin", library_target = target, "{message}"),
        _ => tracing::trace!(target: "kvtier::plugin", library_target = target, "{message}"),
    }
}

/// Installs (once per library) the subscriber forwarding this library's events to the host of
/// `ctx`. Does nothing when the host is this very copy of the code (a tier linked into the host
/// logs through the host's subscriber already) or passes no callback.
pub(super) fn forward_to_host(ctx: &FfiFactoryCtx) {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    let Some(log) = ctx.log else {
        return;
    };
    if ctx.log_ctx == host_marker() {
        return;
    }
    INSTALLED.get_or_init(|| {
        let forward = Forward {
            log,
            ctx: HostCtx(ctx.log_ctx),
            max: filter_of(ctx.max_level),
        };
        // Fails only when the library set its own subscriber first; then that one stays.
        let _ = tracing::subscriber::set_global_default(forward);
    });
}

#[derive(Clone, Copy)]
struct HostCtx(*const c_void);

// SAFETY: the host's `log` callback may be called from any thread with its context (the
// `FfiFactoryCtx` contract); the pointer is only passed back, never dereferenced here.
unsafe impl Send for HostCtx {}
// SAFETY: as above.
unsafe impl Sync for HostCtx {}

struct Forward {
    log: unsafe extern "C" fn(ctx: *const c_void, record: *const FfiLogRecord),
    ctx: HostCtx,
    max: LevelFilter,
}

/// Collects an event's message and its other fields as `key=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl Subscriber for Forward {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max)
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        // Spans are not forwarded; every span gets the same (never used) id.
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut text = Text::default();
        event.record(&mut text);
        text.message.push_str(&text.fields);
        let record = FfiLogRecord {
            level: level_code(*event.metadata().level()),
            target: FfiStr::new(event.metadata().target()),
            message: FfiStr::new(&text.message),
        };
        // SAFETY: the host's callback takes a record valid for the call (ours lives on this
        // stack frame) and may be called from any thread (the `FfiFactoryCtx` contract).
        unsafe { (self.log)(self.ctx.0, &raw const record) };
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}
