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
//! it answered). A question the engine does not look up again (declined, or the engine gave up
//! waiting) would never be answered, so the manager looks it up itself at the start of the next
//! steps until the tier answers ([`RetryWaits::take_rechecks`]): the tier stays measured
//! without any request waiting for it, and a tier whose answers turn into hits is waited for
//! again. A key this manager cascades to a tier is no longer a question: the tier has it
//! because of the cascade, which says nothing about waiting. Without a recompute cost nothing is tracked and every `Retry`
//! is passed on.

use std::time::{Duration, Instant};

use crate::key::{KeyMap, OffloadKey};
use crate::request::ReqContext;

/// Questions tracked at most; beyond it, those older than [`STALE_ASK`] are forgotten (a key
/// the engine never looks up again is never answered), and if that is not enough, all.
const MAX_ASKS: usize = 1 << 16;

/// A question older than this is no longer a sample of the tier's answer time.
const STALE_ASK: Duration = Duration::from_secs(10);

/// Declined questions the manager looks up again itself, at most: a few answers a step keep
/// the averages current, and the re-lookups cost the scheduler's time.
const MAX_RECHECKS: usize = 16;

/// A declined question the manager looks up again: tier, key and the request that asked.
pub(crate) type Recheck = (usize, OffloadKey, ReqContext);

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
    /// The longest a question has been seen unanswered (at a recheck) since the last answer:
    /// a lower bound on the answer time that needs no answer, so a tier too slow to be worth
    /// waiting for is known before its first answer comes back.
    unanswered_secs: f64,
    declined: u64,
    rechecks: u64,
}

impl Payoff {
    /// Whether waiting for an answer should pay: the expected saving (hit rate × recompute per
    /// chunk; an unmeasured tier is assumed to hit) against the expected answer time.
    fn worth_waiting(&self, per_chunk: Duration) -> bool {
        let (hit_rate, answer) = if self.samples == 0 {
            (1.0, self.unanswered_secs)
        } else {
            (self.hit_rate, self.answer_secs.max(self.unanswered_secs))
        };
        hit_rate * per_chunk.as_secs_f64() >= answer
    }
}

/// One tier's figures, for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RetryFigures {
    pub(crate) declined: u64,
    pub(crate) rechecks: u64,
    pub(crate) samples: u64,
    pub(crate) hit_rate: Option<f64>,
    pub(crate) answer_secs: Option<f64>,
}

/// The per-tier measurements and the questions being timed.
pub(crate) struct RetryWaits {
    payoffs: Vec<Payoff>,
    asks: KeyMap<Ask>,
    rechecks: Vec<Recheck>,
}

impl RetryWaits {
    pub(crate) fn new(tiers: usize) -> Self {
        Self {
            payoffs: vec![Payoff::default(); tiers],
            asks: KeyMap::default(),
            rechecks: Vec::new(),
        }
    }

    /// Tier `idx` answered `Retry` for `key` (asked by `ctx`): whether the engine should wait
    /// for the answer, given what recomputing a chunk costs (`per_chunk`).
    pub(crate) fn worth_waiting(
        &mut self,
        idx: usize,
        key: &OffloadKey,
        ctx: &ReqContext,
        per_chunk: Duration,
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
        if !self.asks.contains_key(key) {
            self.asks.insert(
                *key,
                Ask {
                    tier: idx,
                    since: now,
                },
            );
            // Looked up again by the manager unless the engine does it first: an engine that
            // gives up waiting (or is told not to wait) never would.
            if self.rechecks.len() < MAX_RECHECKS {
                self.rechecks.push((idx, *key, ctx.clone()));
            }
        }
        if p.worth_waiting(per_chunk) {
            return true;
        }
        p.declined += 1;
        false
    }

    /// The questions to look up again now: those the engine has not had answered meanwhile
    /// (the caller hands back, through [`RetryWaits::recheck_pending`], those the tier still
    /// cannot answer).
    pub(crate) fn take_rechecks(&mut self) -> Vec<Recheck> {
        let mut taken = std::mem::take(&mut self.rechecks);
        taken.retain(|(_, key, _)| self.asks.contains_key(key));
        for &(idx, ..) in &taken {
            if let Some(p) = self.payoffs.get_mut(idx) {
                p.rechecks += 1;
            }
        }
        taken
    }

    /// This manager stored `keys` in a tier: questions about them are no longer samples (the
    /// answer would say what this manager did, not whether waiting for the tier pays).
    pub(crate) fn stored(&mut self, keys: &[OffloadKey]) {
        if self.asks.is_empty() {
            return;
        }
        for k in keys {
            self.asks.remove(k);
        }
    }

    /// A re-looked-up question is still unanswered: look again next time, unless it is stale.
    pub(crate) fn recheck_pending(&mut self, recheck: Recheck, now: Instant) {
        let waited = self
            .asks
            .get(&recheck.1)
            .filter(|a| a.tier == recheck.0)
            .map(|a| now.saturating_duration_since(a.since));
        if let (Some(w), Some(p)) = (waited, self.payoffs.get_mut(recheck.0)) {
            p.unanswered_secs = p.unanswered_secs.max(w.as_secs_f64());
        }
        let live = waited.is_some_and(|w| w < STALE_ASK);
        if live && self.rechecks.len() < MAX_RECHECKS {
            self.rechecks.push(recheck);
        } else if !live {
            self.asks.remove(&recheck.1);
        }
    }

    /// Whether declined questions wait to be looked up again.
    pub(crate) fn has_rechecks(&self) -> bool {
        !self.rechecks.is_empty()
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
        p.unanswered_secs = 0.0;
        p.samples += 1;
    }

    /// Nothing is waited for any more (reset, or the recompute cost was removed).
    pub(crate) fn clear(&mut self) {
        self.asks.clear();
        self.rechecks.clear();
    }

    /// Tier `idx`'s figures.
    pub(crate) fn figures(&self, idx: usize) -> RetryFigures {
        self.payoffs
            .get(idx)
            .map_or_else(RetryFigures::default, |p| RetryFigures {
                declined: p.declined,
                rechecks: p.rechecks,
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

    fn key(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    fn ctx() -> ReqContext {
        ReqContext::local("r")
    }

    /// Asks and answers `n` keys of tier 0 from `first`.
    fn sample(w: &mut RetryWaits, first: u64, n: u64, hit: bool) {
        for k in first..first + n {
            // The verdict depends on the samples so far; only the timing matters here.
            let _ = w.worth_waiting(0, &key(k), &ctx(), PER_CHUNK, Instant::now());
            w.answered(0, &key(k), hit, 0.2);
        }
        w.rechecks.clear();
    }

    #[test]
    fn an_unmeasured_tier_is_waited_for() {
        let mut w = RetryWaits::new(1);
        assert!(w.worth_waiting(0, &key(1), &ctx(), PER_CHUNK, Instant::now()));
        assert_eq!(w.figures(0).samples, 0);
        // Queued for a recheck, which is skipped when the engine's own lookup got the answer.
        assert!(w.has_rechecks());
        w.answered(0, &key(1), false, 0.2);
        assert!(w.take_rechecks().is_empty());
        assert_eq!(w.figures(0).samples, 1);
    }

    #[test]
    fn a_question_unanswered_for_longer_than_recomputing_ends_the_waits_before_any_answer() {
        let mut w = RetryWaits::new(1);
        let t0 = Instant::now();
        assert!(w.worth_waiting(0, &key(1), &ctx(), PER_CHUNK, t0));
        // Still unanswered 50 µs later: the answer cannot pay for 100 µs of recompute yet.
        let r = w.take_rechecks().pop().unwrap();
        w.recheck_pending(r, t0 + Duration::from_micros(50));
        assert!(w.worth_waiting(0, &key(2), &ctx(), PER_CHUNK, t0));
        // 200 µs: longer than recomputing, whatever the answer will be.
        let r = w.take_rechecks().into_iter().find(|r| r.1 == key(1)).unwrap();
        w.recheck_pending(r, t0 + Duration::from_micros(200));
        assert!(!w.worth_waiting(0, &key(3), &ctx(), PER_CHUNK, t0));
        assert_eq!(w.figures(0).samples, 0);
    }

    #[test]
    fn a_key_this_manager_stored_is_no_longer_a_question() {
        let mut w = RetryWaits::new(1);
        assert!(w.worth_waiting(0, &key(1), &ctx(), PER_CHUNK, Instant::now()));
        w.stored(&[key(1)]);
        assert!(w.take_rechecks().is_empty());
        w.answered(0, &key(1), true, 0.2);
        assert_eq!(w.figures(0).samples, 0, "the cascade put it there");
    }

    #[test]
    fn a_tier_whose_answers_are_misses_is_not_waited_for_and_is_rechecked() {
        let mut w = RetryWaits::new(1);
        sample(&mut w, 0, 20, false);
        let f = w.figures(0);
        assert_eq!((f.samples, f.hit_rate), (20, Some(0.0)));
        assert!(!w.worth_waiting(0, &key(100), &ctx(), PER_CHUNK, Instant::now()));
        assert_eq!(w.figures(0).declined, f.declined + 1);
        // Nobody waits for the declined question: the manager looks it up again itself, until
        // the tier answers; the answer is a sample.
        let r = w.take_rechecks();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].0, r[0].1), (0, key(100)));
        w.recheck_pending(r.into_iter().next().unwrap(), Instant::now());
        let r = w.take_rechecks();
        assert_eq!(w.figures(0).rechecks, 2);
        assert_eq!(r.len(), 1, "still unanswered: looked up again");
        w.answered(0, &key(100), false, 0.2);
        assert_eq!(w.figures(0).samples, 21);
    }

    #[test]
    fn a_tier_whose_answers_turn_into_hits_is_waited_for_again() {
        let mut w = RetryWaits::new(1);
        sample(&mut w, 0, 5, false);
        assert!(!w.worth_waiting(0, &key(50), &ctx(), PER_CHUNK, Instant::now()));
        // The rechecks find hits (another engine of the fleet stored these chunks meanwhile).
        for k in 50..70 {
            let _ = w.worth_waiting(0, &key(k), &ctx(), PER_CHUNK, Instant::now());
            w.answered(0, &key(k), true, 0.2);
        }
        assert!(w.figures(0).hit_rate.unwrap() > 0.9);
        assert!(w.worth_waiting(0, &key(100), &ctx(), PER_CHUNK, Instant::now()));
    }

    #[test]
    fn a_tier_whose_answers_are_hits_is_waited_for_unless_recompute_is_cheaper() {
        let mut w = RetryWaits::new(1);
        // Answers come back at once (well under 100 µs of recompute) and are hits.
        sample(&mut w, 0, 20, true);
        assert_eq!(w.figures(0).hit_rate, Some(1.0));
        assert!(w.worth_waiting(0, &key(100), &ctx(), PER_CHUNK, Instant::now()));
        // With a recompute cost far below the answer time, even hits are not worth it.
        let f = w.figures(0);
        let tiny = Duration::from_secs_f64(f.answer_secs.unwrap() / 2.0);
        assert!(!w.worth_waiting(0, &key(101), &ctx(), tiny, Instant::now()));
    }

    #[test]
    fn stale_rechecks_are_dropped_and_everything_stays_bounded() {
        let mut w = RetryWaits::new(2);
        assert!(w.worth_waiting(0, &key(1), &ctx(), PER_CHUNK, Instant::now()));
        w.answered(1, &key(1), true, 0.2);
        assert_eq!(
            (w.figures(0).samples, w.figures(1).samples),
            (0, 0),
            "another tier's answer"
        );
        w.rechecks.clear();
        let now = Instant::now();
        for k in 0..100 {
            let _ = w.worth_waiting(0, &key(1000 + k), &ctx(), PER_CHUNK, now);
        }
        let r = w.take_rechecks();
        assert_eq!(r.len(), MAX_RECHECKS);
        let later = now + STALE_ASK;
        for c in r {
            w.recheck_pending(c, later);
        }
        assert!(!w.has_rechecks(), "stale questions are not looked up again");
        for k in 0..(MAX_ASKS as u64 + 10) {
            let _ = w.worth_waiting(0, &key(10_000 + k), &ctx(), PER_CHUNK, now);
        }
        assert!(w.asks.len() <= MAX_ASKS);
        assert!(w.rechecks.len() <= MAX_RECHECKS);
    }
}
