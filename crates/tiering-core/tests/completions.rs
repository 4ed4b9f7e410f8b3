//! Store completions reported by copy workers: reconciled with the engine's reports per key,
//! aggregated over tensor-parallel ranks, and — from worker processes — carried over the
//! completion channel into a shared arena. The worker side of the cross-process tests is this
//! same test binary, re-executed with `CHILD_ENV` set.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tiering_core::arena::{ArenaOptions, ArenaView, ChunkArena};
use tiering_core::channel::{WorkerReporter, fingerprint};
use tiering_core::testing::{MemoryPrimary, ScriptedTier};
use tiering_core::{
    LookupResult, ManagerConfig, OffloadKey, OffloadingManager, PrimaryTier, ReqContext, ScheduleEndContext,
    SecondaryTier, TieringManager,
};

fn off_step(reporters: u32) -> ManagerConfig {
    ManagerConfig {
        off_step: true,
        reporters,
        ..ManagerConfig::step_driven()
    }
}

/// Prepares a store of `keys` under `ctx` and writes their rows (the copy "ran"); the store
/// stays unreported.
fn prepare(r: &mut Rig, ctx: &ReqContext, keys: &[OffloadKey]) -> Vec<OffloadKey> {
    let out = r.m.prepare_store(keys, ctx).unwrap().unwrap();
    for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        r.primary
            .arena()
            .write_row(*c)
            .unwrap()
            .copy_from_slice(&bytes_for(k));
    }
    out.keys_to_store
}

#[test]
fn completion_reports_reconcile_per_key() {
    for worker_first in [true, false] {
        let mut r = rig(16, &["disk"], off_step(1));
        let sender = r.m.store_completion_sender();
        let ctx = ReqContext::local("req");
        r.m.on_new_request(&ctx).unwrap();
        let a = prepare(&mut r, &ctx, &[key(1), key(2), key(3)]);
        let b = prepare(&mut r, &ctx, &[key(4), key(5)]);
        end_step(&mut r.m);
        // The worker reports in its own batching and order (one report spanning both stores,
        // then the rest reversed); the engine reports the two stores as prepared.
        let worker = |s: &tiering_core::StoreCompletionSender| {
            s.report(&[key(5), key(1)], true);
            s.report(&[key(3), key(4), key(2)], true);
        };
        let cascades = if worker_first {
            worker(&sender);
            end_step(&mut r.m); // step-driven: the poll applies queued reports
            // One cascade per (report, store) pair: {5},{1} then {3,2},{4}.
            assert_eq!(r.tiers[0].count("submit_store"), 4);
            r.m.complete_store(&a, &ctx, true).unwrap();
            r.m.complete_store(&b, &ctx, true).unwrap();
            4
        } else {
            r.m.complete_store(&b, &ctx, true).unwrap();
            r.m.complete_store(&a, &ctx, true).unwrap();
            assert_eq!(
                r.tiers[0].count("submit_store"),
                2,
                "one cascade per engine report"
            );
            worker(&sender);
            end_step(&mut r.m); // the late worker reports arrive before the request finishes
            2
        };
        r.m.on_request_finished(&ctx).unwrap();
        end_step(&mut r.m);
        end_step(&mut r.m);
        let stats = r.m.stats().unwrap().manager;
        assert_eq!(
            r.tiers[0].count("submit_store"),
            cascades,
            "the second side cascaded nothing ({worker_first})"
        );
        for n in 1..=5 {
            assert_eq!(
                r.tiers[0].get(&key(n)),
                Some(bytes_for(&key(n))),
                "key {n} reached the tier"
            );
        }
        assert_eq!(
            stats.duplicate_store_reports, 5,
            "every key's second report absorbed"
        );
        assert_eq!(stats.store_report_conflicts, 0);
        for n in 1..=5 {
            assert_eq!(r.m.lookup(&key(n), &ctx).unwrap(), LookupResult::Hit, "key {n}");
        }
        assert_eq!(r.tiers[0].finished_requests().len(), 1, "finalized once");
        end_step(&mut r.m);
        r.m.inspect(|s| {
            assert_eq!(
                s.unmatched_store_reports(),
                0,
                "the ledger is empty after finalize"
            );
            assert_eq!(s.tracked_requests(), 0);
        });
        r.primary.check_invariants().unwrap();
        assert_eq!(r.primary.total_pins(), 0);
        r.m.shutdown().unwrap();
    }
}

#[test]
fn conflicting_success_flags_are_counted_and_the_first_report_wins() {
    let mut r = rig(8, &["disk"], off_step(1));
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    let keys = prepare(&mut r, &ctx, &[key(1), key(2)]);
    end_step(&mut r.m);
    // The worker says key 1 failed and key 2 succeeded; the engine says both succeeded.
    sender.report(&[key(1)], false);
    sender.report(&[key(2)], true);
    end_step(&mut r.m);
    r.m.complete_store(&keys, &ctx, true).unwrap();
    end_step(&mut r.m);
    let stats = r.m.stats().unwrap().manager;
    assert_eq!(stats.store_report_conflicts, 1);
    assert_eq!(stats.duplicate_store_reports, 2);
    assert_eq!(
        r.m.lookup(&key(1), &ctx).unwrap(),
        LookupResult::Miss,
        "the failed copy was freed"
    );
    assert_eq!(r.m.lookup(&key(2), &ctx).unwrap(), LookupResult::Hit);
    end_step(&mut r.m);
    r.m.shutdown().unwrap();
}

#[test]
fn tensor_parallel_reports_complete_once_all_ranks_reported() {
    let mut r = rig(8, &["disk"], off_step(2));
    let sender = r.m.store_completion_sender();
    let ctx = ReqContext::local("req");
    r.m.on_new_request(&ctx).unwrap();
    let keys = prepare(&mut r, &ctx, &[key(1), key(2)]);
    end_step(&mut r.m);
    sender.report_rank(1, &keys, true);
    sender.report_rank(1, &keys, true); // a rank repeating itself does not count twice
    end_step(&mut r.m);
    assert_eq!(
        r.m.lookup(&key(1), &ctx).unwrap(),
        LookupResult::HitPending,
        "rank 0 has not reported"
    );
    assert_eq!(r.tiers[0].count("submit_store"), 0);
    end_step(&mut r.m);
    sender.report_rank(0, &keys, true);
    end_step(&mut r.m);
    assert_eq!(
        r.m.lookup(&key(1), &ctx).unwrap(),
        LookupResult::Hit,
        "both ranks reported"
    );
    assert_eq!(r.tiers[0].count("submit_store"), 1, "one cascade");
    r.m.complete_store(&keys, &ctx, true).unwrap();
    r.m.on_request_finished(&ctx).unwrap();
    end_step(&mut r.m);
    let stats = r.m.stats().unwrap().manager;
    assert_eq!(stats.off_step_store_completions, 2);
    assert_eq!(
        stats.duplicate_store_reports, 4,
        "rank 1's repeat and the engine's report"
    );
    r.m.inspect(|s| assert_eq!(s.unmatched_store_reports(), 0));
    r.m.shutdown().unwrap();
}

// ----- worker processes --------------------------------------------------------------------

/// Set in a re-executed child: `role|arena|socket|rank|fingerprint|row:key,row:key…`.
const CHILD_ENV: &str = "KVTIER_COMPLETIONS_CHILD";
const ROWS: usize = 8;
const CHUNK_BYTES: usize = 4096;

/// Rank `rank` of 2 copies its half of the row (tensor parallelism splits the heads).
fn half(rank: u32) -> std::ops::Range<usize> {
    let h = CHUNK_BYTES / 2;
    if rank == 0 { 0..h } else { h..CHUNK_BYTES }
}

fn pattern(k: &OffloadKey) -> Vec<u8> {
    let seed = k.to_bytes()[31];
    (0..CHUNK_BYTES)
        .map(|i| seed.wrapping_mul(13).wrapping_add((i % 251) as u8))
        .collect()
}

/// The child's body, when this binary runs as a worker process.
fn run_child(spec: &str) {
    let parts: Vec<&str> = spec.split('|').collect();
    let (role, arena, socket, rank, fp, orders) =
        (parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]);
    let rank: u32 = rank.parse().unwrap();
    let view = ArenaView::open(arena).unwrap();
    let mut reporter = WorkerReporter::connect(Path::new(socket), rank, fp.parse().unwrap()).unwrap();
    let mut keys = Vec::new();
    let mut held = Vec::new();
    for order in orders.split(',') {
        let (row, n) = order.split_once(':').unwrap();
        let k = key(n.parse().unwrap());
        let mut grant = view.write_row(row.parse().unwrap()).unwrap();
        grant[half(rank)].copy_from_slice(&pattern(&k)[half(rank)]);
        keys.push(k);
        if role == "die" {
            held.push(grant); // dies holding its grants, mid-copy
        }
    }
    if role == "die" {
        println!("child: holding");
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    reporter.report(&keys, true).unwrap();
    reporter.close().unwrap();
    println!("child: reported");
}

/// A worker process, killed and reaped on drop.
struct Worker(Child);

impl Worker {
    fn spawn(test: &str, spec: String) -> (Self, impl Iterator<Item = String>) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.split_once("child: ").map(|(_, s)| s.to_owned()));
        (Self(child), lines)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Producer {
    m: Engine,
    arena: Arc<ChunkArena>,
    primary: MemoryPrimary,
    tier: tiering_core::testing::ScriptedTierHandle,
    socket: PathBuf,
    fp: u64,
    _dir: tempfile::TempDir,
}

fn producer(config: ManagerConfig) -> Producer {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let arena_path = dir.path().join("arena");
    let mut opts = ArenaOptions::new(ROWS, CHUNK_BYTES);
    opts.shared_memory = Some(arena_path.clone());
    let arena = ChunkArena::with_options(&opts).unwrap();
    let primary = MemoryPrimary::with_arena(Arc::clone(&arena));
    let (tier, handle) = ScriptedTier::new("peer");
    let manager = TieringManager::new(
        Box::new(primary.clone()),
        vec![Box::new(tier) as Box<dyn SecondaryTier>],
        config,
    );
    let socket = dir.path().join("completions.sock");
    manager.open_completion_channel(&socket).unwrap();
    let fp = fingerprint(ROWS, CHUNK_BYTES, Some(&arena_path));
    Producer {
        m: Engine::new(manager),
        arena,
        primary,
        tier: handle,
        socket,
        fp,
        _dir: dir,
    }
}

fn spec(p: &Producer, role: &str, rank: u32, orders: &[(u32, u64)]) -> String {
    let orders: Vec<String> = orders.iter().map(|(r, n)| format!("{r}:{n}")).collect();
    format!(
        "{role}|{}|{}|{rank}|{}|{}",
        p.arena.shared_path().unwrap().display(),
        p.socket.display(),
        p.fp,
        orders.join(",")
    )
}

#[test]
fn worker_process_reports_over_the_channel() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return run_child(&spec);
    }
    let mut p = producer(ManagerConfig {
        off_step: true,
        reporters: 2,
        ..ManagerConfig::default()
    });
    let ctx = ReqContext::local("prefill-1");
    p.m.on_new_request(&ctx).unwrap();
    let out =
        p.m.prepare_store(&[key(1), key(2), key(3)], &ctx)
            .unwrap()
            .unwrap();
    end_step(&mut p.m); // the model runs; the copy workers copy and report
    let orders: Vec<(u32, u64)> = out.chunk_ids.iter().copied().zip([1, 2, 3]).collect();
    let name = "worker_process_reports_over_the_channel";
    let (mut w0, mut l0) = Worker::spawn(name, spec(&p, "report", 0, &orders));
    assert_eq!(l0.next().as_deref(), Some("reported"));
    let _ = w0.0.wait();
    // Rank 0 alone does not complete the store.
    assert_eq!(p.tier.count("submit_store"), 0);
    let (mut w1, mut l1) = Worker::spawn(name, spec(&p, "report", 1, &orders));
    assert_eq!(l1.next().as_deref(), Some("reported"));
    let _ = w1.0.wait();
    // The control thread completes and cascades it, with no engine call.
    assert!(p.tier.wait_until(PATIENCE, |v| v.count("submit_store") == 1));
    for n in 1..=3 {
        assert_eq!(
            p.tier.get(&key(n)),
            Some(pattern(&key(n))),
            "bytes of key {n} from both ranks"
        );
    }
    // The engine's own report is absorbed; the chunks load with the workers' bytes.
    p.m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    for n in 1..=3 {
        assert_eq!(p.m.lookup(&key(n), &ctx).unwrap(), LookupResult::Hit);
    }
    let rows = p.m.prepare_load(&[key(2)], &ctx).unwrap();
    assert_eq!(&*p.arena.read_row(rows[0]).unwrap(), pattern(&key(2)).as_slice());
    p.m.complete_load(&[key(2)], &ctx).unwrap();
    p.m.on_request_finished(&ctx).unwrap();
    end_step(&mut p.m);
    let stats = p.m.stats().unwrap().manager;
    assert_eq!(stats.off_step_store_completions, 3);
    assert_eq!(stats.duplicate_store_reports, 3);
    assert_eq!(stats.completion_messages_rejected, 0);
    p.m.shutdown().unwrap();
    assert_eq!(p.arena.granted_rows(), 0);
    let _ = &p.primary;
}

#[test]
fn worker_process_dies_and_its_stores_fail_after_the_deadline() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return run_child(&spec);
    }
    let mut p = producer(ManagerConfig {
        off_step: true,
        reporters: 1,
        worker_deadline: Duration::from_millis(200),
        ..ManagerConfig::default()
    });
    let ctx = ReqContext::local("prefill-1");
    p.m.on_new_request(&ctx).unwrap();
    let out = p.m.prepare_store(&[key(1), key(2)], &ctx).unwrap().unwrap();
    end_step(&mut p.m);
    let orders: Vec<(u32, u64)> = out.chunk_ids.iter().copied().zip([1, 2]).collect();
    let name = "worker_process_dies_and_its_stores_fail_after_the_deadline";
    let (mut w, mut lines) = Worker::spawn(name, spec(&p, "die", 0, &orders));
    assert_eq!(lines.next().as_deref(), Some("holding"));
    // The worker dies mid-copy, holding its row grants and without reporting.
    w.0.kill().unwrap();
    let _ = w.0.wait();
    assert!(eventually(
        || p.m.stats().unwrap().manager.worker_lost_store_keys == 2
    ));
    assert_eq!(
        p.tier.count("submit_store"),
        0,
        "nothing half-written was cascaded"
    );
    assert_eq!(
        p.m.lookup(&key(1), &ctx).unwrap(),
        LookupResult::Miss,
        "the store failed"
    );
    // The engine, unaware, reports success later: absorbed and counted as a conflict.
    p.m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    end_step(&mut p.m);
    assert_eq!(p.m.stats().unwrap().manager.store_report_conflicts, 2);
    // The dead worker's grants were reclaimed: the rows can be stored into again.
    assert_eq!(p.arena.granted_rows(), 0);
    let again = p.m.prepare_store(&[key(7), key(8)], &ctx).unwrap().unwrap();
    for (k, c) in again.keys_to_store.iter().zip(&again.chunk_ids) {
        p.arena.write_row(*c).unwrap().copy_from_slice(&pattern(k));
    }
    p.m.complete_store(&again.keys_to_store, &ctx, true).unwrap();
    p.m.on_request_finished(&ctx).unwrap();
    end_step(&mut p.m);
    assert!(p.tier.wait_until(PATIENCE, |v| v.count("submit_store") == 1));
    p.m.shutdown().unwrap();
    let _ = &p.primary;
}

#[test]
fn a_worker_of_another_arena_is_refused() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return run_child(&spec);
    }
    let mut p = producer(ManagerConfig {
        off_step: true,
        ..ManagerConfig::default()
    });
    // A reporter presenting another arena's fingerprint is rejected at its hello.
    let mut foreign = WorkerReporter::connect(&p.socket, 0, p.fp ^ 1).unwrap();
    let _ = foreign.report(&[key(1)], true);
    assert!(eventually(|| {
        p.m.step()
            .on_schedule_end(&ScheduleEndContext::default())
            .unwrap();
        p.m.end();
        p.m.stats().unwrap().manager.completion_messages_rejected == 1
    }));
    p.m.shutdown().unwrap();
    let _ = PrimaryTier::arena(&p.primary);
}

#[test]
fn a_step_driven_manager_reads_the_channel_at_its_steps() {
    // No control thread: the channel is read where the engine's steps apply completions.
    let mut p = producer(off_step(1));
    let ctx = ReqContext::local("prefill-1");
    p.m.on_new_request(&ctx).unwrap();
    let out = p.m.prepare_store(&[key(1), key(2)], &ctx).unwrap().unwrap();
    end_step(&mut p.m);
    for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        p.arena.write_row(*c).unwrap().copy_from_slice(&pattern(k));
    }
    let mut reporter = WorkerReporter::connect(&p.socket, 0, p.fp).unwrap();
    reporter.report(&out.keys_to_store, true).unwrap();
    // The report waits in the socket until the next step's first call reads it (the write
    // above has returned, so the bytes are there).
    assert_eq!(p.tier.count("submit_store"), 0);
    assert_eq!(
        p.m.lookup(&key(1), &ctx).unwrap(),
        LookupResult::Hit,
        "the step's first call applied the report"
    );
    end_step(&mut p.m);
    assert!(
        eventually(|| {
            end_step(&mut p.m);
            p.tier.count("submit_store") == 1
        }),
        "the completed store is cascaded"
    );
    assert_eq!(p.tier.get(&key(2)), Some(pattern(&key(2))));
    reporter.close().unwrap();
    p.m.complete_store(&out.keys_to_store, &ctx, true).unwrap();
    p.m.on_request_finished(&ctx).unwrap();
    end_step(&mut p.m);
    let stats = p.m.stats().unwrap().manager;
    assert_eq!(stats.off_step_store_completions, 2);
    assert_eq!(stats.completion_messages_rejected, 0);
    p.m.shutdown().unwrap();
    assert!(!p.socket.exists(), "shutdown removes the socket");
    let _ = &p.primary;
}
