//! Read-mostly observation: pending work, events and statistics.

use crate::event::OffloadingEvent;
use crate::stats::{ManagerStats, TierStats};
use crate::tier::PrimaryTier as _;

use super::state::TieringState;
use super::tier_call::Op;

impl TieringState {
    pub(crate) fn has_pending_work_unlocked(&mut self) -> bool {
        if !self.jobs.is_empty() || self.has_parked_cascades() || self.has_unsubmitted_promotions() {
            return true;
        }
        (0..self.tiers.len()).any(|idx| {
            self.tier_call_or_defer(idx, Op::HasPendingWork, |t| t.has_pending_work()) == Some(true)
        })
    }

    pub(crate) fn take_events_unlocked(&mut self) -> Vec<OffloadingEvent> {
        let mut events = self.primary.take_events();
        for idx in 0..self.tiers.len() {
            let Some(taken) = self.tier_call_or_defer(idx, Op::TakeEvents, |t| t.take_events()) else {
                continue;
            };
            let name = self.tiers.name(idx);
            events.extend(taken.into_iter().map(|mut e| {
                if e.ownership.is_none() {
                    e.ownership = Some(name.to_owned());
                }
                e
            }));
        }
        events
    }

    pub(crate) fn stats_unlocked(&mut self) -> ManagerStats {
        let tier_stats: Vec<Option<TierStats>> = (0..self.tiers.len())
            .map(|idx| self.tier_call_or_defer(idx, Op::Stats, |t| t.stats()))
            .collect();
        ManagerStats {
            manager: {
                let mut counters = self.counters.clone();
                (counters.promotion_suspensions, counters.backed_off_lookups) = self.backoff.figures();
                counters
            },
            primary: self.primary.stats(),
            secondaries: tier_stats
                .into_iter()
                .enumerate()
                .map(|(idx, stats)| {
                    let mut stats = stats.unwrap_or_else(|| TierStats::named(self.tiers.name(idx)));
                    if self.tiers.is_quarantined(idx) {
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
            decisions: self.cost.stats(self.tiers.infos().map(|i| i.name.clone())),
        }
    }
}
