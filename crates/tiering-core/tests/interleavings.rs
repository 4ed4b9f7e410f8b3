//! Property test: random interleavings of engine calls, tier job completions and peer requests,
//! with the control-plane thread running, never leave a pin leaked, a ref count out of range, a
//! row grant held, or a job unreported once everything has drained.

mod common;

use std::time::{Duration, Instant};

use common::*;
use proptest::prelude::*;
use tiering_core::testing::{Completion, PeerRequest};
use tiering_core::{
    JobOutcome, LookupResult, ManagerConfig, OffloadKey, OffloadPolicy, PrimaryTier, ReqContext, RequestId,
};

#[derive(Clone, Debug)]
enum Op {
    NewRequest(usize),
    Lookup { req: usize, key: u64, load: bool },
    PrepareStore { req: usize, keys: Vec<u64> },
    CompleteStore { idx: usize, success: bool },
    CompleteLoad { idx: usize },
    Finish(usize),
    Peer { keys: Vec<u64>, fetch: bool },
    TierComplete { idx: usize, outcome: u8 },
    EndStep,
    Pause,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize).prop_map(Op::NewRequest),
        (0..4usize).prop_map(Op::NewRequest),
        (0..4usize, 0..24u64, any::<bool>()).prop_map(|(req, key, load)| Op::Lookup { req, key, load }),
        (0..4usize, 0..24u64, any::<bool>()).prop_map(|(req, key, load)| Op::Lookup { req, key, load }),
        (0..4usize, prop::collection::vec(0..16u64, 1..4))
            .prop_map(|(req, keys)| Op::PrepareStore { req, keys }),
        (0..8usize, prop::bool::weighted(0.8)).prop_map(|(idx, success)| Op::CompleteStore { idx, success }),
        (0..8usize).prop_map(|idx| Op::CompleteLoad { idx }),
        (0..4usize).prop_map(Op::Finish),
        (prop::collection::vec(0..24u64, 1..4), any::<bool>())
            .prop_map(|(keys, fetch)| Op::Peer { keys, fetch }),
        (0..8usize, 0..3u8).prop_map(|(idx, outcome)| Op::TierComplete { idx, outcome }),
        Just(Op::EndStep),
        Just(Op::EndStep),
        Just(Op::Pause),
    ]
}

struct Engine {
    active: Vec<Option<ReqContext>>,
    generation: usize,
    stores: Vec<(ReqContext, Vec<OffloadKey>)>,
    loads: Vec<(ReqContext, Vec<OffloadKey>)>,
}

fn run(ops: &[Op], threaded: bool) -> Result<(), TestCaseError> {
    let config = if threaded {
        ManagerConfig::default()
    } else {
        ManagerConfig::step_driven()
    };
    let mut r = rig(12, &["auto", "manual"], config);
    r.tiers[1].set_completion(Completion::Manual);
    r.tiers[1].set_policy(OffloadPolicy::RequestLevel);
    // Chunks the primary does not hold yet, so lookups promote.
    for n in 8..24 {
        r.tiers[if n % 2 == 0 { 0 } else { 1 }].insert(key(n), bytes_for(&key(n)));
    }
    let mut e = Engine {
        active: vec![None; 4],
        generation: 0,
        stores: Vec::new(),
        loads: Vec::new(),
    };
    let mut hits_this_step: Vec<(usize, OffloadKey)> = Vec::new();
    let mut peer_seq = 0;
    for op in ops {
        match op {
            Op::NewRequest(i) => {
                if e.active[*i].is_none() {
                    e.generation += 1;
                    let ctx = ReqContext::local(format!("r{i}-{}", e.generation));
                    r.m.on_new_request(&ctx).unwrap();
                    e.active[*i] = Some(ctx);
                }
            }
            Op::Lookup { req, key: k, load } => {
                if let Some(ctx) = e.active[*req].clone() {
                    let res = r.m.lookup(&key(*k), &ctx).unwrap();
                    if res == LookupResult::Hit {
                        hits_this_step.push((*req, key(*k)));
                        if *load {
                            r.m.prepare_load(&[key(*k)], &ctx).unwrap();
                            e.loads.push((ctx, vec![key(*k)]));
                        }
                    }
                }
            }
            Op::PrepareStore { req, keys } => {
                if let Some(ctx) = e.active[*req].clone() {
                    let keys: Vec<OffloadKey> = keys.iter().map(|&n| key(n)).collect();
                    if let Some(out) = r.m.prepare_store(&keys, &ctx).unwrap()
                        && !out.keys_to_store.is_empty()
                    {
                        let arena = r.primary.arena().clone();
                        for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
                            arena.write_row(*c).unwrap().copy_from_slice(&bytes_for(k));
                        }
                        e.stores.push((ctx, out.keys_to_store));
                    }
                }
            }
            Op::CompleteStore { idx, success } => {
                if !e.stores.is_empty() {
                    let (ctx, keys) = e.stores.remove(idx % e.stores.len());
                    r.m.complete_store(&keys, &ctx, *success).unwrap();
                }
            }
            Op::CompleteLoad { idx } => {
                if !e.loads.is_empty() {
                    let (ctx, keys) = e.loads.remove(idx % e.loads.len());
                    r.m.complete_load(&keys, &ctx).unwrap();
                }
            }
            Op::Finish(i) => {
                if let Some(ctx) = e.active[*i].take() {
                    r.m.on_request_finished(&ctx).unwrap();
                }
            }
            Op::Peer { keys, fetch } => {
                peer_seq += 1;
                r.tiers[0].push_peer_request(PeerRequest {
                    ctx: ReqContext::new(RequestId::remote("peer:9", format!("p{peer_seq}"))),
                    keys: keys.iter().map(|&n| key(n)).collect(),
                    fetch: *fetch,
                    wait_for_pending: false,
                });
            }
            Op::TierComplete { idx, outcome } => {
                let held = r.tiers[1].held_jobs();
                if !held.is_empty() {
                    let (id, _, keys) = held[idx % held.len()].clone();
                    let outcome = match outcome {
                        0 => JobOutcome::Ok,
                        1 => JobOutcome::Failed,
                        _ => JobOutcome::Partial(keys[..keys.len() / 2].to_vec()),
                    };
                    r.tiers[1].complete(id, outcome);
                }
            }
            Op::EndStep => {
                r.m.on_schedule_end(&Default::default()).unwrap();
                hits_this_step.clear();
            }
            Op::Pause => {
                if !r.m.in_step() {
                    std::thread::sleep(Duration::from_micros(300));
                }
            }
        }
    }
    // Drain like an engine winding down: finish every transfer and request, then step until idle.
    for (ctx, keys) in std::mem::take(&mut e.loads) {
        r.m.complete_load(&keys, &ctx).unwrap();
    }
    for (ctx, keys) in std::mem::take(&mut e.stores) {
        r.m.complete_store(&keys, &ctx, true).unwrap();
    }
    for ctx in e.active.iter_mut().filter_map(Option::take) {
        r.m.on_request_finished(&ctx).unwrap();
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        r.tiers[1].complete_all();
        r.m.on_schedule_end(&Default::default()).unwrap();
        if !r.m.has_pending_work().unwrap() {
            break;
        }
        prop_assert!(Instant::now() < deadline, "the manager never became idle");
        std::thread::sleep(Duration::from_micros(200));
    }
    r.m.inspect(|s| {
        assert_eq!(s.jobs_in_flight(), 0, "unreported jobs");
        assert_eq!(s.reserved_promotions(), 0, "unsubmitted promotions");
        assert_eq!(s.tracked_requests(), 0, "requests never finalized");
    });
    prop_assert_eq!(r.primary.total_pins(), 0, "leaked pins");
    prop_assert_eq!(r.primary.writes_in_flight(), 0, "writes never completed");
    if let Err(e) = r.primary.check_invariants() {
        return Err(TestCaseError::fail(e));
    }
    prop_assert_eq!(r.primary.arena().granted_rows(), 0, "row grants still held");
    // Every local request the tiers heard about was also finished for them.
    for t in &r.tiers {
        let started = t.calls_of("on_new_request").len();
        prop_assert_eq!(t.finished_requests().len(), started);
    }
    r.m.shutdown().unwrap();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn interleavings_with_the_control_thread_leak_nothing(ops in prop::collection::vec(op(), 1..80)) {
        run(&ops, true)?;
    }

    #[test]
    fn step_driven_interleavings_leak_nothing(ops in prop::collection::vec(op(), 1..80)) {
        run(&ops, false)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// The long soak of the threaded property (run with `--run-ignored only`).
    #[test]
    #[ignore = "soak: 2000 cases of up to 300 operations"]
    fn interleavings_soak(ops in prop::collection::vec(op(), 1..300)) {
        run(&ops, true)?;
    }
}
