//! loom models of kvtier's concurrency protocols (`docs/ARCHITECTURE.md`, "Concurrency
//! checks"). Built only with `RUSTFLAGS="--cfg loom"`; each model runs the production types
//! (through `crate::sync`) under every thread interleaving loom explores within its bound.
//!
//! A timed wait with a non-zero timeout never times out under loom (see `crate::sync`), so a
//! lost wake-up makes loom report a deadlock rather than passing on the timeout.

mod completions;
mod control;
mod waker;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A timeout the models never reach (loom does not model time).
pub(super) const FOREVER: Duration = Duration::from_secs(3600);

/// Explores `f` with at most `preemptions` preemptions per execution; prints how many
/// interleavings it ran and returns that count.
pub(super) fn explore<F>(name: &str, preemptions: usize, f: F) -> usize
where
    F: Fn() + Send + Sync + 'static,
{
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        f();
    });
    let n = runs.load(Ordering::Relaxed);
    eprintln!("loom model {name}: {n} interleavings (preemption bound {preemptions})");
    n
}
