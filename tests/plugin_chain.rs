//! The example tier in a TOML chain, linked in and loaded from its shared library: the same
//! scenario runs over both (stores, cascades with LRU eviction and events, promotions, and a
//! peer served through the `ParentManager` with fan-out to the other tier).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use tier_example::peer::{PeerAnswer, PeerClient, PeerQuery};
use tiering_config::ChainConfig;
use tiering_core::{
    LookupResult, OffloadKey, OffloadingManager, PrimaryTier, ReqContext, ScheduleEndContext, TieringManager,
};

// Keep the linked-in registration of `example`.
use tier_example as _;

const CHUNK: usize = 4096;
const DEADLINE: Duration = Duration::from_secs(20);

fn bytes_for(n: u64) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (n as usize).wrapping_mul(131).wrapping_add(i) as u8)
        .collect()
}

fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

/// The chain: a test primary, then two example tiers — `ex-a` (small, serves peers) and `ex-b`.
fn chain_text(library: Option<&Path>, inbox: &Path, thread: bool) -> String {
    let lib = library.map_or(String::new(), |p| format!("library = \"{}\"\n", p.display()));
    format!(
        r#"[primary]
type = "itest-memory"
chunks = 32

[[secondary]]
type = "example"
{lib}name = "ex-a"
capacity = "{a_cap}"
inbox = "{inbox}"

[[secondary]]
type = "example"
{lib}name = "ex-b"
capacity = "64KiB"

[control_plane]
thread = {thread}
idle_wait = "1ms"
"#,
        a_cap = 2 * CHUNK,
        inbox = inbox.display(),
    )
}

fn build(text: &str) -> TieringManager {
    let chain = ChainConfig::parse("itest.toml", text).unwrap();
    match chain.build(tiering_core::registry::Registry::global().unwrap(), CHUNK) {
        Ok(m) => m,
        Err(e) => panic!("{e}"),
    }
}

/// One engine step that only ends (tiers report and serve).
fn step(m: &mut TieringManager) {
    m.step().on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// Steps until `done` holds (each step lets tiers report and serve).
fn step_until(m: &mut TieringManager, mut done: impl FnMut(&mut TieringManager) -> bool) {
    let start = Instant::now();
    while !done(m) {
        assert!(
            start.elapsed() < DEADLINE,
            "condition not reached within {DEADLINE:?}"
        );
        step(m);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn tier_stats(m: &mut TieringManager, name: &str) -> tiering_core::TierStats {
    m.stats()
        .unwrap()
        .secondaries
        .into_iter()
        .find(|s| s.name == name)
        .unwrap()
}

/// Asks `inbox` and steps the manager until the answer arrives.
fn ask(m: &mut TieringManager, client: &PeerClient, inbox: &Path, query: &PeerQuery) -> PeerAnswer {
    client.ask(inbox, query).unwrap();
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < DEADLINE, "no answer from the peer inbox");
        step(m);
        if let Ok(a) = client.answer(Duration::from_millis(5)) {
            return a;
        }
    }
}

/// The scenario both variants run. `meanwhile` runs right after the chain is built: the other
/// tests of this binary build their own `itest-memory` chains concurrently, so the scenario must
/// find its own primary whatever was built in between.
fn scenario(library: Option<&Path>, meanwhile: impl FnOnce()) {
    let dir = tempfile::tempdir().unwrap();
    let inbox = dir.path().join("ex-a.sock");
    let mut m = build(&chain_text(library, &inbox, false));
    meanwhile();
    let primary = common::primary_of(&m);
    let arena = primary.arena().clone();

    // Stores cascade to both tiers; ex-a (2 chunks) evicts its least recently used.
    let r1 = ReqContext::local("r1");
    {
        let mut s = m.step();
        s.on_new_request(&r1).unwrap();
        let keys: Vec<OffloadKey> = (1..=4).map(key).collect();
        let out = s.prepare_store(&keys, &r1).unwrap().unwrap();
        for (k, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            let n = (1..=4).find(|&n| key(n) == *k).unwrap();
            arena.write_row(row).unwrap().copy_from_slice(&bytes_for(n));
        }
        s.complete_store(&out.keys_to_store, &r1, true).unwrap();
        s.on_request_finished(&r1).unwrap();
    }
    step_until(&mut m, |m| {
        tier_stats(m, "ex-a").stores == 4
            && tier_stats(m, "ex-b").stores == 4
            && m.stats().unwrap().jobs_in_flight == 0
    });
    let a = tier_stats(&mut m, "ex-a");
    assert_eq!(
        (a.resident_chunks, a.capacity_chunks, a.evictions),
        (2, 2, 2),
        "{a:?}"
    );
    let b = tier_stats(&mut m, "ex-b");
    assert_eq!(
        (b.resident_chunks, b.capacity_chunks, b.evictions),
        (4, 16, 0),
        "{b:?}"
    );
    assert_eq!(b.bytes_written, 4 * CHUNK as u64);
    let events = m.take_events().unwrap();
    let owned = |name: &str, removed: bool| -> usize {
        events
            .iter()
            .filter(|e| e.ownership.as_deref() == Some(name) && e.removed == removed)
            .map(|e| e.keys.len())
            .sum()
    };
    assert_eq!(owned("ex-b", false), 4);
    assert_eq!(owned("ex-a", false), 4);
    assert_eq!(owned("ex-a", true), 2, "ex-a reported its evictions");
    assert_eq!(primary.total_pins(), 0, "every cascade released its pins");
    assert_eq!(arena.granted_rows(), 0, "every grant came back");

    // Promotion: the primary forgets everything; ex-b still has key 1.
    m.reset_cache().unwrap();
    // Poison every row, so the checks below see the chunk bytes only if a promotion copied them
    // (the rows would otherwise still hold the bytes stored above).
    for row in 0..arena.num_chunks() {
        let row = u32::try_from(row).unwrap();
        arena.write_row(row).unwrap().fill(0xEE);
    }
    let r2 = ReqContext::local("r2");
    {
        let mut s = m.step();
        s.on_new_request(&r2).unwrap();
        assert_eq!(s.lookup(&key(1), &r2).unwrap(), LookupResult::HitPending);
    }
    step_until(&mut m, |m| {
        m.step().lookup(&key(1), &r2).unwrap() == LookupResult::Hit
    });
    {
        let mut s = m.step();
        assert_eq!(s.lookup(&key(1), &r2).unwrap(), LookupResult::Hit);
        let rows = s.prepare_load(&[key(1)], &r2).unwrap();
        assert_eq!(&*arena.read_row(rows[0]).unwrap(), bytes_for(1).as_slice());
        s.complete_load(&[key(1)], &r2).unwrap();
        s.on_request_finished(&r2).unwrap();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    }
    assert!(tier_stats(&mut m, "ex-b").loads >= 1);

    // A peer asks ex-a. Key 2 is in neither ex-a nor the primary, but ex-b has it: the parent
    // fans the lookup out (ex-a, the origin, is skipped) and starts a promotion. Key 1 is a
    // primary hit now; key 9 is nowhere.
    let client = PeerClient::bind(&dir.path().join("peer.sock")).unwrap();
    let q = PeerQuery {
        id: "q1".into(),
        keys: vec![key(1), key(2), key(9)],
        fetch: false,
    };
    let first = ask(&mut m, &client, &inbox, &q);
    assert_eq!(first.error, None);
    assert_eq!(
        first.verdicts,
        vec![LookupResult::Hit, LookupResult::HitPending, LookupResult::Miss]
    );
    step_until(&mut m, |m| m.stats().unwrap().jobs_in_flight == 0);
    let q = PeerQuery {
        id: "q2".into(),
        keys: vec![key(1), key(2), key(9)],
        fetch: true,
    };
    let second = ask(&mut m, &client, &inbox, &q);
    assert_eq!(second.error, None);
    assert_eq!(
        second.verdicts,
        vec![LookupResult::Hit, LookupResult::Hit, LookupResult::Miss]
    );
    assert_eq!(
        second.fetched,
        vec![(key(1), bytes_for(1)), (key(2), bytes_for(2))],
        "the peer received the right bytes through the store job"
    );
    step_until(&mut m, |m| m.stats().unwrap().jobs_in_flight == 0);
    assert_eq!(
        primary.total_pins(),
        0,
        "the peer store job was reported and unpinned"
    );
    assert_eq!(arena.granted_rows(), 0);
    assert_eq!(
        m.inspect(|s| s.tracked_requests()),
        0,
        "remote requests were finished"
    );
    m.shutdown().unwrap();
    assert!(!inbox.exists(), "the tier removed its socket on shutdown");
}

#[test]
fn example_tier_linked_in() {
    scenario(None, || {});
}

#[test]
fn example_tier_loaded_from_its_shared_library() {
    scenario(Some(&common::example_library()), || {});
}

/// What happens when another test builds its chain between this one's `build` and its look-up
/// of the primary (the tests of a binary run in parallel and share the registered primaries):
/// the scenario must still write, and check, the rows of its own arena.
#[test]
fn a_chain_built_meanwhile_does_not_stand_in_for_the_scenarios_primary() {
    let mut other = None;
    scenario(Some(&common::example_library()), || {
        other = Some(build("[primary]\ntype = \"itest-memory\"\nchunks = 8\n"));
    });
    let mut other = other.unwrap();
    let rows = other.arena();
    for row in 0..u32::try_from(rows.num_chunks()).unwrap() {
        assert!(
            rows.read_row(row).unwrap().iter().all(|&b| b == 0),
            "the scenario wrote row {row} of the other chain's arena"
        );
    }
    other.shutdown().unwrap();
}

#[test]
fn loaded_tier_answers_peers_from_the_control_thread() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = dir.path().join("ex-a.sock");
    let lib = common::example_library();
    let mut m = build(&chain_text(Some(&lib), &inbox, true));
    // The control thread runs from the manager's construction; one step, then the engine makes
    // no call.
    step(&mut m);
    assert!(m.control_thread_running());
    let client = PeerClient::bind(&dir.path().join("peer.sock")).unwrap();
    client
        .ask(
            &inbox,
            &PeerQuery {
                id: "idle".into(),
                keys: vec![key(77)],
                fetch: false,
            },
        )
        .unwrap();
    // The library's inbox thread wakes its waker; the wake crosses to the host's control thread,
    // which serves the peer while the engine is idle.
    let answer = client.answer(DEADLINE).unwrap();
    assert_eq!(answer.verdicts, vec![LookupResult::Miss]);
    m.shutdown().unwrap();
}
