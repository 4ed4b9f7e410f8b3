//! Backpressure: a tier whose stores have become slow stops receiving cascades until it
//! recovers; promotions are never dropped.
//!
//! Every successful cascade job is a sample of its tier's [`BackpressureDetector`], in seconds
//! per MiB moved: the submission-to-completion time the tier reports with the result (queueing
//! in the tier included), or the manager's own submission-to-result time when the tier reports
//! none. The detector keeps an
//! exponential moving average (`alpha`); after `warmup` samples, an average above
//! `high_water_per_mib` turns pressure on and one below `low_water_per_mib` turns it off (the gap
//! keeps it from flapping). While the tier is under pressure, one cascade is still let through
//! every `probe_interval` (one probe in flight at most): without it no job would complete, the
//! average could never fall, and a tier that recovered would stay cut off.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The settings of one tier's backpressure. The defaults follow vLLM's (α 0.3, high 1 s and
/// low 0.5 s per MiB, three warm-up samples) plus a probe every 200 ms.
#[derive(Clone, Debug, PartialEq)]
pub struct BackpressureConfig {
    /// Whether cascades to the tier are ever dropped.
    pub enabled: bool,
    /// Weight of the newest sample, in (0, 1].
    pub alpha: f64,
    /// Average store time per MiB above which pressure turns on.
    pub high_water_per_mib: Duration,
    /// Average store time per MiB below which pressure turns off (at most the high water).
    pub low_water_per_mib: Duration,
    /// Samples before the detector may change state.
    pub warmup: u32,
    /// Under pressure, one cascade is let through this often to measure the tier again.
    pub probe_interval: Duration,
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            alpha: 0.3,
            high_water_per_mib: Duration::from_secs(1),
            low_water_per_mib: Duration::from_millis(500),
            warmup: 3,
            probe_interval: Duration::from_millis(200),
        }
    }
}

impl BackpressureConfig {
    /// Backpressure switched off: cascades are never dropped.
    #[must_use]
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Checks the settings; the message names the offending key in backquotes.
    ///
    /// # Errors
    /// `alpha` outside (0, 1], a low water above the high water, or a zero probe interval.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.alpha > 0.0 && self.alpha <= 1.0) {
            return Err(format!("`alpha` must be in (0, 1], found {}", self.alpha));
        }
        if self.low_water_per_mib > self.high_water_per_mib {
            return Err(format!(
                "`low_water_per_mib` ({:?}) must not exceed `high_water_per_mib` ({:?})",
                self.low_water_per_mib, self.high_water_per_mib
            ));
        }
        if self.probe_interval.is_zero() {
            return Err("`probe_interval` must be above zero".into());
        }
        Ok(())
    }
}

/// The store-latency average of one tier and whether it is under pressure.
#[derive(Clone, Debug)]
pub struct BackpressureDetector {
    config: BackpressureConfig,
    ema: Option<f64>,
    samples: u64,
    pressured: bool,
}

impl BackpressureDetector {
    /// A detector with no samples.
    #[must_use]
    pub fn new(config: BackpressureConfig) -> Self {
        Self {
            config,
            ema: None,
            samples: 0,
            pressured: false,
        }
    }

    /// Records a store that took `seconds_per_mib`; returns the new pressure state if it
    /// changed.
    pub fn record(&mut self, seconds_per_mib: f64) -> Option<bool> {
        if !seconds_per_mib.is_finite() || seconds_per_mib < 0.0 {
            return None;
        }
        let a = self.config.alpha;
        let ema = self
            .ema
            .map_or(seconds_per_mib, |e| a * seconds_per_mib + (1.0 - a) * e);
        self.ema = Some(ema);
        self.samples += 1;
        if !self.config.enabled || self.samples < u64::from(self.config.warmup) {
            return None;
        }
        let was = self.pressured;
        if !was && ema > self.config.high_water_per_mib.as_secs_f64() {
            self.pressured = true;
        } else if was && ema < self.config.low_water_per_mib.as_secs_f64() {
            self.pressured = false;
        }
        (was != self.pressured).then_some(self.pressured)
    }

    /// Whether cascades should be dropped.
    #[must_use]
    pub fn is_pressured(&self) -> bool {
        self.pressured
    }

    /// The average store time per MiB in seconds (`None` before the first sample).
    #[must_use]
    pub fn ema_seconds_per_mib(&self) -> Option<f64> {
        self.ema
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &BackpressureConfig {
        &self.config
    }

    /// Forgets every sample (the tier starts unpressured).
    pub fn reset(&mut self) {
        self.ema = None;
        self.samples = 0;
        self.pressured = false;
    }
}

/// The time source of backpressure: the system's monotonic clock, or a manual one a test moves.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<ManualClock>);

impl Clock {
    /// The system's monotonic clock.
    #[must_use]
    pub fn system() -> Self {
        Self(None)
    }

    /// A clock that only moves when the returned handle advances it.
    #[must_use]
    pub fn manual() -> (Self, ManualClock) {
        let handle = ManualClock {
            epoch: Instant::now(),
            offset_nanos: Arc::new(AtomicU64::new(0)),
        };
        (Self(Some(handle.clone())), handle)
    }

    /// The current time.
    #[must_use]
    pub fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.now(),
        }
    }
}

impl PartialEq for Clock {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(&a.offset_nanos, &b.offset_nanos),
            _ => false,
        }
    }
}

/// The handle of a manual [`Clock`].
#[derive(Clone, Debug)]
pub struct ManualClock {
    epoch: Instant,
    offset_nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.offset_nanos.fetch_add(nanos, Ordering::SeqCst);
    }

    fn now(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.offset_nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector() -> BackpressureDetector {
        BackpressureDetector::new(BackpressureConfig {
            alpha: 0.5,
            high_water_per_mib: Duration::from_millis(100),
            low_water_per_mib: Duration::from_millis(50),
            warmup: 2,
            ..BackpressureConfig::default()
        })
    }

    #[test]
    fn hysteresis_after_warmup() {
        let mut d = detector();
        assert_eq!(d.record(1.0), None, "warm-up: no change on the first sample");
        assert_eq!(d.record(1.0), Some(true));
        assert!(d.is_pressured());
        // 0.5 → 0.3 → 0.2 … stays on between the marks.
        assert_eq!(d.record(0.0), None);
        assert_eq!(d.record(0.0), None);
        assert_eq!(d.record(0.0), None);
        assert!((d.ema_seconds_per_mib().unwrap() - 0.125).abs() < 1e-9);
        assert_eq!(d.record(0.0), None, "0.0625: between the marks, still on");
        assert_eq!(d.record(0.0), Some(false), "0.03125: below the low water");
        assert_eq!(d.record(0.07), None, "between the marks: stays off");
        d.reset();
        assert_eq!(d.ema_seconds_per_mib(), None);
    }

    #[test]
    fn disabled_never_pressures_and_bad_settings_are_refused() {
        let mut d = BackpressureDetector::new(BackpressureConfig::disabled());
        for _ in 0..10 {
            assert_eq!(d.record(100.0), None);
        }
        assert!(!d.is_pressured());
        assert_eq!(d.record(f64::NAN), None);
        let bad = BackpressureConfig {
            alpha: 0.0,
            ..BackpressureConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("`alpha`"));
        let bad = BackpressureConfig {
            low_water_per_mib: Duration::from_secs(2),
            ..BackpressureConfig::default()
        };
        assert!(bad.validate().unwrap_err().starts_with("`low_water_per_mib`"));
        assert!(BackpressureConfig::default().validate().is_ok());
    }

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let (clock, hand) = Clock::manual();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0);
        hand.advance(Duration::from_millis(5));
        assert_eq!(clock.now() - t0, Duration::from_millis(5));
        assert_eq!(clock, clock.clone());
        assert_ne!(clock, Clock::system());
    }
}
