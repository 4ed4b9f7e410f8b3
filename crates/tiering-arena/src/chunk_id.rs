//! The name of a row.

/// Index of a row (chunk slot) in a [`ChunkArena`](crate::ChunkArena).
pub type ChunkId = u32;
