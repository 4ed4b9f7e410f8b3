//! The harness every tier's measurement in `kvtier bench tiers` runs in: the primary's arena,
//! the benchmark's request, fresh keys for each round, and the cascade and promotion jobs it
//! submits to a secondary tier and awaits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tiering_core::{
    ControlWaker, JobId, JobKind, JobOutcome, JobResult, OffloadKey, PrimaryTier, ReqContext, SecondaryTier,
    TransferJob,
    arena::{ChunkArena, ChunkId, RowGrant},
};

use super::BenchError;
use super::tier_config::TierBenchConfig;
use crate::sim::{SimRng, chunk_matches};

/// One run of `kvtier bench tiers`: what each tier's measurement shares.
pub(super) struct Bench<'a> {
    /// The primary tier's arena.
    pub(super) arena: Arc<ChunkArena>,
    /// The request every call of the run is made for.
    pub(super) ctx: ReqContext,
    rng: SimRng,
    /// Chunks per job.
    pub(super) batch: usize,
    /// Timed rounds per tier (each measurement adds one untimed round first).
    pub(super) rounds: u64,
    /// The settings.
    pub(super) cfg: &'a TierBenchConfig,
}

impl<'a> Bench<'a> {
    /// A run over `arena` moving `batch` chunks per job for `rounds` rounds; its keys are
    /// seeded from `cfg.seed` and the process id, so each run stores new data.
    pub(super) fn new(arena: Arc<ChunkArena>, batch: usize, rounds: u64, cfg: &'a TierBenchConfig) -> Self {
        Self {
            arena,
            ctx: ReqContext::local("kvtier-bench"),
            rng: SimRng::new(cfg.seed ^ std::process::id() as u64),
            batch,
            rounds,
            cfg,
        }
    }
}

impl Bench<'_> {
    /// One batch of keys no run has used.
    pub(super) fn fresh_keys(&mut self) -> Vec<OffloadKey> {
        (0..self.batch)
            .map(|_| OffloadKey::from_u64(self.rng.next_u64()))
            .collect()
    }

    /// The error of `tier` refusing or failing an operation.
    pub(super) fn tier_err(tier: &str, message: impl Into<String>) -> BenchError {
        BenchError::Tier {
            tier: tier.to_owned(),
            message: message.into(),
        }
    }

    /// Stores the primary rows `rows` (pinned for reading, holding `keys`) into `tier` as job
    /// `job_id`, then releases the pins; returns the time of the store job alone.
    pub(super) fn store_pinned(
        &self,
        name: &str,
        tier: &mut dyn SecondaryTier,
        primary: &mut dyn PrimaryTier,
        (keys, rows): (&[OffloadKey], &[ChunkId]),
        job_id: u64,
        waker: &ControlWaker,
    ) -> Result<Duration, BenchError> {
        let job = TransferJob {
            id: JobId(job_id),
            kind: JobKind::Store,
            keys: keys.to_vec(),
            chunk_ids: rows.to_vec(),
            req: self.ctx.clone(),
            rows: RowGrant::Read(self.arena.read_rows(rows)?),
        };
        let t = Instant::now();
        tier.submit_store(job);
        let r = self.await_job(tier, JobId(job_id), waker)?;
        let store_time = t.elapsed();
        primary
            .complete_read(keys, &self.ctx)
            .map_err(|e| Self::tier_err(name, e.to_string()))?;
        if r.outcome != JobOutcome::Ok {
            return Err(Self::tier_err(name, format!("store job failed: {:?}", r.outcome)));
        }
        Ok(store_time)
    }

    /// Loads `keys` back from `tier` into freshly reserved primary rows (the primary forgot
    /// them), as job `job_id`; checks every byte and returns the time of the load job alone.
    pub(super) fn load_back_verified(
        &self,
        name: &str,
        tier: &mut dyn SecondaryTier,
        primary: &mut dyn PrimaryTier,
        keys: &[OffloadKey],
        job_id: u64,
        waker: &ControlWaker,
    ) -> Result<Duration, BenchError> {
        let out = primary
            .prepare_write(keys, &self.ctx)
            .ok_or_else(|| Self::tier_err(name, "the primary has no room to load a batch"))?;
        let job = TransferJob {
            id: JobId(job_id),
            kind: JobKind::Promotion,
            keys: out.keys_to_store.clone(),
            chunk_ids: out.chunk_ids.clone(),
            req: self.ctx.clone(),
            rows: RowGrant::Write(self.arena.write_rows(&out.chunk_ids)?),
        };
        let t = Instant::now();
        tier.submit_load(job);
        let r = self.await_job(tier, JobId(job_id), waker)?;
        let load_time = t.elapsed();
        let ok = r.outcome == JobOutcome::Ok;
        primary.complete_write(&out.keys_to_store, &self.ctx, ok);
        if !ok {
            return Err(Self::tier_err(name, format!("load job failed: {:?}", r.outcome)));
        }
        for (c, k) in out.chunk_ids.iter().zip(&out.keys_to_store) {
            if !chunk_matches(k, &self.arena.read_row(*c)?) {
                return Err(Self::tier_err(
                    name,
                    format!("chunk {k} came back with different bytes"),
                ));
            }
        }
        Ok(load_time)
    }

    /// Waits for job `id`'s result, asleep on `waker` (set on the tier) between polls.
    pub(super) fn await_job(
        &self,
        tier: &mut dyn SecondaryTier,
        id: JobId,
        waker: &ControlWaker,
    ) -> Result<JobResult, BenchError> {
        let deadline = Instant::now() + self.cfg.job_timeout;
        let mut out = Vec::new();
        loop {
            tier.poll_finished(&mut out);
            if let Some(pos) = out.iter().position(|r| r.id == id) {
                return Ok(out.swap_remove(pos));
            }
            let now = Instant::now();
            if now > deadline {
                return Err(Self::tier_err(
                    &tier.info().name,
                    format!("{id} not reported within {:?}", self.cfg.job_timeout),
                ));
            }
            // A tier that never fires its waker still gets polled every millisecond.
            waker.wait((deadline - now).min(Duration::from_millis(1)));
        }
    }
}
