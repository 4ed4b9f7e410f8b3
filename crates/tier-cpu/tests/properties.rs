//! Property tests of every policy against a simple reference model of the tier: random sequences
//! of stores, completions (successful or failed), loads, cascade reads, touches, request
//! finishes, lookups, event drains and resets.
//!
//! The model knows nothing about recency; it checks what every policy must respect: capacity is
//! never exceeded, a pinned or in-flight chunk is never evicted, a store fails exactly when too
//! few unprotected chunks are evictable, rows are allocated fresh-ascending then LIFO, every
//! completed chunk that disappears was announced by a removal event, and no pin survives once
//! every load has completed.

mod common;

use std::collections::{HashMap, HashSet};

use common::k;
use proptest::prelude::*;
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{OffloadKey, PrimaryTier, ReqContext, arena::ChunkId};

const CAP: usize = 6;
const UNIVERSE: u8 = 14;
const REQS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Store {
        req: usize,
        keys: Vec<u8>,
        positions: bool,
    },
    Complete {
        req: usize,
        pick: u16,
        success: bool,
    },
    Load {
        req: usize,
        keys: Vec<u8>,
    },
    CompleteLoad {
        req: usize,
        pick: u16,
    },
    Read {
        keys: Vec<u8>,
    },
    CompleteRead {
        pick: u16,
    },
    Touch {
        keys: Vec<u8>,
    },
    Finish {
        req: usize,
    },
    Lookup {
        key: u8,
    },
    Events,
    Reset,
}

fn keys_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..UNIVERSE, 1..5)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..REQS, keys_strategy(), any::<bool>()).prop_map(|(req, keys, positions)| Op::Store { req, keys, positions }),
        5 => (0..REQS, any::<u16>(), prop::bool::weighted(0.85)).prop_map(|(req, pick, success)| Op::Complete { req, pick, success }),
        3 => (0..REQS, keys_strategy()).prop_map(|(req, keys)| Op::Load { req, keys }),
        3 => (0..REQS, any::<u16>()).prop_map(|(req, pick)| Op::CompleteLoad { req, pick }),
        1 => keys_strategy().prop_map(|keys| Op::Read { keys }),
        1 => any::<u16>().prop_map(|pick| Op::CompleteRead { pick }),
        2 => keys_strategy().prop_map(|keys| Op::Touch { keys }),
        2 => (0..REQS).prop_map(|req| Op::Finish { req }),
        1 => (0..UNIVERSE).prop_map(|key| Op::Lookup { key }),
        2 => Just(Op::Events),
        1 => Just(Op::Reset),
    ]
}

/// The reference model: residency, ref counts and rows, no recency.
#[derive(Default)]
struct Model {
    slots: HashMap<OffloadKey, (ChunkId, i32)>,
    free: Vec<ChunkId>,
    allocated: u32,
    /// What an event consumer believes is stored (built from drained events).
    visible: HashSet<OffloadKey>,
}

impl Model {
    fn evictable_unprotected(&self, offer: &[OffloadKey]) -> usize {
        self.slots
            .iter()
            .filter(|(key, (_, r))| *r == 0 && !offer.contains(key))
            .count()
    }

    fn allocate(&mut self, n: usize) -> Vec<ChunkId> {
        (0..n)
            .map(|_| {
                if (self.allocated as usize) < CAP {
                    self.allocated += 1;
                    self.allocated - 1
                } else {
                    self.free.pop().expect("model allocation")
                }
            })
            .collect()
    }
}

/// Picks the elements of `from` selected by the bits of `pick` (at least one when non-empty).
fn take_picked(from: &mut Vec<OffloadKey>, pick: u16) -> Vec<OffloadKey> {
    if from.is_empty() {
        return Vec::new();
    }
    let mut taken = Vec::new();
    let mut kept = Vec::new();
    for (i, key) in from.drain(..).enumerate() {
        if pick & (1 << (i % 16)) != 0 {
            taken.push(key);
        } else {
            kept.push(key);
        }
    }
    if taken.is_empty() {
        taken.push(kept.remove(0));
    }
    *from = kept;
    taken
}

struct Harness {
    tier: CpuTier,
    model: Model,
    ctxs: Vec<ReqContext>,
    generation: usize,
    pending: Vec<Vec<OffloadKey>>,
    pinned: Vec<Vec<OffloadKey>>,
    reads: Vec<OffloadKey>,
}

impl Harness {
    fn new(policy: PolicyKind) -> Self {
        Self {
            tier: CpuTier::new(CAP, 64, policy).unwrap(),
            model: Model::default(),
            ctxs: (0..REQS).map(|r| ReqContext::local(format!("r{r}"))).collect(),
            generation: 0,
            pending: vec![Vec::new(); REQS],
            pinned: vec![Vec::new(); REQS],
            reads: Vec::new(),
        }
    }

    fn ready(&self, key: &OffloadKey) -> bool {
        self.model.slots.get(key).is_some_and(|(_, r)| *r >= 0)
    }

    fn drain_events(&mut self) -> Result<(), TestCaseError> {
        let events = self.tier.take_events();
        for e in &events {
            for key in &e.keys {
                if e.removed {
                    prop_assert!(
                        e.metadata_only || self.model.visible.contains(key),
                        "removal of unannounced {key}"
                    );
                    self.model.visible.remove(key);
                } else {
                    self.model.visible.insert(*key);
                }
            }
        }
        // Everything announced and not removed is resident and ready, and vice versa.
        let ready: HashSet<OffloadKey> = self
            .model
            .slots
            .iter()
            .filter(|(_, (_, r))| *r >= 0)
            .map(|(key, _)| *key)
            .collect();
        prop_assert_eq!(&self.model.visible, &ready);
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Store { req, keys, positions } => {
                let offer: Vec<OffloadKey> = keys.iter().map(|&n| k(u64::from(n))).collect();
                let ctx = self.ctxs[*req].clone();
                if *positions {
                    for (i, key) in offer.iter().enumerate() {
                        ctx.set_key_position(*key, (i as u64 + 1) * 16);
                    }
                }
                let mut new: Vec<OffloadKey> = Vec::new();
                for key in &offer {
                    if !self.model.slots.contains_key(key) && !new.contains(key) {
                        new.push(*key);
                    }
                }
                let free = self.model.free.len() + CAP - self.model.allocated as usize;
                let need = new.len().saturating_sub(free);
                let possible = need <= self.model.evictable_unprotected(&offer);
                match self.tier.prepare_store(&offer, &ctx) {
                    None => prop_assert!(!possible, "store failed although {need} rows could be freed"),
                    Some(out) => {
                        prop_assert!(possible, "store succeeded although it needed {need} evictions");
                        prop_assert_eq!(&out.keys_to_store, &new);
                        prop_assert_eq!(out.evicted.len(), need);
                        for v in &out.evicted {
                            let (chunk, r) = self.model.slots.remove(v).expect("evicted key was resident");
                            prop_assert_eq!(r, 0, "evicted a pinned or in-flight chunk");
                            prop_assert!(!offer.contains(v), "evicted a key of its own offer");
                            self.model.free.push(chunk);
                        }
                        let rows = self.model.allocate(new.len());
                        prop_assert_eq!(&out.chunk_ids, &rows);
                        for (key, row) in new.iter().zip(rows) {
                            self.model.slots.insert(*key, (row, -1));
                        }
                        self.pending[*req].extend(new);
                    }
                }
            }
            Op::Complete { req, pick, success } => {
                let keys = take_picked(&mut self.pending[*req], *pick);
                let ctx = self.ctxs[*req].clone();
                self.tier.complete_store(&keys, &ctx, *success);
                for key in &keys {
                    if let Some((chunk, r)) = self.model.slots.get(key).copied() {
                        if r == -1 {
                            if *success {
                                self.model.slots.insert(*key, (chunk, 0));
                            } else {
                                self.model.slots.remove(key);
                                self.model.free.push(chunk);
                            }
                        }
                    }
                }
            }
            Op::Load { req, keys } => self.pin(Some(*req), keys)?,
            Op::Read { keys } => self.pin(None, keys)?,
            Op::CompleteLoad { req, pick } => {
                let keys = take_picked(&mut self.pinned[*req], *pick);
                self.tier
                    .complete_load(&keys, &self.ctxs[*req])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                for key in &keys {
                    self.model.slots.get_mut(key).expect("pinned key resident").1 -= 1;
                }
                // One release too many is refused and changes nothing.
                if let Some(key) = keys.first() {
                    let before = self.tier.ref_count(key);
                    if before == Some(0) {
                        prop_assert!(self.tier.complete_load(&[*key], &self.ctxs[*req]).is_err());
                        prop_assert_eq!(self.tier.ref_count(key), before);
                    }
                }
            }
            Op::CompleteRead { pick } => {
                let keys = take_picked(&mut self.reads, *pick);
                self.tier
                    .complete_read(&keys, &ReqContext::local("cascade"))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                for key in &keys {
                    self.model.slots.get_mut(key).expect("read key resident").1 -= 1;
                }
            }
            Op::Touch { keys } => {
                let keys: Vec<OffloadKey> = keys.iter().map(|&n| k(u64::from(n))).collect();
                self.tier.touch(&keys, &self.ctxs[0]);
            }
            Op::Finish { req } => {
                self.tier.on_request_finished(&self.ctxs[*req]);
                self.generation += 1;
                self.ctxs[*req] = ReqContext::local(format!("r{req}-{}", self.generation));
            }
            Op::Lookup { key } => {
                let key = k(u64::from(*key));
                let expect = match self.model.slots.get(&key) {
                    None => tiering_core::LookupResult::Miss,
                    Some((_, -1)) => tiering_core::LookupResult::HitPending,
                    Some(_) => tiering_core::LookupResult::Hit,
                };
                prop_assert_eq!(self.tier.lookup(&key, &self.ctxs[0]), expect);
            }
            Op::Events => self.drain_events()?,
            Op::Reset => {
                let idle =
                    self.pending.iter().chain(&self.pinned).all(Vec::is_empty) && self.reads.is_empty();
                if idle {
                    self.drain_events()?;
                    self.tier.reset();
                    self.model = Model::default();
                }
            }
        }
        Ok(())
    }

    /// A load for request `req`, or a cascade read when `req` is `None`.
    fn pin(&mut self, req: Option<usize>, keys: &[u8]) -> Result<(), TestCaseError> {
        let want: Vec<OffloadKey> = keys.iter().map(|&n| k(u64::from(n))).collect();
        let all_ready = want.iter().all(|key| self.ready(key));
        let result = match req {
            Some(r) => self.tier.prepare_load(&want, &self.ctxs[r].clone()),
            None => self.tier.prepare_read(&want, &ReqContext::local("cascade")),
        };
        match result {
            Err(_) => prop_assert!(!all_ready, "pinning ready keys refused"),
            Ok(rows) => {
                prop_assert!(all_ready, "pinning unready keys accepted");
                for (key, row) in want.iter().zip(rows) {
                    let slot = self.model.slots.get_mut(key).expect("ready");
                    prop_assert_eq!(slot.0, row);
                    slot.1 += 1;
                }
                match req {
                    Some(r) => self.pinned[r].extend(want),
                    None => self.reads.extend(want),
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.tier.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert!(self.tier.resident() <= CAP);
        prop_assert_eq!(self.tier.resident(), self.model.slots.len());
        for (key, (chunk, r)) in &self.model.slots {
            prop_assert_eq!(self.tier.ref_count(key), Some(*r));
            prop_assert_eq!(self.tier.chunk_of(key), Some(*chunk));
        }
        Ok(())
    }

    fn finish_everything(&mut self) -> Result<(), TestCaseError> {
        for req in 0..REQS {
            let keys = std::mem::take(&mut self.pinned[req]);
            self.tier
                .complete_load(&keys, &self.ctxs[req])
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            for key in keys {
                self.model.slots.get_mut(&key).expect("pinned").1 -= 1;
            }
            let keys = std::mem::take(&mut self.pending[req]);
            self.apply_complete(&keys, req);
        }
        let reads = std::mem::take(&mut self.reads);
        self.tier
            .complete_read(&reads, &ReqContext::local("cascade"))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for key in reads {
            self.model.slots.get_mut(&key).expect("read").1 -= 1;
        }
        prop_assert_eq!(self.tier.total_pins(), 0, "pins left after every load completed");
        prop_assert_eq!(self.tier.num_evictable(), self.tier.resident());
        self.check()?;
        self.drain_events()
    }

    fn apply_complete(&mut self, keys: &[OffloadKey], req: usize) {
        self.tier.complete_store(keys, &self.ctxs[req], true);
        for key in keys {
            if let Some(slot) = self.model.slots.get_mut(key) {
                if slot.1 == -1 {
                    slot.1 = 0;
                }
            }
        }
    }
}

fn run(policy: PolicyKind, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut h = Harness::new(policy);
    for op in ops {
        h.apply(op)?;
        h.check()?;
    }
    h.finish_everything()
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(96))]

    #[test]
    fn lru_respects_the_model(ops in prop::collection::vec(op_strategy(), 1..160)) {
        run(PolicyKind::Lru, &ops)?;
    }

    #[test]
    fn arc_respects_the_model(ops in prop::collection::vec(op_strategy(), 1..160)) {
        run(PolicyKind::Arc, &ops)?;
    }

    #[test]
    fn s3fifo_respects_the_model(ops in prop::collection::vec(op_strategy(), 1..160)) {
        run(PolicyKind::S3Fifo, &ops)?;
    }
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    #[ignore = "soak: thousands of long random sequences per policy"]
    fn soak_every_policy_respects_the_model(ops in prop::collection::vec(op_strategy(), 1..600)) {
        for policy in PolicyKind::ALL {
            run(policy, &ops)?;
        }
    }
}
