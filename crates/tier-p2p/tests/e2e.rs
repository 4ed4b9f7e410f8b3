//! Two nodes in one process pull each other's chunks over loopback.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::*;
use tiering_core::{LookupResult, ManagerConfig};

#[test]
fn consumer_pulls_producer_chunks_retry_then_hit_pending_then_hit() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 4);
    a.store("a-req", &ks);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    for t in &trace {
        assert_eq!(
            t,
            &[LookupResult::Retry, LookupResult::HitPending, LookupResult::Hit],
            "{trace:?}"
        );
    }
    let bytes = b.read_hits(&ctx, &ks);
    for (k, got) in ks.iter().zip(&bytes) {
        assert_eq!(got, &pattern(k), "bytes of {k}");
    }
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
    assert_eq!(b.p2p.chunks_received(), 4);
    assert_eq!(a.p2p.chunks_sent(), 4);
}

#[test]
fn keys_the_producer_lacks_miss_and_the_rest_still_arrive() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let held = keys(0, 2);
    a.store("a-req", &held);
    let mut wanted = held.clone();
    wanted.extend(keys(100, 2));
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &wanted);
    assert_eq!(trace[0].last(), Some(&LookupResult::Hit));
    assert_eq!(trace[1].last(), Some(&LookupResult::Hit));
    assert_eq!(trace[2], [LookupResult::Retry, LookupResult::Miss]);
    assert_eq!(trace[3], [LookupResult::Retry, LookupResult::Miss]);
    let bytes = b.read_hits(&ctx, &held);
    assert_eq!(bytes[1], pattern(&held[1]));
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn both_directions_at_once() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ka = keys(0, 6);
    let kb = keys(1000, 6);
    a.store("a-store", &ka);
    b.store("b-store", &kb);
    let (ha, hb) = (a.p2p.clone(), b.p2p.clone());
    let (tx, rx) = mpsc::channel();
    let ta = {
        let kb = kb.clone();
        let tx = tx.clone();
        std::thread::spawn(move || {
            let ctx = a.pull_ctx("a-pull", &hb);
            a.mgr.on_new_request(&ctx).unwrap();
            let trace = a.pull_until_settled(&ctx, &kb);
            let bytes = a.read_hits(&ctx, &kb);
            a.finish(&ctx);
            tx.send(()).unwrap();
            (a, trace, bytes)
        })
    };
    let tb = {
        let ka = ka.clone();
        std::thread::spawn(move || {
            let ctx = b.pull_ctx("b-pull", &ha);
            b.mgr.on_new_request(&ctx).unwrap();
            let trace = b.pull_until_settled(&ctx, &ka);
            let bytes = b.read_hits(&ctx, &ka);
            b.finish(&ctx);
            tx.send(()).unwrap();
            (b, trace, bytes)
        })
    };
    rx.recv_timeout(PATIENCE).unwrap();
    rx.recv_timeout(PATIENCE).unwrap();
    let (mut a, ta_trace, a_bytes) = ta.join().unwrap();
    let (mut b, tb_trace, b_bytes) = tb.join().unwrap();
    for t in ta_trace.iter().chain(&tb_trace) {
        assert_eq!(t.last(), Some(&LookupResult::Hit));
    }
    for (k, got) in kb.iter().zip(&a_bytes) {
        assert_eq!(got, &pattern(k));
    }
    for (k, got) in ka.iter().zip(&b_bytes) {
        assert_eq!(got, &pattern(k));
    }
    // One session per peer pair, whichever side dialled first.
    a.wait_clean();
    b.wait_clean();
    let _ = Duration::ZERO;
}
