//! The consumer's whitelist of destination rows: the only rows a producer may write are the
//! ones reserved for an outstanding fetch of that producer, for that request and round, for
//! that key. The write grants live here while the fetch is outstanding; a receiver thread
//! checks one out, reads the payload straight into it and checks it back in.
//!
//! Quiescence: a load is finished only once it is closed (no further check-outs) *and* every
//! grant is back, so a row is never released while a receiver may still write into it. A load
//! whose every row arrived and verified is quiescent as well (a verified row is never written
//! again), so it may finish before the producer's `transfer_done`: that saves the consumer a
//! control round trip on every fetch.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tiering_core::{
    OffloadKey,
    arena::{ChunkId, RowWrite},
};

use super::frame::{self, Begin, ChunkStatus};
use crate::auth::{DataKey, Tag};
use crate::notify::Notifier;

/// The producer's side of one session as the consumer verified it at handshake: its
/// incarnation and the key of the data it sends.
pub(crate) struct InboundAuth {
    pub(crate) instance: u64,
    pub(crate) key: DataKey,
}

/// Filled once the session's handshake verified the producer; a fetch registered before that
/// accepts nothing until it is.
pub(crate) type AuthSlot = Arc<OnceLock<InboundAuth>>;

/// How a transfer's `BEGIN` fares against the fetch it names.
pub(crate) enum BeginVerdict {
    /// No outstanding fetch of that peer, request and round: every chunk is rejected unread.
    Unknown,
    /// A fetch exists but the frame is not from the session that reserved its rows (another
    /// incarnation, another key, a forged tag): the connection must be cut.
    Refused(&'static str),
    /// Authenticated: chunks are checked under this key; at most `rows` of them.
    Accepted { key: DataKey, rows: usize },
}

/// Names one outstanding fetch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DestKey {
    pub(crate) peer: String,
    pub(crate) req: String,
    pub(crate) round: u64,
}

struct DestRow {
    key: OffloadKey,
    grant: Option<RowWrite>,
    verified: bool,
}

struct DestLoad {
    rows: Vec<DestRow>,
    by_row: HashMap<ChunkId, usize>,
    closed: bool,
    checked_out: usize,
    /// Rows whose payload arrived and verified.
    verified: usize,
    bytes: u64,
    auth: AuthSlot,
}

impl DestLoad {
    /// Every row arrived and verified, and no receiver holds a grant.
    fn delivered(&self) -> bool {
        self.checked_out == 0 && self.verified == self.rows.len()
    }
}

/// The per-key outcome of a finished load.
pub(crate) struct Finished {
    pub(crate) verified: Vec<bool>,
    pub(crate) bytes: u64,
}

/// Shared by the tier and the receiver threads.
pub(crate) struct DestTable {
    loads: Mutex<HashMap<DestKey, DestLoad>>,
    returned: Condvar,
    notifier: Notifier,
}

impl DestTable {
    pub(crate) fn new(notifier: Notifier) -> Self {
        Self {
            loads: Mutex::new(HashMap::new()),
            returned: Condvar::new(),
            notifier,
        }
    }

    /// Whitelists the rows of one fetch (`keys`, `grants` parallel) for the session whose
    /// handshake fills `auth`. A fetch already outstanding under the same name is refused (the
    /// grants come back): replacing it would orphan the first load, whose finish would then
    /// wait for an entry that is gone, and hand its rows' bytes to the second.
    pub(crate) fn register(
        &self,
        key: DestKey,
        keys: &[OffloadKey],
        grants: Vec<RowWrite>,
        auth: AuthSlot,
    ) -> Result<(), Vec<RowWrite>> {
        let mut loads = self.loads.lock();
        if loads.contains_key(&key) {
            tracing::error!(?key, "a fetch with this name is already outstanding; refused");
            return Err(grants);
        }
        let by_row = grants.iter().enumerate().map(|(i, g)| (g.chunk(), i)).collect();
        let rows = keys
            .iter()
            .zip(grants)
            .map(|(k, g)| DestRow {
                key: *k,
                grant: Some(g),
                verified: false,
            })
            .collect();
        loads.insert(
            key,
            DestLoad {
                rows,
                by_row,
                closed: false,
                checked_out: 0,
                verified: 0,
                bytes: 0,
                auth,
            },
        );
        Ok(())
    }

    /// Checks a transfer's `BEGIN` (from the data connection that greeted as incarnation
    /// `instance`) against the session that reserved the fetch's rows.
    pub(crate) fn authenticate(&self, dk: &DestKey, instance: u64, begin: &Begin, tag: &Tag) -> BeginVerdict {
        let loads = self.loads.lock();
        let Some(load) = loads.get(dk) else {
            return BeginVerdict::Unknown;
        };
        let Some(auth) = load.auth.get() else {
            return BeginVerdict::Refused("the session that reserved these rows is not verified yet");
        };
        if auth.instance != instance {
            return BeginVerdict::Refused(
                "another incarnation of the peer than the one that was fetched from",
            );
        }
        if frame::begin_tag(&auth.key, begin) != *tag {
            return BeginVerdict::Refused("BEGIN tag does not verify under the session's data key");
        }
        BeginVerdict::Accepted {
            key: auth.key.clone(),
            rows: load.rows.len(),
        }
    }

    /// Takes the grant of `row` for writing `key`, if that row is whitelisted for it.
    pub(crate) fn checkout(
        &self,
        dk: &DestKey,
        row: ChunkId,
        key: &OffloadKey,
    ) -> Result<RowWrite, ChunkStatus> {
        let mut loads = self.loads.lock();
        let Some(load) = loads.get_mut(dk) else {
            return Err(ChunkStatus::Rejected);
        };
        if load.closed {
            return Err(ChunkStatus::Rejected);
        }
        let Some(&i) = load.by_row.get(&row) else {
            return Err(ChunkStatus::Rejected);
        };
        let slot = &mut load.rows[i];
        if slot.key != *key || slot.verified {
            return Err(ChunkStatus::Rejected);
        }
        let grant = slot.grant.take().ok_or(ChunkStatus::Rejected)?;
        load.checked_out += 1;
        Ok(grant)
    }

    /// Returns a grant taken by [`DestTable::checkout`], with whether its payload verified.
    pub(crate) fn checkin(&self, dk: &DestKey, grant: RowWrite, verified: bool) {
        let mut loads = self.loads.lock();
        let wake = if let Some(load) = loads.get_mut(dk)
            && let Some(&i) = load.by_row.get(&grant.chunk())
        {
            let len = grant.len() as u64;
            let slot = &mut load.rows[i];
            slot.verified = verified;
            slot.grant = Some(grant);
            load.checked_out -= 1;
            if verified {
                load.bytes += len;
                load.verified += 1;
            }
            load.closed || load.delivered()
        } else {
            // Entries are removed only when nothing is checked out, so this cannot happen;
            // dropping the grant here would still be safe (the write is over).
            tracing::error!(?dk, "a write grant came back for an unknown fetch");
            false
        };
        drop(loads);
        self.returned.notify_all();
        if wake {
            self.notifier.wake();
        }
    }

    /// Refuses every further write for the fetch.
    pub(crate) fn close(&self, dk: &DestKey) {
        if let Some(load) = self.loads.lock().get_mut(dk) {
            load.closed = true;
        }
    }

    /// Closes the fetch and, once no grant is checked out, removes it, drops its grants and
    /// returns what verified. `None` while a receiver still writes. A fetch that is not here
    /// (never registered, or already finished) has nothing left to wait for: it finishes with
    /// nothing verified, rather than being waited for forever.
    pub(crate) fn try_finish(&self, dk: &DestKey) -> Option<Finished> {
        let mut loads = self.loads.lock();
        let Some(load) = loads.get_mut(dk) else {
            drop(loads);
            return Some(Self::gone(dk));
        };
        load.closed = true;
        if load.checked_out > 0 {
            return None;
        }
        let load = loads.remove(dk)?;
        drop(loads);
        Some(Finished {
            verified: load.rows.iter().map(|r| r.verified).collect(),
            bytes: load.bytes,
        })
    }

    /// Removes the fetch and returns what verified if every row arrived and verified (nothing
    /// more can be written into it); `None` otherwise, leaving it open. A fetch that is not
    /// here finishes with nothing verified, as in [`DestTable::try_finish`].
    pub(crate) fn try_finish_delivered(&self, dk: &DestKey) -> Option<Finished> {
        let mut loads = self.loads.lock();
        let Some(load) = loads.get(dk) else {
            drop(loads);
            return Some(Self::gone(dk));
        };
        if !load.delivered() {
            return None;
        }
        let load = loads.remove(dk)?;
        drop(loads);
        Some(Finished {
            verified: vec![true; load.rows.len()],
            bytes: load.bytes,
        })
    }

    /// The outcome of a fetch with no entry: no row of it can be written any more.
    fn gone(dk: &DestKey) -> Finished {
        tracing::error!(
            ?dk,
            "finishing a fetch whose rows are not registered; nothing verified"
        );
        Finished {
            verified: Vec::new(),
            bytes: 0,
        }
    }

    /// Waits until no grant of any fetch is checked out, up to `timeout`; returns how many are
    /// still out.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut loads = self.loads.lock();
        loop {
            let out: usize = loads.values().map(|l| l.checked_out).sum();
            if out == 0 || Instant::now() >= deadline {
                return out;
            }
            let _ = self.returned.wait_until(&mut loads, deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use tiering_core::{ControlWaker, arena::ChunkArena};

    use super::*;

    fn table() -> DestTable {
        let notifier = Notifier::default();
        notifier.set(ControlWaker::new());
        DestTable::new(notifier)
    }

    fn name(round: u64) -> DestKey {
        DestKey {
            peer: "127.0.0.1:7000".into(),
            req: "r1".into(),
            round,
        }
    }

    #[test]
    fn a_second_fetch_under_the_same_name_is_refused_and_the_first_stands() {
        let arena = ChunkArena::new(8, 64).unwrap();
        let t = table();
        let keys = [OffloadKey::from_u64(1), OffloadKey::from_u64(2)];
        t.register(
            name(0),
            &keys,
            arena.write_rows(&[0, 1]).unwrap(),
            AuthSlot::default(),
        )
        .unwrap();
        let back = t
            .register(
                name(0),
                &keys,
                arena.write_rows(&[2, 3]).unwrap(),
                AuthSlot::default(),
            )
            .expect_err("the same fetch name twice");
        assert_eq!(back.len(), 2, "the refused grants come back");
        drop(back);
        // The first fetch's rows are still the whitelisted ones.
        let Ok(g) = t.checkout(&name(0), 0, &keys[0]) else {
            panic!("row 0 stays whitelisted");
        };
        assert!(
            t.checkout(&name(0), 2, &keys[0]).is_err(),
            "row 2 was never whitelisted"
        );
        t.checkin(&name(0), g, true);
        let fin = t.try_finish(&name(0)).expect("nothing checked out");
        assert_eq!(fin.verified, vec![true, false]);
        drop(fin);
        assert_eq!(arena.granted_rows(), 0, "every grant was dropped");
    }

    #[test]
    fn a_fetch_whose_entry_is_gone_finishes_with_nothing_verified() {
        let t = table();
        // Waiting for an entry that no longer exists would wait forever: the load's job would
        // never be reported and the tier would keep pending work.
        let fin = t.try_finish(&name(3)).expect("nothing can be written any more");
        assert!(fin.verified.is_empty());
        assert_eq!(fin.bytes, 0);
        let fin = t
            .try_finish_delivered(&name(3))
            .expect("nothing can be written any more");
        assert!(fin.verified.is_empty());
    }
}
