//! Where the time of the Python benchmark's operations goes on the Rust side: the loop of
//! `bench/bench_manager.py` (16-key loads and stores as fresh requests, each store request
//! finished and its events drained) run on a CPU tier directly and then through a
//! `TieringManager` step, in one process, timed per call. The difference between the two is
//! the manager's share; the Python figures minus the manager's are the binding's (FFI and
//! Python objects).
//!
//!     cargo run --release -p kvtier-py --example manager_path -- [lru|arc] [chunks] [iterations] [direct|manager|both]
//!
//! Wall-clock nanoseconds per call, averaged; on a shared machine compare the two lines of one
//! run, not runs with each other.
use std::process::ExitCode;
use std::time::Instant;
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{ManagerConfig, OffloadKey, OffloadingManager, PrimaryTier, ReqContext, TieringManager};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let parsed = (|| -> Option<(PolicyKind, usize, usize)> {
        Some((
            args.get(1).map_or("arc", |s| s.as_str()).parse().ok()?,
            args.get(2).map_or(Some(100_000), |s| s.parse().ok())?,
            args.get(3).map_or(Some(50_000), |s| s.parse().ok())?,
        ))
    })();
    let Some((policy, n, iters)) = parsed.filter(|&(_, n, _)| n >= 1024) else {
        eprintln!("usage: manager_path [lru|arc|...] [chunks >= 1024] [iterations] [direct|manager|both]");
        return ExitCode::FAILURE;
    };
    run(policy, n, iters, args.get(4).map_or("both", |s| s.as_str()));
    ExitCode::SUCCESS
}

fn run(policy: PolicyKind, n: usize, iters: usize, mode: &str) {
    let keys: Vec<OffloadKey> = (0..n as u64)
        .map(|i| OffloadKey::from_u64(i ^ 0xabcdef))
        .collect();
    let seq: Vec<OffloadKey> = (0..100_000).map(|i| keys[(i * 7919 + i / 3) % n]).collect();
    // Direct
    if mode != "manager" {
        let mut tier = CpuTier::new(n, 64, policy).expect("a full tier of ready chunks serves the loop");
        let fill = ReqContext::local("fill");
        for b in keys.chunks(1024) {
            tier.prepare_store(b, &fill)
                .expect("a full tier of ready chunks serves the loop");
            tier.complete_store(b, &fill, true);
        }
        tier.on_request_finished(&fill);
        tier.take_events();
        let t = Instant::now();
        for i in 0..iters {
            let b = &seq[(i * 16) % (100_000 - 16)..][..16];
            let c = ReqContext::local("load");
            tier.prepare_load(b, &c)
                .expect("a full tier of ready chunks serves the loop");
            tier.complete_load(b, &c)
                .expect("a full tier of ready chunks serves the loop");
        }
        let load = t.elapsed().as_nanos() as f64 / iters as f64;
        let mut next = 1u64 << 48;
        let mut tp = [0u128; 5];
        for _ in 0..iters {
            let b: Vec<OffloadKey> = (0..16)
                .map(|_| {
                    next += 1;
                    OffloadKey::from_u64(next)
                })
                .collect();
            let t0 = Instant::now();
            let c = ReqContext::local("store");
            let t1 = Instant::now();
            let out = tier
                .prepare_store(&b, &c)
                .expect("a full tier of ready chunks serves the loop");
            assert_eq!(out.evicted.len(), 16);
            let t2 = Instant::now();
            tier.complete_store(&b, &c, true);
            let t3 = Instant::now();
            tier.on_request_finished(&c);
            let t4 = Instant::now();
            std::hint::black_box(tier.take_events());
            let t5 = Instant::now();
            for (j, (a, z)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]
                .iter()
                .enumerate()
            {
                tp[j] += (*z - *a).as_nanos();
            }
        }
        let f = |x: u128| x as f64 / iters as f64;
        println!(
            "direct  {policy:?} {n}: load16 {load:.0} ns | store: ctx {:.0} prep {:.0} compl {:.0} fin {:.0} events {:.0} total {:.0}",
            f(tp[0]),
            f(tp[1]),
            f(tp[2]),
            f(tp[3]),
            f(tp[4]),
            f(tp.iter().sum())
        );
    }
    if mode != "direct" {
        let tier = CpuTier::new(n, 64, policy).expect("a full tier of ready chunks serves the loop");
        let mut m = TieringManager::new(Box::new(tier), Vec::new(), ManagerConfig::default());
        let mut s = m.step();
        let fill = ReqContext::local("fill");
        s.on_new_request(&fill)
            .expect("a full tier of ready chunks serves the loop");
        for b in keys.chunks(1024) {
            s.prepare_store(b, &fill)
                .expect("a full tier of ready chunks serves the loop");
            s.complete_store(b, &fill, true)
                .expect("a full tier of ready chunks serves the loop");
        }
        s.on_request_finished(&fill)
            .expect("a full tier of ready chunks serves the loop");
        s.take_events()
            .expect("a full tier of ready chunks serves the loop");
        let t = Instant::now();
        for i in 0..iters {
            let b = &seq[(i * 16) % (100_000 - 16)..][..16];
            let c = ReqContext::local("load");
            s.prepare_load(b, &c)
                .expect("a full tier of ready chunks serves the loop");
            s.complete_load(b, &c)
                .expect("a full tier of ready chunks serves the loop");
        }
        let load = t.elapsed().as_nanos() as f64 / iters as f64;
        let bench = ReqContext::local("bench");
        s.on_new_request(&bench)
            .expect("a full tier of ready chunks serves the loop");
        let t = Instant::now();
        for k in &seq {
            std::hint::black_box(
                s.lookup(k, &bench)
                    .expect("a full tier of ready chunks serves the loop"),
            );
        }
        let lookup = t.elapsed().as_nanos() as f64 / seq.len() as f64;
        let mut next = 1u64 << 48;
        let mut tp = [0u128; 6];
        for _ in 0..iters {
            let b: Vec<OffloadKey> = (0..16)
                .map(|_| {
                    next += 1;
                    OffloadKey::from_u64(next)
                })
                .collect();
            let t0 = Instant::now();
            let c = ReqContext::local("store");
            s.on_new_request(&c)
                .expect("a full tier of ready chunks serves the loop");
            let t1 = Instant::now();
            let out = s
                .prepare_store(&b, &c)
                .expect("a full tier of ready chunks serves the loop")
                .expect("a full tier of ready chunks serves the loop");
            assert_eq!(out.evicted.len(), 16);
            let t2 = Instant::now();
            s.complete_store(&b, &c, true)
                .expect("a full tier of ready chunks serves the loop");
            let t3 = Instant::now();
            s.on_request_finished(&c)
                .expect("a full tier of ready chunks serves the loop");
            let t4 = Instant::now();
            std::hint::black_box(
                s.take_events()
                    .expect("a full tier of ready chunks serves the loop"),
            );
            let t5 = Instant::now();
            drop(c);
            for (j, (a, z)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]
                .iter()
                .enumerate()
            {
                tp[j] += (*z - *a).as_nanos();
            }
        }
        let f = |x: u128| x as f64 / iters as f64;
        println!(
            "manager {policy:?} {n}: load16 {load:.0} ns lookup {lookup:.0} ns | store: ctx+new {:.0} prep {:.0} compl {:.0} fin {:.0} events {:.0} total {:.0}",
            f(tp[0]),
            f(tp[1]),
            f(tp[2]),
            f(tp[3]),
            f(tp[4]),
            f(tp.iter().sum())
        );
    }
}
