//! The panic boundary (`docs/ARCHITECTURE.md`, "Panic boundary"): a tier that panics in any call
//! — from the scheduler thread or the control thread, linked in or behind the plugin C ABI —
//! never unwinds into the engine, leaves the step lock free, is quarantined (or, under
//! `on_tier_failure = "fail"`, reported as an error naming the tier and the call), and the
//! manager keeps serving from the other tiers. A panicking primary fails the manager. A tier
//! call that never returns is named within `tier_timeout`.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use tiering_core::testing::{Completion, MemoryPrimary, PeerRequest, ScriptedTier, ScriptedTierHandle};
use tiering_core::{
    LookupResult, ManagerConfig, ManagerError, OffloadKey, OffloadingEvent, OffloadingManager, OnTierFailure,
    PrepareStoreOutput, PrimaryTier, ReqContext, RequestId, ScheduleEndContext, SecondaryTier, TierError,
    TierInfo, TierStats, TieringManager,
    arena::{ChunkArena, ChunkId},
    registry::SecondaryContext,
};
use tiering_plugin::export::{self, descriptor};
use tiering_plugin::ffi::{ErrSink, FfiFactoryCtx, FfiStatus, FfiStr, PluginDescriptor, TierState};
use tiering_plugin::{PluginTier, from_entry_point};

/// The engine calls that reach a secondary tier, by the scripted tier's op name.
const SCHEDULER_OPS: [&str; 12] = [
    "lookup",
    "touch",
    "on_new_request",
    "on_request_finished",
    "take_events",
    "stats",
    "has_pending_work",
    "submit_store",
    "submit_load",
    "poll",
    "serve",
    "on_schedule_end",
];

/// The method name the boundary reports for a scripted op.
fn call_name(op: &str) -> &str {
    match op {
        "poll" => "poll_finished",
        "serve" => "serve_external_requests",
        other => other,
    }
}

fn lock_is_free(m: &TieringManager) -> bool {
    tiering_core::testing::lock_is_free(m, PATIENCE)
}

/// `bad` (panics on demand) then `good` (holds key 7) behind a memory primary.
struct Chain {
    m: Engine,
    primary: MemoryPrimary,
    bad: ScriptedTierHandle,
    good: ScriptedTierHandle,
}

fn chain(config: ManagerConfig, bad: (ScriptedTier, ScriptedTierHandle)) -> Chain {
    let primary = MemoryPrimary::new(16, CHUNK);
    let (good_tier, good) = ScriptedTier::quiet("good");
    good.insert(key(7), bytes_for(&key(7)));
    let m = TieringManager::new(
        Box::new(primary.clone()),
        vec![Box::new(bad.0) as Box<dyn SecondaryTier>, Box::new(good_tier)],
        config,
    );
    Chain {
        m: Engine::new(m),
        primary,
        bad: bad.1,
        good,
    }
}

/// Makes the engine call that reaches the bad tier's `op`; returns what the engine saw.
fn trigger(c: &mut Chain, op: &str, ctx: &ReqContext) -> Result<(), ManagerError> {
    match op {
        "lookup" => c.m.lookup(&key(50), ctx).map(drop),
        "touch" => c.m.touch(&[key(50)], ctx),
        "on_new_request" => c.m.on_new_request(&ReqContext::local("another")).map(drop),
        "on_request_finished" => {
            let done = ReqContext::local("done");
            c.m.on_new_request(&done)?;
            c.m.on_request_finished(&done)
        }
        "take_events" => c.m.take_events().map(drop),
        "stats" => c.m.stats().map(drop),
        "has_pending_work" => c.m.has_pending_work().map(drop),
        "submit_store" => {
            let out = c.m.prepare_store(&[key(1)], ctx)?.expect("room");
            let arena = c.primary.arena().clone();
            arena
                .write_row(out.chunk_ids[0])
                .unwrap()
                .copy_from_slice(&bytes_for(&key(1)));
            c.m.complete_store(&out.keys_to_store, ctx, true)
        }
        "submit_load" => {
            c.bad.insert(key(3), bytes_for(&key(3)));
            c.m.lookup(&key(3), ctx)?;
            c.m.on_schedule_end(&ScheduleEndContext::default())
        }
        "serve" => {
            c.bad.panic_next_serve();
            c.m.on_schedule_end(&ScheduleEndContext::default())
        }
        // poll, on_schedule_end
        _ => c.m.on_schedule_end(&ScheduleEndContext::default()),
    }
}

/// After the panic: the good tier still serves key 7 bit-exact to a new request.
fn good_tier_serves(c: &mut Chain) {
    let ctx = ReqContext::local("after");
    c.m.on_new_request(&ctx).unwrap();
    assert_eq!(c.m.lookup(&key(7), &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut c.m);
    assert_eq!(c.m.lookup(&key(7), &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut c.m, &c.primary, &ctx, key(7)), bytes_for(&key(7)));
    c.m.on_request_finished(&ctx).unwrap();
    end_step(&mut c.m);
}

fn assert_quarantined(c: &mut Chain, op: &str) {
    let q = c.m.inspect(|s| s.quarantined_tiers());
    assert_eq!(q.len(), 1, "{op}: {q:?}");
    assert_eq!(q[0].0, "bad", "{op}");
    assert!(
        q[0].1.contains(&format!("panicked in {}", call_name(op))) && q[0].1.contains("scripted panic"),
        "{op}: the reason names the call: {}",
        q[0].1
    );
    let stats = c.m.stats().unwrap();
    assert_eq!(stats.manager.tiers_quarantined, 1, "{op}");
    assert_eq!(stats.manager.tier_panics, 1, "{op}");
    assert_eq!(stats.secondaries[0].extra.get("quarantined"), Some(&1.0), "{op}");
}

#[test]
fn a_panic_in_any_scheduler_thread_call_quarantines_the_tier_and_the_engine_goes_on() {
    for op in SCHEDULER_OPS {
        let mut c = chain(ManagerConfig::step_driven(), ScriptedTier::new("bad"));
        let ctx = ReqContext::local("r");
        c.m.on_new_request(&ctx).unwrap();
        end_step(&mut c.m);
        if op != "serve" {
            c.bad.panic_next(op);
        }
        let seen = catch_unwind(AssertUnwindSafe(|| trigger(&mut c, op, &ctx)));
        let Ok(seen) = seen else {
            panic!("{op}: the tier's panic unwound into the engine");
        };
        seen.unwrap_or_else(|e| panic!("{op}: a quarantined panic is no engine error: {e}"));
        c.m.end();
        assert!(lock_is_free(&c.m.handle), "{op}: the lock stayed held");
        assert_quarantined(&mut c, op);
        good_tier_serves(&mut c);
        c.m.on_request_finished(&ctx).unwrap();
        end_step(&mut c.m);
        assert_eq!(c.primary.total_pins(), 0, "{op}: no pin leaked");
        c.primary.check_invariants().unwrap();
        c.m.shutdown().unwrap();
        assert_eq!(
            c.bad.count("shutdown"),
            1,
            "{op}: the quarantined tier was stopped once"
        );
    }
}

#[test]
fn a_lookup_that_panics_walks_on_to_the_next_tier() {
    let mut c = chain(ManagerConfig::step_driven(), ScriptedTier::new("bad"));
    let ctx = ReqContext::local("r");
    c.m.on_new_request(&ctx).unwrap();
    c.bad.panic_next("lookup");
    // The bad tier is asked first, panics, and the good tier's hit is the answer.
    assert_eq!(c.m.lookup(&key(7), &ctx).unwrap(), LookupResult::HitPending);
    end_step(&mut c.m);
    assert_eq!(c.m.lookup(&key(7), &ctx).unwrap(), LookupResult::Hit);
    assert_eq!(load_bytes(&mut c.m, &c.primary, &ctx, key(7)), bytes_for(&key(7)));
    c.m.end();
    assert_quarantined(&mut c, "lookup");
    c.m.shutdown().unwrap();
}

#[test]
fn a_panic_on_the_control_thread_quarantines_the_tier() {
    for op in ["poll", "serve", "lookup"] {
        let config = ManagerConfig {
            idle_wait: Duration::from_millis(1),
            ..ManagerConfig::default()
        };
        // The bad tier opts in to the control thread; the good one does not.
        let mut c = chain(config, ScriptedTier::new("bad"));
        assert!(c.m.control_thread_running(), "{op}");
        let ctx = ReqContext::local("r");
        c.m.on_new_request(&ctx).unwrap();
        end_step(&mut c.m);
        match op {
            "serve" => {
                c.bad.panic_next_serve();
                c.bad.push_peer_request(PeerRequest {
                    ctx: ReqContext::new(RequestId::remote("10.0.0.9:7000", "p")),
                    keys: vec![key(7)],
                    fetch: false,
                    wait_for_pending: false,
                });
            }
            "poll" => {
                c.bad.panic_next("poll");
                c.m.waker().wake();
            }
            _ => {
                c.bad.panic_next("lookup");
                assert_eq!(c.m.lookup(&key(50), &ctx).unwrap(), LookupResult::Miss);
                end_step(&mut c.m);
            }
        }
        assert!(
            eventually(|| c.m.inspect(|s| s.quarantined_tiers().len()) == 1),
            "{op}: quarantined"
        );
        assert!(c.m.control_failure().is_none(), "{op}: no error for the engine");
        assert!(lock_is_free(&c.m.handle), "{op}");
        assert_quarantined(&mut c, op);
        assert!(c.m.control_thread_running(), "{op}: quarantine keeps the thread");
        good_tier_serves(&mut c);
        c.m.shutdown().unwrap();
    }
}

#[test]
fn under_the_fail_policy_the_engine_sees_an_error_naming_tier_and_call() {
    for op in SCHEDULER_OPS {
        let config = ManagerConfig {
            on_tier_failure: OnTierFailure::Fail,
            ..ManagerConfig::step_driven()
        };
        let mut c = chain(config, ScriptedTier::new("bad"));
        let ctx = ReqContext::local("r");
        c.m.on_new_request(&ctx).unwrap();
        end_step(&mut c.m);
        if op != "serve" {
            c.bad.panic_next(op);
        }
        let seen = catch_unwind(AssertUnwindSafe(|| trigger(&mut c, op, &ctx)))
            .unwrap_or_else(|_| panic!("{op}: the tier's panic unwound into the engine"));
        // The call that met the panic returns it, or (when it cannot fail without misreporting
        // what it did) the step's next call does.
        let err = match seen {
            Err(e) => e,
            Ok(()) => {
                c.m.lookup(&key(99), &ctx)
                    .expect_err("the next call returns the panic")
            }
        };
        let msg = err.to_string();
        assert!(
            matches!(err, ManagerError::Tier { .. } | ManagerError::ControlPlane(_)),
            "{op}: {msg}"
        );
        assert!(
            msg.contains("tier bad") && msg.contains(&format!("panicked in {}", call_name(op))),
            "{op}: {msg}"
        );
        c.m.end();
        assert!(lock_is_free(&c.m.handle), "{op}");
        assert!(
            c.m.inspect(|s| s.quarantined_tiers()).is_empty(),
            "{op}: the fail policy keeps the tier"
        );
        assert_eq!(c.m.stats().unwrap().manager.tier_panics, 1, "{op}");
        c.m.shutdown().unwrap();
    }
}

/// A primary that panics in one chosen call.
#[derive(Clone)]
struct PanickyPrimary {
    inner: MemoryPrimary,
    panic_in: Arc<Mutex<Option<&'static str>>>,
}

impl PanickyPrimary {
    fn check(&self, call: &'static str) {
        let mut armed = self.panic_in.lock();
        if *armed == Some(call) {
            *armed = None;
            drop(armed);
            panic!("the primary gave up in {call}");
        }
    }
}

impl PrimaryTier for PanickyPrimary {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    fn arena(&self) -> &Arc<ChunkArena> {
        self.inner.arena()
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.check("lookup");
        self.inner.lookup(key, ctx)
    }
    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.inner.prepare_load(keys, ctx)
    }
    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.inner.touch(keys, ctx);
    }
    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.inner.complete_load(keys, ctx)
    }
    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.check("prepare_store");
        self.inner.prepare_store(keys, ctx)
    }
    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.inner.complete_store(keys, ctx, success);
    }
    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.inner.prepare_read(keys, ctx)
    }
    fn complete_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.inner.complete_read(keys, ctx)
    }
    fn prepare_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.inner.prepare_write(keys, ctx)
    }
    fn complete_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.inner.complete_write(keys, ctx, success);
    }
    fn on_request_finished(&mut self, ctx: &ReqContext) {
        self.inner.on_request_finished(ctx);
    }
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.inner.take_events()
    }
    fn stats(&self) -> TierStats {
        self.inner.stats()
    }
    fn reset(&mut self) {
        self.inner.reset();
    }
}

#[test]
fn a_panicking_primary_fails_the_manager_without_unwinding() {
    for call in ["lookup", "prepare_store"] {
        let primary = PanickyPrimary {
            inner: MemoryPrimary::new(8, CHUNK),
            panic_in: Arc::new(Mutex::new(None)),
        };
        let (tier, _h) = ScriptedTier::quiet("disk");
        let mut m = Engine::new(TieringManager::new(
            Box::new(primary.clone()),
            vec![Box::new(tier) as Box<dyn SecondaryTier>],
            ManagerConfig::step_driven(),
        ));
        let ctx = ReqContext::local("r");
        m.on_new_request(&ctx).unwrap();
        *primary.panic_in.lock() = Some(call);
        let seen = catch_unwind(AssertUnwindSafe(|| match call {
            "lookup" => m.lookup(&key(1), &ctx).map(drop),
            _ => m.prepare_store(&[key(1)], &ctx).map(drop),
        }))
        .unwrap_or_else(|_| panic!("{call}: the primary's panic unwound into the engine"));
        let err = seen.expect_err("the call that met the panic fails");
        assert!(matches!(err, ManagerError::Failed(_)), "{call}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains("primary tier") && msg.contains(&format!("panicked in {call}")),
            "{call}: {msg}"
        );
        m.end();
        assert!(lock_is_free(&m.handle), "{call}");
        // Failed for good: every later engine call says so, the handle's hooks too.
        let again = m.lookup(&key(2), &ctx).unwrap_err();
        assert!(matches!(again, ManagerError::Failed(_)), "{call}: {again}");
        m.end();
        assert!(matches!(m.handle.stats(), Err(ManagerError::Failed(_))), "{call}");
        // Shutdown still runs; it reports the primary (whose arena it keeps alive).
        assert!(m.shutdown().is_err(), "{call}");
    }
}

// ---- behind the plugin C ABI ------------------------------------------------------------------

static PLUGIN_HANDLES: Mutex<Vec<(String, ScriptedTierHandle)>> = Mutex::new(Vec::new());

#[allow(clippy::unnecessary_wraps, reason = "the factory signature returns a Result")]
fn scripted_factory(
    options: &toml::Table,
    _: &SecondaryContext,
) -> Result<Box<dyn SecondaryTier>, TierError> {
    let name = options
        .get("name")
        .and_then(toml::Value::as_str)
        .unwrap_or("plugged")
        .to_owned();
    let (tier, h) = ScriptedTier::quiet(&name);
    PLUGIN_HANDLES.lock().push((name, h));
    Ok(Box::new(tier))
}

unsafe extern "C" fn create_scripted(
    o: FfiStr,
    c: *const FfiFactoryCtx,
    out: *mut TierState,
    e: ErrSink,
) -> FfiStatus {
    // SAFETY: forwarded verbatim from the host.
    unsafe { export::create(scripted_factory, o, c, out, e) }
}

static SCRIPTED: PluginDescriptor = descriptor("panics-scripted", create_scripted);

extern "C" fn scripted_entry() -> *const PluginDescriptor {
    &raw const SCRIPTED
}

#[test]
fn a_panic_behind_the_plugin_abi_takes_the_same_quarantine_path() {
    let library = from_entry_point("in-process panics", scripted_entry).unwrap();
    for op in [
        "lookup",
        "touch",
        "on_new_request",
        "on_request_finished",
        "submit_store",
        "take_events",
        "stats",
    ] {
        let primary = MemoryPrimary::new(16, CHUNK);
        let ctx = SecondaryContext::new(Arc::clone(primary.arena()), tiering_core::ControlWaker::new());
        let name = format!("plugged-{op}");
        let mut options = toml::Table::new();
        options.insert("name".into(), toml::Value::String(name.clone()));
        let plugged = PluginTier::create(library, &options, &ctx).unwrap();
        let handle = PLUGIN_HANDLES
            .lock()
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, h)| h.clone())
            .unwrap();
        let (good_tier, good) = ScriptedTier::quiet("good");
        good.insert(key(7), bytes_for(&key(7)));
        let mut c = Chain {
            m: Engine::new(TieringManager::new(
                Box::new(primary.clone()),
                vec![Box::new(plugged) as Box<dyn SecondaryTier>, Box::new(good_tier)],
                ManagerConfig::step_driven(),
            )),
            primary,
            bad: handle,
            good,
        };
        let rctx = ReqContext::local("r");
        c.m.on_new_request(&rctx).unwrap();
        end_step(&mut c.m);
        c.bad.panic_next(op);
        // The library catches the panic at its C boundary; the host raises it again once the
        // call has returned, and the manager's guard quarantines the tier at the call that met
        // it, exactly as for a linked-in tier: no unwind into the engine and no engine error.
        let seen = catch_unwind(AssertUnwindSafe(|| {
            let first = trigger(&mut c, op, &rctx);
            let end = c.m.on_schedule_end(&ScheduleEndContext::default());
            first.and(end)
        }))
        .unwrap_or_else(|_| panic!("{op}: the library's panic unwound into the engine"));
        seen.unwrap_or_else(|e| panic!("{op}: a quarantined panic is no engine error: {e}"));
        assert_eq!(
            c.m.stats().unwrap().manager.tier_panics,
            1,
            "{op}: counted as a panic"
        );
        c.m.end();
        assert!(lock_is_free(&c.m.handle), "{op}");
        let q = c.m.inspect(|s| s.quarantined_tiers());
        assert_eq!(q.len(), 1, "{op}: {q:?}");
        assert!(q[0].1.contains(&format!("panicked in {op}")), "{op}: {}", q[0].1);
        assert_eq!(c.m.stats().unwrap().manager.tiers_quarantined, 1, "{op}");
        good_tier_serves(&mut c);
        c.m.shutdown().unwrap();
        drop(c.good);
    }
}

// ---- hung tiers --------------------------------------------------------------------------------

#[test]
fn a_step_waiting_on_a_tier_stuck_in_the_control_thread_is_told_which() {
    let (tier, h) = ScriptedTier::new("peer");
    let primary = MemoryPrimary::new(8, CHUNK);
    let config = ManagerConfig {
        idle_wait: Duration::from_millis(1),
        tier_timeout: Duration::from_millis(50),
        ..ManagerConfig::default()
    };
    let m = TieringManager::new(
        Box::new(primary),
        vec![Box::new(tier) as Box<dyn SecondaryTier>],
        config,
    );
    // The serve outlasts the bound by far (a wedged transport).
    h.set_serve_delay(Duration::from_secs(2));
    h.push_peer_request(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("10.0.0.9:7000", "p")),
        keys: Vec::new(),
        fetch: false,
        wait_for_pending: false,
    });
    assert!(h.wait_until(PATIENCE, |v| v.count("serve") >= 1));
    let mut step = m.detached_step();
    let err = step
        .lookup(&key(1), &ReqContext::local("r"))
        .expect_err("the holder is stuck in a tier call");
    drop(step);
    match &err {
        ManagerError::TierTimedOut { tier, op, .. } => {
            assert_eq!((tier.as_str(), *op), ("peer", "serve_external_requests"), "{err}");
        }
        other => panic!("expected a named hang, got {other}"),
    }
    // Once the call returns, steps work again.
    h.set_serve_delay(Duration::ZERO);
    assert!(eventually(|| {
        let mut s = m.detached_step();
        s.on_new_request(&ReqContext::local("later")).is_ok()
    }));
    drop(m);
}

#[test]
fn shutdown_names_the_tier_call_the_control_thread_is_stuck_in() {
    let (tier, h) = ScriptedTier::new("peer");
    let config = ManagerConfig {
        idle_wait: Duration::from_millis(1),
        tier_timeout: Duration::from_millis(50),
        // Far longer than the tier timeout: the hang is named before this runs out.
        shutdown_lock_timeout: Duration::from_secs(600),
        ..ManagerConfig::default()
    };
    let mut m = TieringManager::new(
        Box::new(MemoryPrimary::new(8, CHUNK)),
        vec![Box::new(tier) as Box<dyn SecondaryTier>],
        config,
    );
    h.set_serve_delay(Duration::from_secs(3));
    h.push_peer_request(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("10.0.0.9:7000", "p")),
        keys: Vec::new(),
        fetch: false,
        wait_for_pending: false,
    });
    assert!(h.wait_until(PATIENCE, |v| v.count("serve") >= 1));
    let err = m.shutdown().expect_err("the control thread is stuck in the tier");
    assert!(
        matches!(&err, ManagerError::TierTimedOut { tier, op: "serve_external_requests", .. } if tier == "peer"),
        "{err}"
    );
    // The tier is left alive (it may still touch the arena); a later shutdown completes.
    h.set_serve_delay(Duration::ZERO);
    assert!(eventually(|| m.shutdown().is_ok()));
}

#[test]
fn a_drain_that_never_returns_is_named() {
    let config = ManagerConfig {
        tier_timeout: Duration::from_millis(50),
        ..ManagerConfig::step_driven()
    };
    let mut c = chain(config, ScriptedTier::new("bad"));
    c.bad.set_completion(Completion::Manual);
    c.bad.block_drain();
    let err = c.m.reset_cache().expect_err("the drain hangs");
    assert!(
        matches!(&err, ManagerError::TierTimedOut { tier, op: "drain_jobs", .. } if tier == "bad"),
        "{err}"
    );
    c.bad.release_drain();
    good_tier_serves(&mut c);
    c.m.shutdown().unwrap();
}

#[test]
fn the_control_thread_owns_opted_in_tiers_from_the_first_step() {
    let (tier, h) = ScriptedTier::new("peer");
    let m = TieringManager::new(
        Box::new(MemoryPrimary::new(8, CHUNK)),
        vec![Box::new(tier) as Box<dyn SecondaryTier>],
        ManagerConfig::default(),
    );
    assert!(m.control_thread_running(), "the thread exists before any step");
    let mut m = Engine::new(m);
    let ctx = ReqContext::local("r");
    m.on_new_request(&ctx).unwrap();
    assert_eq!(m.lookup(&key(1), &ctx).unwrap(), LookupResult::Miss);
    end_step(&mut m);
    let me = std::thread::current().id();
    assert!(
        !h.calls()
            .iter()
            .any(|c| c.thread == me && matches!(c.op, "poll" | "serve")),
        "the first step did not poll or serve the opted-in tier: {:?}",
        h.calls()
    );
    m.shutdown().unwrap();
}
