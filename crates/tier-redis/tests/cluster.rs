//! The Redis tier against a real 3-master Redis Cluster (created with
//! `redis-cli --cluster create`): chunks spread over every master and come back bit-exact.

mod common;

use std::time::{Duration, Instant};

use common::{Node, PATIENCE, RedisCluster, Rig, content, keys, options, redis_installed};
use tier_redis::{RedisTierOptions, invalidate_namespace};
use tiering_core::{JobOutcome, SecondaryTier};

const CHUNK: usize = 8 * 1024;

fn cluster_options(cluster: &RedisCluster, namespace: &str) -> RedisTierOptions {
    let mut o = options("", namespace);
    o.url = None;
    // One seed is enough to discover the rest; give two.
    o.urls = cluster.urls()[..2].to_vec();
    o.cluster = true;
    o
}

fn dbsize(node: &common::RedisServer) -> u64 {
    node.cli(&["DBSIZE"])
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

#[test]
fn chunks_spread_over_all_three_masters_and_come_back_bit_exact() {
    if !redis_installed() {
        return;
    }
    let cluster = RedisCluster::start(3);
    let opts = cluster_options(&cluster, "cl");
    let mut node = Node::new(&opts, 4, CHUNK);
    let all = keys(0..24);
    node.store(&all);
    assert_eq!(node.redis_stats().stores, 24);
    assert_eq!(node.redis_stats().failures, 0);
    let sizes: Vec<u64> = cluster.nodes.iter().map(dbsize).collect();
    assert_eq!(sizes.iter().sum::<u64>(), 24, "{sizes:?}");
    assert!(
        sizes.iter().all(|&n| n > 0),
        "every master holds chunks: {sizes:?}"
    );
    for k in &all[..20] {
        assert!(!node.in_primary(k));
        assert_eq!(node.fetch(k), Some(content(k, CHUNK)), "{k}");
    }
    // INFO is summed over the masters.
    let deadline = Instant::now() + PATIENCE;
    loop {
        node.end_step();
        let s = node.redis_stats();
        if s.resident_chunks >= 24 {
            assert!(s.extra["server_used_memory_bytes"] > 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "INFO never reported the keys: {s:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    node.shutdown();

    // Invalidation scans every master.
    assert_eq!(invalidate_namespace(&opts, "cl").unwrap(), 24);
    assert!(cluster.nodes.iter().all(|n| dbsize(n) == 0));
}

#[test]
fn a_cluster_job_larger_than_one_pipeline_is_split_and_loaded_whole() {
    if !redis_installed() {
        return;
    }
    let cluster = RedisCluster::start(3);
    let mut opts = cluster_options(&cluster, "cl-big");
    opts.pipeline_bytes = 3 * CHUNK as u64;
    let mut rig = Rig::new(&opts, CHUNK, 40);
    let ks = keys(100..140);
    assert_eq!(rig.store(&ks).outcome, JobOutcome::Ok);
    let (r, rows) = rig.load(&ks);
    assert_eq!(r.outcome, JobOutcome::Ok);
    for (k, row) in ks.iter().zip(rows) {
        assert!(row == content(k, CHUNK), "{k}");
    }
    assert!(rig.tier.stats().extra["connects"] >= 1.0);
}
