//! The off-step completion hand-off: copy workers report through the production
//! [`StoreCompletionSender`] (queue push, then wake) while the engine holds or releases the
//! step lock, and a control thread running the production [`ControlLoop`] applies the queue with
//! the production `TieringState::sweep`. The state is a real `TieringState` over an in-memory
//! primary that counts how often each store is applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use loom::thread;

use super::{FOREVER, explore};
use crate::arena::ChunkArena;
use crate::channel::CompletionQueue;
use crate::error::TierError;
use crate::event::OffloadingEvent;
use crate::key::OffloadKey;
use crate::manager::completions::StoreCompletionSender;
use crate::manager::control::{ControlLoop, ControlTurn, ExitSignal};
use crate::manager::{ManagerConfig, TieringState};
use crate::outcome::{ChunkId, LookupResult, PrepareStoreOutput};
use crate::request::{ReqContext, TierInfo};
use crate::stats::TierStats;
use crate::sync::{self, MutexGuard};
use crate::testing::MemoryPrimary;
use crate::tier::PrimaryTier;
use crate::waker::ControlWaker;

/// The in-memory primary, counting the keys `complete_store` applies (a second application of
/// the same store would be invisible in the primary itself, which ignores ready keys).
struct CountingPrimary {
    inner: MemoryPrimary,
    applied: Arc<AtomicU32>,
}

impl PrimaryTier for CountingPrimary {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    fn arena(&self) -> &Arc<ChunkArena> {
        self.inner.arena()
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
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
        self.inner.prepare_store(keys, ctx)
    }
    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        let n = u32::try_from(keys.len()).expect("a small test");
        self.applied.fetch_add(n, Ordering::Relaxed);
        self.inner.complete_store(keys, ctx, success);
    }
    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.inner.prepare_read(keys, ctx)
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

/// A manager's state with one store of one key prepared (off-step mode, `reporters` ranks),
/// the control thread's stop handshake, and the primary's application count.
struct Fixture {
    state: sync::Mutex<TieringState>,
    queue: Arc<CompletionQueue>,
    stop: sync::AtomicBool,
    waker: ControlWaker,
    exit: Arc<ExitSignal>,
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    applied: Arc<AtomicU32>,
}

impl Fixture {
    fn new(reporters: u32) -> Arc<Self> {
        let applied = Arc::new(AtomicU32::new(0));
        let primary = CountingPrimary {
            inner: MemoryPrimary::new(4, 64),
            applied: Arc::clone(&applied),
        };
        let config = ManagerConfig {
            off_step: true,
            reporters,
            ..ManagerConfig::default()
        };
        let mut state = TieringState::new(Box::new(primary), Vec::new(), &config);
        let ctx = ReqContext::local("r");
        state.on_new_request_unlocked(&ctx, None);
        let out = state
            .prepare_store_unlocked(&[OffloadKey::from_u64(1)], &ctx)
            .unwrap()
            .expect("room for one key");
        assert_eq!(out.keys_to_store.len(), 1);
        // As `start_control_thread` does: from now on the control thread applies worker reports.
        state.tiers.set_control_thread_live(true);
        Arc::new(Self {
            queue: Arc::clone(state.completions.queue()),
            state: sync::Mutex::new(state),
            stop: sync::AtomicBool::new(false),
            waker: ControlWaker::new(),
            exit: Arc::new(ExitSignal::default()),
            ctx,
            keys: out.keys_to_store,
            applied,
        })
    }

    /// A worker's sender, as `TieringManager::store_completion_sender` builds it.
    fn sender(&self) -> StoreCompletionSender {
        StoreCompletionSender::new(Arc::clone(&self.queue), self.waker.clone())
    }

    fn control_loop(&self) -> ControlLoop<'_> {
        ControlLoop::new(&self.stop, &self.waker)
    }

    /// The control thread: the production loop with the production sweep; with `until_applied`
    /// it also ends once the store was applied (so no stop is needed and a lost wake would
    /// leave it asleep forever).
    fn spawn_control(self: &Arc<Self>, until_applied: bool) -> thread::JoinHandle<()> {
        let fx = Arc::clone(self);
        let notice = fx.exit.notice();
        thread::spawn(move || {
            let _notice = notice;
            let mut turn = Sweeping {
                fx: &fx,
                until_applied,
            };
            fx.control_loop().run(&mut turn, FOREVER);
        })
    }

    /// The engine's `complete_store` of the prepared key, in a step of its own.
    fn engine_completes(&self) {
        let mut step = self.state.lock();
        step.complete_store_unlocked(&self.keys, &self.ctx, true).unwrap();
        MutexGuard::unlock_fair(step);
    }

    /// Shutdown: stop and join the control thread, then drain what is still queued, as
    /// `shutdown_tiers` does.
    fn shut_down(&self, control: thread::JoinHandle<()>) {
        self.control_loop().request_stop();
        assert!(self.exit.wait_for(FOREVER), "the control thread exited");
        control.join().unwrap();
        self.state.lock().apply_queued_completions();
    }

    fn applied(&self) -> u32 {
        self.applied.load(Ordering::Relaxed)
    }

    /// The store was applied exactly once and no report went unmatched.
    fn assert_applied_once(&self) {
        assert_eq!(self.applied(), 1, "the store was applied exactly once");
        assert_eq!(self.state.lock().counters.unmatched_worker_reports, 0);
    }

    /// The request has `n` stores pending.
    fn assert_pending_stores(&self, n: u32) {
        let state = self.state.lock();
        let pending = state.requests.pending_stores(self.ctx.id());
        assert_eq!(pending, Some(n));
    }
}

/// The control thread's turn: the production sweep under the state lock.
struct Sweeping<'a> {
    fx: &'a Fixture,
    until_applied: bool,
}

impl<'a> ControlTurn for Sweeping<'a> {
    type Guard = MutexGuard<'a, TieringState>;

    fn try_lock(&mut self) -> Option<Self::Guard> {
        self.fx.state.try_lock_for(FOREVER)
    }

    fn busy(&mut self) {
        thread::yield_now();
    }

    fn sweep(&mut self, mut guard: Self::Guard) -> Option<Duration> {
        let faults = guard.sweep();
        assert!(faults.is_empty(), "a sweep without tiers cannot fail");
        MutexGuard::unlock_fair(guard);
        (!self.until_applied || self.fx.applied() == 0).then_some(FOREVER)
    }
}

/// A worker's report, with no engine report and no stop: the control thread wakes, applies the
/// store once, and ends. A lost wake would leave it asleep (a deadlock loom reports).
#[test]
fn loom_completions_a_worker_report_reaches_the_control_thread() {
    explore(
        "completions_a_worker_report_reaches_the_control_thread",
        3,
        || {
            let fx = Fixture::new(1);
            let control = fx.spawn_control(true);
            fx.sender().report(&fx.keys, true);
            control.join().unwrap();
            fx.assert_applied_once();
            assert_eq!(fx.state.lock().counters.off_step_store_completions, 1);
            // The store ends with the engine's report, which is absorbed.
            fx.assert_pending_stores(1);
            fx.engine_completes();
            fx.assert_applied_once();
            fx.assert_pending_stores(0);
            assert_eq!(fx.state.lock().counters.duplicate_store_reports, 1);
        },
    );
}

/// A worker reports while the engine's step completes the same store (before, during or after
/// the engine holds the lock), the control thread sweeping meanwhile, then shutdown: the store
/// is applied exactly once and the other report is absorbed.
#[test]
fn loom_completions_engine_and_worker_apply_once() {
    explore("completions_engine_and_worker_apply_once", 3, || {
        let fx = Fixture::new(1);
        let control = fx.spawn_control(false);
        let sender = fx.sender();
        let keys = fx.keys.clone();
        let worker = thread::spawn(move || sender.report(&keys, true));
        fx.engine_completes();
        worker.join().unwrap();
        fx.shut_down(control);
        fx.assert_applied_once();
        fx.assert_pending_stores(0);
        let state = fx.state.lock();
        assert_eq!(
            state.counters.duplicate_store_reports, 1,
            "the later report was absorbed"
        );
        assert_eq!(
            state.completions.tracked_keys(),
            0,
            "every report arrived: nothing kept"
        );
    });
}

/// Two tensor-parallel ranks report the same store from two threads, no engine report: the
/// control thread applies it once, only after both (a single rank's report applying it would
/// make the other rank's a duplicate).
#[test]
fn loom_completions_two_ranks_aggregate_to_one_application() {
    explore("completions_two_ranks_aggregate_to_one_application", 2, || {
        let fx = Fixture::new(2);
        let control = fx.spawn_control(true);
        let workers: Vec<_> = (0..2u32)
            .map(|rank| {
                let sender = fx.sender();
                let keys = fx.keys.clone();
                thread::spawn(move || sender.report_rank(rank, &keys, true))
            })
            .collect();
        control.join().unwrap();
        for w in workers {
            w.join().unwrap();
        }
        fx.state.lock().apply_queued_completions();
        fx.assert_applied_once();
        {
            let state = fx.state.lock();
            assert_eq!(state.counters.off_step_store_completions, 1);
            assert_eq!(
                state.counters.duplicate_store_reports, 0,
                "no rank's report applied alone"
            );
        }
        fx.engine_completes();
        fx.assert_applied_once();
        fx.assert_pending_stores(0);
    });
}

/// Two ranks and the engine race on the same store while the control thread sweeps, then
/// shutdown: one application, and exactly one of the two authoritative reports (the engine's,
/// or the ranks' aggregate) is absorbed.
#[test]
fn loom_completions_two_ranks_and_the_engine_apply_once() {
    explore("completions_two_ranks_and_the_engine_apply_once", 2, || {
        let fx = Fixture::new(2);
        let control = fx.spawn_control(false);
        let workers: Vec<_> = (0..2u32)
            .map(|rank| {
                let sender = fx.sender();
                let keys = fx.keys.clone();
                thread::spawn(move || sender.report_rank(rank, &keys, true))
            })
            .collect();
        fx.engine_completes();
        for w in workers {
            w.join().unwrap();
        }
        fx.shut_down(control);
        fx.assert_applied_once();
        fx.assert_pending_stores(0);
        let state = fx.state.lock();
        assert_eq!(state.counters.duplicate_store_reports, 1);
        assert_eq!(state.completions.tracked_keys(), 0);
    });
}
