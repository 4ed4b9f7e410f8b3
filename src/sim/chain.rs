//! The tier chain the simulator drives: a [`TieringManager`] plus the primary tier's arena,
//! which the engine's copy worker needs and which the manager does not hand out.

use std::sync::Arc;

use tiering_core::{ChunkArena, ManagerConfig, PrimaryTier, SecondaryTier, TieringManager};

use super::error::BoxError;

/// A built chain, ready to drive.
pub struct Chain {
    /// The manager over the chain.
    pub manager: TieringManager,
    /// The primary tier's arena (rows the device copies read and write).
    pub arena: Arc<ChunkArena>,
    /// The primary tier's name.
    pub primary: String,
    /// The secondary tiers' names, in chain (lookup) order.
    pub secondaries: Vec<String>,
}

impl Chain {
    /// A manager over `primary` and `secondaries`; the arena is taken from the primary first.
    #[must_use]
    pub fn new(
        primary: Box<dyn PrimaryTier>,
        secondaries: Vec<Box<dyn SecondaryTier>>,
        config: ManagerConfig,
    ) -> Self {
        let arena = Arc::clone(primary.arena());
        let primary_name = primary.info().name;
        let names = secondaries.iter().map(|t| t.info().name).collect();
        Self {
            manager: TieringManager::new(primary, secondaries, config),
            arena,
            primary: primary_name,
            secondaries: names,
        }
    }

    /// As [`Chain::new`] for a manager built elsewhere (for example from a chain file).
    #[must_use]
    pub fn from_parts(
        manager: TieringManager,
        arena: Arc<ChunkArena>,
        primary: String,
        secondaries: Vec<String>,
    ) -> Self {
        Self {
            manager,
            arena,
            primary,
            secondaries,
        }
    }
}

/// Builds a fresh chain for a run, given the engine's chunk size in bytes.
pub trait ChainFactory {
    /// Builds the chain.
    ///
    /// # Errors
    /// Whatever the tiers' construction reports.
    fn build(&self, chunk_bytes: usize) -> Result<Chain, BoxError>;
}

impl<F> ChainFactory for F
where
    F: Fn(usize) -> Result<Chain, BoxError>,
{
    fn build(&self, chunk_bytes: usize) -> Result<Chain, BoxError> {
        self(chunk_bytes)
    }
}
