//! Test doubles shared by every crate's tests (feature `test-utils`): a minimal in-memory
//! primary tier, a scriptable secondary tier that records its calls, an engine driver, and a
//! stable-toolchain fuzz driver.

mod engine;
pub mod fuzz;
mod memory_primary;
mod scripted_tier;

pub use engine::Engine;
pub use memory_primary::MemoryPrimary;
pub use scripted_tier::{
    Call, Completion, PeerRequest, ScriptedTier, ScriptedTierHandle, ScriptedTierView, ServedPeer,
    next_sequence,
};

use crate::manager::TieringManager;

/// Whether another thread can take a step of `manager` within `patience`: the lock is free (a
/// test's check that a failed or panicking call released it).
#[must_use]
pub fn lock_is_free(manager: &TieringManager, patience: std::time::Duration) -> bool {
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        scope.spawn(move || {
            drop(manager.detached_step());
            let _ = tx.send(());
        });
        rx.recv_timeout(patience).is_ok()
    })
}

/// The deterministic bytes of a chunk named `key`, `len` long: different for every key and every
/// byte position, so a test that reads a chunk back can tell it from any other (a xorshift
/// stream seeded by the key's digest).
#[must_use]
pub fn chunk_content(key: &crate::OffloadKey, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = key.digest() | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
