//! Whether a secondary tier's `Retry` is worth the engine's wait (`docs/ARCHITECTURE.md`,
//! "Cost model").
//!
//! A tier that cannot answer a lookup from memory (a Redis tier asking the server whether a
//! key exists, a peer tier asking its peers) answers `Retry`, and the engine defers the
//! request until the answer is in. That wait pays off only as often as the answer is a hit:
//! on a workload with no reuse every wait is lost time. With a recompute cost set, the manager
//! measures, per tier, how long its answers take (from the first `Retry` for a key to the
//! lookup that gets a `Hit` or `Miss` for it) and how often they are hits, and passes a
//! `Retry` on only while `hit rate × recompute per chunk ≥ answer time`; otherwise the lookup
//! answers `Miss` and the engine recomputes. The tier still asks (it queued the question when
//! it answered), so a later lookup of the key finds the answer. A tier whose waits are
//! declined is not measured any more, so once per probe interval one `Retry` is passed on to
//! measure it again. Without a recompute cost nothing is tracked and every `Retry` is passed on.

use std::time::{Duration, Instant};

use crate::key::{KeyMap, OffloadKey};

/// Questions tracked at most; beyond it, those older than [`STALE_ASK`] are forgotten (a key
/// the engine never looks up again is never answered), and if that is not enough, all.
const MAX_ASKS: usize = 1 << 16;

/// A question older than this is no longer a sample of the tier's answer time.
const STALE_ASK: Duration = Duration::from_secs(10);

/// A tier answered `Retry` for a key: since when the engine waits for it.
struct Ask {
    tier: usize,
    since: Instant,
}

/// What waiting on one tier's `Retry` has brought: moving averages over answered questions.
#[derive(Clone, Copy, Debug, Default)]
struct Payoff {
    samples: u64,
    hit_rate: f64,
    answer_secs: f64,
    declined: u64,
    probes: u64,
    /// The last answered question or started probe.
    last_measure: Option<Instant>,
}

/// One tier's figures, for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RetryFigures {
    pub(crate) declined: u64,
    pub(crate) probes: u64,
    pub(crate) samples: u64,
    pub(crate) hit_rate: Option<f64>,
    pub(crate) answer_secs: Option<f64>,
}

/// The per-tier measurements and the questions being timed.
pub(crate) struct RetryWaits {
    payoffs: Vec<Payoff>,
    asks: KeyMap<Ask>,
}

impl RetryWaits {
    pub(crate) fn new(tiers: usize) -> Self {
        Self {
            payoffs: vec![Payoff::default(); tiers],
            asks: KeyMap::default(),
        }
    }

    /// Tier `idx` answered `Retry` for `key`: whether the engine should wait for the answer,
    /// given what recomputing a chunk costs (`per_chunk`). `ema_weight` weighs a new sample,
    /// `probe_interval` spaces the waits passed on to re-measure a declined tier (zero: never).
    pub(crate) fn worth_waiting(
        &mut self,
        idx: usize,
        key: &OffloadKey,
        per_chunk: Duration,
        probe_interval: Duration,
        now: Instant,
    ) -> bool {
        let Some(p) = self.payoffs.get_mut(idx) else {
            return true;
        };
        if self.asks.len() >= MAX_ASKS && !self.asks.contains_key(key) {
            self.asks
                .retain(|_, a| now.saturating_duration_since(a.since) < STALE_ASK);
            if self.asks.len() >= MAX_ASKS {
                self.asks.clear();
            }
        }
        self.asks.entry(*key).or_insert(Ask {
            tier: idx,
            since: now,
        });
        if p.samples == 0 || p.hit_rate * per_chunk.as_secs_f64() >= p.answer_secs {
            return true;
        }
        let stale = !probe_interval.is_zero()
            && p.last_measure
                .is_none_or(|t| now.saturating_duration_since(t) >= probe_interval);
        if stale {
            p.probes += 1;
            p.last_measure = Some(now);
            return true;
        }
        p.declined += 1;
        false
    }

    /// Tier `idx` answered `key` (`hit` or not): a sample when the key was waiting on it.
    pub(crate) fn answered(&mut self, idx: usize, key: &OffloadKey, hit: bool, ema_weight: f64) {
        if self.asks.is_empty() {
            return;
        }
        let Some(ask) = self.asks.remove(key) else {
            return;
        };
        let Some(p) = self.payoffs.get_mut(idx).filter(|_| ask.tier == idx) else {
            return;
        };
        let now = Instant::now();
        let secs = now.saturating_duration_since(ask.since).as_secs_f64();
        let w = if p.samples == 0 { 1.0 } else { ema_weight };
        p.hit_rate += w * (f64::from(u8::from(hit)) - p.hit_rate);
        p.answer_secs += w * (secs - p.answer_secs);
        p.samples += 1;
        p.last_measure = Some(now);
    }

    /// Nothing is waited for any more (reset, or the recompute cost was removed).
    pub(crate) fn clear(&mut self) {
        self.asks.clear();
    }

    /// Tier `idx`'s figures.
    pub(crate) fn figures(&self, idx: usize) -> RetryFigures {
        self.payoffs
            .get(idx)
            .map_or_else(RetryFigures::default, |p| RetryFigures {
                declined: p.declined,
                probes: p.probes,
                samples: p.samples,
                hit_rate: (p.samples > 0).then_some(p.hit_rate),
                answer_secs: (p.samples > 0).then_some(p.answer_secs),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PER_CHUNK: Duration = Duration::from_micros(100);
    const NO_PROBE: Duration = Duration::ZERO;

    fn key(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    /// Asks and answers `n` keys of tier 0 from `first`, each answer `after` the question.
    fn sample(w: &mut RetryWaits, first: u64, n: u64, hit: bool) {
        for k in first..first + n {
            // The verdict depends on the samples so far; only the timing matters here.
            let _ = w.worth_waiting(0, &key(k), PER_CHUNK, NO_PROBE, Instant::now());
            w.answered(0, &key(k), hit, 0.2);
        }
    }

    #[test]
    fn an_unmeasured_tier_is_waited_for() {
        let mut w = RetryWaits::new(1);
        assert!(w.worth_waiting(0, &key(1), PER_CHUNK, NO_PROBE, Instant::now()));
        assert_eq!(w.figures(0).samples, 0);
    }

    #[test]
    fn a_tier_whose_answers_are_misses_is_not_waited_for() {
        let mut w = RetryWaits::new(1);
        sample(&mut w, 0, 20, false);
        let f = w.figures(0);
        assert_eq!((f.samples, f.hit_rate), (20, Some(0.0)));
        let declined = f.declined;
        assert!(!w.worth_waiting(0, &key(100), PER_CHUNK, NO_PROBE, Instant::now()));
        assert_eq!(w.figures(0).declined, declined + 1);
        // The question is still timed: its answer is a sample.
        w.answered(0, &key(100), false, 0.2);
        assert_eq!(w.figures(0).samples, 21);
    }

    #[test]
    fn a_tier_whose_answers_are_hits_is_waited_for() {
        let mut w = RetryWaits::new(1);
        // Answers come back at once (well under 100 µs of recompute) and are hits.
        sample(&mut w, 0, 20, true);
        assert_eq!(w.figures(0).hit_rate, Some(1.0));
        assert!(w.worth_waiting(0, &key(100), PER_CHUNK, NO_PROBE, Instant::now()));
        // With a recompute cost far below the answer time, even hits are not worth it.
        let f = w.figures(0);
        let tiny = Duration::from_secs_f64(f.answer_secs.unwrap() / 2.0);
        assert!(!w.worth_waiting(0, &key(101), tiny, NO_PROBE, Instant::now()));
    }

    #[test]
    fn a_declined_tier_is_probed_once_per_interval() {
        let mut w = RetryWaits::new(1);
        sample(&mut w, 0, 5, false);
        let before = w.figures(0);
        let t = Instant::now() + Duration::from_secs(2);
        let interval = Duration::from_secs(1);
        assert!(w.worth_waiting(0, &key(50), PER_CHUNK, interval, t), "a probe");
        assert!(
            !w.worth_waiting(0, &key(51), PER_CHUNK, interval, t),
            "one per interval"
        );
        let f = w.figures(0);
        assert_eq!((f.probes, f.declined), (before.probes + 1, before.declined + 1));
    }

    #[test]
    fn an_answer_from_another_tier_is_not_a_sample_and_questions_stay_bounded() {
        let mut w = RetryWaits::new(2);
        assert!(w.worth_waiting(0, &key(1), PER_CHUNK, NO_PROBE, Instant::now()));
        w.answered(1, &key(1), true, 0.2);
        assert_eq!((w.figures(0).samples, w.figures(1).samples), (0, 0));
        let now = Instant::now();
        for k in 0..(MAX_ASKS as u64 + 10) {
            w.worth_waiting(1, &key(k), PER_CHUNK, NO_PROBE, now);
        }
        assert!(w.asks.len() <= MAX_ASKS);
    }
}
