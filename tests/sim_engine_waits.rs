//! An engine that weighs loading against recomputing (`SimConfig::recompute_cost`) stops
//! waiting for a tier that never answers once waiting would cost more than recomputing, and
//! one that does not weigh them keeps waiting for an answer that comes.

use std::time::Duration;

mod common;

use common::sim::{TPC, run_one_request};
use kvtier::sim::chunk_keys;
use tiering_core::testing::ScriptedTier;
use tiering_core::{LookupResult, SecondaryTier};

fn request() -> (Vec<u32>, Vec<u32>) {
    // 10 full chunks and 5 more prompt tokens.
    let prompt: Vec<u32> = (0..(10 * TPC + 5) as u32).map(|t| t * 5 + 1).collect();
    (prompt, vec![9, 8, 7])
}

#[test]
fn a_lookup_that_never_resolves_is_given_up_and_the_request_recomputes() {
    let (prompt, output) = request();
    let mut all = prompt.clone();
    all.extend_from_slice(&output);
    let keys = chunk_keys(&all, TPC, 0);
    let (slow, handle) = ScriptedTier::new("slow");
    // The tier never learns whether it has the first chunk.
    handle.set_lookup(keys[0], LookupResult::Retry);
    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(slow)];
    let report = run_one_request(tiers, &prompt, &output, |cfg| {
        cfg.recompute_cost = true;
        cfg.drain_timeout = Duration::from_secs(20);
    });
    println!("{report}");
    assert_eq!(report.requests, 1);
    assert!(report.lookups.retry > 0, "{report}");
    // Either side stops the wait: the manager, once the question has gone unanswered longer
    // than recomputing a chunk (32 µs) and answers `Miss` (`retries_declined_by_cost`), or the
    // engine's own weighing (`waits_given_up`): 10 chunks × 16 tokens × 2 µs = 320 µs of
    // recompute at stake, credited with even odds before any wait paid off, and 50 µs per
    // step. The request waits a few steps, not until the drain timeout.
    let declined = report.decisions[0].retries_declined_by_cost;
    assert!(report.waits_given_up + declined >= 1, "{report}");
    assert!(report.deferrals >= 1 && report.deferrals <= 8, "{report}");
    assert_eq!(report.source_tokens("computed"), prompt.len() as u64, "{report}");
    assert_eq!(report.copy_jobs.completed, report.copy_jobs.submitted);
    let leaks = report
        .identities
        .iter()
        .filter(|i| i.name.contains("after the run"));
    for id in leaks {
        assert!(id.holds, "{id:?}");
    }
}

#[test]
fn without_the_weighing_the_engine_waits_for_the_answer() {
    let (prompt, output) = request();
    let mut all = prompt.clone();
    all.extend_from_slice(&output);
    let keys = chunk_keys(&all, TPC, 0);
    let (slow, handle) = ScriptedTier::new("slow");
    handle.set_lookup(keys[0], LookupResult::Retry);
    let flipper = {
        let handle = handle.clone();
        let k0 = keys[0];
        std::thread::spawn(move || {
            // Each deferred scan asks the tier twice (the pending chunk, then the next one):
            // 20 deferrals, far more than the weighing engine would wait.
            assert!(handle.wait_until(Duration::from_secs(30), |v| v.count("lookup") >= 40));
            handle.set_lookup(k0, LookupResult::Miss);
        })
    };
    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(slow)];
    let report = run_one_request(tiers, &prompt, &output, |_| {});
    flipper.join().unwrap();
    assert_eq!(report.waits_given_up, 0, "{report}");
    assert!(report.deferrals >= 20, "{report}");
    assert_eq!(report.source_tokens("computed"), prompt.len() as u64, "{report}");
}
