//! A consumer's lookup of a round is handled after its fetch of that round (lookups wait for the
//! producer's next serve, a fetch is bound as soon as it is read): the producer must not pin
//! chunks into a round that was already fetched. Pinned there, they were never sent nor
//! released, and their store job kept the producer's tier pending forever — the soak's round
//! stall after a peer restart (issue 30).

mod common;

use std::time::{Duration, Instant};

use common::fake_peer::FakePeer;
use common::*;
use tier_p2p::SharedSecret;
use tier_p2p::wire::{Message, decode_keys, encode_keys};
use tiering_core::ManagerConfig;

#[test]
fn a_lookup_read_after_its_rounds_fetch_pins_nothing_and_the_producer_settles() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 2);
    a.store("made", &ks);
    let mut consumer = FakePeer::new(&a.p2p, SharedSecret::new(SECRET), 5);
    consumer.handshake(|| {});
    // The node acknowledges once its data plane toward us is up: from then on a fetch's
    // transfer stays in flight (we never acknowledge it), so its round stays fetched.
    let start = Instant::now();
    while !matches!(
        consumer.recv(Duration::from_millis(50)),
        Some(Message::ConnectAck { .. })
    ) {
        assert!(start.elapsed() < PATIENCE, "no connect_ack");
    }
    // Round 0: the first key is looked up and answered as a hit (pinned for the round).
    consumer.send(&Message::Lookup {
        kv_request_id: "c1".into(),
        keys: encode_keys(&ks[..1]),
        round_seq: 0,
    });
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < PATIENCE, "no lookup_resp");
        if let Some(Message::LookupResp { hits, .. }) = consumer.recv(Duration::from_millis(50)) {
            assert_eq!(hits, vec![true]);
            break;
        }
    }
    // The round's fetch, then a second lookup of round 0. A consumer sends that lookup before
    // the fetch, but the producer binds a fetch as soon as it reads it and serves lookups
    // later, so it sees exactly this order whenever both arrive before its next serve; sent in
    // this order the test does not depend on how the two reads interleave with serves.
    consumer.send(&Message::Fetch {
        kv_request_id: "c1".into(),
        round_seq: 0,
        keys: encode_keys(&ks[..1]),
        block_indexes: vec![3],
        await_stores: false,
    });
    consumer.send(&Message::Lookup {
        kv_request_id: "c1".into(),
        keys: encode_keys(&ks[1..]),
        round_seq: 0,
    });
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < PATIENCE, "the late lookup was never answered");
        if let Some(Message::LookupResp { keys, hits, .. }) = consumer.recv(Duration::from_millis(50)) {
            assert_eq!(decode_keys(&keys).unwrap(), ks[1..].to_vec());
            assert_eq!(hits, vec![false], "a fetched round takes no more chunks");
            break;
        }
    }
    // The consumer goes away without acknowledging the transfer: every pin must come back and
    // the producer's tier must have no work left.
    consumer.send(&Message::Disconnect {
        reason: "test".into(),
    });
    drop(consumer);
    a.wait_clean();
    let start = Instant::now();
    while a.mgr.has_pending_work().unwrap() {
        assert!(
            start.elapsed() < PATIENCE,
            "the producer's tier kept pending work"
        );
        a.mgr.on_schedule_end(&end()).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    a.mgr.shutdown().unwrap();
}
