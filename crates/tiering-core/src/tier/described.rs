//! [`Redescribed`]: a secondary tier with its medium or locality set by the deployment (a chain's
//! `medium` / `locality` keys) instead of by its type. A Redis server on the same host is local;
//! a "disk" on network storage is remote; request tier filters match what the chain says.

use crate::error::TierError;
use crate::event::OffloadingEvent;
use crate::job::{JobResult, TransferJob};
use crate::key::OffloadKey;
use crate::outcome::{LookupResult, OffloadPolicy};
use crate::request::{Locality, Medium, ReqContext, TierInfo};
use crate::stats::TierStats;
use crate::waker::ControlWaker;

use super::{ParentManager, SecondaryTier, TierHealth};

/// Wraps a secondary tier and overrides the medium and/or locality its [`SecondaryTier::info`]
/// and its events declare; every other call is forwarded unchanged. The chain builder wraps a
/// tier whose `[[secondary]]` table sets `medium` or `locality`, whatever its type (plugin
/// tiers included).
pub struct Redescribed {
    inner: Box<dyn SecondaryTier>,
    medium: Option<Medium>,
    locality: Option<Locality>,
}

impl Redescribed {
    /// `inner`, declaring `medium` and `locality` where they are `Some` (its own otherwise).
    #[must_use]
    pub fn new(inner: Box<dyn SecondaryTier>, medium: Option<Medium>, locality: Option<Locality>) -> Self {
        Self {
            inner,
            medium,
            locality,
        }
    }

    /// `tier` itself when there is nothing to override, else wrapped.
    #[must_use]
    pub fn wrap(
        tier: Box<dyn SecondaryTier>,
        medium: Option<Medium>,
        locality: Option<Locality>,
    ) -> Box<dyn SecondaryTier> {
        if medium.is_none() && locality.is_none() {
            tier
        } else {
            Box::new(Self::new(tier, medium, locality))
        }
    }
}

// Every method of the trait is forwarded, defaults included: a method left out here would
// silently answer the trait's default for a wrapped tier.
impl SecondaryTier for Redescribed {
    fn info(&self) -> TierInfo {
        let mut info = self.inner.info();
        if self.medium.is_some() {
            info.medium = self.medium;
        }
        if self.locality.is_some() {
            info.locality = self.locality;
        }
        info
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.inner.set_waker(waker);
    }

    fn needs_control_plane(&self) -> bool {
        self.inner.needs_control_plane()
    }

    fn next_deadline(&self) -> Option<std::time::Instant> {
        self.inner.next_deadline()
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.inner.lookup(key, ctx)
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.inner.submit_store(job);
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.inner.submit_load(job);
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.inner.poll_finished(out);
    }

    fn has_pending_work(&self) -> bool {
        self.inner.has_pending_work()
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.inner.touch(keys, ctx);
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        self.inner.on_new_request(ctx)
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        self.inner.on_request_finished(ctx);
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        self.inner.serve_external_requests(parent)
    }

    fn on_schedule_end(&mut self) {
        self.inner.on_schedule_end();
    }

    fn drain_jobs(&mut self) {
        self.inner.drain_jobs();
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let mut events = self.inner.take_events();
        for e in &mut events {
            if self.medium.is_some() {
                e.medium = self.medium;
            }
            if self.locality.is_some() {
                e.locality = self.locality;
            }
        }
        events
    }

    fn stats(&self) -> TierStats {
        self.inner.stats()
    }

    fn health(&self) -> TierHealth {
        self.inner.health()
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        self.inner.shutdown()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::ScriptedTier;

    #[test]
    fn only_the_overridden_fields_change_in_info_and_events() {
        let (t, h) =
            ScriptedTier::with_info(TierInfo::new("x", Some(Medium::Storage), Some(Locality::Local)));
        let w = Redescribed::wrap(Box::new(t), None, Some(Locality::Remote));
        assert_eq!(
            w.info(),
            TierInfo::new("x", Some(Medium::Storage), Some(Locality::Remote))
        );
        h.set_health(TierHealth {
            healthy: false,
            recoveries: 3,
        });
        assert_eq!(w.health().recoveries, 3, "forwarded");
        let (t, _) = ScriptedTier::new("y");
        let plain = Redescribed::wrap(Box::new(t), None, None);
        assert_eq!(plain.info().locality, Some(Locality::Local));
    }
}
