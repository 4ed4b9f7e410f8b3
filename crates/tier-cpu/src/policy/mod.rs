//! Eviction policies: one trait, three implementations selected by name.
//!
//! - `lru` ([`LruPolicy`]) and `arc` ([`ArcPolicy`]) reproduce the released vLLM 0.33.0 policies
//!   exactly (logical recency ranks with request ranks and positions; ARC's T1/T2/B1/B2 with
//!   target adaptation).
//! - `s3fifo` ([`S3FifoPolicy`]) is scan resistant: a small probationary FIFO, a main FIFO with
//!   a 2-bit frequency, and a ghost queue.
//!
//! Policies order *chunk ids* (arena rows), not keys: the tier resolves keys once and hands the
//! policy dense ids, so every structure is a flat array indexed by chunk id. Ref counts stay in
//! the tier; a policy reads them through [`SlotView`] when it needs to know whether a chunk is
//! ready or evictable.

mod arc;
mod ghost;
pub(crate) mod list;
mod lru;
mod s3fifo;

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use tiering_core::{OffloadKey, ReqContext, arena::ChunkId};

pub use crate::slots::SlotView;
pub use arc::ArcPolicy;
pub use lru::LruPolicy;
pub use s3fifo::S3FifoPolicy;

/// The chunks an eviction must not take: the resident keys of the store offer being served.
#[derive(Clone, Copy)]
pub struct Protected<'a> {
    bits: &'a [u64],
}

impl<'a> Protected<'a> {
    /// A set over a bitmap indexed by chunk id.
    #[must_use]
    pub fn new(bits: &'a [u64]) -> Self {
        Self { bits }
    }

    /// Whether `chunk` is protected.
    #[inline]
    #[must_use]
    pub fn contains(&self, chunk: ChunkId) -> bool {
        let c = chunk as usize;
        self.bits.get(c / 64).is_some_and(|w| w & (1 << (c % 64)) != 0)
    }
}

/// A key as the tier resolved it: the chunk holding it (`None` when it is not resident) and, for
/// the hooks that use it, the end-token position the request recorded for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRef {
    /// The key.
    pub key: OffloadKey,
    /// Its chunk, when resident.
    pub chunk: Option<ChunkId>,
    /// The request's recorded position of the key ([`EvictionPolicy::on_request_access`] only;
    /// `None` elsewhere).
    pub position: Option<u64>,
}

/// A resident key a finishing request observed, in head-to-tail prefix order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FinishedKey {
    /// The key.
    pub key: OffloadKey,
    /// Its chunk.
    pub chunk: ChunkId,
    /// The request inserted it and never reused it.
    pub insertion_only: bool,
    /// The request reused it (loaded it, or offered it while it was ready).
    pub reused: bool,
}

/// A policy's internal orders, for tests and diagnostics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicySnapshot {
    /// Named key lists, each in eviction-scan order (least recent first).
    pub lists: Vec<(&'static str, Vec<OffloadKey>)>,
    /// ARC's adaptive T1 target, when the policy has one.
    pub target: Option<f64>,
}

impl PolicySnapshot {
    /// The list named `name` (empty when absent).
    #[must_use]
    pub fn list(&self, name: &str) -> Vec<OffloadKey> {
        self.lists
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, keys)| keys.clone())
            .unwrap_or_default()
    }
}

/// An eviction policy of the CPU tier.
///
/// The tier calls the hooks in the same places vLLM 0.33.0's manager calls its `CachePolicy`;
/// see each method. Chunk ids passed in are always resident unless stated otherwise.
pub trait EvictionPolicy: Send {
    /// The policy's kind.
    fn kind(&self) -> PolicyKind;

    /// The bound of the ghost lists the tier keeps for this policy, or `None` (the default)
    /// when it keeps none. The tier keeps two lists of keys evicted recently in its key index
    /// (so a key's one probe also tells whether it is a ghost): victims join the list
    /// [`EvictionPolicy::victim_ghost_lists`] names, each list is trimmed to the bound (oldest
    /// first) after every eviction, a ghost stored again leaves its list, and a ghost hit
    /// moves the ghost to the back of its list after [`EvictionPolicy::on_ghost_hit`].
    fn ghost_bound(&self) -> Option<usize> {
        None
    }

    /// A key of ghost list `list` was seen: by a store miss new to its request (before any key
    /// of the offer is inserted), or by a touch. `lengths` are the ghost lists' lengths. Called
    /// per key in reverse call order, and only when [`EvictionPolicy::ghost_bound`] is `Some`.
    fn on_ghost_hit(&mut self, list: usize, lengths: [usize; 2]) {
        let _ = (list, lengths);
    }

    /// After a successful [`EvictionPolicy::evict`], the ghost list each victim joins, in
    /// victim order (empty when the policy keeps no ghosts).
    fn victim_ghost_lists(&self) -> &[u8] {
        &[]
    }

    /// Whether [`EvictionPolicy::on_request_access`] does anything: a policy that ignores first
    /// observations returns `false`, and the tier skips resolving them for it.
    fn observes_request_access(&self) -> bool {
        true
    }

    /// Keys the request observes for the first time (store offers and loads), before any
    /// insertion of the same call.
    fn on_request_access(&mut self, keys: &[KeyRef], slots: SlotView<'_>, ctx: &ReqContext) {
        let _ = (keys, slots, ctx);
    }

    /// Whether [`EvictionPolicy::insert`] reads the key's recorded position: a policy that
    /// ignores it returns `false`, and the tier passes `None` instead of looking positions up.
    /// Defaults to `true`.
    fn uses_insert_position(&self) -> bool {
        true
    }

    /// A chunk was reserved for `key` (write in flight); `position` is the request's recorded
    /// position of the key. `slots` already maps `chunk` to `key`.
    fn insert(
        &mut self,
        chunk: ChunkId,
        key: &OffloadKey,
        position: Option<u64>,
        slots: SlotView<'_>,
        ctx: &ReqContext,
    );

    /// Chunks were reserved for `keys` (writes in flight), `chunks[i]` for `keys[i]` with the
    /// request's recorded position `positions[i]`: the same as [`EvictionPolicy::insert`] of
    /// each in order, which the default does. `slots` already maps every chunk to its key.
    fn insert_batch(
        &mut self,
        chunks: &[ChunkId],
        keys: &[OffloadKey],
        positions: &[Option<u64>],
        slots: SlotView<'_>,
        ctx: &ReqContext,
    ) {
        for ((&chunk, key), &position) in chunks.iter().zip(keys).zip(positions) {
            self.insert(chunk, key, position, slots, ctx);
        }
    }

    /// A reserved chunk whose write failed is dropped (no ghost entry).
    fn remove(&mut self, chunk: ChunkId, slots: SlotView<'_>);

    /// Starts loading what a [`EvictionPolicy::touch`] of `chunks` reads first (a hint: a tier
    /// large enough to request a batch's lines ahead calls it, once per batch, with the rows it
    /// expects the batch's keys in while those rows are still on their way, so the policy's
    /// misses overlap the table's instead of following them). Does nothing by default.
    fn prefetch_touch(&self, chunks: &[ChunkId]) {
        let _ = chunks;
    }

    /// A recency hint, keys in call order (the first key ends most recent); `chunks[i]` is the
    /// chunk of `keys[i]` (`None` when it is not resident).
    fn touch(
        &mut self,
        keys: &[OffloadKey],
        chunks: &[Option<ChunkId>],
        slots: SlotView<'_>,
        ctx: &ReqContext,
    );

    /// The request finished; `keys` are the resident keys it observed, head first.
    fn on_request_finished(&mut self, keys: &[FinishedKey], slots: SlotView<'_>, ctx: &ReqContext);

    /// Whether [`EvictionPolicy::mark_evictable`] and [`EvictionPolicy::mark_non_evictable`] do
    /// anything: a policy that reads evictability from the [`SlotView`] instead returns `false`,
    /// and the tier skips the calls (one per ref-count edge). Defaults to `true`, so a policy
    /// that implements the hooks is called without further ado.
    fn observes_evictability(&self) -> bool {
        true
    }

    /// The chunk's ref count reached 0 (store completed or last reader done).
    fn mark_evictable(&mut self, chunk: ChunkId) {
        let _ = chunk;
    }

    /// The chunk's ref count left 0 (first reader).
    fn mark_non_evictable(&mut self, chunk: ChunkId) {
        let _ = chunk;
    }

    /// Chooses exactly `n` evictable, unprotected chunks, forgets them and appends them to
    /// `out` in eviction order. The tier only calls this when at least `n` such chunks exist;
    /// if the policy still cannot find them it returns `false` and no chunk stops being
    /// resident.
    fn evict(
        &mut self,
        n: usize,
        slots: SlotView<'_>,
        protected: Protected<'_>,
        out: &mut Vec<ChunkId>,
    ) -> bool;

    /// Forgets everything, including ghosts and adaptive state.
    fn clear(&mut self);

    /// Internal orders, for tests and diagnostics.
    fn snapshot(&self, slots: SlotView<'_>) -> PolicySnapshot;

    /// Policy-specific gauges for [`tiering_core::TierStats::extra`].
    fn extra_stats(&self, slots: SlotView<'_>, out: &mut Vec<(&'static str, f64)>) {
        let _ = (slots, out);
    }
}

/// The eviction policies, by configuration name.
///
/// In a chain file it is a string, case-insensitive; a value of another type is reported as
/// `expected a string ("lru", "arc" or "s3fifo"), found …` (see
/// [`tiering_core::options::parse_options`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// vLLM 0.33.0's logical-rank LRU.
    #[default]
    Lru,
    /// vLLM 0.33.0's ARC.
    Arc,
    /// S3-FIFO.
    S3Fifo,
}

impl PolicyKind {
    /// Every policy, in the order error messages list them.
    pub const ALL: [Self; 3] = [Self::Lru, Self::Arc, Self::S3Fifo];

    /// The configuration name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Arc => "arc",
            Self::S3Fifo => "s3fifo",
        }
    }

    /// A fresh policy of this kind for a tier of `capacity` chunks.
    #[must_use]
    pub fn build(self, capacity: usize) -> Box<dyn EvictionPolicy> {
        match self {
            Self::Lru => Box::new(LruPolicy::new(capacity)),
            Self::Arc => Box::new(ArcPolicy::new(capacity)),
            Self::S3Fifo => Box::new(S3FifoPolicy::new(capacity)),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An eviction policy name that is not one of [`PolicyKind::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {name:?}; supported: lru, arc, s3fifo")]
pub struct UnknownPolicy {
    /// The name given.
    pub name: String,
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|k| k.name() == lower || (*k == Self::S3Fifo && lower == "s3-fifo"))
            .ok_or_else(|| UnknownPolicy { name: s.to_owned() })
    }
}

impl TryFrom<String> for PolicyKind {
    type Error = UnknownPolicy;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl<'de> Deserialize<'de> for PolicyKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Names;

        impl serde::de::Visitor<'_> for Names {
            type Value = PolicyKind;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string (")?;
                for (i, k) in PolicyKind::ALL.iter().enumerate() {
                    let sep = match i {
                        0 => "",
                        i if i + 1 == PolicyKind::ALL.len() => " or ",
                        _ => ", ",
                    };
                    write!(f, "{sep}{:?}", k.name())?;
                }
                f.write_str(")")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PolicyKind, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_str(Names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_supported_ones() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
            assert_eq!(k.build(4).kind(), k);
        }
        assert_eq!("ARC".parse::<PolicyKind>(), Ok(PolicyKind::Arc));
        assert_eq!("s3-fifo".parse::<PolicyKind>(), Ok(PolicyKind::S3Fifo));
        let err = "lfu".parse::<PolicyKind>().unwrap_err();
        let wrong =
            toml::from_str::<std::collections::HashMap<String, PolicyKind>>("eviction = 3").unwrap_err();
        assert!(
            wrong
                .message()
                .contains("invalid type: integer `3`, expected a string (\"lru\", \"arc\" or \"s3fifo\")"),
            "{wrong}"
        );
        assert_eq!(
            err.to_string(),
            "unknown eviction policy \"lfu\"; supported: lru, arc, s3fifo"
        );
    }

    #[test]
    fn protected_bits_are_indexed_by_chunk() {
        let bits = [0b1010u64, 1];
        let p = Protected::new(&bits);
        assert!(p.contains(1) && p.contains(3) && p.contains(64));
        assert!(!p.contains(0) && !p.contains(2) && !p.contains(65) && !p.contains(1000));
    }
}
