//! Shared helpers for the manager integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

pub use tiering_core::testing::Engine;
use tiering_core::testing::{MemoryPrimary, ScriptedTier, ScriptedTierHandle};
use tiering_core::{
    ManagerConfig, OffloadKey, ReqContext, ScheduleEndContext, SecondaryTier, TieringManager,
};

/// Bytes per chunk in these tests.
pub const CHUNK: usize = 64;

/// A generous deadline for waiting on the control thread (a liveness bound, not a speed check).
pub const PATIENCE: Duration = Duration::from_secs(30);

pub struct Rig {
    pub m: Engine,
    pub primary: MemoryPrimary,
    pub tiers: Vec<ScriptedTierHandle>,
}

pub fn rig(num_chunks: usize, tier_names: &[&str], config: ManagerConfig) -> Rig {
    let primary = MemoryPrimary::new(num_chunks, CHUNK);
    let mut boxed: Vec<Box<dyn SecondaryTier>> = Vec::new();
    let mut tiers = Vec::new();
    for name in tier_names {
        let (t, h) = ScriptedTier::new(name);
        boxed.push(Box::new(t));
        tiers.push(h);
    }
    let m = Engine::new(TieringManager::new(Box::new(primary.clone()), boxed, config));
    Rig { m, primary, tiers }
}

pub fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

pub fn bytes_for(k: &OffloadKey) -> Vec<u8> {
    let seed = k.to_bytes()[31];
    (0..CHUNK).map(|i| seed.wrapping_add(i as u8)).collect()
}

pub fn end_step(m: &mut Engine) {
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// Stores `keys` into the primary as the engine would: prepare, write the rows, complete.
pub fn store(m: &mut Engine, primary: &MemoryPrimary, ctx: &ReqContext, keys: &[OffloadKey]) {
    let out = m.prepare_store(keys, ctx).unwrap().expect("room in primary");
    let arena = tiering_core::PrimaryTier::arena(primary).clone();
    for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        arena.write_row(*c).unwrap().copy_from_slice(&bytes_for(k));
    }
    if !out.keys_to_store.is_empty() {
        m.complete_store(&out.keys_to_store, ctx, true).unwrap();
    }
}

/// Reads the bytes of a primary hit through a load, as the engine's device copier would.
pub fn load_bytes(m: &mut Engine, primary: &MemoryPrimary, ctx: &ReqContext, k: OffloadKey) -> Vec<u8> {
    let ids = m.prepare_load(&[k], ctx).unwrap();
    let arena = tiering_core::PrimaryTier::arena(primary).clone();
    let bytes = arena.read_row(ids[0]).unwrap().to_vec();
    m.complete_load(&[k], ctx).unwrap();
    bytes
}

/// Polls `pred` until it holds or `PATIENCE` passes.
pub fn eventually(mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        if pred() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    pred()
}
