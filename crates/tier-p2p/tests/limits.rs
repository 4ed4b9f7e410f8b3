//! Inbound limits: a flooding peer is cut off without hurting the others, and oversized
//! control messages are refused by their size.

mod common;

use std::time::Duration;

use common::fake_peer::FakePeer;
use common::*;
use tier_p2p::P2pCounters;
use tier_p2p::wire::{Message, encode_keys};
use tiering_core::{LookupResult, ManagerConfig, OffloadKey};

fn raw_dealer(ctx: &zmq::Context, identity: &str, node: &tier_p2p::P2pHandle) -> zmq::Socket {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_identity(identity.as_bytes()).unwrap();
    d.set_linger(0).unwrap();
    d.set_sndhwm(0).unwrap();
    d.connect(&format!("tcp://{}", node.local_id())).unwrap();
    d
}

#[test]
fn a_flooding_peer_is_disconnected_while_another_peers_fetch_completes() {
    init_tracing();
    let mut o = opts();
    o.inbound.per_peer_budget = 16;
    o.inbound.queue_capacity = 64;
    let mut a = Node::new(o, ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 4);
    a.store("a-req", &ks);
    // B's session with A is up and its first chunks arrive.
    let ctx = b.pull_ctx("b-1", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let t = b.pull_until_settled(&ctx, &ks[..2]);
    assert!(t.iter().all(|t| t.last() == Some(&LookupResult::Hit)), "{t:?}");

    // A peer with a session floods A with well-formed messages while A handles nothing.
    let mut flooder = FakePeer::new(&a.p2p, tier_p2p::SharedSecret::new(SECRET), 5);
    flooder.handshake(|| {});
    wait_for("the flooder's session", || {
        P2pCounters::get(&a.p2p.counters().sessions_ready) >= 2
    });
    let lookup = Message::Lookup {
        kv_request_id: "flood".into(),
        keys: encode_keys(&[OffloadKey::from_u64(1)]),
        round_seq: 0,
    }
    .encode();
    let handle = a.p2p.clone();
    a.with_lock_held(|| {
        let mut sent = 0;
        while sent < 2000 {
            if flooder.send_raw(&lookup) {
                sent += 1;
            }
        }
        wait_for("the flood to be detected", || flood_dropped(&handle) > 0);
    });
    wait_for("the flooder to be counted", || {
        P2pCounters::get(&a.p2p.counters().peers_flooded) == 1
    });
    // Messages still queued in ZeroMQ when the flood was detected are read (and dropped: the
    // peer is banned) afterwards, so the count reaches the total asynchronously.
    wait_for(
        "every message past the budget and the queue to be dropped",
        || flood_dropped(&a.p2p) >= 2000 - 16 - 64,
    );
    // Its session is closed, with a goodbye that says why.
    let start = std::time::Instant::now();
    loop {
        assert!(start.elapsed() < PATIENCE, "no disconnect reached the flooder");
        if let Some(Message::Disconnect { reason }) = flooder.recv(Duration::from_millis(20)) {
            assert!(reason.contains("flooded"), "{reason}");
            break;
        }
    }
    assert!(P2pCounters::get(&a.p2p.counters().sessions_lost) >= 1);

    // B's request goes on on the same session: the rest of its chunks arrive intact.
    let t = b.pull_until_settled(&ctx, &ks);
    assert!(t.iter().all(|t| t.last() == Some(&LookupResult::Hit)), "{t:?}");
    for (k, got) in ks.iter().zip(b.read_hits(&ctx, &ks)) {
        assert_eq!(got, pattern(k));
    }
    b.finish(&ctx);
    assert_eq!(P2pCounters::get(&b.p2p.counters().sessions_lost), 0);
    b.wait_clean();
    a.wait_clean();
}

fn flood_dropped(h: &tier_p2p::P2pHandle) -> u64 {
    h.inbound_dropped()
}

#[test]
fn an_oversized_control_message_is_refused_by_its_size_and_never_decoded() {
    init_tracing();
    let mut o = opts();
    o.inbound.max_message_bytes = 64 * 1024;
    let a = Node::new(o, ManagerConfig::default());
    let zctx = zmq::Context::new();
    let big = raw_dealer(&zctx, "127.0.0.1:7", &a.p2p);
    // Garbage: had it been received, it would count as a malformed frame.
    big.send(vec![0xc1u8; 1 << 20], 0).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let small = raw_dealer(&zctx, "127.0.0.1:8", &a.p2p);
    small.send(&b"\xc1small"[..], 0).unwrap();
    wait_for("the small frame", || a.p2p.malformed_frames() >= 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        a.p2p.malformed_frames(),
        1,
        "the oversized message was never handed over"
    );
}
