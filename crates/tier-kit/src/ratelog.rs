//! Rate-limited warnings for tiers: a failing device or server must not flood the log with one
//! line per chunk.

use std::collections::HashMap;
use std::fmt::Display;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Logs at most one warning per kind per period, and counts what it suppressed in between.
pub struct RateLimitedLog {
    period: Duration,
    state: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl RateLimitedLog {
    /// A limiter allowing one line per kind every `period`.
    #[must_use]
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            state: Mutex::new(HashMap::new()),
        }
    }

    /// Warns about `what` (of category `kind`) unless a warning of that kind was logged within
    /// the period; returns whether it logged.
    pub fn warn(&self, tier: &str, kind: &'static str, what: impl Display) -> bool {
        let now = Instant::now();
        let suppressed = {
            let mut state = self.state.lock();
            match state.get_mut(kind) {
                Some((last, count)) if now.duration_since(*last) < self.period => {
                    *count += 1;
                    return false;
                }
                Some((last, count)) => {
                    *last = now;
                    std::mem::take(count)
                }
                None => {
                    state.insert(kind, (now, 0));
                    0
                }
            }
        };
        tracing::warn!(tier, kind, suppressed, "{what}");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_within_the_period_are_suppressed_per_kind() {
        let log = RateLimitedLog::new(Duration::from_secs(3600));
        assert!(log.warn("disk", "write", "first"));
        assert!(!log.warn("disk", "write", "second"));
        assert!(log.warn("disk", "read", "another kind"));
        let zero = RateLimitedLog::new(Duration::ZERO);
        assert!(zero.warn("disk", "write", "a"));
        assert!(zero.warn("disk", "write", "b"));
    }
}
