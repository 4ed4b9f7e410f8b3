//! The engine's scan semantics and hit attribution over scripted secondary tiers: a promotion
//! from the second tier is pending while the first answers `Retry` for a later chunk; the
//! request waits for both, then loads exactly the promoted chunks, attributed to the tier that
//! served them.

use std::time::Duration;

mod common;

use common::sim::{CHUNK, TPC, run_one_request};
use kvtier::sim::{chunk_keys, fill_chunk};
use tiering_core::testing::ScriptedTier;
use tiering_core::{LookupResult, SecondaryTier};

#[test]
fn retry_defers_a_pending_promotion_and_hits_are_attributed_to_the_serving_tier() {
    // One request: 10 full chunks and 5 more prompt tokens.
    let prompt: Vec<u32> = (0..(10 * TPC + 5) as u32).map(|t| t * 7 + 3).collect();
    let output: Vec<u32> = vec![1, 2, 3, 4];
    let mut all = prompt.clone();
    all.extend_from_slice(&output);
    let keys = chunk_keys(&all, TPC, 0);

    let (a, a_handle) = ScriptedTier::new("a");
    let (b, b_handle) = ScriptedTier::new("b");
    // Tier b holds the first six chunks, with the bytes the engine's model would have written.
    for k in &keys[..6] {
        let mut bytes = vec![0u8; CHUNK];
        fill_chunk(k, &mut bytes);
        b_handle.insert(*k, bytes);
    }
    // Tier a does not know yet whether it has chunk 6.
    a_handle.set_lookup(keys[6], LookupResult::Retry);
    let flipper = {
        let a_handle = a_handle.clone();
        let k6 = keys[6];
        std::thread::spawn(move || {
            // After a few deferred scans, a's answer arrives: it does not have chunk 6.
            assert!(a_handle.wait_until(Duration::from_secs(30), |v| v.count("lookup") >= 20));
            a_handle.set_lookup(k6, LookupResult::Miss);
        })
    };

    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(a), Box::new(b)];
    let report = run_one_request(tiers, &prompt, &output, |_| {});
    flipper.join().unwrap();
    println!("{report}");

    assert!(report.lookups.retry > 0, "{report}");
    assert!(report.lookups.hit_pending >= 6, "{report}");
    assert!(report.deferrals > 0, "{report}");
    assert_eq!(report.chain, ["cpu", "a", "b"]);
    assert_eq!(report.source_tokens("b"), (6 * TPC) as u64, "{report}");
    assert_eq!(report.source_tokens("a"), 0);
    assert_eq!(report.source_tokens("cpu"), 0);
    assert_eq!(report.source_tokens("computed"), (prompt.len() - 6 * TPC) as u64);
    assert_eq!(report.tokens_not_recomputed, Some((6 * TPC) as i64));
    assert_eq!(report.manager.promoted_keys, 6);
    assert_eq!(report.copy_jobs.corrupt_chunks, 0);
    assert_eq!(report.copy_jobs.completed, report.copy_jobs.submitted);
    // The scripted tiers do not count bytes, so only the engine's own identities apply here.
    let scripted = |name: &str| ["a→", "b→", "→a ", "→b "].iter().any(|t| name.contains(t));
    for id in report.identities.iter().filter(|i| !scripted(&i.name)) {
        assert!(id.holds, "{id:?}");
    }
    // Every newly computed chunk was cascaded to both tiers.
    assert!(b_handle.contains(&keys[9]));
    assert!(a_handle.contains(&keys[9]));
}
