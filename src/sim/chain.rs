//! The tier chain the simulator drives: a [`TieringManager`] plus the primary tier's arena,
//! which the engine's copy worker needs and which the manager does not hand out.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use tiering_core::config::{ChainConfig, TierSource, TierSpec};
use tiering_core::plugin::PluginTier;
use tiering_core::registry::TierFactory;
use tiering_core::{
    ChunkArena, ControlWaker, ManagerConfig, PrimaryContext, PrimaryTier, Registry, SecondaryContext,
    SecondaryTier, TierError, TieringManager,
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

/// A tier of a chain file that could not be built: where it is and why.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {tier}: {message}")]
pub struct TierBuildError {
    /// The chain file.
    pub file: String,
    /// The line of the tier's section.
    pub line: usize,
    /// The tier's position and type.
    pub tier: String,
    /// What went wrong.
    pub message: String,
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
    /// An unknown tier type (the chain error names file, line and key), or a factory that
    /// failed or panicked ([`TierBuildError`]).
    pub fn from_config(
        config: &ChainConfig,
        registry: &Registry,
        chunk_bytes: usize,
    ) -> Result<Self, BoxError> {
        let resolved = config.resolve(registry)?;
        let specs: Vec<&TierSpec> = config.tiers().collect();
        let fail = |spec: &TierSpec, message: String| TierBuildError {
            file: config.source.clone(),
            line: spec.line,
            tier: spec.describe(),
            message,
        };
        let TierSource::Linked {
            factory: TierFactory::Primary(make_primary),
            ..
        } = resolved.sources[0]
        else {
            return Err(fail(
                specs[0],
                "the primary tier must be a registered primary type".into(),
            )
            .into());
        };
        let mut primary = guarded(|| make_primary(&specs[0].options, &PrimaryContext::new(chunk_bytes)))
            .map_err(|e| fail(specs[0], e.to_string()))?;
        let waker = ControlWaker::new();
        let mut secondaries: Vec<Box<dyn SecondaryTier>> = Vec::new();
        for (spec, source) in specs[1..].iter().zip(&resolved.sources[1..]) {
            let ctx = SecondaryContext::new(Arc::clone(primary.arena()), waker.clone());
            let made = match *source {
                TierSource::Linked {
                    factory: TierFactory::Secondary(f),
                    ..
                } => guarded(|| f(&spec.options, &ctx)).map_err(|e| e.to_string()),
                TierSource::Library(lib) => PluginTier::create(lib, &spec.options, &ctx)
                    .map(|t| Box::new(t) as Box<dyn SecondaryTier>)
                    .map_err(|e| e.to_string()),
                TierSource::Linked { .. } => Err("a primary tier type cannot be a secondary".into()),
            };
            match made {
                Ok(t) => secondaries.push(t),
                Err(message) => {
                    while let Some(mut t) = secondaries.pop() {
                        if let Err(e) = t.shutdown() {
                            tracing::warn!(tier = %t.info().name, error = %e, "shutdown after a failed build");
                        }
                    }
                    if let Err(e) = primary.shutdown() {
                        tracing::warn!(error = %e, "primary shutdown after a failed build");
                    }
                    return Err(fail(spec, message).into());
                }
            }
        }
        Ok(Self {
            primary,
            secondaries,
            waker,
            manager: config.control_plane.manager_config(),
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

/// Runs a tier factory, turning a panic into an error.
fn guarded<T>(f: impl FnOnce() -> Result<T, TierError>) -> Result<T, TierError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let text = p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a non-string payload".into());
        Err(TierError::Other(format!("the factory panicked: {text}")))
    })
}
