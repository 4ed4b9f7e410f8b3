//! Load-versus-recompute decisions (`docs/ARCHITECTURE.md`, "Cost model").
//!
//! A secondary hit is only worth promoting if the chunk lands sooner than the engine could
//! recompute it. The engine states its recompute cost once ([`RecomputeCost`]); the manager
//! measures each secondary tier itself, from the promotions it submits and sees finish, so a
//! tier needs to implement nothing for this. Without a recompute cost every hit is promoted and
//! nothing has a deadline, exactly as before this module existed.
//!
//! The model of one tier: a promotion submitted while `ahead` bytes of promotions are queued or
//! in flight on that tier finishes after `fixed + per_byte × (ahead + own)` seconds. Both
//! coefficients are an exponentially weighted least-squares fit over the tier's finished
//! promotions (submission to the moment the manager saw the result, so poll latency is in the
//! measurement, as the engine experiences it). While every sample has the same size the fit
//! cannot tell the fixed part from the per-byte part and charges everything per byte, which
//! errs on the side of declining when queues grow.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::job::JobId;
use crate::key::{KeyMap, OffloadKey};
use crate::stats::PromotionDecisions;

use super::retry_wait::RetryWaits;
use crate::request::ReqContext;

/// What recomputing KV data costs the engine: the model time per prompt token and the tokens
/// one chunk holds. The engine sets it once ([`ManagerConfig::cost`](super::ManagerConfig::cost)
/// or [`TieringManager::set_recompute_cost`](super::TieringManager::set_recompute_cost)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecomputeCost {
    per_token: Duration,
    tokens_per_chunk: u32,
}

impl RecomputeCost {
    /// `per_token` of prefill time for each of the `tokens_per_chunk` tokens of a chunk.
    #[must_use]
    pub fn new(per_token: Duration, tokens_per_chunk: u32) -> Self {
        Self {
            per_token,
            tokens_per_chunk,
        }
    }

    /// The prefill time per token.
    #[must_use]
    pub fn per_token(&self) -> Duration {
        self.per_token
    }

    /// Tokens per chunk.
    #[must_use]
    pub fn tokens_per_chunk(&self) -> u32 {
        self.tokens_per_chunk
    }

    /// What recomputing one chunk costs.
    #[must_use]
    pub fn per_chunk(&self) -> Duration {
        self.per_token.saturating_mul(self.tokens_per_chunk)
    }
}

/// How the manager weighs a promotion against recomputing (the `[cost]` section of a chain).
#[derive(Clone, Copy, Debug)]
pub struct CostConfig {
    /// The engine's recompute cost. `None` (the default) promotes every secondary hit, with no
    /// deadline.
    pub recompute: Option<RecomputeCost>,
    /// A promotion's deadline is its expected completion times this factor (at least 1).
    pub deadline_slack: f64,
    /// The shortest deadline: a promotion is never abandoned sooner than this after it was
    /// started (a lookup cannot come back faster than one engine step anyway).
    pub deadline_floor: Duration,
    /// Weight of a new sample in the tier's moving fit (0 < w ≤ 1).
    pub ema_weight: f64,
    /// A tier whose hits are all declined is no longer measured, so it could never be found
    /// to have recovered: once this long has passed since its last sample (or probe), one
    /// declined hit is promoted anyway as a probe; the lookup still answers `Miss` (nobody waits
    /// for a tier expected to be slow), and later lookups wait for it at most the recompute
    /// estimate × slack.
    /// Zero never probes.
    pub probe_interval: Duration,
}

impl Default for CostConfig {
    fn default() -> Self {
        Self {
            recompute: None,
            deadline_slack: 2.0,
            deadline_floor: Duration::from_millis(1),
            ema_weight: 0.2,
            probe_interval: Duration::from_secs(1),
        }
    }
}

// `f64` fields compare by bit pattern so `ManagerConfig` keeps `Eq`.
impl PartialEq for CostConfig {
    fn eq(&self, other: &Self) -> bool {
        self.recompute == other.recompute
            && self.deadline_slack.to_bits() == other.deadline_slack.to_bits()
            && self.deadline_floor == other.deadline_floor
            && self.ema_weight.to_bits() == other.ema_weight.to_bits()
            && self.probe_interval == other.probe_interval
    }
}

impl Eq for CostConfig {}

impl CostConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// The first setting out of range, described.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.deadline_slack.is_finite() && self.deadline_slack >= 1.0) {
            return Err(format!(
                "deadline_slack must be a number of at least 1, found {}",
                self.deadline_slack
            ));
        }
        if !(self.ema_weight > 0.0 && self.ema_weight <= 1.0) {
            return Err(format!("ema_weight must be in (0, 1], found {}", self.ema_weight));
        }
        if let Some(r) = self.recompute
            && r.tokens_per_chunk == 0
        {
            return Err("tokens_per_chunk must be at least 1".into());
        }
        Ok(())
    }
}

/// An exponentially weighted least-squares fit of `seconds = fixed + per_byte × bytes`.
#[derive(Clone, Copy, Debug, Default)]
struct LoadFit {
    samples: u64,
    mean_x: f64,
    mean_y: f64,
    mean_xx: f64,
    mean_xy: f64,
}

impl LoadFit {
    fn record(&mut self, bytes: f64, secs: f64, weight: f64) {
        let w = if self.samples == 0 { 1.0 } else { weight };
        let mix = |old: f64, new: f64| old + w * (new - old);
        self.mean_x = mix(self.mean_x, bytes);
        self.mean_y = mix(self.mean_y, secs);
        self.mean_xx = mix(self.mean_xx, bytes * bytes);
        self.mean_xy = mix(self.mean_xy, bytes * secs);
        self.samples += 1;
    }

    /// `(fixed seconds, seconds per byte)`, both non-negative; `None` before any sample.
    fn coefficients(&self) -> Option<(f64, f64)> {
        if self.samples == 0 {
            return None;
        }
        let through_origin = || {
            if self.mean_x > 0.0 {
                (0.0, self.mean_y / self.mean_x)
            } else {
                (self.mean_y, 0.0)
            }
        };
        let var = self.mean_xx - self.mean_x * self.mean_x;
        // Sizes that barely vary cannot separate the two parts (see the module docs).
        if var <= (0.05 * self.mean_x).powi(2) {
            return Some(through_origin());
        }
        let slope = (self.mean_xy - self.mean_x * self.mean_y) / var;
        if slope < 0.0 {
            return Some((self.mean_y.max(0.0), 0.0));
        }
        let intercept = self.mean_y - slope * self.mean_x;
        if intercept < 0.0 {
            return Some(through_origin());
        }
        Some((intercept, slope))
    }

    fn predict(&self, bytes: u64) -> Option<Duration> {
        let (fixed, per_byte) = self.coefficients()?;
        let secs = fixed + per_byte * bytes as f64;
        Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
    }
}

/// A submitted promotion being timed.
struct Timing {
    tier: usize,
    submitted: Instant,
    /// Bytes of this tier's promotions ahead of it plus its own.
    backlog: u64,
}

/// A started promotion and when the engine stops waiting for it.
struct Watch {
    tier: usize,
    deadline: Instant,
    abandoned: bool,
}

/// Per-tier counters of the decisions.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    started: u64,
    promoted: u64,
    declined_by_cost: u64,
    abandoned_by_deadline: u64,
    probes: u64,
    /// The last finished sample or started probe.
    last_measure: Option<Instant>,
}

/// What the lookup should do with a secondary hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Promote; the engine stops waiting at `deadline` (none without a recompute cost).
    Promote(Option<Instant>),
    /// Promote to re-measure a tier whose hits have been declined for a while, but answer
    /// `Miss` (the engine recomputes rather than wait for a tier expected to be slow); the chunk
    /// lands for later requests, which wait for it no longer than `deadline`.
    Probe(Instant),
    /// Answer `Miss`: recomputing is cheaper.
    Decline,
}

/// The cost model and the decision state (see the module docs).
pub(crate) struct CostModel {
    config: CostConfig,
    fits: Vec<LoadFit>,
    counts: Vec<Counts>,
    timings: HashMap<JobId, Timing>,
    watches: KeyMap<Watch>,
    retries: RetryWaits,
}

impl CostModel {
    pub(crate) fn new(config: CostConfig, tiers: usize) -> Self {
        Self {
            config,
            fits: vec![LoadFit::default(); tiers],
            counts: vec![Counts::default(); tiers],
            timings: HashMap::new(),
            watches: KeyMap::default(),
            retries: RetryWaits::new(tiers),
        }
    }

    pub(crate) fn set_recompute(&mut self, recompute: Option<RecomputeCost>) {
        self.config.recompute = recompute;
        if recompute.is_none() {
            // Today's behaviour again: nothing has a deadline, every `Retry` is waited for.
            self.watches.clear();
            self.retries.clear();
        }
    }

    pub(crate) fn recompute(&self) -> Option<RecomputeCost> {
        self.config.recompute
    }

    /// Decides on a secondary hit of tier `idx`: `backlog` is the bytes of the tier's
    /// promotions queued or in flight plus this chunk's, `reserved` the chunks this request
    /// already reserved on the tier this step (the request saves their recompute too).
    pub(crate) fn decide(&mut self, idx: usize, backlog: u64, reserved: usize, now: Instant) -> Verdict {
        let Some(recompute) = self.config.recompute else {
            return Verdict::Promote(None);
        };
        let chunks = u32::try_from(reserved.saturating_add(1)).unwrap_or(u32::MAX);
        let budget = recompute.per_chunk().saturating_mul(chunks);
        let expected = self.fits.get(idx).and_then(|f| f.predict(backlog));
        let (slack, floor) = (self.config.deadline_slack, self.config.deadline_floor);
        let deadline = |wait: Duration| now + wait.mul_f64(slack).max(floor);
        if expected.is_some_and(|e| e > budget) {
            let probe_interval = self.config.probe_interval;
            let Some(c) = self.counts.get_mut(idx) else {
                return Verdict::Decline;
            };
            let stale = !probe_interval.is_zero()
                && c.last_measure
                    .is_none_or(|t| now.saturating_duration_since(t) >= probe_interval);
            if !stale {
                c.declined_by_cost += 1;
                return Verdict::Decline;
            }
            // A probe: promoted to re-measure the tier, but the engine that asked does not
            // wait for it (it recomputes); a later request waits no longer than recomputing.
            c.probes += 1;
            c.last_measure = Some(now);
            return Verdict::Probe(deadline(budget));
        }
        // Nothing measured yet: allow the promotion, bounded by what recomputing would cost.
        Verdict::Promote(Some(deadline(expected.unwrap_or(budget))))
    }

    /// Tier `idx` answered `Retry` for `key` (asked by `ctx`): whether the engine should wait
    /// for the answer (`super::retry_wait`); always without a recompute cost.
    pub(crate) fn retry_worth_waiting(&mut self, idx: usize, key: &OffloadKey, ctx: &ReqContext) -> bool {
        let Some(recompute) = self.config.recompute else {
            return true;
        };
        self.retries
            .worth_waiting(idx, key, ctx, recompute.per_chunk(), Instant::now())
    }

    /// The `Retry` questions being timed (rechecks, cascaded keys; `super::retry_wait`).
    pub(crate) fn retries(&mut self) -> &mut RetryWaits {
        &mut self.retries
    }

    /// Tier `idx` answered `key` with a hit or a miss (a sample when the key was waiting on it).
    pub(crate) fn answered(&mut self, idx: usize, key: &OffloadKey, hit: bool) {
        self.retries.answered(idx, key, hit, self.config.ema_weight);
    }

    /// A promotion of `key` from tier `idx` was reserved.
    pub(crate) fn started(&mut self, idx: usize, key: OffloadKey, deadline: Option<Instant>) {
        if let Some(c) = self.counts.get_mut(idx) {
            c.started += 1;
        }
        if let Some(deadline) = deadline {
            self.watches.insert(
                key,
                Watch {
                    tier: idx,
                    deadline,
                    abandoned: false,
                },
            );
        }
    }

    /// The primary answered `HitPending` for `key`: whether the engine should stop waiting
    /// (the key's promotion is past its deadline). Counted once per promotion.
    pub(crate) fn past_deadline(&mut self, key: &OffloadKey, now: Instant) -> bool {
        let Some(w) = self.watches.get_mut(key) else {
            return false;
        };
        if now < w.deadline {
            return false;
        }
        if !w.abandoned {
            w.abandoned = true;
            if let Some(c) = self.counts.get_mut(w.tier) {
                c.abandoned_by_deadline += 1;
            }
        }
        true
    }

    /// A promotion job was submitted to tier `idx`; `backlog` includes its own bytes.
    pub(crate) fn submitted(&mut self, id: JobId, idx: usize, backlog: u64, now: Instant) {
        self.timings.insert(
            id,
            Timing {
                tier: idx,
                submitted: now,
                backlog,
            },
        );
    }

    /// A promotion job finished (`promoted` of its keys landed); its keys are no longer
    /// watched, and a successful one is a sample of its tier's cost.
    pub(crate) fn finished(&mut self, id: JobId, keys: &[OffloadKey], promoted: usize, now: Instant) {
        self.forget(keys);
        let Some(t) = self.timings.remove(&id) else {
            return;
        };
        if let Some(c) = self.counts.get_mut(t.tier) {
            c.promoted += promoted as u64;
        }
        if promoted > 0
            && let Some(fit) = self.fits.get_mut(t.tier)
        {
            let secs = now.saturating_duration_since(t.submitted).as_secs_f64();
            fit.record(t.backlog as f64, secs, self.config.ema_weight);
            if let Some(c) = self.counts.get_mut(t.tier) {
                c.last_measure = Some(now);
            }
        }
    }

    /// A promotion job ended without a result (its tier left the chain).
    pub(crate) fn dropped(&mut self, id: JobId, keys: &[OffloadKey]) {
        self.forget(keys);
        self.timings.remove(&id);
    }

    /// Keys whose promotion ended or was never submitted.
    pub(crate) fn forget(&mut self, keys: &[OffloadKey]) {
        if self.watches.is_empty() {
            return;
        }
        for k in keys {
            self.watches.remove(k);
        }
    }

    /// Everything in flight is gone (reset).
    pub(crate) fn clear_watches(&mut self) {
        self.watches.clear();
        self.retries.clear();
    }

    /// Per-tier decision counters and the fitted model, named in chain order.
    pub(crate) fn stats(&self, names: impl Iterator<Item = String>) -> Vec<PromotionDecisions> {
        names
            .zip(self.counts.iter().zip(&self.fits))
            .enumerate()
            .map(|(idx, (name, (c, f)))| {
                let coef = f.coefficients();
                let r = self.retries.figures(idx);
                PromotionDecisions {
                    name,
                    started: c.started,
                    promoted: c.promoted,
                    declined_by_cost: c.declined_by_cost,
                    abandoned_by_deadline: c.abandoned_by_deadline,
                    probes: c.probes,
                    samples: f.samples,
                    load_fixed_secs: coef.map(|(fixed, _)| fixed),
                    load_secs_per_mib: coef.map(|(_, per_byte)| per_byte * f64::from(1u32 << 20)),
                    retries_declined_by_cost: r.declined,
                    retry_rechecks: r.rechecks,
                    retry_samples: r.samples,
                    retry_hit_rate: r.hit_rate,
                    retry_answer_secs: r.answer_secs,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 16 << 10;

    fn model(per_token_us: u64) -> CostModel {
        CostModel::new(
            CostConfig {
                recompute: Some(RecomputeCost::new(Duration::from_micros(per_token_us), 16)),
                probe_interval: Duration::ZERO,
                ..CostConfig::default()
            },
            1,
        )
    }

    #[test]
    fn without_a_recompute_cost_everything_is_promoted_with_no_deadline() {
        let mut m = CostModel::new(CostConfig::default(), 1);
        let now = Instant::now();
        m.submitted(JobId(1), 0, CHUNK, now);
        m.finished(JobId(1), &[], 1, now + Duration::from_secs(5));
        assert_eq!(m.decide(0, CHUNK, 0, now), Verdict::Promote(None));
    }

    #[test]
    fn an_unmeasured_tier_is_promoted_with_the_recompute_budget_as_deadline() {
        let mut m = model(100); // 1.6 ms per chunk
        let now = Instant::now();
        assert_eq!(
            m.decide(0, CHUNK, 0, now),
            Verdict::Promote(Some(now + Duration::from_micros(3200)))
        );
    }

    #[test]
    fn a_slow_tier_is_declined_and_a_fast_one_promoted() {
        let now = Instant::now();
        let mut slow = model(1); // 16 µs per chunk
        slow.submitted(JobId(1), 0, CHUNK, now);
        slow.finished(JobId(1), &[], 1, now + Duration::from_millis(2));
        assert_eq!(slow.decide(0, CHUNK, 0, now), Verdict::Decline);
        let mut fast = model(1000); // 16 ms per chunk
        fast.submitted(JobId(1), 0, CHUNK, now);
        fast.finished(JobId(1), &[], 1, now + Duration::from_millis(2));
        let Verdict::Promote(Some(deadline)) = fast.decide(0, CHUNK, 0, now) else {
            panic!("a 2 ms load beats 16 ms of recompute");
        };
        // 2 ms expected × slack 2.
        assert_eq!(deadline, now + Duration::from_millis(4));
        // The request's other reserved chunks raise the budget; a deep queue raises the cost.
        assert_eq!(fast.decide(0, 100 * CHUNK, 0, now), Verdict::Decline);
        assert!(matches!(
            fast.decide(0, 100 * CHUNK, 99, now),
            Verdict::Promote(Some(_))
        ));
    }

    #[test]
    fn a_tier_declined_for_a_while_is_probed_once_per_interval() {
        let mut m = model(1);
        m.config.probe_interval = Duration::from_secs(1);
        let now = Instant::now();
        m.submitted(JobId(1), 0, CHUNK, now);
        m.finished(JobId(1), &[], 1, now + Duration::from_millis(2));
        let soon = now + Duration::from_millis(500);
        assert_eq!(m.decide(0, CHUNK, 0, soon), Verdict::Decline);
        // A second after the last sample: one probe, deadline from the recompute estimate
        // (2 × 16 µs, so the 1 ms floor).
        let later = now + Duration::from_millis(1002);
        assert_eq!(
            m.decide(0, CHUNK, 0, later),
            Verdict::Probe(later + Duration::from_millis(1))
        );
        assert_eq!(
            m.decide(0, CHUNK, 0, later),
            Verdict::Decline,
            "one probe per interval"
        );
        let s = m.stats(std::iter::once("t".to_owned()));
        assert_eq!((s[0].probes, s[0].declined_by_cost), (1, 2));
    }

    #[test]
    fn the_fit_separates_a_fixed_latency_from_the_per_byte_cost() {
        let mut f = LoadFit::default();
        // 1 ms fixed + 1 µs per KiB, over varied sizes.
        for kib in [16u64, 64, 16, 256, 32, 128, 16, 512] {
            let secs = 1e-3 + 1e-6 * kib as f64;
            f.record((kib << 10) as f64, secs, 0.2);
        }
        let (fixed, per_byte) = f.coefficients().unwrap();
        assert!((fixed - 1e-3).abs() < 1e-6, "{fixed}");
        assert!((per_byte * 1024.0 - 1e-6).abs() < 1e-9, "{per_byte}");
        // One size only: everything is charged per byte.
        let mut g = LoadFit::default();
        g.record(CHUNK as f64, 1e-3, 0.2);
        g.record(CHUNK as f64, 1e-3, 0.2);
        assert_eq!(g.coefficients(), Some((0.0, 1e-3 / CHUNK as f64)));
    }

    #[test]
    fn a_watch_is_abandoned_once_at_its_deadline_and_forgotten_when_it_lands() {
        let mut m = model(1);
        let now = Instant::now();
        let key = OffloadKey::from_u64(7);
        m.started(0, key, Some(now + Duration::from_millis(1)));
        assert!(!m.past_deadline(&key, now));
        assert!(m.past_deadline(&key, now + Duration::from_millis(1)));
        assert!(m.past_deadline(&key, now + Duration::from_millis(2)));
        let s = m.stats(std::iter::once("t".to_owned()));
        assert_eq!((s[0].started, s[0].abandoned_by_deadline), (1, 1));
        m.submitted(JobId(3), 0, CHUNK, now);
        m.finished(JobId(3), &[key], 1, now + Duration::from_millis(3));
        assert!(!m.past_deadline(&key, now + Duration::from_millis(4)));
        assert_eq!(m.stats(std::iter::once("t".to_owned()))[0].promoted, 1);
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let bad = CostConfig {
            deadline_slack: 0.5,
            ..CostConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("deadline_slack"));
        let bad = CostConfig {
            ema_weight: 0.0,
            ..CostConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("ema_weight"));
        let bad = CostConfig {
            recompute: Some(RecomputeCost::new(Duration::from_micros(1), 0)),
            ..CostConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("tokens_per_chunk"));
        assert!(CostConfig::default().validate().is_ok());
    }
}
