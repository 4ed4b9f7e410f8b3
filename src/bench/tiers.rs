//! `kvtier bench tiers`: store and load throughput of each tier of a chain, next to the physical
//! limit it is built on, measured in the same run and interleaved round by round so both see the
//! same machine state.
//!
//! - CPU (primary) tier: `prepare_store` + copy into the arena rows + `complete_store` (and the
//!   load direction), against a plain `memcpy` of the same bytes to and from a buffer as large
//!   as the data moved.
//! - Storage tiers: a cascade job (`submit_store` of granted rows) and a promotion job
//!   (`submit_load` into reserved rows, verified byte for byte), against raw `O_DIRECT`
//!   `pwrite`/`pread` in the same directory (buffered I/O when the filesystem refuses
//!   `O_DIRECT`, and the report says so): for a disk tier the same calls it makes (calls in
//!   flight × slots per call), for another storage tier one call per job (see
//!   `raw_file`).
//! - Redis tiers: the same cascade and promotion jobs against the `redis` crate's raw pipelined
//!   `SET`/`GET` of the same bytes to the same server, plus lookup latency (see [`super::redis`]).
//! - Remote tiers (peers) move data only between nodes: `kvtier bench fetch-rtt` measures them.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tier_disk::IoShape;
use tiering_core::{ControlWaker, Locality, Medium, PrimaryTier, SecondaryTier};

use super::BenchError;
use super::raw_file::RawFile;
use super::redis::LookupLatency;
use super::tier_config::TierBenchConfig;
use super::tier_figures::{Meter, TierBenchRow, row};
use super::tier_harness::Bench;
use crate::host_buffer::{HostBuffer, PAGE_ALIGN};
use crate::sim::{BuiltTiers, fill_chunk};

/// Every figure, plus the tiers that were not measured and why.
#[derive(Clone, Debug, Serialize)]
pub struct TierBenchReport {
    /// The settings.
    pub config: TierBenchConfig,
    /// The figures.
    pub rows: Vec<TierBenchRow>,
    /// Tiers not measured, with the reason.
    pub skipped: Vec<(String, String)>,
    /// Lookup latency of the tiers that answer lookups asynchronously (Redis).
    pub lookups: Vec<LookupLatency>,
}

impl fmt::Display for TierBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvtier bench tiers — {} KiB chunks, {} chunks per job, {} MiB per tier and direction",
            self.config.chunk_bytes / 1024,
            self.config.batch_chunks,
            self.config.total_bytes >> 20
        )?;
        writeln!(
            f,
            "  {:<10} {:<6} {:>10}   {:<34} {:>10} {:>7} {:>9}",
            "tier", "op", "GiB/s", "reference", "GiB/s", "ratio", "pair p50"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "  {:<10} {:<6} {:>10.2}   {:<34} {:>10.2} {:>7.2} {:>9.2}",
                r.tier, r.op, r.gib_per_s, r.reference, r.reference_gib_per_s, r.ratio, r.paired_ratio
            )?;
        }
        for l in &self.lookups {
            writeln!(
                f,
                "  {:<10} lookup p50 {:.0} µs, p99 {:.0} µs (first Retry to answer, {} keys); one lookup call p99 {:.1} µs",
                l.tier, l.p50_us, l.p99_us, l.samples, l.call_p99_us
            )?;
        }
        for (tier, why) in &self.skipped {
            writeln!(f, "  {tier:<10} skipped: {why}")?;
        }
        Ok(())
    }
}

/// Measures every tier of `tiers` and shuts them down.
///
/// # Errors
/// A setting out of range, a tier that refuses an operation, fails a job, returns wrong bytes or
/// does not report within the timeout, or a reference whose I/O fails.
pub fn bench_tiers(tiers: BuiltTiers, cfg: &TierBenchConfig) -> Result<TierBenchReport, BenchError> {
    let BuiltTiers {
        mut primary,
        mut secondaries,
        ..
    } = tiers;
    let arena = Arc::clone(primary.arena());
    if arena.chunk_bytes() != cfg.chunk_bytes {
        return Err(BenchError::InvalidSetting {
            name: "chunk_bytes",
            reason: format!(
                "the arena holds {} bytes per chunk, not {}",
                arena.chunk_bytes(),
                cfg.chunk_bytes
            ),
        });
    }
    let batch = cfg.batch_chunks.min(arena.num_chunks()).max(1);
    // Touch every row once, so first-touch page faults are not billed to the tier (the memcpy
    // reference copies between buffers that are already mapped). Nothing holds a row yet.
    for c in 0..arena.num_chunks() {
        arena.write_row(u32::try_from(c).unwrap_or(u32::MAX))?.fill(0);
    }
    let batch_bytes = (batch * cfg.chunk_bytes) as u64;
    let rounds = cfg.total_bytes.div_ceil(batch_bytes).max(1);
    let mut bench = Bench::new(arena, batch, rounds, cfg);
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let mut lookups = Vec::new();
    let result = (|| -> Result<(), BenchError> {
        rows.extend(bench.primary(primary.as_mut())?);
        for tier in &mut secondaries {
            let info = tier.info();
            if let Some(target) = cfg.redis.iter().find(|t| t.name == info.name) {
                let (r, l) = bench.redis(primary.as_mut(), tier.as_mut(), target)?;
                rows.extend(r);
                lookups.push(l);
                continue;
            }
            if info.locality == Some(Locality::Remote) {
                skipped.push((
                    info.name,
                    "a peer tier moves data only between nodes; `kvtier bench fetch-rtt` measures it".into(),
                ));
                continue;
            }
            if info.medium == Some(Medium::Cpu) {
                skipped.push((info.name, "no physical reference for a CPU secondary tier".into()));
                continue;
            }
            rows.extend(bench.secondary(primary.as_mut(), tier.as_mut())?);
        }
        Ok(())
    })();
    primary.on_request_finished(&bench.ctx);
    for t in &mut secondaries {
        if let Err(e) = t.shutdown() {
            tracing::warn!(tier = %t.info().name, error = %e, "shutdown after the benchmark failed");
        }
    }
    if let Err(e) = primary.shutdown() {
        tracing::warn!(error = %e, "primary shutdown after the benchmark failed");
    }
    result?;
    Ok(TierBenchReport {
        config: cfg.clone(),
        rows,
        skipped,
        lookups,
    })
}

/// The memcpy reference: `src` into `dst` one `chunk`-sized call at a time, as the tier's rows
/// are copied. A single batch-sized memcpy would take glibc's streaming-store path for large
/// copies, another kind of copy than the one it is the reference for.
fn copy_by_chunk(dst: &mut [u8], src: &[u8], chunk: usize) {
    for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
        d.copy_from_slice(s);
    }
}

impl Bench<'_> {
    /// Primary: engine-side store and load through the tier's bookkeeping and arena rows.
    fn primary(&mut self, primary: &mut dyn PrimaryTier) -> Result<Vec<TierBenchRow>, BenchError> {
        let name = primary.info().name;
        let cb = self.cfg.chunk_bytes;
        // Page-aligned like an engine's pinned staging buffers and like the rows, so neither side
        // of a ratio copies between buffers of mismatched alignment (`crate::host_buffer`).
        let mut device = HostBuffer::page_aligned(self.batch * cb);
        let mut scratch = HostBuffer::page_aligned(self.batch * cb);
        for (i, c) in device.chunks_mut(cb).enumerate() {
            c.fill(i as u8);
        }
        // The reference copies to and from a buffer as large as the data the tier's rows
        // spread over (capped by the arena), touched up front: a cache-warm 2×batch memcpy
        // would flatter the reference against rows spread over the arena.
        let batch_len = self.batch * cb;
        let regions = usize::try_from(self.rounds + 1)
            .unwrap_or(usize::MAX)
            .min(self.arena.num_chunks() / self.batch)
            .max(1);
        let mut cold = HostBuffer::filled(regions * batch_len, PAGE_ALIGN, 0x5A);
        let (mut store, mut load, mut copy_in, mut copy_out) = (
            Meter::default(),
            Meter::default(),
            Meter::default(),
            Meter::default(),
        );
        // One untimed round first, so page faults of fresh rows do not count.
        for round in 0..=self.rounds {
            let keys = self.fresh_keys();
            let region = (round as usize % regions) * batch_len;
            // The sides take turns going first: whichever copies second finds its source or
            // destination already in cache from the first.
            let tier_first = round % 2 == 0;
            let (mut store_time, mut copy_time) = (Duration::ZERO, Duration::ZERO);
            for side in [tier_first, !tier_first] {
                let t = Instant::now();
                if side {
                    let out = primary
                        .prepare_store(&keys, &self.ctx)
                        .ok_or_else(|| Self::tier_err(&name, "prepare_store found no room for one batch"))?;
                    for (c, src) in out.chunk_ids.iter().zip(device.chunks(cb)) {
                        self.arena.write_row(*c)?.copy_from_slice(src);
                    }
                    primary.complete_store(&out.keys_to_store, &self.ctx, true);
                    store_time = t.elapsed();
                } else {
                    copy_by_chunk(&mut cold[region..region + batch_len], &device, cb);
                    copy_time = t.elapsed();
                }
            }
            let (mut load_time, mut back_time) = (Duration::ZERO, Duration::ZERO);
            for side in [tier_first, !tier_first] {
                let t = Instant::now();
                if side {
                    let rows = primary
                        .prepare_load(&keys, &self.ctx)
                        .map_err(|e| Self::tier_err(&name, e.to_string()))?;
                    for (c, dst) in rows.iter().zip(scratch.chunks_mut(cb)) {
                        dst.copy_from_slice(&self.arena.read_row(*c)?);
                    }
                    primary
                        .complete_load(&keys, &self.ctx)
                        .map_err(|e| Self::tier_err(&name, e.to_string()))?;
                    load_time = t.elapsed();
                } else {
                    copy_by_chunk(&mut scratch, &cold[region..region + batch_len], cb);
                    back_time = t.elapsed();
                }
            }
            if round > 0 {
                let b = (keys.len() * cb) as u64;
                store.add(b, store_time);
                copy_in.add(b, copy_time);
                load.add(b, load_time);
                copy_out.add(b, back_time);
            }
        }
        Ok(vec![
            row(&name, "store", &store, "memcpy", &copy_in),
            row(&name, "load", &load, "memcpy", &copy_out),
        ])
    }

    /// A storage tier: cascade and promotion jobs against raw O_DIRECT I/O.
    fn secondary(
        &mut self,
        primary: &mut dyn PrimaryTier,
        tier: &mut dyn SecondaryTier,
    ) -> Result<Vec<TierBenchRow>, BenchError> {
        let name = tier.info().name;
        let cb = self.cfg.chunk_bytes;
        let disk = self.cfg.disk.iter().find(|d| d.name == name);
        let shape = disk.and_then(|d| IoShape::for_job(cb, d.io_threads, self.batch));
        // The reference writes as many distinct bytes of file as the tier can.
        let moved = self
            .rounds
            .saturating_add(1)
            .saturating_mul((self.batch * cb) as u64);
        let spread = disk.map_or(moved, |d| moved.min(d.capacity));
        let reserve = disk.is_some_and(|d| d.preallocate);
        let mut reference = RawFile::open(
            &self.cfg.scratch_dir,
            self.batch,
            cb,
            shape.as_ref(),
            (spread, reserve),
        )?;
        let (mut store, mut load, mut raw_w, mut raw_r) = (
            Meter::default(),
            Meter::default(),
            Meter::default(),
            Meter::default(),
        );
        // Await each job asleep on the tier's waker, which it fires when a job ends, not in a
        // poll loop (a poller on a 2-core machine steals a core from the tier's workers).
        let waker = ControlWaker::new();
        tier.set_waker(waker.clone());
        tier.on_new_request(&self.ctx);
        let mut job_id = 1u64 << 40;
        for round in 0..=self.rounds {
            let keys = self.fresh_keys();
            // Stage the batch in the primary (untimed), with content the load can verify.
            let out = primary
                .prepare_store(&keys, &self.ctx)
                .ok_or_else(|| Self::tier_err(&name, "the primary has no room for one batch"))?;
            for (c, k) in out.chunk_ids.iter().zip(&out.keys_to_store) {
                fill_chunk(k, &mut self.arena.write_row(*c)?);
            }
            primary.complete_store(&out.keys_to_store, &self.ctx, true);
            let rows = primary
                .prepare_read(&keys, &self.ctx)
                .map_err(|e| Self::tier_err(&name, e.to_string()))?;
            // The sides take turns going first: the first after an idle spell also pays for
            // waking the machine.
            let tier_first = round % 2 == 0;
            job_id += 1;
            let (store_time, write_time) = if tier_first {
                let s = self.store_pinned(&name, tier, primary, (&keys, &rows), job_id, &waker)?;
                (s, reference.write_batch()?)
            } else {
                let w = reference.write_batch()?;
                (
                    self.store_pinned(&name, tier, primary, (&keys, &rows), job_id, &waker)?,
                    w,
                )
            };
            // Drop the primary copies so the load really comes from the tier.
            primary.reset();
            job_id += 1;
            let (load_time, read_time) = if tier_first {
                let l = self.load_back_verified(&name, tier, primary, &keys, job_id, &waker)?;
                (l, reference.read_batch()?)
            } else {
                let r = reference.read_batch()?;
                (
                    self.load_back_verified(&name, tier, primary, &keys, job_id, &waker)?,
                    r,
                )
            };
            primary.reset();
            if round > 0 {
                let b = (keys.len() * cb) as u64;
                store.add(b, store_time);
                load.add(b, load_time);
                raw_w.add(b, write_time);
                raw_r.add(b, read_time);
            }
        }
        tier.on_request_finished(&self.ctx);
        Ok(vec![
            row(&name, "store", &store, &reference.label("write"), &raw_w),
            row(&name, "load", &load, &reference.label("read"), &raw_r),
        ])
    }
}
