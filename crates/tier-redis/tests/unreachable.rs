//! A server that goes away: the tier stops answering `Hit` from its presence cache (the answers
//! are kept for a long `presence_ttl` here, so a stale cached `Hit` would show), a failed load
//! invalidates its keys, a promotion is not retried endlessly, and when the server is back the
//! tier reports a recovery and serves hits again.

mod common;

use std::time::{Duration, Instant};

use common::{Node, PATIENCE, RedisServer, Rig, content, key, keys, options, redis_installed};
use tiering_core::options::HumanDuration;
use tiering_core::{JobOutcome, LookupResult, SecondaryTier, TierHealth};

const CHUNK: usize = 4 * 1024;

fn long_presence(url: &str, namespace: &str) -> tier_redis::RedisTierOptions {
    let mut o = options(url, namespace);
    o.presence_ttl = HumanDuration(Duration::from_secs(600));
    o
}

#[test]
fn lookups_miss_while_the_server_is_unreachable_and_hit_again_after_it_is_back() {
    if !redis_installed() {
        return;
    }
    let mut server = RedisServer::start();
    let mut rig = Rig::new(&long_presence(&server.url(), "alone"), CHUNK, 8);
    assert_eq!(rig.store(&keys(0..4)).outcome, JobOutcome::Ok);
    for k in keys(0..4) {
        assert_eq!(rig.lookup(&k), LookupResult::Hit);
    }
    assert_eq!(rig.tier.health(), TierHealth::default());

    server.kill();
    let (r, _) = rig.load(&[key(0)]);
    assert_eq!(r.outcome, JobOutcome::Failed);
    let health = rig.tier.health();
    assert!(!health.healthy, "the failed load found the server gone");
    assert_eq!(health.recoveries, 0);
    // Neither the key whose load failed nor a key the cache still holds as present is a hit.
    for k in keys(0..4) {
        assert_eq!(rig.lookup(&k), LookupResult::Miss, "{k}");
    }
    assert!(rig.stat("unreachable_misses") >= 4.0);
    assert_eq!(rig.stat("invalidated_presence"), 1.0);
    assert_eq!(rig.stat("server_reachable"), 0.0);

    // Back (empty). Lookups and step ends let a worker probe the server after its backoff.
    server.restart();
    let deadline = Instant::now() + PATIENCE;
    while !rig.tier.health().healthy {
        assert!(Instant::now() < deadline, "the tier never found the server back");
        assert_eq!(rig.lookup(&key(1)), LookupResult::Miss);
        rig.tier.on_schedule_end();
        rig.waker.wait(Duration::from_millis(20));
    }
    assert_eq!(rig.tier.health().recoveries, 1);
    // The restarted server lost the keys, and the tier's cache was cleared with the recovery.
    assert_eq!(rig.lookup(&key(2)), LookupResult::Miss);
    assert_eq!(rig.store(&keys(10..12)).outcome, JobOutcome::Ok);
    assert_eq!(rig.lookup(&key(10)), LookupResult::Hit);
    let (r, rows) = rig.load(&keys(10..12));
    assert_eq!(r.outcome, JobOutcome::Ok);
    assert_eq!(rows[0], content(&key(10), CHUNK));
    assert_eq!(rows[1], content(&key(11), CHUNK));
}

#[test]
fn a_killed_server_costs_one_failed_promotion_and_its_keys_come_back_after_a_restart() {
    if !redis_installed() {
        return;
    }
    let mut server = RedisServer::start();
    let mut node = Node::new(&long_presence(&server.url(), "managed"), 4, CHUNK);
    // Keys 0..8 are only in redis (the CPU tier holds the last four), and the tier's cache
    // holds every one as present.
    node.store(&keys(0..12));
    for k in keys(0..8) {
        assert!(!node.in_primary(&k));
    }
    let base = node.manager_stats().manager;

    server.kill();
    let mut answered_from_redis = Vec::new();
    for step in 0..60 {
        let batch = if step == 0 { 0..4 } else { 4..8 };
        for k in keys(batch.clone()) {
            let a = node.lookup(&k);
            if a != LookupResult::Miss {
                answered_from_redis.push((step, k, a));
            }
        }
        node.end_step();
        node.settle();
        // The first step's keys too: their promotion failed, they are not tried again.
        if step > 0 {
            for k in keys(0..4) {
                assert_eq!(node.lookup(&k), LookupResult::Miss, "step {step}: {k}");
            }
        }
    }
    assert!(
        answered_from_redis.iter().all(|(step, _, _)| *step == 0),
        "only the first step's lookups came before the failure: {answered_from_redis:?}"
    );
    let m = node.manager_stats().manager;
    assert_eq!(
        m.promotion_jobs - base.promotion_jobs,
        1,
        "one failed promotion job, not one per step"
    );
    assert!(m.failed_promotion_keys - base.failed_promotion_keys <= 4);
    assert!(node.redis_stats().extra["unreachable_misses"] >= 4.0);

    server.restart();
    let deadline = Instant::now() + PATIENCE;
    while node.redis_stats().extra["server_reachable"] < 1.0 {
        assert!(Instant::now() < deadline, "the tier never found the server back");
        assert_eq!(node.lookup(&key(5)), LookupResult::Miss);
        node.end_step();
        std::thread::sleep(Duration::from_millis(20));
    }
    // The restarted server is empty: old keys are misses (asked, not stuck), new ones hit.
    assert_eq!(node.fetch(&key(0)), None);
    node.store(&keys(100..104));
    node.store(&keys(200..204));
    for k in keys(100..104) {
        assert!(!node.in_primary(&k));
        assert_eq!(node.fetch(&k), Some(content(&k, CHUNK)), "{k} after the restart");
    }
    node.shutdown();
}
