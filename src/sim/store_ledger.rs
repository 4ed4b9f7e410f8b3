//! Which nodes of a multi-node run (`kvtier run --nodes N`) stored each chunk into their own
//! primary tier: known only to the simulator, it tells a chunk a node loads from a shared tier
//! as its own, another node's (cross-node) or no node's of this run (see [`super::nodes`]).

use parking_lot::Mutex;
use tiering_core::{KeyMap, OffloadKey};

/// The most engines `--nodes` runs (the ledger keeps one bit per node).
pub const MAX_NODES: usize = 64;

/// Which nodes of a multi-node run stored each chunk into their primary tier.
#[derive(Debug, Default)]
pub struct StoreLedger {
    stored_by: Mutex<KeyMap<u64>>,
}

/// Who stored a chunk, as one node sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storer {
    /// This node stored it (perhaps others too).
    ThisNode,
    /// Only other nodes of the run stored it.
    OtherNode,
    /// No node of the run stored it.
    Nobody,
}

impl StoreLedger {
    /// Records that `node` stored `keys`.
    pub fn record(&self, keys: &[OffloadKey], node: usize) {
        let bit = 1u64 << (node % MAX_NODES);
        let mut map = self.stored_by.lock();
        for k in keys {
            *map.entry(*k).or_default() |= bit;
        }
    }

    /// Who stored `key`, from `node`'s point of view.
    #[must_use]
    pub fn storer(&self, key: &OffloadKey, node: usize) -> Storer {
        let bit = 1u64 << (node % MAX_NODES);
        match self.stored_by.lock().get(key).copied().unwrap_or(0) {
            0 => Storer::Nobody,
            mask if mask & bit != 0 => Storer::ThisNode,
            _ => Storer::OtherNode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_tells_this_node_from_another_and_from_nobody() {
        let ledger = StoreLedger::default();
        let (a, b, c) = (
            OffloadKey::from_u64(1),
            OffloadKey::from_u64(2),
            OffloadKey::from_u64(3),
        );
        ledger.record(&[a, b], 0);
        ledger.record(&[b], 1);
        assert_eq!(ledger.storer(&a, 0), Storer::ThisNode);
        assert_eq!(ledger.storer(&a, 1), Storer::OtherNode);
        assert_eq!(ledger.storer(&b, 1), Storer::ThisNode);
        assert_eq!(ledger.storer(&c, 0), Storer::Nobody);
    }
}
