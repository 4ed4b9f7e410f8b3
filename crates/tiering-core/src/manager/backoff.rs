//! Failed promotions are remembered (`docs/ARCHITECTURE.md`, "Failed promotions back off").
//!
//! When a promotion of key K from secondary tier T fails (the job failed, or K is in the failed
//! part of a partial result), lookups of K skip T — they fall through to the next tier in chain
//! order, or miss — until T's back-off expires or T reports a recovery through
//! [`SecondaryTier::health`](crate::tier::SecondaryTier::health). Without this, the next lookup
//! of K reserves a row and starts the same promotion again, every step, for as long as the tier
//! is down.
//!
//! A tier whose promotions keep failing (`suspend_after` failed jobs with no success between) is
//! skipped for every key until the back-off expires, so a dead tier's hits turn into misses
//! within a few steps instead of one failed promotion per new key. The back-off is per tier: it
//! starts at `initial`, doubles each time a failure comes after the previous back-off expired
//! (the retry failed too), and is capped at `max`. A successful promotion from the tier, or a
//! recovery, resets it.
//!
//! The table of remembered keys is bounded (`max_keys`; the oldest entries go first) and
//! cleared by `reset_cache`; a tier's entries go when the tier recovers.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::admission::Clock;
use crate::key::{KeyBuildHasher, OffloadKey};
use crate::tier::TierHealth;

/// How failed promotions back off ([`ManagerConfig::promotion_backoff`](super::ManagerConfig)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromotionBackoffConfig {
    /// The first back-off of a tier (`[control_plane] promotion_backoff`, default 1 s).
    pub initial: Duration,
    /// The longest back-off (`[control_plane] promotion_backoff_max`, default 30 s).
    pub max: Duration,
    /// Failed promotion jobs in a row after which the whole tier is skipped, not only the failed
    /// keys (default 3; at least 1).
    pub suspend_after: u32,
    /// Remembered (tier, key) failures at most (default 65,536).
    pub max_keys: usize,
}

impl Default for PromotionBackoffConfig {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
            suspend_after: 3,
            max_keys: 1 << 16,
        }
    }
}

/// One tier's back-off.
#[derive(Clone, Copy, Debug, Default)]
struct TierBackoff {
    /// Failed promotion jobs since the tier last promoted successfully or recovered.
    failed_in_a_row: u32,
    /// The back-off in force (zero before the first failure).
    interval: Duration,
    /// When the current back-off window ends; `None`: no failure since the last reset.
    window_end: Option<Instant>,
    /// Whether the whole tier is skipped until `window_end`.
    suspended: bool,
    /// The tier's health when its last failure was recorded.
    health: TierHealth,
}

/// What the manager remembers of failed promotions (see the module docs). Owns its state; the
/// manager tells it what happened and asks it whether a lookup may use a tier.
pub(crate) struct PromotionBackoff {
    config: PromotionBackoffConfig,
    clock: Clock,
    tiers: Vec<TierBackoff>,
    /// (tier, key) → until when lookups of the key skip the tier.
    keys: HashMap<(usize, OffloadKey), Instant, KeyBuildHasher>,
    /// The same entries in insertion order (with stale ones for keys inserted again or
    /// forgotten), for expiry and for dropping the oldest at the cap.
    order: VecDeque<(usize, OffloadKey, Instant)>,
    /// Whether any tier has a window or any key is remembered: the lookup's fast path.
    engaged: bool,
    /// Times a tier was suspended (every key skipped).
    suspensions: u64,
    /// Lookups that skipped a tier because of a remembered failure.
    skipped_lookups: u64,
}

impl PromotionBackoff {
    pub(crate) fn new(config: PromotionBackoffConfig, clock: Clock, tiers: usize) -> Self {
        Self {
            config: PromotionBackoffConfig {
                suspend_after: config.suspend_after.max(1),
                max: config.max.max(config.initial),
                ..config
            },
            clock,
            tiers: vec![TierBackoff::default(); tiers],
            keys: HashMap::default(),
            order: VecDeque::new(),
            engaged: false,
            suspensions: 0,
            skipped_lookups: 0,
        }
    }

    /// Whether nothing is remembered (no lookup needs to ask).
    #[inline]
    pub(crate) fn is_idle(&self) -> bool {
        !self.engaged
    }

    /// Whether tier `idx` has failures on record (its health is worth reading).
    pub(crate) fn watches(&self, idx: usize) -> bool {
        self.tiers.get(idx).is_some_and(|t| t.window_end.is_some())
    }

    /// Times a tier was suspended, and lookups that skipped a tier.
    pub(crate) fn figures(&self) -> (u64, u64) {
        (self.suspensions, self.skipped_lookups)
    }

    /// Remembered (tier, key) failures now.
    pub(crate) fn remembered_keys(&self) -> usize {
        self.keys.len()
    }

    /// Whether tier `idx` is skipped for every key now.
    pub(crate) fn suspended(&self, idx: usize) -> bool {
        let now = self.clock.now();
        self.tiers
            .get(idx)
            .is_some_and(|t| t.suspended && t.window_end.is_some_and(|end| now < end))
    }

    /// The current back-off of tier `idx` (zero when none is in force).
    #[cfg(test)]
    pub(crate) fn interval(&self, idx: usize) -> Duration {
        self.tiers.get(idx).map_or(Duration::ZERO, |t| t.interval)
    }

    /// Whether a lookup of `key` skips tier `idx` now. Call only when not [`Self::is_idle`].
    pub(crate) fn skips(&mut self, idx: usize, key: &OffloadKey) -> bool {
        let Some(t) = self.tiers.get(idx) else {
            return false;
        };
        let Some(end) = t.window_end else {
            return false;
        };
        let now = self.clock.now();
        let skip =
            (t.suspended && now < end) || self.keys.get(&(idx, *key)).is_some_and(|&until| now < until);
        if skip {
            self.skipped_lookups += 1;
        }
        skip
    }

    /// Housekeeping once per step: forgets tier `idx`'s failures if `health` shows a recovery
    /// since the last one, and expired entries of every tier.
    pub(crate) fn observe_health(&mut self, idx: usize, health: TierHealth) {
        if let Some(t) = self.tiers.get(idx)
            && t.window_end.is_some()
            && health.recovered_since(&t.health)
        {
            tracing::info!(tier = idx, "tier recovered: its failed promotions are forgotten");
            self.forget_tier(idx);
        }
    }

    /// Drops the entries that expired (from the front of the insertion order, which is nearly
    /// the expiry order).
    pub(crate) fn expire(&mut self) {
        if !self.engaged {
            return;
        }
        let now = self.clock.now();
        while let Some(&(idx, key, until)) = self.order.front() {
            if until > now {
                break;
            }
            self.order.pop_front();
            if self.keys.get(&(idx, key)) == Some(&until) {
                self.keys.remove(&(idx, key));
            }
        }
        self.recompute_engaged();
    }

    /// A promotion job of tier `idx` failed for `keys` (all of its keys when `whole_job`, else
    /// the failed part of a partial result). `health` is the tier's signal now.
    pub(crate) fn failed(&mut self, idx: usize, keys: &[OffloadKey], whole_job: bool, health: TierHealth) {
        let now = self.clock.now();
        let Some(t) = self.tiers.get_mut(idx) else {
            return;
        };
        let was_suspended = t.suspended && t.window_end.is_some_and(|end| now < end);
        t.interval = match t.window_end {
            // The first failure, the first since a success, or the first after a long quiet
            // period.
            None => self.config.initial,
            _ if t.interval.is_zero() => self.config.initial,
            Some(end) if now >= end + self.config.max => self.config.initial,
            // The tier was tried again after its back-off and failed again.
            Some(end) if now >= end => (t.interval * 2).min(self.config.max),
            Some(_) => t.interval,
        };
        if whole_job {
            t.failed_in_a_row = t.failed_in_a_row.saturating_add(1);
        } else {
            // Some keys came: the tier works, only these keys do not.
            t.failed_in_a_row = 0;
        }
        let until = now + t.interval;
        t.window_end = Some(t.window_end.map_or(until, |end| end.max(until)));
        t.health = health;
        t.suspended = t.failed_in_a_row >= self.config.suspend_after;
        if t.suspended && !was_suspended {
            self.suspensions += 1;
            tracing::warn!(
                tier = idx,
                failed_jobs = t.failed_in_a_row,
                backoff = ?t.interval,
                "promotions from this tier keep failing: it is skipped by lookups until the back-off expires or it recovers"
            );
        }
        for key in keys {
            self.remember(idx, *key, until);
        }
        self.engaged = true;
    }

    /// A promotion job of tier `idx` succeeded completely: the tier works, so it is no longer
    /// suspended and its next failure starts a fresh back-off (keys that failed on their own
    /// stay remembered until they expire).
    pub(crate) fn succeeded(&mut self, idx: usize) {
        if let Some(t) = self.tiers.get_mut(idx) {
            t.failed_in_a_row = 0;
            t.suspended = false;
            t.interval = Duration::ZERO;
        }
    }

    /// Forgets everything about tier `idx` (it recovered, or left the chain).
    pub(crate) fn forget_tier(&mut self, idx: usize) {
        if let Some(t) = self.tiers.get_mut(idx) {
            *t = TierBackoff::default();
        }
        self.keys.retain(|(i, _), _| *i != idx);
        self.order.retain(|(i, _, _)| *i != idx);
        self.recompute_engaged();
    }

    /// Forgets everything (`reset_cache`).
    pub(crate) fn clear(&mut self) {
        for t in &mut self.tiers {
            *t = TierBackoff::default();
        }
        self.keys.clear();
        self.order.clear();
        self.engaged = false;
    }

    fn remember(&mut self, idx: usize, key: OffloadKey, until: Instant) {
        let cap = self.config.max_keys.max(1);
        // Bound both the table and the order queue (which may hold stale entries).
        while self.keys.len() >= cap || self.order.len() >= cap.saturating_mul(2) {
            let Some((i, k, u)) = self.order.pop_front() else {
                break;
            };
            if self.keys.get(&(i, k)) == Some(&u) {
                self.keys.remove(&(i, k));
            }
        }
        self.keys.insert((idx, key), until);
        self.order.push_back((idx, key, until));
    }

    fn recompute_engaged(&mut self) {
        let now = self.clock.now();
        self.engaged = !self.keys.is_empty()
            || self
                .tiers
                .iter()
                .any(|t| t.suspended && t.window_end.is_some_and(|end| now < end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    fn backoff(max_keys: usize) -> (PromotionBackoff, crate::admission::ManualClock) {
        let (clock, handle) = Clock::manual();
        let config = PromotionBackoffConfig {
            max_keys,
            ..PromotionBackoffConfig::default()
        };
        (PromotionBackoff::new(config, clock, 2), handle)
    }

    #[test]
    fn a_failed_key_is_skipped_until_its_backoff_expires() {
        let (mut b, clock) = backoff(16);
        assert!(b.is_idle());
        b.failed(0, &[key(1)], true, TierHealth::default());
        assert!(b.skips(0, &key(1)));
        assert!(!b.skips(0, &key(2)), "one failed job does not suspend the tier");
        assert!(!b.skips(1, &key(1)), "other tiers are unaffected");
        clock.advance(Duration::from_millis(999));
        assert!(b.skips(0, &key(1)));
        clock.advance(Duration::from_millis(1));
        assert!(!b.skips(0, &key(1)));
        b.expire();
        assert_eq!(b.remembered_keys(), 0);
    }

    #[test]
    fn repeated_failures_suspend_the_tier_and_double_the_backoff_up_to_the_cap() {
        let (mut b, clock) = backoff(16);
        for n in 0..3 {
            b.failed(0, &[key(n)], true, TierHealth::default());
        }
        assert!(b.suspended(0));
        assert!(b.skips(0, &key(99)));
        assert_eq!(
            b.interval(0),
            Duration::from_secs(1),
            "failures within one window do not double"
        );
        let mut expected = Duration::from_secs(1);
        for _ in 0..8 {
            clock.advance(expected);
            assert!(
                !b.skips(0, &key(99)),
                "the back-off expired: the tier is tried again"
            );
            b.failed(0, &[key(99)], true, TierHealth::default());
            expected = (expected * 2).min(Duration::from_secs(30));
            assert_eq!(b.interval(0), expected);
            assert!(b.skips(0, &key(100)));
        }
        assert_eq!(b.interval(0), Duration::from_secs(30));
        b.succeeded(0);
        assert!(!b.suspended(0));
        assert!(!b.skips(0, &key(100)));
        assert!(b.skips(0, &key(99)), "the key's own failure is still remembered");
    }

    #[test]
    fn a_recovery_forgets_the_tier() {
        let (mut b, _clock) = backoff(16);
        let down = TierHealth {
            healthy: false,
            recoveries: 4,
        };
        for n in 0..3 {
            b.failed(0, &[key(n)], true, down);
        }
        b.observe_health(0, down);
        assert!(b.skips(0, &key(7)));
        b.observe_health(
            0,
            TierHealth {
                healthy: true,
                recoveries: 4,
            },
        );
        assert!(!b.skips(0, &key(7)));
        assert!(!b.skips(0, &key(0)));
        assert!(b.is_idle());
        // A generation counter alone also counts.
        b.failed(1, &[key(1)], true, TierHealth::default());
        b.observe_health(
            1,
            TierHealth {
                healthy: true,
                recoveries: 1,
            },
        );
        assert!(!b.skips(1, &key(1)));
    }

    #[test]
    fn the_table_is_bounded_and_partial_failures_do_not_suspend() {
        let (mut b, _clock) = backoff(8);
        for n in 0..100 {
            b.failed(0, &[key(n)], false, TierHealth::default());
        }
        assert_eq!(b.remembered_keys(), 8);
        assert!(b.order.len() <= 16);
        assert!(!b.suspended(0));
        assert!(b.skips(0, &key(99)), "the newest entries are kept");
        assert!(!b.skips(0, &key(0)), "the oldest were dropped");
        b.clear();
        assert!(b.is_idle());
        assert_eq!(b.remembered_keys(), 0);
    }
}
