//! How often waiting for lookups or promotions has paid off lately: the odds an engine that
//! weighs loading against recomputing (`SimConfig::recompute_cost`) credits a wait with.

/// Weight of one request's outcome in the moving average.
const WAIT_PAYOFF_WEIGHT: f64 = 0.1;

/// The payoff credited before any request waited: even odds.
const INITIAL_WAIT_PAYOFF: f64 = 0.5;

/// The lowest payoff a wait is credited with, so a tier that had only misses is still waited
/// for when the saving at stake is large (and its recovery can be noticed).
const MIN_WAIT_PAYOFF: f64 = 0.05;

/// A moving average, over requests that waited, of whether the wait served more chunks.
#[derive(Clone, Copy, Debug)]
pub(super) struct WaitPayoff(f64);

impl Default for WaitPayoff {
    /// Even odds, before any request waited.
    fn default() -> Self {
        Self(INITIAL_WAIT_PAYOFF)
    }
}

impl WaitPayoff {
    /// Counts the outcome of one request that waited: whether it then loaded more chunks.
    pub(super) fn record(&mut self, paid_off: bool) {
        self.0 += WAIT_PAYOFF_WEIGHT * (f64::from(u8::from(paid_off)) - self.0);
    }

    /// The odds a wait is credited with: the average, at least `MIN_WAIT_PAYOFF`.
    pub(super) fn credited(self) -> f64 {
        self.0.max(MIN_WAIT_PAYOFF)
    }
}
