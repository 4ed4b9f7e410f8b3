//! `after_first_reuse`: a chunk is admitted once it has been used a second time — loaded from
//! the primary by a request, or offered for storing again (the engine recomputed it). A chunk
//! used once (the common case for a one-off prompt) never reaches the tier. The memory of seen
//! chunks is bounded (`max_tracked` keys, least recent forgotten first).

use super::{Access, AdmissionContext, AdmissionError, AdmissionPolicy, LruMap};
use crate::key::{KeySet, OffloadKey};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[serde(default = "default_tracked")]
    max_tracked: usize,
}

fn default_tracked() -> usize {
    65_536
}

/// Whether a tracked chunk has been reused.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seen {
    Once,
    Reused,
}

/// The reuse gate.
pub(crate) struct AfterFirstReuse {
    seen: LruMap<Seen>,
    max_tracked: usize,
}

impl AdmissionPolicy for AfterFirstReuse {
    fn on_access(&mut self, keys: &[OffloadKey], access: Access) {
        // One access per key per call: a key repeated within one offer is not a reuse.
        let mut this_call = KeySet::default();
        for key in keys {
            if !this_call.insert(*key) {
                continue;
            }
            match self.seen.touch(key) {
                Some(s) => *s = Seen::Reused,
                None => {
                    if self.seen.len() >= self.max_tracked {
                        self.seen.pop_oldest();
                    }
                    let s = match access {
                        Access::Reused => Seen::Reused,
                        Access::Offered => Seen::Once,
                    };
                    self.seen.insert(*key, s);
                }
            }
        }
    }

    fn admit(&mut self, key: &OffloadKey) -> bool {
        self.seen.get(key) == Some(&Seen::Reused)
    }
}

fn build(options: &toml::Table, _ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
    let o: Options = super::registry::parse(options)?;
    if o.max_tracked == 0 {
        return Err(AdmissionError::Options("`max_tracked` must be at least 1".into()));
    }
    Ok(Box::new(AfterFirstReuse {
        seen: LruMap::new(),
        max_tracked: o.max_tracked,
    }))
}

crate::register_admission!("after_first_reuse" => build);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_after_a_second_use_only() {
        let k = OffloadKey::from_u64;
        let mut p = AfterFirstReuse {
            seen: LruMap::new(),
            max_tracked: 2,
        };
        p.on_access(&[k(1), k(1)], Access::Offered);
        assert!(!p.admit(&k(1)), "a key repeated in one offer is used once");
        p.on_access(&[k(1)], Access::Reused);
        assert!(p.admit(&k(1)));
        p.on_access(&[k(2)], Access::Offered);
        p.on_access(&[k(2)], Access::Offered);
        assert!(p.admit(&k(2)), "an offer of a chunk seen before is a reuse");
        p.on_access(&[k(3)], Access::Reused);
        assert!(p.admit(&k(3)), "a load is a reuse of a stored chunk");
        assert!(!p.admit(&k(1)), "the bound forgot the least recent key");
    }
}
