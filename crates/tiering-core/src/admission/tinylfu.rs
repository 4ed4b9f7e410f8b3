//! `tinylfu`: frequency-based admission with a count-min sketch
//! ([`FrequencySketch`](super::FrequencySketch)) that ages by halving.
//!
//! Every access (offer or load) is recorded in the sketch. The policy also keeps a model of
//! what the tier holds: the keys it let through, in recency order (a load refreshes a key),
//! bounded by the tier's capacity in chunks (`capacity`, default the tier's reported capacity).
//! The least recent key of that model stands for the tier's next eviction victim, since the
//! manager cannot ask a tier which chunk it would evict. A candidate is admitted when its
//! estimated frequency is at least `min_count` and, once the model is full, strictly above the
//! victim's — so a chunk seen once never displaces one seen more often. With no capacity known
//! (a tier reporting none and no `capacity` option) only the `min_count` floor applies, and its
//! default is then 2 instead of 1.

use super::{Access, AdmissionContext, AdmissionError, AdmissionPolicy, FrequencySketch, LruMap};
use crate::key::OffloadKey;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    /// Chunks the tier holds (the victim model's bound); 0 = no model.
    #[serde(default)]
    capacity: Option<u64>,
    /// Frequency floor for admission.
    #[serde(default)]
    min_count: Option<u32>,
    /// Counters per sketch row (power of two); default: 4 × capacity, at least 1024.
    #[serde(default)]
    width: Option<usize>,
    /// Accesses between two halvings; default: 10 × width.
    #[serde(default)]
    sample_size: Option<u64>,
}

/// The frequency gate.
pub(crate) struct TinyLfu {
    sketch: FrequencySketch,
    resident: LruMap<()>,
    capacity: Option<usize>,
    min_count: u32,
}

impl AdmissionPolicy for TinyLfu {
    fn on_access(&mut self, keys: &[OffloadKey], access: Access) {
        for key in keys {
            self.sketch.record(key);
            if access == Access::Reused {
                self.resident.touch(key);
            }
        }
    }

    fn admit(&mut self, key: &OffloadKey) -> bool {
        let estimate = self.sketch.estimate(key);
        if estimate < self.min_count {
            return false;
        }
        let Some(capacity) = self.capacity else {
            return true;
        };
        if self.resident.contains(key) || self.resident.len() < capacity {
            return true;
        }
        self.resident
            .oldest()
            .is_none_or(|victim| estimate > self.sketch.estimate(victim))
    }

    fn on_cascaded(&mut self, keys: &[OffloadKey]) {
        let Some(capacity) = self.capacity else {
            return;
        };
        for key in keys {
            if self.resident.touch(key).is_some() {
                continue;
            }
            while self.resident.len() >= capacity {
                self.resident.pop_oldest();
            }
            self.resident.insert(*key, ());
        }
    }
}

fn build(options: &toml::Table, ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
    let o: Options = super::registry::parse(options)?;
    let capacity = match o.capacity {
        Some(0) => None,
        Some(c) => Some(c),
        None => ctx.capacity_chunks,
    };
    let capacity = capacity.map(|c| usize::try_from(c).unwrap_or(usize::MAX));
    let width = match o.width {
        Some(w) if w == 0 || w > 1 << 24 => {
            return Err(AdmissionError::Options(
                "`width` must be from 1 to 16777216 counters".into(),
            ));
        }
        Some(w) => w,
        None => capacity.map_or(1024, |c| c.saturating_mul(4).clamp(1024, 1 << 24)),
    };
    let sample_size = match o.sample_size {
        Some(0) => return Err(AdmissionError::Options("`sample_size` must be at least 1".into())),
        Some(s) => s,
        None => 10 * width.max(64).next_power_of_two() as u64,
    };
    let min_count = o.min_count.unwrap_or(if capacity.is_some() { 1 } else { 2 });
    Ok(Box::new(TinyLfu {
        sketch: FrequencySketch::new(width, sample_size),
        resident: LruMap::new(),
        capacity,
        min_count,
    }))
}

crate::register_admission!("tinylfu" => build);

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(options: &str, capacity: Option<u64>) -> Box<dyn AdmissionPolicy> {
        build(
            &options.parse().unwrap(),
            &AdmissionContext::new("disk", capacity),
        )
        .unwrap()
    }

    #[test]
    fn frequent_key_displaces_the_victim_and_a_one_hit_wonder_does_not() {
        let k = OffloadKey::from_u64;
        let mut p = policy("", Some(2));
        // Fill the tier's model with two keys seen once each.
        for n in [1, 2] {
            p.on_access(&[k(n)], Access::Offered);
            assert!(p.admit(&k(n)), "room left: admitted");
            p.on_cascaded(&[k(n)]);
        }
        // A one-hit wonder does not beat the victim (key 1, seen once).
        p.on_access(&[k(10)], Access::Offered);
        assert!(!p.admit(&k(10)));
        // A key offered once and loaded twice does.
        p.on_access(&[k(20)], Access::Offered);
        p.on_access(&[k(20)], Access::Reused);
        p.on_access(&[k(20)], Access::Reused);
        assert!(p.admit(&k(20)));
        p.on_cascaded(&[k(20)]);
        // The victim was key 1; key 2 is next, and the wonder still loses to it.
        assert!(!p.admit(&k(10)));
    }

    #[test]
    fn without_a_capacity_a_floor_of_two_applies() {
        let k = OffloadKey::from_u64;
        let mut p = policy("", None);
        p.on_access(&[k(1)], Access::Offered);
        assert!(!p.admit(&k(1)));
        p.on_access(&[k(1)], Access::Reused);
        assert!(p.admit(&k(1)));
        let mut p = policy("min_count = 3\ncapacity = 0", Some(100));
        p.on_access(&[k(1), k(1)], Access::Offered);
        assert!(!p.admit(&k(1)));
    }

    #[test]
    fn bad_options_are_refused() {
        let ctx = AdmissionContext::default();
        for bad in [
            "width = 0",
            "sample_size = 0",
            "capacity = -1",
            "doorkeeper = true",
        ] {
            assert!(build(&bad.parse().unwrap(), &ctx).is_err(), "{bad}");
        }
    }
}
