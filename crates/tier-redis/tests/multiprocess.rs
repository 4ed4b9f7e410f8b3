//! Two managers in two OS processes share chunks through one server: this test binary runs
//! itself again as the producer (selected by an environment variable), which stores chunks
//! through its own manager; the consumer then promotes them into its own CPU tier.

mod common;

use std::process::Command;

use common::{Node, RedisServer, content, keys, options, redis_installed};

const CHUNK: usize = 16 * 1024;
const CHILD_URL: &str = "KVTIER_REDIS_TEST_PRODUCER_URL";

/// The producer: only does something when the parent process starts it.
#[test]
fn producer_process() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        return;
    };
    let mut node = Node::new(&options(&url, "shared"), 4, CHUNK);
    node.store(&keys(0..12));
    assert_eq!(node.redis_stats().stores, 12);
    node.shutdown();
    println!("producer stored 12 chunks");
}

#[test]
fn two_processes_share_chunks_through_one_server() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "producer_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_URL, server.url())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("producer stored 12 chunks"),
        "producer failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // This process never stored anything: every chunk comes from the other one.
    let mut node = Node::new(&options(&server.url(), "shared"), 4, CHUNK);
    for k in keys(0..12) {
        assert_eq!(node.fetch(&k), Some(content(&k, CHUNK)), "{k}");
    }
    let s = node.redis_stats();
    assert_eq!(s.loads, 12);
    assert_eq!(s.stores, 0);
    // A different namespace in the same server sees none of them.
    let mut other = Node::new(&options(&server.url(), "not-shared"), 4, CHUNK);
    assert_eq!(other.fetch(&keys(0..1)[0]), None);
    other.shutdown();
    node.shutdown();
}
