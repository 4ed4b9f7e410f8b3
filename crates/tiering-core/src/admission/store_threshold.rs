//! `store_threshold`: vLLM 0.33.0's frequency gate, in front of a secondary tier instead of the
//! CPU tier. A chunk is admitted once it has been offered for storing `n` times. Offers are
//! counted in a bounded tracker in recency order (`max_tracker_size` keys): an offer moves a
//! tracked key to the most recent end and adds one, and inserts an untracked key with a count
//! of one, making room by dropping the least recent key that is not part of the same offer (or
//! not inserting at all when every tracked key is). Loads do not count. `n` below 2 admits
//! everything and tracks nothing, as in vLLM.

use super::{Access, AdmissionContext, AdmissionError, AdmissionPolicy, LruMap};
use crate::key::{KeySet, OffloadKey};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[serde(default = "default_n")]
    n: u32,
    #[serde(default = "default_tracker")]
    max_tracker_size: usize,
}

fn default_n() -> u32 {
    2
}

fn default_tracker() -> usize {
    64_000
}

/// The offer-count gate.
pub(crate) struct StoreThreshold {
    threshold: u32,
    max_tracker_size: usize,
    counts: Option<LruMap<u32>>,
}

impl StoreThreshold {
    pub(crate) fn new(threshold: u32, max_tracker_size: usize) -> Self {
        Self {
            threshold,
            max_tracker_size,
            counts: (threshold >= 2).then(LruMap::new),
        }
    }
}

impl AdmissionPolicy for StoreThreshold {
    fn on_access(&mut self, keys: &[OffloadKey], access: Access) {
        let Some(counts) = self.counts.as_mut() else {
            return;
        };
        if access != Access::Offered {
            return;
        }
        // Keys of this offer already tracked are refreshed and protected from the room-making
        // below.
        let mut protected = KeySet::default();
        for key in keys {
            if let Some(c) = counts.touch(key) {
                *c += 1;
                protected.insert(*key);
            }
        }
        let mut unprotected = counts.len() - protected.len();
        for key in keys {
            if counts.contains(key) {
                continue;
            }
            if counts.len() >= self.max_tracker_size {
                if unprotected == 0 {
                    continue;
                }
                // The least recent entries precede every protected one (those were just
                // refreshed) and every key this offer inserted.
                counts.pop_oldest();
                unprotected -= 1;
            }
            counts.insert(*key, 1);
        }
    }

    fn admit(&mut self, key: &OffloadKey) -> bool {
        match &self.counts {
            None => true,
            Some(counts) => counts.get(key).copied().unwrap_or(0) >= self.threshold,
        }
    }
}

fn build(options: &toml::Table, _ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
    let o: Options = super::registry::parse(options)?;
    if o.max_tracker_size == 0 {
        return Err(AdmissionError::Options(
            "`max_tracker_size` must be at least 1".into(),
        ));
    }
    Ok(Box::new(StoreThreshold::new(o.n, o.max_tracker_size)))
}

crate::register_admission!("store_threshold" => build);

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn second_offer_admits_and_loads_do_not_count() {
        let mut p = StoreThreshold::new(2, 8);
        p.on_access(&[k(1), k(2)], Access::Offered);
        assert!(!p.admit(&k(1)));
        p.on_access(&[k(1)], Access::Reused);
        assert!(!p.admit(&k(1)));
        p.on_access(&[k(1)], Access::Offered);
        assert!(p.admit(&k(1)));
        assert!(!p.admit(&k(2)));
        assert!(!p.admit(&k(3)));
    }

    #[test]
    fn threshold_below_two_admits_everything() {
        for n in [0, 1] {
            let mut p = StoreThreshold::new(n, 8);
            assert!(p.admit(&k(5)));
            assert!(p.counts.is_none());
        }
    }
}
