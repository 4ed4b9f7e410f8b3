//! Helpers shared by the integration tests: real `redis-server` processes on free loopback
//! ports (killed on drop), a 3-master cluster, and — in one place, so it can be ported to the
//! manager's step-guard API quickly — the code that drives a `TieringManager` with a CPU
//! primary and a Redis secondary.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tier_cpu::{CpuTier, PolicyKind};
use tier_redis::{RedisTier, RedisTierOptions};
use tiering_core::testing::Engine;
use tiering_core::{
    LookupResult, ManagerConfig, OffloadKey, PrimaryTier, ReqContext, ScheduleEndContext, TierStats,
    TieringManager, arena::ChunkArena,
};

/// How long a test waits for something that should happen promptly.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Whether `redis-server` and `redis-cli` are installed; says so loudly when they are not (the
/// test then returns without checking anything — run `scripts/install-test-deps.sh`).
pub fn redis_installed() -> bool {
    let ok = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if ok("redis-server") && ok("redis-cli") {
        return true;
    }
    eprintln!(
        "\n!!!!!!!! SKIPPED: redis-server / redis-cli are not installed; \
         run scripts/install-test-deps.sh to run the tier-redis tests !!!!!!!!\n"
    );
    false
}

/// A free loopback port whose cluster-bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// One `redis-server` process with no persistence, in a temporary directory. Killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    args: Vec<String>,
    password: Option<String>,
}

impl RedisServer {
    /// A standalone server.
    pub fn start() -> Self {
        Self::start_with(&[], None)
    }

    /// A server requiring `password`.
    pub fn with_password(password: &str) -> Self {
        Self::start_with(&["--requirepass", password], Some(password))
    }

    /// A server with extra arguments.
    pub fn start_with(args: &[&str], password: Option<&str>) -> Self {
        let mut s = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            password: password.map(str::to_owned),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.cli(&["PING"]).is_some_and(|o| o.contains("PONG")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} never answered",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `redis-cli` against this server; its stdout, or `None` if it failed.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(p) = &self.password {
            cmd.args(["--no-auth-warning", "-a", p]);
        }
        let out = cmd.args(args).stderr(Stdio::null()).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A direct client connection (with the password, if any).
    pub fn client(&self) -> redis::Connection {
        let mut info = redis::IntoConnectionInfo::into_connection_info(self.url().as_str()).unwrap();
        if let Some(p) = &self.password {
            let settings = info.redis_settings().clone().set_password(p);
            info = info.set_redis_settings(settings);
        }
        redis::Client::open(info).unwrap().get_connection().unwrap()
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or_default()
    }

    /// The directory the server runs in.
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of `n` masters and no replicas, created with `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(n: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::start_with(
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "5000",
                    ],
                    None,
                )
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("running redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + PATIENCE;
        for s in &nodes {
            loop {
                let info = s.cli(&["CLUSTER", "INFO"]).unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "the cluster never became ready");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

/// The deterministic content of `key` (different for every key and byte position).
pub use tiering_core::testing::chunk_content as content;

pub fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

pub fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(key).collect()
}

/// Options for a tier talking to `url` with short timeouts (tests kill servers).
pub fn options(url: &str, namespace: &str) -> RedisTierOptions {
    let mut o = RedisTierOptions::new(url);
    o.namespace = namespace.to_owned();
    o.workers = 2;
    o.io_timeout = tiering_core::options::HumanDuration(Duration::from_millis(500));
    o.connect_timeout = tiering_core::options::HumanDuration(Duration::from_millis(500));
    o.reconnect_backoff = tiering_core::options::HumanDuration(Duration::from_millis(50));
    o.reconnect_backoff_max = tiering_core::options::HumanDuration(Duration::from_millis(200));
    o.presence_ttl = tiering_core::options::HumanDuration(Duration::from_millis(300));
    o
}

// ----- driving a TieringManager (CPU primary + Redis secondary), step-driven ------------------

/// One simulated engine: a manager over a CPU primary of `primary_chunks` rows and one Redis
/// tier, driven step by step.
pub struct Node {
    pub m: Engine,
    pub arena: Arc<ChunkArena>,
    ctx: ReqContext,
    next_req: u64,
}

impl Node {
    pub fn new(opts: &RedisTierOptions, primary_chunks: usize, chunk_bytes: usize) -> Self {
        let cpu = CpuTier::new(primary_chunks, chunk_bytes, PolicyKind::Lru).unwrap();
        let arena = Arc::clone(cpu.arena());
        let redis = RedisTier::connect(opts, chunk_bytes).unwrap();
        let m = Engine::new(TieringManager::new(
            Box::new(cpu),
            vec![Box::new(redis)],
            ManagerConfig::step_driven(),
        ));
        let mut node = Self {
            m,
            arena,
            ctx: ReqContext::local("r0"),
            next_req: 0,
        };
        node.new_request();
        node
    }

    /// Finishes the current request and starts another.
    pub fn new_request(&mut self) {
        if self.next_req > 0 {
            self.m.on_request_finished(&self.ctx).unwrap();
            self.end_step();
        }
        self.next_req += 1;
        self.ctx = ReqContext::local(format!("r{}", self.next_req));
        self.m.on_new_request(&self.ctx).unwrap();
    }

    pub fn end_step(&mut self) {
        self.m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    }

    /// Ends steps until the manager has no pending work.
    pub fn settle(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            self.end_step();
            if !self.m.has_pending_work().unwrap() {
                return;
            }
            assert!(Instant::now() < deadline, "the manager never settled");
            self.m.waker().wait(Duration::from_millis(20));
        }
    }

    /// Stores `keys` through the engine path (prepare, write rows, complete → cascade) and
    /// waits for the cascades.
    pub fn store(&mut self, keys: &[OffloadKey]) {
        let chunk = self.arena.chunk_bytes();
        for k in keys {
            let out = self
                .m
                .prepare_store(&[*k], &self.ctx)
                .unwrap()
                .expect("room in the primary");
            for (key, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
                self.arena
                    .write_row(row)
                    .unwrap()
                    .copy_from_slice(&content(key, chunk));
            }
            self.m.complete_store(&[*k], &self.ctx, true).unwrap();
            // The cascade pins the row until redis has it: wait, so the next store can evict.
            self.settle();
        }
    }

    /// Looks `key` up, stepping while the answer is `Retry`; returns the first other answer.
    pub fn lookup(&mut self, key: &OffloadKey) -> LookupResult {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.m.lookup(key, &self.ctx).unwrap() {
                LookupResult::Retry => {}
                other => return other,
            }
            assert!(Instant::now() < deadline, "lookup of {key} never resolved");
            self.end_step();
            self.m.waker().wait(Duration::from_millis(20));
        }
    }

    /// Brings `key` into the primary if any tier has it and returns the row's bytes (`None`
    /// when it is a miss or the promotion failed).
    pub fn fetch(&mut self, key: &OffloadKey) -> Option<Vec<u8>> {
        match self.lookup(key) {
            LookupResult::Miss => return None,
            LookupResult::Hit => {}
            LookupResult::HitPending => {
                self.end_step();
                self.settle();
                if self.m.lookup(key, &self.ctx).unwrap() != LookupResult::Hit {
                    // The promotion failed: the primary slot was released.
                    return None;
                }
            }
            LookupResult::Retry => unreachable!(),
        }
        let rows = self.m.prepare_load(&[*key], &self.ctx).unwrap();
        let bytes = self.arena.read_row(rows[0]).unwrap().to_vec();
        self.m.complete_load(&[*key], &self.ctx).unwrap();
        self.end_step();
        Some(bytes)
    }

    /// Whether the primary holds `key` right now (no secondary is asked).
    pub fn in_primary(&mut self, key: &OffloadKey) -> bool {
        let only_primary = ReqContext::builder(tiering_core::RequestId::local("probe"))
            .filter(tiering_core::TierFilter::primary_only())
            .build();
        matches!(self.m.lookup(key, &only_primary).unwrap(), LookupResult::Hit)
    }

    /// The manager's stats.
    pub fn manager_stats(&mut self) -> tiering_core::ManagerStats {
        self.m.stats().unwrap()
    }

    /// The Redis tier's stats.
    pub fn redis_stats(&mut self) -> TierStats {
        self.m.stats().unwrap().secondaries[0].clone()
    }

    pub fn shutdown(mut self) {
        self.m.on_request_finished(&self.ctx).unwrap();
        self.end_step();
        self.m.shutdown().unwrap();
    }
}

// ----- driving a RedisTier alone with hand-made jobs --------------------------------------------

/// A tier with an arena of its own, driven by hand-made jobs.
pub struct Rig {
    pub arena: Arc<ChunkArena>,
    pub tier: RedisTier,
    pub waker: tiering_core::ControlWaker,
    next_job: u64,
}

impl Rig {
    pub fn new(opts: &RedisTierOptions, chunk_bytes: usize, rows: usize) -> Self {
        use tiering_core::SecondaryTier;
        let arena = ChunkArena::new(rows, chunk_bytes).unwrap();
        let mut tier = RedisTier::connect(opts, chunk_bytes).unwrap();
        let waker = tiering_core::ControlWaker::new();
        tier.set_waker(waker.clone());
        Self {
            arena,
            tier,
            waker,
            next_job: 0,
        }
    }

    fn job(&mut self, keys: &[OffloadKey], store: bool) -> tiering_core::TransferJob {
        use tiering_core::{JobId, JobKind, TransferJob, arena::RowGrant};
        self.next_job += 1;
        let rows: Vec<u32> = (0..keys.len() as u32).collect();
        for (k, &r) in keys.iter().zip(&rows) {
            let mut w = self.arena.write_row(r).unwrap();
            if store {
                let bytes = content(k, w.len());
                w.copy_from_slice(&bytes);
            } else {
                w.fill(0);
            }
        }
        TransferJob {
            id: JobId(self.next_job),
            kind: if store { JobKind::Store } else { JobKind::Promotion },
            keys: keys.to_vec(),
            chunk_ids: rows.clone(),
            req: ReqContext::local("test"),
            rows: if store {
                RowGrant::Read(self.arena.read_rows(&rows).unwrap())
            } else {
                RowGrant::Write(self.arena.write_rows(&rows).unwrap())
            },
        }
    }

    /// Waits for `n` results.
    pub fn wait(&mut self, n: usize) -> Vec<tiering_core::JobResult> {
        use tiering_core::SecondaryTier;
        let deadline = Instant::now() + PATIENCE;
        let mut out = Vec::new();
        loop {
            self.tier.poll_finished(&mut out);
            if out.len() >= n {
                assert_eq!(out.len(), n, "more results than jobs: {out:?}");
                return out;
            }
            assert!(Instant::now() < deadline, "only {} of {n} results", out.len());
            self.waker.wait(Duration::from_millis(50));
        }
    }

    /// Submits a store of `keys` from rows `first_row..` without waiting.
    pub fn submit_store_at(&mut self, keys: &[OffloadKey], first_row: u32) {
        use tiering_core::{JobId, JobKind, SecondaryTier, TransferJob, arena::RowGrant};
        self.next_job += 1;
        let rows: Vec<u32> = (first_row..first_row + keys.len() as u32).collect();
        let job = TransferJob {
            id: JobId(self.next_job),
            kind: JobKind::Store,
            keys: keys.to_vec(),
            chunk_ids: rows.clone(),
            req: ReqContext::local("test"),
            rows: RowGrant::Read(self.arena.read_rows(&rows).unwrap()),
        };
        self.tier.submit_store(job);
    }

    /// Stores `keys` (key `i` from row `i`) in one job and waits for its result.
    pub fn store(&mut self, keys: &[OffloadKey]) -> tiering_core::JobResult {
        use tiering_core::SecondaryTier;
        let job = self.job(keys, true);
        self.tier.submit_store(job);
        self.wait(1).remove(0)
    }

    /// Loads `keys` into zeroed rows `0..n`; the result and each row's bytes.
    pub fn load(&mut self, keys: &[OffloadKey]) -> (tiering_core::JobResult, Vec<Vec<u8>>) {
        use tiering_core::SecondaryTier;
        let job = self.job(keys, false);
        self.tier.submit_load(job);
        let r = self.wait(1).remove(0);
        let rows = (0..keys.len() as u32)
            .map(|i| self.arena.read_row(i).unwrap().to_vec())
            .collect();
        (r, rows)
    }

    /// The tier's answer for `key`, stepping while it is `Retry`.
    pub fn lookup(&mut self, key: &OffloadKey) -> LookupResult {
        use tiering_core::SecondaryTier;
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.tier.lookup(key, &ReqContext::local("test")) {
                LookupResult::Retry => {}
                other => return other,
            }
            assert!(Instant::now() < deadline, "lookup of {key} never resolved");
            self.tier.on_schedule_end();
            self.waker.wait(Duration::from_millis(20));
        }
    }

    pub fn stat(&self, name: &str) -> f64 {
        use tiering_core::SecondaryTier;
        self.tier.stats().extra.get(name).copied().unwrap_or(f64::NAN)
    }
}
