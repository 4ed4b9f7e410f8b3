//! The [`ControlWaker`]: no wake-up is lost, and wakes coalesce.

use loom::thread;

use super::{FOREVER, explore};
use crate::waker::ControlWaker;

/// A wake issued before, during or after the waiter goes to sleep is observed: the wait returns
/// `true` (were it lost, the waiter would sleep forever and loom would report the deadlock),
/// and it clears the pending flag.
#[test]
fn loom_waker_a_racing_wake_is_never_lost() {
    let n = explore("waker_a_racing_wake_is_never_lost", 3, || {
        let waker = ControlWaker::new();
        let tier = waker.clone();
        let t = thread::spawn(move || tier.wake());
        assert!(waker.wait(FOREVER), "the wake was observed");
        t.join().unwrap();
        assert!(!waker.wait(std::time::Duration::ZERO), "observing cleared it");
    });
    assert!(n > 1, "loom explored the interleavings");
}

/// Two concurrent wakes against one waiting thread: the first wait sees a wake, the waiter never
/// sleeps through both, and once everything is observed nothing stays pending. Two wakes give at
/// most two observed wake-ups, and exactly one when both land before the wait (they coalesce).
#[test]
fn loom_waker_concurrent_wakes_coalesce() {
    explore("waker_concurrent_wakes_coalesce", 3, || {
        let waker = ControlWaker::new();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let w = waker.clone();
                thread::spawn(move || w.wake())
            })
            .collect();
        assert!(waker.wait(FOREVER), "a wake ended the wait");
        for h in handles {
            h.join().unwrap();
        }
        // The second wake either coalesced into the first observation or is still pending;
        // either way one more non-blocking wait drains it, and the next sees nothing.
        let _ = waker.wait(std::time::Duration::ZERO);
        assert!(!waker.wait(std::time::Duration::ZERO), "nothing left pending");
    });
    explore("waker_wakes_before_the_wait_coalesce", 3, || {
        let waker = ControlWaker::new();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let w = waker.clone();
                thread::spawn(move || w.wake())
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(waker.wait(FOREVER));
        assert!(!waker.wait(std::time::Duration::ZERO), "two wakes, one wake-up");
    });
}
