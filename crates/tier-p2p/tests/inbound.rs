//! The control socket is read by the thread that handles its messages, with the I/O thread as
//! a backstop while the manager lock is held: messages read either way are handled in the
//! order they were sent.

mod common;

use std::time::{Duration, Instant};

use common::fake_peer::FakePeer;
use common::*;
use tier_p2p::SharedSecret;
use tier_p2p::wire::{Message, encode_keys};
use tiering_core::{ManagerConfig, OffloadKey};

/// A lookup of a key the node lacks (so no chunk is pinned for it).
fn lookup(round: u64) -> Message {
    Message::Lookup {
        kv_request_id: "ordered".into(),
        keys: encode_keys(&[OffloadKey::from_u64(1 << 40 | round)]),
        round_seq: round,
    }
}

/// The rounds of the next `n` lookup answers the peer receives, in arrival order.
fn answered_rounds(peer: &FakePeer, n: usize) -> Vec<u64> {
    let mut rounds = Vec::new();
    let start = Instant::now();
    while rounds.len() < n {
        assert!(start.elapsed() < PATIENCE, "answers so far: {rounds:?}");
        if let Some(Message::LookupResp { round_seq, .. }) = peer.recv(Duration::from_millis(20)) {
            rounds.push(round_seq);
        }
    }
    rounds
}

#[test]
fn lookups_relayed_while_the_lock_is_held_and_read_directly_after_are_answered_in_order() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    a.store("a-req", &keys(0, 4));
    let mut peer = FakePeer::new(&a.p2p, SharedSecret::new(SECRET), 3);
    peer.handshake(|| {});

    // Idle node: its control thread reads the socket itself and answers.
    peer.send(&lookup(0));
    assert_eq!(answered_rounds(&peer, 1), [0]);

    // Lock held: nothing is handled, but the I/O thread reads and queues what waits.
    let handle = a.p2p.clone();
    let relayed_before = handle.inbound_relayed();
    a.with_lock_held(|| {
        for r in 1..=10 {
            peer.send(&lookup(r));
        }
        wait_for("the I/O thread to relay the waiting lookups", || {
            handle.inbound_relayed() >= relayed_before + 10
        });
    });
    // Released: later lookups are read straight from the socket, after the queued ones.
    for r in 11..=20 {
        peer.send(&lookup(r));
    }
    assert_eq!(answered_rounds(&peer, 20), (1..=20).collect::<Vec<u64>>());
    assert_eq!(a.p2p.malformed_frames(), 0);
    a.wait_clean();
}

#[test]
fn idle_connected_nodes_do_not_spin_on_heartbeats() {
    init_tracing();
    // Heartbeats every 20 ms: if their traffic woke the control thread through the watched
    // socket, two idle seconds would bring about a hundred sweeps.
    let mut o = opts();
    o.heartbeat.interval_ms = 20;
    let mut a = Node::new(o.clone(), ManagerConfig::default());
    let mut b = Node::new(o, ManagerConfig::default());
    let ks = keys(0, 2);
    a.store("a-req", &ks);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    b.assert_all_landed(&ctx, &ks);
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
    let sweeps = |n: &mut Node| n.mgr.stats().unwrap().manager.sweeps;
    let (a0, b0) = (sweeps(&mut a), sweeps(&mut b));
    let idle = Duration::from_secs(2);
    std::thread::sleep(idle);
    let (da, db) = (sweeps(&mut a) - a0, sweeps(&mut b) - b0);
    // Counted, not timed: at most 20 sweeps per idle second.
    assert!(
        da <= 20 * idle.as_secs() && db <= 20 * idle.as_secs(),
        "{da} and {db} sweeps in {idle:?} of idleness"
    );
    // The session is still up and serves at once.
    let ctx = b.pull_ctx("b-req-2", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    b.assert_all_landed(&ctx, &ks);
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}
