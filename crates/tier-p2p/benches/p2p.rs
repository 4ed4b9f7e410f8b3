//! The p2p tier against raw transports, measured in the same run.
//!
//! - `control_rtt`: a consumer's lookup → the producer's `lookup_resp` (idle peers; the
//!   producer answers from its control-plane thread) versus a raw ZeroMQ DEALER/ROUTER
//!   ping-pong of a message of the same size, echoed by a thread of its own. Target: ≤ 1.5×
//!   raw. The reference as the issue measures it runs both raw ends on one ZeroMQ context:
//!   one libzmq I/O thread writes the loopback TCP and, in the same pass, reads it at the
//!   other end. Each p2p node has its own context, as two processes would, so a second
//!   reference puts the raw ends on two contexts too (two more I/O thread wake-ups per round
//!   trip, the same threads the tier's round trip wakes). What the ratios depend on: the
//!   tier's own work per round trip (decoding, the sweep, a few more non-blocking socket reads)
//!   against the wake-ups both sides pay, and how slowly this machine wakes an idle thread
//!   while other processes load its cores. On a VM guest with the `haltpoll` idle driver (as
//!   measured here: an idle vCPU polls up to 50 µs before it halts), a thread woken within
//!   that window wakes in a few µs and one woken later takes a VM exit and an IPI: a round
//!   trip whose gaps stay under the window runs in a fast mode (raw, one context: ~25 µs)
//!   and otherwise in a slow one (~90 µs), so the raw figure flips between runs and the ratio
//!   with it. Each ratio comes from 1500 ABBA-interleaved pairs in blocks of 300, reported as
//!   the median per-pair ratio with p10/p90, min–max and the spread of the block medians.
//! - `data_plane`: one fetch of 16 chunks of 2 MiB, and one of 256 chunks of 64 KiB (fetch →
//!   push → acks → `transfer_done`), each versus a raw loopback TCP stream of the same shape
//!   with one ack: the raw sender writes as many distinct rows (as the producer writes rows)
//!   into a destination of the same volume. Target: ≥ 90 % of raw. Both ends share the
//!   machine's cores, and on loopback the writing thread also runs the receiving side's TCP
//!   path, so every byte's MAC (computed once by each end) competes with the copies for the
//!   same cores: the ratio depends on the MAC's speed against the kernel's copies (POLYVAL
//!   with VPCLMULQDQ here; the `mac` section measures both) and on what else runs on the
//!   machine. The 64 KiB shape adds per-chunk work (a header tag and a trailer each).
//! - `mac_cost`: one end's payload MAC per byte against a copy of the byte, on thread CPU
//!   time (what authentication costs, whatever else the machine runs), and the data plane's
//!   POLYVAL against RustCrypto's `polyval` crate on the same pieces.
//!
//! After criterion's figures, the bench prints both ratios as medians of ABBA-paired runs, and
//! the CPU time both ends of a data-plane transfer spend (p2p against raw): unlike the
//! throughput ratio, it barely moves with the machine's load, and shows what the MACs cost.
//!
//! `KVTIER_P2P_BENCH=control`, `=data` or `=mac` runs one section; `=profile-p2p` or `=profile-raw`
//! runs only 5000 round trips of one control side, for `strace -f -c` or `perf record`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use tier_p2p::wire::{Message, encode_keys};
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions};
use tiering_core::testing::MemoryPrimary;
use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, LookupResult, ManagerConfig, OffloadKey, OffloadingManager,
    PrimaryTier, ReqContext, RequestId, ScheduleEndContext, SecondaryTier, TieringManager, TransferJob,
    arena::{ChunkArena, RowGrant},
};

const BIG_CHUNK: usize = 2 << 20;
const BIG_COUNT: usize = 16;
const MID_CHUNK: usize = 64 << 10;
const MID_COUNT: usize = 256;
const SMALL_CHUNK: usize = 4096;

fn opts() -> P2pTierOptions {
    let mut o = P2pTierOptions::loopback();
    o.hash_seed = "bench".into();
    o.layout_fingerprint = "bench".into();
    o
}

struct Producer {
    /// Kept alive: its control thread serves the consumer.
    _mgr: TieringManager,
    handle: P2pHandle,
}

fn producer(chunk: usize, keys: &[OffloadKey]) -> Producer {
    let primary = MemoryPrimary::new(keys.len().max(4), chunk);
    let tier = P2pTier::new(opts(), primary.arena()).unwrap();
    let handle = tier.handle();
    let arena = primary.arena().clone();
    let mut mgr = TieringManager::new(Box::new(primary), vec![Box::new(tier)], ManagerConfig::default());
    let ctx = ReqContext::local("store");
    let mut step = mgr.step();
    step.on_new_request(&ctx).unwrap();
    if !keys.is_empty() {
        let out = step.prepare_store(keys, &ctx).unwrap().unwrap();
        for (i, &c) in out.chunk_ids.iter().enumerate() {
            arena.write_row(c).unwrap().fill(i as u8 ^ 0x5a);
        }
        step.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    }
    step.on_request_finished(&ctx).unwrap();
    step.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    // The step ends: from here on the producer's control thread does everything.
    drop(step);
    Producer { _mgr: mgr, handle }
}

/// How long the consumer waits on the tier's waker when nothing woke it: the manager's idle wait
/// (the tier wakes the waker when an answer or a landed fetch is there to collect).
fn idle_wait() -> Duration {
    ManagerConfig::default().idle_wait
}

/// A consumer driven directly (no manager), so the measurement is the tier's own path.
struct Consumer {
    waker: ControlWaker,
    tier: P2pTier,
    arena: Arc<ChunkArena>,
    ctx: ReqContext,
    next_job: u64,
    out: Vec<JobResult>,
}

fn consumer(chunk: usize, rows: usize, from: &P2pHandle) -> Consumer {
    let arena = ChunkArena::new(rows, chunk).unwrap();
    let mut tier = P2pTier::new(opts(), &arena).unwrap();
    // Wait like the manager's control thread does: on the tier's waker, for at most the
    // manager's idle wait, not in a spin (or a 1 ms poll) that would take one of the two cores
    // from the data-plane threads.
    let waker = ControlWaker::new();
    tier.set_waker(waker.clone());
    let params = serde_json::json!({"remote_kv_source": {
        "kv_request_id": "bench", "host": from.host(), "port": from.port()}});
    let serde_json::Value::Object(m) = params else {
        unreachable!()
    };
    let ctx = ReqContext::builder(RequestId::local("bench")).params(m).build();
    tier.on_new_request(&ctx);
    Consumer {
        waker,
        tier,
        arena,
        ctx,
        next_job: 0,
        out: Vec::new(),
    }
}

impl Consumer {
    /// Probes `keys` and waits for every answer.
    fn probe(&mut self, keys: &[OffloadKey]) -> Vec<LookupResult> {
        for k in keys {
            let _ = self.tier.lookup(k, &self.ctx);
        }
        self.tier.on_schedule_end();
        loop {
            self.tier.poll_finished(&mut self.out);
            let r: Vec<LookupResult> = keys.iter().map(|k| self.tier.lookup(k, &self.ctx)).collect();
            if r.iter().all(|v| *v != LookupResult::Retry) {
                return r;
            }
            self.waker.wait(idle_wait());
        }
    }

    /// Fetches `keys` (already probed as hits) into rows 0.. and waits for the result.
    fn fetch(&mut self, keys: &[OffloadKey]) -> JobResult {
        let ids: Vec<u32> = (0..keys.len() as u32).collect();
        let id = JobId(self.next_job);
        self.next_job += 1;
        self.tier.submit_load(TransferJob {
            id,
            kind: JobKind::Promotion,
            keys: keys.to_vec(),
            chunk_ids: ids.clone(),
            req: self.ctx.clone(),
            rows: RowGrant::Write(self.arena.write_rows(&ids).unwrap()),
        });
        loop {
            self.tier.poll_finished(&mut self.out);
            if let Some(i) = self.out.iter().position(|r| r.id == id) {
                return self.out.swap_remove(i);
            }
            self.waker.wait(idle_wait());
        }
    }
}

/// One lookup → lookup_resp over the tier (a key the producer lacks, so no pinning).
fn tier_rtt(c: &mut Consumer, n: &mut u64) -> Duration {
    *n += 1;
    let key = OffloadKey::from_u64(1 << 40 | *n);
    let t = Instant::now();
    let r = c.probe(&[key]);
    let d = t.elapsed();
    assert_eq!(r, [LookupResult::Miss]);
    d
}

struct RawZmq {
    _ctx: [zmq::Context; 2],
    dealer: zmq::Socket,
    payload: Vec<u8>,
}

/// The reference as the issue measures it: both ends on one context (one libzmq I/O thread
/// carries both directions).
fn raw_zmq() -> RawZmq {
    let ctx = zmq::Context::new();
    raw_zmq_on(ctx.clone(), ctx)
}

/// Both ends on their own context, as two nodes (two processes) are: each direction crosses
/// two libzmq I/O threads, as the tier's messages do.
fn raw_zmq_two_contexts() -> RawZmq {
    raw_zmq_on(zmq::Context::new(), zmq::Context::new())
}

fn raw_zmq_on(router_ctx: zmq::Context, dealer_ctx: zmq::Context) -> RawZmq {
    let router = router_ctx.socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let ep = router.get_last_endpoint().unwrap().unwrap();
    std::thread::spawn(move || {
        while let Ok(frames) = router.recv_multipart(0) {
            if router.send_multipart(frames, 0).is_err() {
                return;
            }
        }
    });
    let dealer = dealer_ctx.socket(zmq::DEALER).unwrap();
    dealer.set_identity(b"127.0.0.1:1").unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&ep).unwrap();
    let payload = Message::Lookup {
        kv_request_id: "bench".into(),
        keys: encode_keys(&[OffloadKey::from_u64(1)]),
        round_seq: 0,
    }
    .encode();
    RawZmq {
        _ctx: [router_ctx, dealer_ctx],
        dealer,
        payload,
    }
}

fn raw_rtt(z: &RawZmq) -> Duration {
    let t = Instant::now();
    z.dealer.send(&z.payload, 0).unwrap();
    let _ = z.dealer.recv_bytes(0).unwrap();
    t.elapsed()
}

struct RawTcp {
    go: mpsc::Sender<()>,
    rx: TcpStream,
    buf: Vec<u8>,
    chunk: usize,
}

/// The raw reference for `count` rows of `chunk` bytes: one write per row, one ack.
fn raw_tcp(chunk: usize, count: usize) -> RawTcp {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (go, go_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        // As many distinct rows as the producer sends: writing one 2 MiB buffer 16 times
        // would read it from cache where the producer reads 32 MiB of rows.
        let rows: Vec<Vec<u8>> = (0..count).map(|i| vec![i as u8 ^ 0x5a; chunk]).collect();
        let mut ack = [0u8; 1];
        while go_rx.recv().is_ok() {
            for row in &rows {
                s.write_all(row).unwrap();
            }
            s.read_exact(&mut ack).unwrap();
        }
    });
    let (rx, _) = listener.accept().unwrap();
    rx.set_nodelay(true).unwrap();
    RawTcp {
        go,
        rx,
        buf: vec![0u8; chunk * count],
        chunk,
    }
}

fn raw_stream(r: &mut RawTcp) -> Duration {
    let t = Instant::now();
    r.go.send(()).unwrap();
    for c in r.buf.chunks_mut(r.chunk) {
        r.rx.read_exact(c).unwrap();
    }
    r.rx.write_all(&[1]).unwrap();
    t.elapsed()
}

fn tier_fetch(c: &mut Consumer, keys: &[OffloadKey]) -> Duration {
    tier_fetch_cpu(c, keys).0
}

/// One fetch: its wall time and the process's CPU time over the same span (the probe before
/// it is in neither).
fn tier_fetch_cpu(c: &mut Consumer, keys: &[OffloadKey]) -> (Duration, Duration) {
    let r = c.probe(keys);
    assert!(r.iter().all(|v| *v == LookupResult::Hit), "{r:?}");
    let cpu = process_cpu();
    let t = Instant::now();
    let res = c.fetch(keys);
    let d = t.elapsed();
    let cpu = process_cpu() - cpu;
    assert_eq!(res.outcome, tiering_core::JobOutcome::Ok);
    (d, cpu)
}

/// ABBA pairs of the data-plane ratio.
const DATA_PAIRS: usize = 40;

/// CPU time of the whole process (every thread, including those that exited).
fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// `f`'s wall time and the process's CPU time spent meanwhile.
fn with_cpu(f: impl FnOnce() -> Duration) -> (Duration, Duration) {
    let c = process_cpu();
    let d = f();
    (d, process_cpu() - c)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Median, min and max.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_unstable_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Blocks of ABBA-ordered control pairs, and pairs per block.
const RTT_BLOCKS: usize = 5;
const RTT_PAIRS: usize = 300;

/// Paired control round trips: per-pair ratios (tier / raw) of every block, and every round
/// trip of each side.
struct RttPairs {
    blocks: Vec<Vec<f64>>,
    tier: Vec<Duration>,
    raw: Vec<Duration>,
}

/// `RTT_BLOCKS` blocks of `RTT_PAIRS` ABBA-ordered pairs of a tier lookup and a raw round trip
/// (both sides see the same machine state; the order alternates so neither always runs first).
fn paired_rtt(con: &mut Consumer, n: &mut u64, z: &RawZmq) -> RttPairs {
    let mut p = RttPairs {
        blocks: Vec::new(),
        tier: Vec::new(),
        raw: Vec::new(),
    };
    for _ in 0..RTT_BLOCKS {
        let mut ratios = Vec::with_capacity(RTT_PAIRS);
        for i in 0..RTT_PAIRS {
            let (t, r) = if i % 2 == 0 {
                let t = tier_rtt(con, n);
                (t, raw_rtt(z))
            } else {
                let r = raw_rtt(z);
                (tier_rtt(con, n), r)
            };
            ratios.push(t.as_secs_f64() / r.as_secs_f64());
            p.tier.push(t);
            p.raw.push(r);
        }
        p.blocks.push(ratios);
    }
    p
}

/// The `q`-quantile of sorted `v`.
fn quantile(v: &[f64], q: f64) -> f64 {
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn print_rtt(label: &str, p: RttPairs) {
    let block_medians: Vec<f64> = p.blocks.iter().map(|b| spread(b.clone()).0).collect();
    let mut all: Vec<f64> = p.blocks.into_iter().flatten().collect();
    all.sort_unstable_by(f64::total_cmp);
    let (_, blo, bhi) = spread(block_medians);
    let pct = |v: Vec<Duration>| {
        let mut us: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_unstable_by(f64::total_cmp);
        (quantile(&us, 0.1), quantile(&us, 0.5), quantile(&us, 0.9))
    };
    let (t10, t50, t90) = pct(p.tier);
    let (r10, r50, r90) = pct(p.raw);
    println!(
        "RESULT {label}: {} pairs; p2p {t50:.1} µs (p10 {t10:.1}, p90 {t90:.1}), raw zmq {r50:.1} µs (p10 {r10:.1}, p90 {r90:.1}); per-pair ratio median {:.2}, p10 {:.2}, p90 {:.2}, min {:.2}, max {:.2}; median of each block of {RTT_PAIRS}: {blo:.2}..{bhi:.2}",
        all.len(),
        quantile(&all, 0.5),
        quantile(&all, 0.1),
        quantile(&all, 0.9),
        all[0],
        all[all.len() - 1],
    );
}

/// Which sections run: `KVTIER_P2P_BENCH=control`, `=data` or `=mac` picks one (all by
/// default).
fn section(name: &str) -> bool {
    std::env::var("KVTIER_P2P_BENCH").map_or(true, |v| v.is_empty() || v == name)
}

/// `KVTIER_P2P_BENCH=profile-p2p` or `=profile-raw`: only 5000 round trips of one side, to
/// profile it alone (`strace -f -c`, `perf record`); prints nothing. `=profile-data-p2p` or
/// `=profile-data-raw` (with `-64k` for the 64 KiB shape): see [`profile_data`].
fn profile_one_side() -> bool {
    let Ok(which) = std::env::var("KVTIER_P2P_BENCH") else {
        return false;
    };
    match which.as_str() {
        "profile-p2p" => {
            let p_small = producer(SMALL_CHUNK, &[]);
            let mut con = consumer(SMALL_CHUNK, 4, &p_small.handle);
            let mut n = 0;
            for _ in 0..5000 {
                tier_rtt(&mut con, &mut n);
            }
            drop((con, p_small));
        }
        "profile-raw" => {
            let z = raw_zmq();
            for _ in 0..5000 {
                raw_rtt(&z);
            }
        }
        data if data.starts_with("profile-data-") => return profile_data(data),
        _ => return false,
    }
    true
}

/// `profile-data-p2p`, `profile-data-raw` (16 × 2 MiB) and the same with `-64k` (256 × 64 KiB):
/// 200 transfers of one data-plane side, then their wall and process CPU time. `false` for any
/// other name.
fn profile_data(which: &str) -> bool {
    let (side, (chunk, count)) = match which.strip_prefix("profile-data-") {
        Some("p2p") => ("p2p", (BIG_CHUNK, BIG_COUNT)),
        Some("raw") => ("raw", (BIG_CHUNK, BIG_COUNT)),
        Some("p2p-64k") => ("p2p", (MID_CHUNK, MID_COUNT)),
        Some("raw-64k") => ("raw", (MID_CHUNK, MID_COUNT)),
        _ => return false,
    };
    let (wall, cpu) = if side == "p2p" {
        let keys: Vec<OffloadKey> = (0..count as u64).map(OffloadKey::from_u64).collect();
        let p = producer(chunk, &keys);
        let mut con = consumer(chunk, count, &p.handle);
        tier_fetch(&mut con, &keys);
        let measured = with_cpu(|| (0..200).map(|_| tier_fetch(&mut con, &keys)).sum());
        drop((con, p));
        measured
    } else {
        let mut raw = raw_tcp(chunk, count);
        raw_stream(&mut raw);
        with_cpu(|| (0..200).map(|_| raw_stream(&mut raw)).sum())
    };
    println!(
        "{which}: 200 × {count} × {} in {wall:?} wall, {cpu:?} process CPU",
        human(chunk)
    );
    true
}

fn benches(c: &mut Criterion) {
    if profile_one_side() {
        return;
    }
    if section("control") {
        control(c);
    }
    if section("data") {
        data(c);
    }
    if section("mac") {
        mac_cost();
    }
}

fn control(c: &mut Criterion) {
    let p_small = producer(SMALL_CHUNK, &[]);
    let mut con = consumer(SMALL_CHUNK, 4, &p_small.handle);
    let mut n = 0;
    for _ in 0..50 {
        tier_rtt(&mut con, &mut n);
    }
    let z = raw_zmq();
    let z2 = raw_zmq_two_contexts();
    for _ in 0..50 {
        raw_rtt(&z);
        raw_rtt(&z2);
    }
    let mut g = c.benchmark_group("control_rtt");
    g.bench_function("p2p_lookup_round_trip", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| tier_rtt(&mut con, &mut n)).sum());
    });
    g.bench_function("raw_zmq_dealer_router_ping_pong", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| raw_rtt(&z)).sum());
    });
    g.bench_function("raw_zmq_ping_pong_two_contexts", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| raw_rtt(&z2)).sum());
    });
    g.finish();

    let one = paired_rtt(&mut con, &mut n, &z);
    let two = paired_rtt(&mut con, &mut n, &z2);
    print_rtt("control_rtt (target <= 1.5)", one);
    print_rtt(
        "control_rtt vs raw ends on two contexts (as the two p2p nodes)",
        two,
    );
    drop((con, p_small));
}

fn data(c: &mut Criterion) {
    data_shape(c, BIG_CHUNK, BIG_COUNT);
    data_shape(c, MID_CHUNK, MID_COUNT);
}

/// One fetch of `count` chunks of `chunk` bytes against the raw reference of the same shape:
/// criterion's figures, then the paired ratio and the CPU time of both ends.
fn data_shape(c: &mut Criterion, chunk: usize, count: usize) {
    let shape = format!("{count}x{}", human(chunk));
    let keys: Vec<OffloadKey> = (0..count as u64).map(OffloadKey::from_u64).collect();
    let p = producer(chunk, &keys);
    let mut con = consumer(chunk, count, &p.handle);
    tier_fetch(&mut con, &keys);
    let mut raw = raw_tcp(chunk, count);
    raw_stream(&mut raw);
    let mut g = c.benchmark_group("data_plane");
    g.throughput(Throughput::Bytes((chunk * count) as u64));
    g.sample_size(20);
    g.bench_function(format!("p2p_fetch_{shape}"), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| tier_fetch(&mut con, &keys)).sum());
    });
    g.bench_function(format!("raw_loopback_tcp_{shape}"), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| raw_stream(&mut raw)).sum());
    });
    g.finish();

    // Ratios from ABBA-ordered pairs (both sides see the same machine state; the order
    // alternates so neither always runs first), reported as the median of per-pair ratios.
    let mut data_ratios = Vec::new();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut a_cpu, mut b_cpu) = (Vec::new(), Vec::new());
    for i in 0..DATA_PAIRS {
        let ((t, tc), (r, rc)) = if i % 2 == 0 {
            let t = tier_fetch_cpu(&mut con, &keys);
            (t, with_cpu(|| raw_stream(&mut raw)))
        } else {
            let r = with_cpu(|| raw_stream(&mut raw));
            (tier_fetch_cpu(&mut con, &keys), r)
        };
        data_ratios.push(r.as_secs_f64() / t.as_secs_f64());
        a.push(t);
        b.push(r);
        a_cpu.push(tc);
        b_cpu.push(rc);
    }
    let (tier_d, raw_d) = (median(a), median(b));
    let cpu_ratios: Vec<f64> = a_cpu
        .iter()
        .zip(&b_cpu)
        .map(|(t, r)| t.as_secs_f64() / r.as_secs_f64())
        .collect();
    let (tier_cpu, raw_cpu) = (median(a_cpu), median(b_cpu));
    let gib = (chunk * count) as f64 / f64::from(1u32 << 30);
    let (dm, dlo, dhi) = spread(data_ratios.clone());
    let met = data_ratios.iter().filter(|r| **r >= 0.9).count();
    println!(
        "RESULT data_plane {shape}: {DATA_PAIRS} pairs; p2p {:.2} GiB/s, raw tcp {:.2} GiB/s (medians); paired ratio median {dm:.2}, min {dlo:.2}, max {dhi:.2}; {met} of {DATA_PAIRS} pairs >= 0.90 (target: median >= 0.90); load {}",
        gib / tier_d.as_secs_f64(),
        gib / raw_d.as_secs_f64(),
        load_average(),
    );
    let (cm, clo, chi) = spread(cpu_ratios);
    println!(
        "RESULT data_plane {shape} CPU time of both ends per {} MiB (medians, all threads of the process): p2p {:.1} ms, raw tcp {:.1} ms; paired p2p/raw median {cm:.2}, min {clo:.2}, max {chi:.2}",
        (chunk * count) >> 20,
        tier_cpu.as_secs_f64() * 1e3,
        raw_cpu.as_secs_f64() * 1e3,
    );
    drop((con, p));
}

/// `2MiB`, `64KiB`.
fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

/// The 1-minute load average, as `uptime` prints it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// CPU time of the calling thread (unaffected by other processes taking the core).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// What one end's payload MAC costs per byte against copying the byte, on this thread's
/// CPU time: over 32 MiB of distinct rows, each piece copied into a destination (as the
/// kernel copies it out of or into a socket buffer) and then MACed while in cache, as the
/// data plane does. The MAC's share of a copy is the floor of what authentication adds to
/// an end's work; loopback TCP costs each end more than one copy (the ratio printed by
/// `data` says how much), so the share of the whole transfer is smaller.
fn mac_cost() {
    use polyval::universal_hash::UniversalHash;
    use tier_p2p::auth::DataKey;
    use tier_p2p::dataplane::frame::{Begin, ChunkHeader, PIECE, TransferMac};
    use tier_p2p::dataplane::polyval::Polyval;

    let rows: Vec<Vec<u8>> = (0..BIG_COUNT)
        .map(|i| (0..BIG_CHUNK).map(|j| (j * 31 + i) as u8).collect())
        .collect();
    let mut dst = vec![0u8; BIG_CHUNK];
    let begin = Begin {
        transfer_id: 1,
        kv_request_id: "bench".into(),
        round: 0,
        count: BIG_COUNT as u32,
    };
    let macs = TransferMac::new(&DataKey::from_bytes([7; 32]), &begin);
    let polyval = Polyval::new([9; 16]);
    let crate_polyval = polyval::Polyval::new(&[9; 16].into());
    let blake = blake3::Hasher::new_keyed(&[5; 32]);
    let total = (BIG_CHUNK * BIG_COUNT) as f64;
    let (mut copy, mut mac, mut pv, mut pvc, mut b3) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut sink = 0u8;
    for round in 0..9 {
        let (mut c, mut m, mut p, mut pc, mut b) = (
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
        );
        for (i, row) in rows.iter().enumerate() {
            let h = ChunkHeader {
                index: i as u32,
                dst_row: i as u32,
                key: OffloadKey::from_u64(i as u64),
                len: BIG_CHUNK as u32,
            };
            let mut payload = macs.payload(&h);
            for (src, out) in row.chunks(PIECE).zip(dst.chunks_mut(PIECE)) {
                let t = thread_cpu();
                out.copy_from_slice(src);
                let t1 = thread_cpu();
                payload.piece(out);
                let t2 = thread_cpu();
                // The two POLYVALs of the same piece, in cache, in ABBA order over the rounds.
                let (own, other, x) = abba(
                    round,
                    || polyval.hash(out)[0],
                    || {
                        let mut h = crate_polyval.clone();
                        h.update_padded(out);
                        h.finalize()[0]
                    },
                );
                sink ^= x;
                p += own;
                pc += other;
                let t3 = thread_cpu();
                sink ^= blake.clone().update(out).finalize().as_bytes()[0];
                let t4 = thread_cpu();
                c += t1 - t;
                m += t2 - t1;
                b += t4 - t3;
            }
            sink ^= payload.finalize().unwrap().as_bytes()[0];
        }
        let gbs = |d: Duration| total / d.as_secs_f64() / 1e9;
        copy.push(gbs(c));
        mac.push(gbs(m));
        pv.push(gbs(p));
        pvc.push(gbs(pc));
        b3.push(gbs(b));
    }
    let share: Vec<f64> = copy.iter().zip(&mac).map(|(c, m)| c / m).collect();
    let crate_share: Vec<f64> = pvc.iter().zip(&pv).map(|(c, p)| c / p).collect();
    let ((c, clo, chi), (m, mlo, mhi), (b, _, _), (sh, shlo, shhi)) =
        (spread(copy), spread(mac), spread(b3), spread(share));
    let ((p, plo, phi), (pc, pclo, pchi), (r, rlo, rhi)) = (spread(pv), spread(pvc), spread(crate_share));
    println!(
        "RESULT mac_cost per end, 9 runs of 32 MiB in 256 KiB pieces (thread CPU time; load {}): copy {c:.1} GB/s ({clo:.1}..{chi:.1}); payload MAC {m:.1} GB/s ({mlo:.1}..{mhi:.1}); of which POLYVAL alone {p:.1} GB/s; keyed BLAKE3 for comparison {b:.1} GB/s; MAC time / copy time median {sh:.2} ({shlo:.2}..{shhi:.2}) [{sink}]",
        load_average(),
    );
    println!(
        "RESULT mac_polyval, the same 9 runs, piece by piece in ABBA order (thread CPU time): in-house {p:.1} GB/s ({plo:.1}..{phi:.1}); RustCrypto polyval crate {pc:.1} GB/s ({pclo:.1}..{pchi:.1}); crate / in-house per run median {r:.2} ({rlo:.2}..{rhi:.2})",
    );
}

/// Thread CPU times of `a` and `b`, run `a` first in rounds 0 and 3 of every four and `b`
/// first in the others (ABBA), and their outputs combined.
fn abba(round: usize, mut a: impl FnMut() -> u8, mut b: impl FnMut() -> u8) -> (Duration, Duration, u8) {
    fn timed(f: &mut impl FnMut() -> u8) -> (Duration, u8) {
        let t = thread_cpu();
        let x = f();
        (thread_cpu() - t, x)
    }
    let ((da, xa), (db, xb)) = if matches!(round % 4, 0 | 3) {
        let ra = timed(&mut a);
        (ra, timed(&mut b))
    } else {
        let rb = timed(&mut b);
        (timed(&mut a), rb)
    };
    (da, db, xa ^ xb)
}

criterion_group! {
    name = p2p;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = benches
}

fn main() {
    p2p();
    Criterion::default().configure_from_args().final_summary();
}
