//! What the current scheduler step already polled. A step makes hundreds of lookups and several
//! other engine calls; only the first of them polls the tiers (and, once, the control thread's
//! tiers for a promotion the step waits on), so the flags are checked on every call and reset
//! when a step begins.

/// The current step's once-per-step polls (see the module docs).
#[derive(Default)]
pub(crate) struct StepPolls {
    /// The scheduler's poll of the tiers it services ran.
    tiers: bool,
    /// The poll for awaited promotions (and the once-per-step back-off and retry checks) ran.
    promotions: bool,
}

impl StepPolls {
    /// A step begins (or the cache was reset): nothing polled yet.
    pub(crate) fn begin(&mut self) {
        *self = Self::default();
    }

    /// Whether this step already polled the tiers the scheduler services.
    pub(crate) fn tiers_polled(&self) -> bool {
        self.tiers
    }

    /// Notes the tiers' poll; whether it had already run.
    pub(crate) fn poll_tiers(&mut self) -> bool {
        std::mem::replace(&mut self.tiers, true)
    }

    /// Whether this step already polled for awaited promotions.
    pub(crate) fn promotions_polled(&self) -> bool {
        self.promotions
    }

    /// Notes the poll for awaited promotions.
    pub(crate) fn poll_promotions(&mut self) {
        self.promotions = true;
    }
}
