//! The tier chain the simulator drives: a [`TieringManager`] plus the primary tier's arena (the
//! rows the engine's copy worker reads and writes) and the tiers' names for the report.

use std::sync::Arc;

use tiering_config::ChainConfig;
use tiering_core::{
    ControlWaker, ManagerConfig, PrimaryTier, SecondaryTier, TieringManager, arena::ChunkArena,
    registry::Registry,
};

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

/// The tiers of a chain file, built but not yet handed to a manager (so callers keep the
/// primary's arena, or drive one tier alone, as `kvtier bench tiers` does).
pub struct BuiltTiers {
    /// The primary tier.
    pub primary: Box<dyn PrimaryTier>,
    /// The secondary tiers in chain order.
    pub secondaries: Vec<Box<dyn SecondaryTier>>,
    /// The waker every secondary was built with.
    pub waker: ControlWaker,
    /// The manager settings from `[control_plane]`.
    pub manager: ManagerConfig,
}

impl BuiltTiers {
    /// Resolves `config` against `registry` and builds every tier for chunks of `chunk_bytes`,
    /// primary first; on a failure the tiers already built are shut down in reverse order.
    ///
    /// # Errors
    /// An unknown tier type, or a factory that failed or panicked; the chain error names the
    /// file, line and tier.
    pub fn from_config(
        config: &ChainConfig,
        registry: &Registry,
        chunk_bytes: usize,
    ) -> Result<Self, BoxError> {
        let built = config.resolve(registry)?.build_tiers(chunk_bytes)?;
        Ok(Self {
            primary: built.primary,
            secondaries: built.secondaries,
            waker: built.waker,
            manager: built.manager_config,
        })
    }

    /// The chain over these tiers.
    #[must_use]
    pub fn into_chain(self) -> Chain {
        let arena = Arc::clone(self.primary.arena());
        let primary = self.primary.info().name;
        let names = self.secondaries.iter().map(|t| t.info().name).collect();
        Chain {
            manager: TieringManager::with_waker(self.primary, self.secondaries, self.manager, self.waker),
            arena,
            primary,
            secondaries: names,
        }
    }
}

/// A factory that builds the chain described by `config` with the tier types of `registry`.
pub fn config_chain(
    config: ChainConfig,
    registry: &'static Registry,
) -> impl Fn(usize) -> Result<Chain, BoxError> {
    move |chunk_bytes| Ok(BuiltTiers::from_config(&config, registry, chunk_bytes)?.into_chain())
}
