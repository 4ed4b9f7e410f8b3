//! The presence cache behind `lookup`: answers the scheduler from memory, queues unknown keys
//! for one pipelined `EXISTS` batch, and remembers answers for a short time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tiering_core::{KeyMap, LookupResult, OffloadKey};

/// Entries kept before stale answers are pruned.
const PRUNE_ABOVE: usize = 1 << 16;

/// Entries kept at most: above it, fresh answers are dropped too (their keys are asked again).
/// Fresh answers are bounded by the lookup rate times the ttl; dropping them sooner livelocks a
/// scheduler that looks up more distinct keys per step than the cache keeps: every answer is
/// discarded before the lookup that would read it, which asks again and gets `Retry`.
const HARD_LIMIT: usize = 1 << 21;

#[derive(Clone, Copy, Debug)]
enum State {
    /// Queued or being asked since then.
    Pending(Instant),
    /// On the server as of then.
    Present(Instant),
    /// Not on the server (or the server did not answer) as of then.
    Absent(Instant),
}

/// What a lookup found in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// A fresh answer (`Hit` or `Miss`).
    Known(LookupResult),
    /// Asked, not answered yet.
    Pending,
    /// Asked too long ago without an answer: treat as a miss.
    TimedOut,
    /// Not known: now queued for the next batch.
    Queued,
}

/// Known presence of keys on the server, and the keys waiting to be asked.
pub(crate) struct Presence {
    entries: KeyMap<State>,
    batch: Vec<OffloadKey>,
    /// Entries in `Pending` state.
    pending: usize,
    ttl: Duration,
    timeout: Duration,
}

impl Presence {
    /// Answers live `ttl`; a question unanswered after `timeout` is a miss.
    pub(crate) fn new(ttl: Duration, timeout: Duration) -> Self {
        Self {
            entries: HashMap::default(),
            batch: Vec::new(),
            pending: 0,
            ttl,
            timeout,
        }
    }

    /// The cached answer for `key`, queuing it for the server when there is none.
    pub(crate) fn lookup(&mut self, key: &OffloadKey, now: Instant) -> Answer {
        match self.entries.get(key) {
            Some(State::Present(at)) if now.duration_since(*at) < self.ttl => {
                return Answer::Known(LookupResult::Hit);
            }
            Some(State::Absent(at)) if now.duration_since(*at) < self.ttl => {
                return Answer::Known(LookupResult::Miss);
            }
            Some(State::Pending(since)) => {
                return if now.duration_since(*since) < self.timeout {
                    Answer::Pending
                } else {
                    // Forget the question: the next lookup after the server answers (or a
                    // fresh one) asks again.
                    self.entries.insert(*key, State::Absent(now));
                    self.pending -= 1;
                    Answer::TimedOut
                };
            }
            _ => {}
        }
        self.entries.insert(*key, State::Pending(now));
        self.pending += 1;
        self.batch.push(*key);
        Answer::Queued
    }

    /// Keys waiting to be asked.
    pub(crate) fn batch_len(&self) -> usize {
        self.batch.len()
    }

    /// Takes the keys waiting to be asked.
    pub(crate) fn take_batch(&mut self) -> Vec<OffloadKey> {
        self.prune();
        std::mem::take(&mut self.batch)
    }

    /// Whether any question is outstanding.
    pub(crate) fn has_pending(&self) -> bool {
        self.pending > 0
    }

    /// Records the server's answer (or, with `present = false`, a failure to ask).
    pub(crate) fn set(&mut self, key: OffloadKey, present: bool, now: Instant) {
        let state = if present {
            State::Present(now)
        } else {
            State::Absent(now)
        };
        if let Some(State::Pending(_)) = self.entries.insert(key, state) {
            self.pending -= 1;
        }
    }

    /// Forgets a cached `Hit` for `key` (its load failed); returns whether there was one. Other
    /// states stay: a known absence is still true, a pending question is still asked.
    pub(crate) fn invalidate(&mut self, key: &OffloadKey) -> bool {
        if let Some(State::Present(_)) = self.entries.get(key) {
            self.entries.remove(key);
            true
        } else {
            false
        }
    }

    /// Forgets every answer (after an invalidation or `reset`).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.batch.clear();
        self.pending = 0;
    }

    fn prune(&mut self) {
        if self.entries.len() <= PRUNE_ABOVE {
            return;
        }
        let now = Instant::now();
        let ttl = self.ttl;
        self.entries.retain(|_, s| match s {
            State::Pending(_) => true,
            State::Present(at) | State::Absent(at) => now.duration_since(*at) < ttl,
        });
        if self.entries.len() > HARD_LIMIT {
            self.entries.retain(|_, s| matches!(s, State::Pending(_)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_queued_once_then_answered_until_stale() {
        let mut p = Presence::new(Duration::from_secs(2), Duration::from_secs(1));
        let t0 = Instant::now();
        let k = OffloadKey::from_u64(1);
        assert_eq!(p.lookup(&k, t0), Answer::Queued);
        assert_eq!(p.lookup(&k, t0), Answer::Pending);
        assert_eq!(p.take_batch(), vec![k]);
        assert!(p.has_pending());
        p.set(k, true, t0);
        assert!(!p.has_pending());
        assert_eq!(
            p.lookup(&k, t0 + Duration::from_secs(1)),
            Answer::Known(LookupResult::Hit)
        );
        // Stale: asked again.
        assert_eq!(p.lookup(&k, t0 + Duration::from_secs(3)), Answer::Queued);
        p.set(k, false, t0 + Duration::from_secs(3));
        assert_eq!(
            p.lookup(&k, t0 + Duration::from_secs(4)),
            Answer::Known(LookupResult::Miss)
        );
    }

    #[test]
    fn invalidating_drops_only_a_cached_hit() {
        let mut p = Presence::new(Duration::from_secs(60), Duration::from_secs(1));
        let t0 = Instant::now();
        let (hit, absent, asked) = (
            OffloadKey::from_u64(1),
            OffloadKey::from_u64(2),
            OffloadKey::from_u64(3),
        );
        p.set(hit, true, t0);
        p.set(absent, false, t0);
        assert_eq!(p.lookup(&asked, t0), Answer::Queued);
        assert!(p.invalidate(&hit));
        assert!(!p.invalidate(&absent));
        assert!(!p.invalidate(&asked));
        assert_eq!(p.lookup(&hit, t0), Answer::Queued, "asked again");
        assert_eq!(p.lookup(&absent, t0), Answer::Known(LookupResult::Miss));
        assert_eq!(p.lookup(&asked, t0), Answer::Pending);
    }

    #[test]
    fn an_unanswered_question_times_out_into_a_miss() {
        let mut p = Presence::new(Duration::from_secs(2), Duration::from_millis(100));
        let t0 = Instant::now();
        let k = OffloadKey::from_u64(1);
        assert_eq!(p.lookup(&k, t0), Answer::Queued);
        assert_eq!(p.lookup(&k, t0 + Duration::from_millis(150)), Answer::TimedOut);
        assert_eq!(
            p.lookup(&k, t0 + Duration::from_millis(160)),
            Answer::Known(LookupResult::Miss)
        );
    }

    #[test]
    fn fresh_answers_outlive_a_prune_so_a_large_scan_of_keys_gets_them() {
        let mut p = Presence::new(Duration::from_secs(2), Duration::from_secs(1));
        let t0 = Instant::now();
        let n = PRUNE_ABOVE as u64 + 1000;
        for i in 0..n {
            assert_eq!(p.lookup(&OffloadKey::from_u64(i), t0), Answer::Queued);
        }
        let asked = p.take_batch();
        assert_eq!(asked.len() as u64, n);
        for k in asked {
            p.set(k, false, t0);
        }
        // The next batch prunes: fresh answers must stay, or every key is asked again forever.
        assert_eq!(p.lookup(&OffloadKey::from_u64(n), t0), Answer::Queued);
        assert_eq!(p.take_batch().len(), 1);
        for i in 0..n {
            assert_eq!(
                p.lookup(&OffloadKey::from_u64(i), t0),
                Answer::Known(LookupResult::Miss)
            );
        }
    }
}
