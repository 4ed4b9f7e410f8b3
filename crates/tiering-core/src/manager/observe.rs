//! Read-mostly observation: pending work, events and statistics.

use crate::event::OffloadingEvent;
use crate::stats::{ManagerStats, TierStats};

use super::state::TieringState;

impl TieringState {
    pub(crate) fn has_pending_work_unlocked(&self) -> bool {
        !self.jobs.is_empty()
            || self.has_parked_cascades()
            || self.has_unsubmitted_promotions()
            || self
                .tiers
                .iter()
                .any(|s| s.tier.as_ref().is_some_and(|t| t.has_pending_work()))
    }

    pub(crate) fn take_events_unlocked(&mut self) -> Vec<OffloadingEvent> {
        let mut events = self.primary.take_events();
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                events.extend(tier.take_events().into_iter().map(|mut e| {
                    if e.ownership.is_none() {
                        e.ownership = Some(slot.info.name.clone());
                    }
                    e
                }));
            }
        }
        events
    }

    pub(crate) fn stats_unlocked(&self) -> ManagerStats {
        ManagerStats {
            manager: {
                let mut counters = self.counters.clone();
                (counters.promotion_suspensions, counters.backed_off_lookups) = self.backoff.figures();
                counters
            },
            primary: self.primary.stats(),
            secondaries: self
                .tiers
                .iter()
                .enumerate()
                .map(|(idx, s)| {
                    let mut stats = s
                        .tier
                        .as_ref()
                        .map_or_else(|| TierStats::named(&s.info.name), |t| t.stats());
                    if s.quarantined.is_some() {
                        stats.extra.insert("quarantined".to_owned(), 1.0);
                    }
                    if self.backoff.suspended(idx) {
                        stats.extra.insert("promotions_suspended".to_owned(), 1.0);
                    }
                    stats
                })
                .collect(),
            jobs_in_flight: self.jobs.len() as u64,
            gates: self.gates.stats(),
            decisions: self.cost.stats(self.tiers.iter().map(|s| s.info.name.clone())),
        }
    }
}
