//! Test nodes: a `TieringManager` over a `MemoryPrimary` with a p2p tier, driven like an engine.
#![allow(dead_code, reason = "each test binary uses a different subset")]

pub mod fake_peer;

use std::time::{Duration, Instant};

use serde_json::json;
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions};
use tiering_core::testing::{Engine, MemoryPrimary};
use tiering_core::{
    LookupResult, ManagerConfig, OffloadKey, PrimaryTier, ReqContext, RequestId, ScheduleEndContext,
    TieringManager,
};

pub const CHUNK: usize = 4096;
pub const ROWS: usize = 32;
/// Generous bound for waiting on an event (never a performance assertion).
pub const PATIENCE: Duration = Duration::from_secs(30);

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub struct Node {
    pub mgr: Engine,
    pub primary: MemoryPrimary,
    pub p2p: P2pHandle,
}

/// The shared secret of the test deployment.
pub const SECRET: &[u8] = b"kvtier-test-secret";

pub fn opts() -> P2pTierOptions {
    let mut o = P2pTierOptions::loopback();
    o.hash_seed = "seed".into();
    o.layout_fingerprint = "layout".into();
    o.insecure = false;
    o.secret = Some(tier_p2p::SharedSecret::new(SECRET));
    o
}

/// The bytes the producer stores for `key`.
pub fn pattern(key: &OffloadKey) -> Vec<u8> {
    let seed = key.digest();
    (0..CHUNK)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

pub fn keys(from: u64, n: u64) -> Vec<OffloadKey> {
    (from..from + n).map(OffloadKey::from_u64).collect()
}

pub fn end() -> ScheduleEndContext {
    ScheduleEndContext::default()
}

impl Node {
    pub fn new(opts: P2pTierOptions, config: ManagerConfig) -> Self {
        Self::with_rows(opts, config, ROWS)
    }

    pub fn with_rows(opts: P2pTierOptions, config: ManagerConfig, rows: usize) -> Self {
        Self::with_geometry(opts, config, rows, CHUNK)
    }

    pub fn with_geometry(opts: P2pTierOptions, config: ManagerConfig, rows: usize, chunk: usize) -> Self {
        let primary = MemoryPrimary::new(rows, chunk);
        let tier = P2pTier::new(opts, primary.arena()).expect("p2p tier");
        let p2p = tier.handle();
        let mgr = Engine::new(TieringManager::new(
            Box::new(primary.clone()),
            vec![Box::new(tier)],
            config,
        ));
        Self { mgr, primary, p2p }
    }

    /// Stores `keys` with their pattern bytes, as an engine would after computing them.
    pub fn store(&mut self, req: &str, keys: &[OffloadKey]) {
        let ctx = ReqContext::local(req);
        self.mgr.on_new_request(&ctx).unwrap();
        let out = self
            .mgr
            .prepare_store(keys, &ctx)
            .unwrap()
            .expect("room to store");
        let arena = self.primary.arena().clone();
        for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            arena.write_row(c).unwrap().copy_from_slice(&pattern(k));
        }
        self.mgr.complete_store(&out.keys_to_store, &ctx, true).unwrap();
        self.mgr.on_request_finished(&ctx).unwrap();
        self.mgr.on_schedule_end(&end()).unwrap();
    }

    /// A producer's engine step that starts storing `keys` for `ctx`: `prepare_store`, the
    /// device copy writes the rows, `on_schedule_end`. The store stays in flight (not
    /// completed); returns the keys to report when it is.
    pub fn start_store(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<OffloadKey> {
        let out = self.mgr.prepare_store(keys, ctx).unwrap().expect("room to store");
        let arena = self.primary.arena().clone();
        for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            arena.write_row(c).unwrap().copy_from_slice(&pattern(k));
        }
        self.mgr.on_schedule_end(&end()).unwrap();
        out.keys_to_store
    }

    /// A decode request pulling every chunk of the hand-off `kv` from `from`, without probing
    /// (`remote_prefiller`).
    pub fn prefiller_ctx(&self, req: &str, kv: &str, from: &P2pHandle) -> ReqContext {
        let params = json!({"remote_prefiller": {
            "kv_request_id": kv,
            "host": from.host(),
            "port": from.port(),
        }});
        let serde_json::Value::Object(m) = params else {
            unreachable!()
        };
        ReqContext::builder(RequestId::local(req)).params(m).build()
    }

    /// A request pulling every chunk of `kv` from the peer at `host:port` without probing
    /// (`remote_prefiller`).
    pub fn prefiller_ctx_to(&self, req: &str, kv: &str, host: &str, port: u16) -> ReqContext {
        let params = json!({"remote_prefiller": {"kv_request_id": kv, "host": host, "port": port}});
        let serde_json::Value::Object(m) = params else {
            unreachable!()
        };
        ReqContext::builder(RequestId::local(req)).params(m).build()
    }

    /// Steps `ctx` over `keys` until `peer` sees a fetch from this node.
    pub fn step_until_fetch(
        &mut self,
        ctx: &ReqContext,
        keys: &[OffloadKey],
        peer: &fake_peer::FakePeer,
    ) -> fake_peer::SeenFetch {
        let start = Instant::now();
        loop {
            let _ = self.step(ctx, keys);
            if let Some(f) = peer.poll_fetch(Duration::from_millis(5)) {
                return f;
            }
            assert!(start.elapsed() < PATIENCE, "the node never fetched");
        }
    }

    /// Starts a `remote_prefiller` request `req` pulling `keys` from the fake producer `peer`
    /// (as `kv`), completes the handshake and steps until the fetch reached `peer`.
    pub fn fetch_from_fake(
        &mut self,
        peer: &mut fake_peer::FakePeer,
        req: &str,
        kv: &str,
        keys: &[OffloadKey],
    ) -> (ReqContext, fake_peer::SeenFetch) {
        let (host, port) = peer.host_port();
        let ctx = self.prefiller_ctx_to(req, kv, &host, port);
        self.mgr.on_new_request(&ctx).unwrap();
        peer.handshake(|| self.mgr.on_schedule_end(&end()).unwrap());
        let f = self.step_until_fetch(&ctx, keys, peer);
        (ctx, f)
    }

    /// Steps until `keys` settle, asserts each became a `Hit` and loads them: the bytes must be
    /// each key's pattern.
    pub fn assert_all_landed(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) {
        let trace = self.pull_until_settled(ctx, keys);
        assert!(
            trace.iter().all(|t| t.last() == Some(&LookupResult::Hit)),
            "{trace:?}"
        );
        for (k, got) in keys.iter().zip(self.read_hits(ctx, keys)) {
            assert_eq!(got, pattern(k));
        }
    }

    /// Runs `f` while holding this node's manager lock, so neither its engine nor its control
    /// thread handles anything meanwhile (its I/O threads still run).
    pub fn with_lock_held<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.mgr.inspect(|_| f())
    }

    /// Whether every byte of these arena rows is still zero.
    pub fn rows_untouched(&self, rows: &[u32]) -> bool {
        let arena = self.primary.arena().clone();
        rows.iter()
            .all(|&r| arena.read_row(r).unwrap().iter().all(|&b| b == 0))
    }

    /// A consumer request pulling from `from`.
    pub fn pull_ctx(&self, req: &str, from: &P2pHandle) -> ReqContext {
        self.pull_ctx_to(req, from.host(), from.port())
    }

    /// A consumer request pulling from the peer at `host:port`.
    pub fn pull_ctx_to(&self, req: &str, host: &str, port: u16) -> ReqContext {
        let params = json!({"remote_kv_source": {
            "kv_request_id": format!("{}-{req}", self.p2p.local_id()),
            "host": host,
            "port": port,
        }});
        let serde_json::Value::Object(m) = params else {
            unreachable!()
        };
        ReqContext::builder(RequestId::local(req)).params(m).build()
    }

    /// One engine step: look every key up, end the step. Returns the verdicts.
    pub fn step(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<LookupResult> {
        let r = keys.iter().map(|k| self.mgr.lookup(k, ctx).unwrap()).collect();
        self.mgr.on_schedule_end(&end()).unwrap();
        r
    }

    /// Steps until every key is settled (`Hit` or `Miss`), recording each key's distinct
    /// verdicts in order. Panics after `PATIENCE`.
    pub fn pull_until_settled(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<Vec<LookupResult>> {
        let mut trace: Vec<Vec<LookupResult>> = vec![Vec::new(); keys.len()];
        let start = Instant::now();
        loop {
            let r = self.step(ctx, keys);
            for (t, v) in trace.iter_mut().zip(&r) {
                if t.last() != Some(v) {
                    t.push(*v);
                }
            }
            if r.iter()
                .all(|v| matches!(v, LookupResult::Hit | LookupResult::Miss))
            {
                return trace;
            }
            if start.elapsed() >= PATIENCE {
                let tails: Vec<_> = trace
                    .iter()
                    .map(|t| (t.len(), &t[t.len().saturating_sub(3)..]))
                    .collect();
                panic!("pull did not settle: (changes, last verdicts) per key: {tails:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Loads hit keys as the engine would and returns their bytes.
    pub fn read_hits(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<Vec<u8>> {
        let chunks = self.mgr.prepare_load(keys, ctx).unwrap();
        let arena = self.primary.arena().clone();
        let bytes = chunks
            .iter()
            .map(|&c| arena.read_row(c).unwrap().to_vec())
            .collect();
        self.mgr.complete_load(keys, ctx).unwrap();
        bytes
    }

    pub fn finish(&mut self, ctx: &ReqContext) {
        self.mgr.on_request_finished(ctx).unwrap();
        self.mgr.on_schedule_end(&end()).unwrap();
    }

    /// Waits (stepping when step-driven) until no job is in flight, nothing is pinned or
    /// reserved and no arena row is granted.
    pub fn wait_clean(&mut self) {
        let start = Instant::now();
        loop {
            let jobs = self.mgr.inspect(|s| s.jobs_in_flight());
            let arena = self.primary.arena().clone();
            if jobs == 0
                && self.primary.total_pins() == 0
                && self.primary.writes_in_flight() == 0
                && arena.granted_rows() == 0
            {
                self.primary.check_invariants().unwrap();
                return;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "leak: {jobs} jobs, {} pins, {} writes, {} rows granted",
                self.primary.total_pins(),
                self.primary.writes_in_flight(),
                arena.granted_rows()
            );
            self.mgr.on_schedule_end(&end()).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// A prefill request whose stored chunks are parked for whoever fetches `kv`
/// (`remote_decoder`).
pub fn decoder_ctx(req: &str, kv: &str) -> ReqContext {
    let serde_json::Value::Object(m) = json!({"remote_decoder": {"kv_request_id": kv}}) else {
        unreachable!()
    };
    ReqContext::builder(RequestId::local(req)).params(m).build()
}

/// Waits for `cond` (an event, not a performance bound).
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}
