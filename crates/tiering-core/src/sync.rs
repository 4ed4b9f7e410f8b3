//! The synchronisation primitives of the protocols the loom models check (the control waker,
//! the control thread's stop handshake, the completion queue): `parking_lot` and `std` in every
//! normal build, loom's model-checked versions when compiled with `--cfg loom`
//! (`docs/ARCHITECTURE.md`, "Concurrency checks").
//!
//! The loom versions keep `parking_lot`'s API, so the code under test is the code that ships.
//! Two modelling choices follow from what loom can explore:
//! - a timed condvar wait with a non-zero timeout never times out, so a wake-up the protocol
//!   loses shows as a deadlock instead of being papered over by the timeout; a zero timeout does
//!   not block at all, as in production;
//! - `try_lock_for` is one `try_lock`: a caller that gives up is as good as one whose timeout
//!   ran out, and loom explores both the success and the busy path.

#[cfg(not(loom))]
pub(crate) use parking_lot::{Condvar, Mutex};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicBool;

#[cfg(loom)]
#[allow(unused_imports, reason = "the guard type is named by the loom models only")]
pub(crate) use checked::{Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicBool;

#[cfg(loom)]
mod checked {
    use std::ops::{Deref, DerefMut};
    use std::sync::PoisonError;
    use std::time::Duration;

    /// loom's mutex behind `parking_lot`'s API (no poisoning: a poisoned lock is taken as is,
    /// as `parking_lot` would).
    #[derive(Default)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    /// The guard of [`Mutex`]; `None` only while a condvar wait holds the inner guard.
    pub(crate) struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);

    // Not every item is used by the shipped code; the loom models use the rest.
    #[allow(dead_code, reason = "part of the parking_lot API the models use")]
    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap_or_else(PoisonError::into_inner)))
        }

        /// One attempt: loom explores both outcomes (see the module docs).
        pub(crate) fn try_lock_for(&self, _timeout: Duration) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock().ok().map(|g| MutexGuard(Some(g)))
        }
    }

    #[allow(dead_code, reason = "part of the parking_lot API the models use")]
    impl<T> MutexGuard<'_, T> {
        /// Fairness is not modelled: loom explores every hand-over order anyway.
        pub(crate) fn unlock_fair(guard: Self) {
            drop(guard);
        }

        fn inner(&self) -> &loom::sync::MutexGuard<'_, T> {
            match &self.0 {
                Some(g) => g,
                None => unreachable!("a guard is only empty inside Condvar::wait_for"),
            }
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.inner()
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            match &mut self.0 {
                Some(g) => g,
                None => unreachable!("a guard is only empty inside Condvar::wait_for"),
            }
        }
    }

    /// loom's condvar behind `parking_lot`'s API.
    #[derive(Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    /// Whether a timed wait ran out (`parking_lot`'s type of the same name).
    pub(crate) struct WaitTimeoutResult(bool);

    impl WaitTimeoutResult {
        pub(crate) fn timed_out(&self) -> bool {
            self.0
        }
    }

    impl Condvar {
        pub(crate) fn notify_one(&self) -> bool {
            self.0.notify_one();
            true
        }

        pub(crate) fn notify_all(&self) -> usize {
            self.0.notify_all();
            0
        }

        /// Waits for a notification; a non-zero timeout never runs out (see the module docs).
        pub(crate) fn wait_for<T>(
            &self,
            guard: &mut MutexGuard<'_, T>,
            timeout: Duration,
        ) -> WaitTimeoutResult {
            if timeout.is_zero() {
                return WaitTimeoutResult(true);
            }
            let Some(inner) = guard.0.take() else {
                unreachable!("a guard is only empty inside Condvar::wait_for")
            };
            guard.0 = Some(self.0.wait(inner).unwrap_or_else(PoisonError::into_inner));
            WaitTimeoutResult(false)
        }
    }
}
