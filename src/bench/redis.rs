//! The Redis tier in `kvtier bench tiers`: store and load throughput of the tier's cascade and
//! promotion jobs against the `redis` crate's raw pipelined `SET`/`GET` of the same bytes on
//! one connection to the same server (encoded and sent as the tier's workers do: see
//! `RawRedis`), interleaved round by round, the two sides taking turns going first; plus the latency of a lookup
//! from its first `Retry` to its answer (one pipelined `EXISTS` batch per round, asked by a
//! second tier instance with an empty presence cache so every answer comes from the server).
//!
//! A job is timed from its submission to its result, awaited as the engine's control plane
//! awaits it: asleep on the tier's waker, which the worker fires when the job ends. (A polling
//! loop would steal the worker's core on a small machine and bill the tier for its own sleeps.)
//!
//! The ratio depends on the chunk size (per-command overhead vs bytes), the batch size (one
//! pipeline per job up to the tier's `pipeline_bytes`), the tier's header and checksum work,
//! and — since server and client share this machine — on how many cores are free: a job
//! passes through three thread wake-ups (worker, server reply, waiting thread) where the
//! reference, on the waiting thread itself, passes through one (the reply); on a busy machine
//! each can wait for a scheduler slice, which weighs most on small jobs (small chunks).

use std::time::{Duration, Instant};

use serde::Serialize;
use tier_redis::{KeyScheme, RedisTier, RedisTierOptions};
use tiering_core::{ControlWaker, LookupResult, OffloadKey, PrimaryTier, ReqContext, SecondaryTier};

use super::BenchError;
use super::tier_config::RedisTarget;
use super::tier_figures::{Meter, TierBenchRow, row};
use super::tier_harness::Bench;
use crate::sim::fill_chunk;

/// Lookup latency of one tier: first call (`Retry`) to answer.
#[derive(Clone, Debug, Serialize)]
pub struct LookupLatency {
    /// The tier.
    pub tier: String,
    /// Keys looked up.
    pub samples: usize,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// 99th percentile of one `lookup` call itself (what the scheduler thread pays), µs.
    pub call_p99_us: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

fn raw_err(e: &redis::RedisError) -> BenchError {
    BenchError::Reference {
        reference: "redis raw pipeline".into(),
        error: std::io::Error::other(e.to_string()),
    }
}

impl Bench<'_> {
    /// Measures the Redis tier `tier` (built from `target`).
    pub(super) fn redis(
        &mut self,
        primary: &mut dyn PrimaryTier,
        tier: &mut dyn SecondaryTier,
        target: &RedisTarget,
    ) -> Result<(Vec<TierBenchRow>, LookupLatency), BenchError> {
        let name = target.name.clone();
        let cb = self.cfg.chunk_bytes;
        let mut raw = RawRedis::connect(&target.options)?;
        // A second instance: same server, namespace and layout, empty presence cache.
        let mut prober =
            RedisTier::connect(&target.options, cb).map_err(|e| Self::tier_err(&name, e.to_string()))?;
        let (mut store, mut load, mut raw_w, mut raw_r) = (
            Meter::default(),
            Meter::default(),
            Meter::default(),
            Meter::default(),
        );
        let (mut latencies, mut calls) = (Vec::new(), Vec::new());
        let mut staging = vec![0u8; self.batch * cb];
        tier.on_new_request(&self.ctx);
        // Jobs are awaited as the engine's control plane awaits them: asleep until the tier's
        // waker fires, not polling (a poller on a 2-core machine steals the worker's core).
        let waker = ControlWaker::new();
        tier.set_waker(waker.clone());
        let mut job_id = 1u64 << 41;
        let scheme = KeyScheme::new(&target.options.namespace, cb, &target.options.layout_fingerprint);
        for round in 0..=self.rounds {
            let keys = self.fresh_keys();
            raw.stored.extend(keys.iter().map(|k| scheme.name(k)));
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
            for (c, dst) in rows.iter().zip(staging.chunks_mut(cb)) {
                dst.copy_from_slice(&self.arena.read_row(*c)?);
            }
            // Whichever side goes first after the lookups or the round's set-up pays for waking
            // an idle server and machine (measured: ~1.5 ms on a 2 MiB job here), so the sides
            // take turns going first.
            let tier_first = round % 2 == 0;
            job_id += 1;
            let (store_time, write_time) = if tier_first {
                let s = self.store_pinned(&name, tier, primary, (&keys, &rows), job_id, &waker)?;
                (s, raw.set_batch(&staging, cb)?)
            } else {
                let w = raw.set_batch(&staging, cb)?;
                (
                    self.store_pinned(&name, tier, primary, (&keys, &rows), job_id, &waker)?,
                    w,
                )
            };

            self.lookups(&mut prober, &keys, &mut latencies, &mut calls)?;

            primary.reset();
            job_id += 1;
            let (load_time, read_time) = if tier_first {
                let l = self.load_back_verified(&name, tier, primary, &keys, job_id, &waker)?;
                (l, raw.get_batch(&mut staging, cb)?)
            } else {
                let r = raw.get_batch(&mut staging, cb)?;
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
        if let Err(e) = prober.shutdown() {
            tracing::warn!(error = %e, "shutting the lookup prober down failed");
        }
        drop(raw);
        latencies.sort();
        calls.sort();
        let lookup = LookupLatency {
            tier: name.clone(),
            samples: latencies.len(),
            p50_us: percentile(&latencies, 0.50),
            p99_us: percentile(&latencies, 0.99),
            call_p99_us: percentile(&calls, 0.99),
        };
        Ok((
            vec![
                row(
                    &name,
                    "store",
                    &store,
                    "redis-rs raw pipelined SET, packed",
                    &raw_w,
                ),
                row(&name, "load", &load, "redis-rs raw pipelined GET, packed", &raw_r),
            ],
            lookup,
        ))
    }

    /// Looks `keys` up on `prober` as a scheduler does: every key once (`Retry`), the step
    /// ends (the batch goes out), then again until each resolves; records each key's latency.
    fn lookups(
        &self,
        prober: &mut RedisTier,
        keys: &[OffloadKey],
        latencies: &mut Vec<Duration>,
        calls: &mut Vec<Duration>,
    ) -> Result<(), BenchError> {
        let ctx = ReqContext::local("kvtier-bench-lookup");
        let start = Instant::now();
        let mut pending: Vec<OffloadKey> = keys.to_vec();
        let deadline = start + self.cfg.job_timeout;
        loop {
            let mut still = Vec::with_capacity(pending.len());
            for k in pending {
                let t = Instant::now();
                let r = prober.lookup(&k, &ctx);
                calls.push(t.elapsed());
                match r {
                    LookupResult::Retry => still.push(k),
                    LookupResult::Hit => latencies.push(start.elapsed()),
                    other => {
                        return Err(Self::tier_err(
                            &prober.info().name,
                            format!("lookup of a stored chunk answered {other:?}"),
                        ));
                    }
                }
            }
            if still.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Self::tier_err(&prober.info().name, "lookups never resolved"));
            }
            prober.on_schedule_end();
            pending = still;
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// The reference: one connection, one pipeline per batch, the chunk bytes as plain values. It
/// drives the connection as the tier's workers do, so it is as good a client as the tier's:
/// commands encoded once into a reused buffer, `SET`s sent every [`SEND_BYTES`] as they are
/// encoded, replies read one by one (each `GET` value copied out as it arrives) — minus the
/// tier's header, checksum, worker hand-off and job bookkeeping. Each batch writes new keys, as
/// the tier's cascades do: overwriting the same keys every round let the server reuse the
/// values it had just freed, while the tier's new keys grow its dictionary and take fresh memory
/// (measured at 64 KiB chunks: the tier read 0.5 of a reference that overwrote).
struct RawRedis {
    conn: redis::Connection,
    /// Opens the clean-up connection (the measuring one may hold unread replies after an error).
    client: redis::Client,
    prefix: String,
    /// Reference keys written so far (`prefix` + 0..keys); the last batch is the last `batch`.
    keys: usize,
    batch: usize,
    /// The tier's keys this run stored (deleted at the end: the benchmark's data is not cache).
    stored: Vec<Vec<u8>>,
    /// The encoded commands, reused from batch to batch.
    buf: Vec<u8>,
}

/// Encoded `SET` bytes per write, as the tier's workers send them.
const SEND_BYTES: usize = 256 << 10;

/// Appends the RESP bulk string `data`.
fn bulk(buf: &mut Vec<u8>, data: &[u8]) {
    buf.push(b'$');
    buf.extend_from_slice(data.len().to_string().as_bytes());
    buf.extend_from_slice(b"\r\n");
    buf.extend_from_slice(data);
    buf.extend_from_slice(b"\r\n");
}

impl RawRedis {
    fn connect(opts: &RedisTierOptions) -> Result<Self, BenchError> {
        let url = opts
            .server_urls()
            .ok()
            .and_then(|u| u.into_iter().next())
            .unwrap_or_default();
        if opts.cluster {
            return Err(BenchError::InvalidSetting {
                name: "cluster",
                reason: "the raw reference needs one standalone server; bench a `url` chain".into(),
            });
        }
        let mut info =
            redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(|e| raw_err(&e))?;
        if let Ok(Some(p)) = opts.password() {
            let settings = info.redis_settings().clone().set_password(p);
            info = info.set_redis_settings(settings);
        }
        // As the tier's connections: Nagle off.
        let client = redis::Client::open(tier_redis::with_nodelay(info)).map_err(|e| raw_err(&e))?;
        let conn = client.get_connection().map_err(|e| raw_err(&e))?;
        Ok(Self {
            conn,
            client,
            prefix: format!("kvtier-bench-raw:{}:", std::process::id()),
            keys: 0,
            batch: 0,
            stored: Vec::new(),
            buf: Vec::new(),
        })
    }

    fn key(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    fn set_batch(&mut self, data: &[u8], cb: usize) -> Result<Duration, BenchError> {
        let t = Instant::now();
        let n = data.len() / cb;
        let first = self.keys;
        self.buf.clear();
        for (i, chunk) in data.chunks(cb).enumerate() {
            let key = self.key(first + i);
            self.buf.extend_from_slice(b"*3\r\n$3\r\nSET\r\n");
            bulk(&mut self.buf, key.as_bytes());
            bulk(&mut self.buf, chunk);
            if self.buf.len() >= SEND_BYTES {
                self.conn
                    .send_packed_command(&self.buf)
                    .map_err(|e| raw_err(&e))?;
                self.buf.clear();
            }
        }
        if !self.buf.is_empty() {
            self.conn
                .send_packed_command(&self.buf)
                .map_err(|e| raw_err(&e))?;
        }
        for _ in 0..n {
            match self.conn.recv_response().map_err(|e| raw_err(&e))? {
                redis::Value::Okay => {}
                other => {
                    return Err(raw_err(&redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "SET answered",
                        format!("{other:?}"),
                    ))));
                }
            }
        }
        self.keys += n;
        self.batch = n;
        Ok(t.elapsed())
    }

    fn get_batch(&mut self, out: &mut [u8], cb: usize) -> Result<Duration, BenchError> {
        let t = Instant::now();
        self.buf.clear();
        // The batch written last: the tier, too, reads back what it just stored.
        let first = self.keys - self.batch;
        let n = (out.len() / cb).min(self.batch);
        for i in first..first + n {
            let key = self.key(i);
            self.buf.extend_from_slice(b"*2\r\n$3\r\nGET\r\n");
            bulk(&mut self.buf, key.as_bytes());
        }
        self.conn
            .send_packed_command(&self.buf)
            .map_err(|e| raw_err(&e))?;
        for dst in out.chunks_mut(cb).take(n) {
            match self.conn.recv_response().map_err(|e| raw_err(&e))? {
                redis::Value::BulkString(v) if v.len() == cb => dst.copy_from_slice(&v),
                other => {
                    let what = match other {
                        redis::Value::BulkString(v) => format!("{} bytes", v.len()),
                        other => format!("{other:?}"),
                    };
                    return Err(raw_err(&redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "GET of a reference chunk answered",
                        what,
                    ))));
                }
            }
        }
        Ok(t.elapsed())
    }
}

impl Drop for RawRedis {
    /// Deletes the reference's keys and the chunks the tier stored during the run, also when
    /// the run stopped on an error: the benchmark's data is not cache.
    fn drop(&mut self) {
        let stored = std::mem::take(&mut self.stored);
        let raw = (0..self.keys).map(|i| self.key(i).into_bytes());
        let all: Vec<Vec<u8>> = raw.chain(stored).collect();
        let mut conn = match self.client.get_connection() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot delete the benchmark's keys");
                return;
            }
        };
        for part in all.chunks(1000) {
            let mut p = redis::pipe();
            for k in part {
                p.cmd("UNLINK").arg(k).ignore();
            }
            if let Err(e) = p.query::<()>(&mut conn) {
                tracing::warn!(error = %e, "cannot delete the benchmark's keys");
                return;
            }
        }
    }
}
