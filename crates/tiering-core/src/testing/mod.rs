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
