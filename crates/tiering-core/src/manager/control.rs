//! The control-plane thread and its sweep: apply copy-worker reports, poll the opted-in tiers
//! for finished jobs, let them serve inbound peer requests, and (off-step) submit the promotions
//! serving reserved — between scheduler steps, off the scheduler thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::error::ControlPlaneFailure;
use crate::sync;
use crate::waker::ControlWaker;

use super::config::ManagerConfig;
use super::faults::TierFault;
use super::jobs::Servicer;
use super::state::TieringState;
use super::telemetry::Holder;
use super::tier_call::{TierCalls, catch};

/// What the engine-facing handle, its steps and the control thread share.
pub(crate) struct Shared {
    pub(crate) state: Arc<Mutex<TieringState>>,
    /// Raised by shutdown; see [`ControlLoop`].
    pub(crate) stop: sync::AtomicBool,
    /// A control-plane failure not yet returned to the engine (returned once).
    failure: Mutex<Option<Arc<ControlPlaneFailure>>>,
    pub(crate) waker: ControlWaker,
    pub(crate) control: Mutex<Option<ControlThread>>,
    /// The thread may (still) be started: enabled in the config, at least one opted-in tier,
    /// and not fallen back to step-driven servicing.
    pub(crate) thread_enabled: AtomicBool,
    pub(crate) config: ManagerConfig,
    pub(crate) shut_down: AtomicBool,
    /// The tier call in progress (the state's record, readable without the lock).
    pub(crate) calls: Arc<TierCalls>,
}

impl Shared {
    pub(crate) fn new(state: TieringState, waker: ControlWaker, config: ManagerConfig) -> Self {
        let opted_in = state.tiers.any_on_control_plane();
        let calls = Arc::clone(state.tiers.calls());
        Self {
            calls,
            state: Arc::new(Mutex::new(state)),
            stop: sync::AtomicBool::new(false),
            failure: Mutex::new(None),
            waker,
            control: Mutex::new(None),
            thread_enabled: AtomicBool::new(config.control_plane_thread && opted_in),
            config,
            shut_down: AtomicBool::new(false),
        }
    }

    /// Takes the failure to return to the engine, if one is pending.
    pub(crate) fn take_failure(&self) -> Option<Arc<ControlPlaneFailure>> {
        self.failure.lock().take()
    }

    /// The pending failure's message, without taking it.
    pub(crate) fn peek_failure(&self) -> Option<String> {
        self.failure.lock().as_ref().map(|f| f.message.clone())
    }

    /// Records a failure for the next engine call (the first one pending wins; later ones are
    /// only logged).
    pub(crate) fn record_failure(&self, message: String) {
        let mut slot = self.failure.lock();
        if slot.is_none() {
            *slot = Some(Arc::new(ControlPlaneFailure { message }));
        }
    }

    /// The control loop's stop handshake over this manager's flag and waker.
    fn control_loop(&self) -> ControlLoop<'_> {
        ControlLoop::new(&self.stop, &self.waker)
    }

    /// Stops the control thread (if it runs) and waits up to `join_timeout` for it to exit.
    pub(crate) fn stop_control_thread(&self) {
        self.control_loop().request_stop();
        let thread = self.control.lock().take();
        if let Some(thread) = thread
            && !thread.join(self.config.join_timeout)
        {
            tracing::error!(
                "the control-plane thread did not stop within {:?}; shutting tiers down anyway \
                 (it re-checks the stop flag before any further sweep)",
                self.config.join_timeout
            );
        }
    }

    /// Starts the control thread if it is enabled and not running yet. Called once, when the
    /// manager is built, with the state locked (passed in): the opted-in tiers belong to the
    /// thread from before the first step.
    pub(crate) fn start_control_thread(self: &Arc<Self>, state: &mut TieringState) {
        if !self.thread_enabled.load(Ordering::Acquire) || self.shut_down.load(Ordering::Acquire) {
            return;
        }
        let mut control = self.control.lock();
        if control.is_some() {
            return;
        }
        match ControlThread::spawn(Arc::clone(self)) {
            Ok(thread) => {
                state.tiers.set_control_thread_live(true);
                *control = Some(thread);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start the control-plane thread; staying step-driven");
                self.thread_enabled.store(false, Ordering::Release);
            }
        }
    }
}

/// The control thread's loop and its stop handshake, apart from what a sweep does. This is the
/// part the loom models check (`docs/ARCHITECTURE.md`, "Concurrency checks"); the production
/// turn is [`Sweeps`].
///
/// The stop flag is raised before the wake, and the loop checks it before each wait, after it,
/// and once more with the lock held (shutdown may begin while the thread waits for the lock),
/// so a stopping loop never starts a sweep and never sleeps through the stop request.
pub(crate) struct ControlLoop<'a> {
    stop: &'a sync::AtomicBool,
    waker: &'a ControlWaker,
}

/// One turn of the control loop once it is awake: take the lock, sweep under it.
pub(crate) trait ControlTurn {
    /// The held lock.
    type Guard;
    /// Tries to take the lock, waiting a bounded time.
    fn try_lock(&mut self) -> Option<Self::Guard>;
    /// The lock could not be taken (the loop retries at once, after a stop check).
    fn busy(&mut self);
    /// One sweep under `guard`, which it releases. Returns the next idle wait, or `None` when
    /// the loop must end.
    fn sweep(&mut self, guard: Self::Guard) -> Option<Duration>;
}

impl<'a> ControlLoop<'a> {
    pub(crate) fn new(stop: &'a sync::AtomicBool, waker: &'a ControlWaker) -> Self {
        Self { stop, waker }
    }

    /// Asks the loop to end: the flag first, then the wake, so the woken thread sees the flag.
    pub(crate) fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Runs turns until stopped or until a sweep ends the loop; the first idle wait is
    /// `first_wait`, later ones what the last sweep returned.
    pub(crate) fn run<T: ControlTurn>(&self, turn: &mut T, first_wait: Duration) {
        let mut wait = first_wait;
        loop {
            if self.stopping() {
                return;
            }
            self.waker.wait(wait);
            if self.stopping() {
                return;
            }
            let Some(guard) = turn.try_lock() else {
                turn.busy();
                wait = Duration::ZERO;
                continue;
            };
            // Shutdown may have begun while this thread waited for the lock.
            if self.stopping() {
                return;
            }
            match turn.sweep(guard) {
                Some(next) => wait = next,
                None => return,
            }
        }
    }
}

/// Tells the joiner that the control thread has left its loop. Raised by [`ExitNotice`]'s drop,
/// so also when the thread unwinds.
#[derive(Default)]
pub(crate) struct ExitSignal {
    exited: sync::Mutex<bool>,
    cond: sync::Condvar,
}

impl ExitSignal {
    fn raise(&self) {
        *self.exited.lock() = true;
        self.cond.notify_all();
    }

    /// Waits up to `timeout` for the exit; returns whether it happened.
    pub(crate) fn wait_for(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut exited = self.exited.lock();
        while !*exited {
            // An unrepresentable deadline is as good as none.
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() || self.cond.wait_for(&mut exited, left).timed_out() {
                break;
            }
        }
        *exited
    }

    /// A guard that raises the signal when dropped.
    pub(crate) fn notice(self: &Arc<Self>) -> ExitNotice {
        ExitNotice(Arc::clone(self))
    }
}

/// Raises its [`ExitSignal`] when dropped.
pub(crate) struct ExitNotice(Arc<ExitSignal>);

impl Drop for ExitNotice {
    fn drop(&mut self) {
        self.0.raise();
    }
}

/// A running control-plane thread.
pub(crate) struct ControlThread {
    handle: JoinHandle<()>,
    exited: Arc<ExitSignal>,
}

impl ControlThread {
    fn spawn(shared: Arc<Shared>) -> std::io::Result<Self> {
        let exited = Arc::new(ExitSignal::default());
        let notice = exited.notice();
        let handle = std::thread::Builder::new()
            .name("kvtier-control".into())
            .spawn(move || {
                let _notice = notice;
                run(&shared);
            })?;
        tracing::info!("kvtier control-plane thread started");
        Ok(Self { handle, exited })
    }

    /// Waits up to `timeout` for the thread to exit; joins it if it did.
    pub(crate) fn join(self, timeout: Duration) -> bool {
        if !self.exited.wait_for(timeout) {
            return false;
        }
        let _ = self.handle.join();
        true
    }

    /// Whether the thread has exited.
    pub(crate) fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    pub(crate) fn thread_id(&self) -> std::thread::ThreadId {
        self.handle.thread().id()
    }
}

impl TieringState {
    /// One control-plane sweep (see the module docs). Returns the tier faults it met; a
    /// failure that belongs to no tier comes back as a fault of `usize::MAX`.
    pub(crate) fn sweep(&mut self) -> Vec<TierFault> {
        self.counters.sweeps += 1;
        self.apply_queued_completions();
        let mut faults = self.poll_tiers(Servicer::ControlThread);
        faults.extend(self.serve_tiers(Servicer::ControlThread));
        if self.completions.off_step()
            && let Err(e) = self.flush_promotions()
        {
            // Promotions a peer's lookup started go out now, not at the next step end.
            faults.push(TierFault::new(usize::MAX, e));
        }
        faults
    }

    /// Applies the failure policy to a sweep's faults. Returns whether the control thread must
    /// stop (the `fail` policy, or a failure no tier can be blamed for).
    fn settle_sweep_faults(&mut self, faults: Vec<TierFault>, shared: &Shared) -> bool {
        let mut stop = false;
        for f in faults {
            tracing::error!(error = %f.error, "control-plane sweep failed");
            let blamed = f.tier < self.tiers.len();
            if blamed && self.failures.quarantines() {
                self.quarantine(f.tier, &f.error.to_string());
            } else if blamed {
                stop = true;
            }
            self.counters.control_failures += 1;
            shared.record_failure(f.error.to_string());
        }
        stop
    }
}

/// Falls back to servicing every tier from the scheduler thread.
fn fall_back_to_step_driven(shared: &Shared, state: &mut TieringState) {
    state.tiers.set_control_thread_live(false);
    shared.thread_enabled.store(false, Ordering::Release);
    tracing::error!("the control-plane thread stops; tiers are serviced at step end from now on");
}

/// The production turn: a sweep of the manager state, with the lock metrics and the
/// starvation warning.
struct Sweeps<'a> {
    shared: &'a Shared,
    starved_since: Option<Instant>,
    asked: Instant,
    /// The stuck tier call last reported by the watchdog (reported once).
    reported_stuck: Option<(String, &'static str)>,
}

impl<'a> ControlTurn for Sweeps<'a> {
    type Guard = MutexGuard<'a, TieringState>;

    fn try_lock(&mut self) -> Option<Self::Guard> {
        self.asked = Instant::now();
        let guard = self.shared.state.try_lock_for(self.shared.config.lock_timeout)?;
        self.starved_since = None;
        Some(guard)
    }

    fn busy(&mut self) {
        let config = &self.shared.config;
        let now = Instant::now();
        // The watchdog of scheduler-thread tier calls: the engine cannot be freed from a tier
        // call that never returns on its own thread, but it is named.
        if let Some(stuck) = self.shared.calls.in_progress()
            && stuck.age >= config.tier_timeout
            && self.reported_stuck.as_ref() != Some(&(stuck.tier.clone(), stuck.op))
        {
            tracing::error!(
                tier = %stuck.tier,
                call = stuck.op,
                "tier {} has been inside {} for {:?} (over tier_timeout = {:?}) and holds the manager lock",
                stuck.tier,
                stuck.op,
                stuck.age,
                config.tier_timeout
            );
            self.reported_stuck = Some((stuck.tier, stuck.op));
        }
        match self.starved_since {
            None => self.starved_since = Some(now),
            Some(since) if now.duration_since(since) >= config.starvation_warning => {
                tracing::warn!(
                    "the scheduler has held the manager lock for over {:?}: a step guard was \
                     kept across model execution, so peers are not being served",
                    config.starvation_warning
                );
                self.starved_since = Some(now);
                if let Some(s) = self.shared.state.try_lock_for(Duration::ZERO) {
                    s.telemetry.starved();
                }
            }
            Some(_) => {}
        }
    }

    fn sweep(&mut self, mut guard: Self::Guard) -> Option<Duration> {
        let shared = self.shared;
        let acquired = Instant::now();
        crate::fetch_trace::record(shared.waker.trace_id(), crate::fetch_trace::Point::ControlLocked);
        // The outer boundary of the thread's calls: tier panics are caught inside the sweep, so
        // one that reaches here came from the manager's own code; a panic of the primary tier
        // leaves the manager failed. Either way the thread stops and the next engine call hears.
        let stop = match catch(|| guard.sweep()) {
            Ok(faults) => guard.settle_sweep_faults(faults, shared),
            Err(panic) => {
                let message = format!("a sweep panicked: {panic}");
                tracing::error!(%message, "control-plane sweep failed");
                guard.counters.control_failures += 1;
                shared.record_failure(message);
                true
            }
        };
        let stop = stop || guard.failure().is_some();
        if stop {
            fall_back_to_step_driven(shared, &mut guard);
            MutexGuard::unlock_fair(guard);
            return None;
        }
        let idle_wait = shared.config.idle_wait;
        let wait = guard.next_deadline().map_or(idle_wait, |d| {
            d.saturating_duration_since(Instant::now()).min(idle_wait)
        });
        guard.publish_metrics();
        guard
            .telemetry
            .lock(Holder::Control, acquired - self.asked, acquired.elapsed());
        MutexGuard::unlock_fair(guard);
        crate::fetch_trace::record(shared.waker.trace_id(), crate::fetch_trace::Point::ControlSwept);
        Some(wait)
    }
}

fn run(shared: &Shared) {
    let mut sweeps = Sweeps {
        shared,
        starved_since: None,
        asked: Instant::now(),
        reported_stuck: None,
    };
    shared.control_loop().run(&mut sweeps, shared.config.idle_wait);
}
