//! The control thread's stop handshake: [`ControlLoop`] (the loop production runs, with a
//! counting turn in place of the manager's sweep) and [`ExitSignal`] (what `join` waits on).
//!
//! The control thread is spawned as production's `ControlThread::spawn` does: it holds the
//! exit notice while it runs the loop. The joiner is shutdown's `stop_control_thread`:
//! `request_stop`, then wait for the exit signal.

use std::sync::Arc;

use loom::thread;

use super::{FOREVER, explore};
use crate::manager::control::{ControlLoop, ControlTurn, ExitSignal};
use crate::sync::{self, MutexGuard};
use crate::waker::ControlWaker;

/// The state behind the lock: what the engine did and what the control thread saw.
#[derive(Default)]
struct Work {
    /// Engine steps that completed (under the lock).
    steps: u32,
    sweeps: u32,
}

/// What a manager shares with its control thread, reduced to the handshake's parts.
#[derive(Default)]
struct Parts {
    stop: sync::AtomicBool,
    waker: ControlWaker,
    state: sync::Mutex<Work>,
    exit: Arc<ExitSignal>,
}

impl Parts {
    fn control_loop(&self) -> ControlLoop<'_> {
        ControlLoop::new(&self.stop, &self.waker)
    }
}

/// A sweep that checks what it sees and counts itself.
struct CountingTurn<'a> {
    state: &'a sync::Mutex<Work>,
}

impl<'a> ControlTurn for CountingTurn<'a> {
    type Guard = MutexGuard<'a, Work>;

    fn try_lock(&mut self) -> Option<Self::Guard> {
        self.state.try_lock_for(FOREVER)
    }

    fn busy(&mut self) {
        // Production waits `lock_timeout` inside `try_lock_for`; here the retry lets the
        // holder run first.
        thread::yield_now();
    }

    fn sweep(&mut self, mut guard: Self::Guard) -> Option<std::time::Duration> {
        // Every wake but the stop's is issued by a step after its work, under its lock, so a
        // sweep always sees that work.
        assert_eq!(guard.steps, 1, "a sweep ran without the step that woke it");
        guard.sweeps += 1;
        MutexGuard::unlock_fair(guard);
        Some(FOREVER)
    }
}

/// Spawns the control thread as production does: the exit notice lives as long as the loop.
fn spawn_control(parts: &Arc<Parts>) -> thread::JoinHandle<()> {
    let parts = Arc::clone(parts);
    let notice = parts.exit.notice();
    thread::spawn(move || {
        let _notice = notice;
        let mut turn = CountingTurn { state: &parts.state };
        parts.control_loop().run(&mut turn, FOREVER);
    })
}

/// Shutdown's side: stop, then the bounded join (which must not need its timeout).
fn stop_and_join(parts: &Parts, control: thread::JoinHandle<()>) {
    parts.control_loop().request_stop();
    assert!(parts.exit.wait_for(FOREVER), "the control thread exited");
    control.join().unwrap();
}

/// Shutdown stops an idle control thread: the stop's wake ends its wait, it exits without a
/// sweep, the join returns, and the lock is free afterwards.
#[test]
fn loom_control_stop_ends_an_idle_loop() {
    explore("control_stop_ends_an_idle_loop", 3, || {
        let parts = Arc::new(Parts::default());
        let control = spawn_control(&parts);
        stop_and_join(&parts, control);
        let state = parts.state.try_lock_for(FOREVER).expect("the lock is free");
        assert_eq!(state.sweeps, 0, "a stopping loop never sweeps");
    });
}

/// A step (lock, work, a tier's wake, unlock) races the control thread, then the engine shuts
/// down: whichever way they interleave, the thread sweeps at most once, sees the step's work
/// when it does, exits, and leaves the lock free.
#[test]
fn loom_control_stop_races_an_engine_step() {
    explore("control_stop_races_an_engine_step", 3, || {
        let parts = Arc::new(Parts::default());
        let control = spawn_control(&parts);
        {
            let mut step = parts.state.lock();
            step.steps += 1;
            parts.waker.wake();
            MutexGuard::unlock_fair(step);
        }
        stop_and_join(&parts, control);
        let state = parts.state.try_lock_for(FOREVER).expect("the lock is free");
        assert!(state.sweeps <= 1);
    });
}

/// Shutdown while a step guard is still held (a binding that kept its step across the call):
/// the control thread, woken and unable to take the lock, still sees the stop and exits, so
/// the join returns without the lock ever being released.
#[test]
fn loom_control_stop_with_the_step_lock_held() {
    explore("control_stop_with_the_step_lock_held", 3, || {
        let parts = Arc::new(Parts::default());
        let control = spawn_control(&parts);
        // A tier wakes the thread during the step, so it contends for the lock the step holds.
        let mut step = parts.state.lock();
        step.steps += 1;
        parts.waker.wake();
        stop_and_join(&parts, control);
        assert!(step.sweeps == 0, "no sweep while the step held the lock");
        MutexGuard::unlock_fair(step);
    });
}
