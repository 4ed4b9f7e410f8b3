//! A chain driven through several workloads in turn, for runs that last (`kvtier soak`): the
//! manager, its tiers and what they hold persist from one workload to the next, and each
//! workload's figures come back on their own.

use std::sync::Arc;

use tiering_core::{ManagerStats, OffloadingEvent, arena::ChunkArena};

use super::chain::ChainFactory;
use super::config::SimConfig;
use super::engine::{Engine, check_workload};
use super::error::SimError;
use super::metrics::RunMetrics;
use super::offload::Offload;
use super::workload::Workload;

/// A built chain and the engine settings it runs under; see the module documentation.
pub struct Session {
    cfg: SimConfig,
    off: Option<Offload>,
    arena: Arc<ChunkArena>,
    tiers: Vec<String>,
}

impl Session {
    /// Builds the chain (for chunks of `cfg.chunk_bytes`). The KV-cache events its tiers emit
    /// are kept for [`Session::take_events`].
    ///
    /// # Errors
    /// An invalid setting, or a chain that cannot be built or whose rows do not fit the chunks.
    pub fn start(factory: &dyn ChainFactory, cfg: &SimConfig) -> Result<Self, SimError> {
        cfg.validate()?;
        let chain = factory.build(cfg.chunk_bytes).map_err(SimError::Chain)?;
        if chain.arena.chunk_bytes() != cfg.chunk_bytes {
            return Err(SimError::InvalidSetting {
                name: "chunk_bytes",
                reason: format!(
                    "the chain's arena rows hold {} bytes, the engine's chunks {}",
                    chain.arena.chunk_bytes(),
                    cfg.chunk_bytes
                ),
            });
        }
        let tiers = std::iter::once(chain.primary.clone())
            .chain(chain.secondaries.iter().cloned())
            .collect();
        let arena = Arc::clone(&chain.arena);
        let mut off = Offload::new(chain.manager, chain.arena, chain.secondaries.len())?;
        off.keep_events();
        Ok(Self {
            cfg: cfg.clone(),
            off: Some(off),
            arena,
            tiers,
        })
    }

    /// Runs every request of `workload` to completion and drains the tiers' jobs. A failed run
    /// ends the session (its manager is gone; later calls fail).
    ///
    /// # Errors
    /// An empty or oversized workload, a manager error, a copy-worker failure, or a run that
    /// stalls (no progress within `cfg.drain_timeout`).
    pub fn run(&mut self, workload: &Workload) -> Result<RunMetrics, SimError> {
        check_workload(&self.cfg, workload)?;
        let off = self
            .off
            .take()
            .ok_or_else(|| SimError::Worker("the session's manager is gone after a failed run".into()))?;
        let (metrics, off) = Engine::new(&self.cfg, &workload.requests, Some(off), None)?.run()?;
        self.off = off;
        Ok(metrics)
    }

    /// The primary tier's arena (the rows the engine's copies read and write).
    #[must_use]
    pub fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    /// The tiers' names: the primary first, then the secondaries in chain order.
    #[must_use]
    pub fn tiers(&self) -> &[String] {
        &self.tiers
    }

    /// The manager's and tiers' counters.
    ///
    /// # Errors
    /// The manager's error, or the session ended.
    pub fn stats(&mut self) -> Result<ManagerStats, SimError> {
        self.live()?.stats()
    }

    /// The KV-cache events the tiers emitted since the last call, in order (also the ones
    /// still queued in the manager).
    ///
    /// # Errors
    /// The manager's error, or the session ended.
    pub fn take_events(&mut self) -> Result<Vec<OffloadingEvent>, SimError> {
        let off = self.live()?;
        off.take_events()?;
        Ok(off.take_kept_events())
    }

    /// Shuts the manager and its tiers down.
    ///
    /// # Errors
    /// The manager's error, or the session ended.
    pub fn shutdown(mut self) -> Result<(), SimError> {
        self.live()?.shutdown()
    }

    fn live(&mut self) -> Result<&mut Offload, SimError> {
        self.off
            .as_mut()
            .ok_or_else(|| SimError::Worker("the session's manager is gone after a failed run".into()))
    }
}

/// Runs `workload` with offloading off (the device prefix cache only): the reference a run
/// with offloading is compared against.
///
/// # Errors
/// An invalid setting or workload, or a run that stalls.
pub fn run_offload_off(cfg: &SimConfig, workload: &Workload) -> Result<RunMetrics, SimError> {
    cfg.validate()?;
    check_workload(cfg, workload)?;
    Ok(Engine::new(cfg, &workload.requests, None, None)?.run()?.0)
}
