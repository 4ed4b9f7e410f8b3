//! Authentication: the handshake refuses a peer with another (or no) secret, and the data plane
//! accepts bytes only from the session that reserved the rows, under that session's key.

mod common;

use common::fake_peer::{FakePeer, push};
use common::*;
use tier_p2p::auth::DataKey;
use tier_p2p::dataplane::frame::ChunkStatus;
use tier_p2p::{P2pCounters, SharedSecret};
use tiering_core::{LookupResult, ManagerConfig};

#[test]
fn a_node_with_another_secret_or_none_is_refused_at_handshake_and_sends_nothing() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 2);
    a.store("a-req", &ks);
    let mut another = opts();
    another.secret = Some(SharedSecret::new(b"another secret"));
    let mut insecure = opts();
    insecure.secret = None;
    insecure.insecure = true;
    for (i, o) in [another, insecure].into_iter().enumerate() {
        let mut b = Node::new(o, ManagerConfig::default());
        let ctx = b.pull_ctx(&format!("b-{i}"), &a.p2p);
        b.mgr.on_new_request(&ctx).unwrap();
        let trace = b.pull_until_settled(&ctx, &ks);
        assert!(
            trace.iter().all(|t| t.last() == Some(&LookupResult::Miss)),
            "{trace:?}"
        );
        assert!(
            b.p2p.last_error().unwrap().contains("authentication"),
            "{:?}",
            b.p2p.last_error()
        );
        b.finish(&ctx);
        b.wait_clean();
        assert_eq!(b.p2p.chunks_received(), 0);
    }
    wait_for("the producer to refuse both", || {
        P2pCounters::get(&a.p2p.counters().handshake_failures) >= 2
    });
    assert_eq!(a.p2p.chunks_sent(), 0);
    a.wait_clean();
}

#[test]
fn a_peer_without_the_session_key_gets_no_byte_into_any_row() {
    init_tracing();
    let mut b = Node::new(opts(), ManagerConfig::default());
    let mut peer = FakePeer::new(&b.p2p, SharedSecret::new(SECRET), 41);
    let ks = keys(0, 3);
    let (ctx, f) = b.fetch_from_fake(&mut peer, "b-req", "kv-1", &ks);

    // Frames under keys derived without the secret (another secret, the insecure key, a
    // guess): cut at the BEGIN, nothing read into a row.
    let honest = peer.data_key();
    for wrong in [
        SharedSecret::new(b"not the secret").data_key(&dummy_connect(), &dummy_connect()),
        DataKey::from_bytes([0x55; 32]),
    ] {
        let mut conn = peer.data_conn(peer.instance);
        assert_eq!(push(&mut conn, &peer.transfer_bytes(&wrong, &f, 1)), None);
    }
    // The right key, but greeting as another incarnation of the peer.
    let mut conn = peer.data_conn(peer.instance + 1);
    assert_eq!(push(&mut conn, &peer.transfer_bytes(&honest, &f, 1)), None);
    wait_for("three refusals", || b.p2p.auth_failures() == 3);
    assert_eq!(b.p2p.chunks_received(), 0);
    assert_eq!(b.p2p.checksum_failures(), 0);

    // The honest producer of that session is accepted into the very same rows.
    let mut conn = peer.data_conn(peer.instance);
    assert_eq!(
        push(&mut conn, &peer.transfer_bytes(&honest, &f, 2)),
        Some(vec![ChunkStatus::Ok; 3])
    );
    peer.transfer_done(&f, true);
    b.assert_all_landed(&ctx, &ks);
    b.finish(&ctx);
    b.wait_clean();
}

#[test]
fn a_frame_captured_in_one_session_is_rejected_in_another() {
    init_tracing();
    let mut b = Node::new(opts(), ManagerConfig::default());
    let mut peer = FakePeer::new(&b.p2p, SharedSecret::new(SECRET), 42);
    let (host, port) = peer.host_port();

    // Session 1: an honest transfer, captured on the way.
    let first = keys(0, 2);
    let ctx = b.prefiller_ctx_to("b-1", "kv", &host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    peer.handshake(|| b.mgr.on_schedule_end(&end()).unwrap());
    let f1 = b.step_until_fetch(&ctx, &first, &peer);
    let key1 = peer.data_key();
    let captured = peer.transfer_bytes(&key1, &f1, 1);
    let mut conn = peer.data_conn(peer.instance);
    assert_eq!(push(&mut conn, &captured), Some(vec![ChunkStatus::Ok; 2]));
    peer.transfer_done(&f1, true);
    let trace = b.pull_until_settled(&ctx, &first);
    assert!(trace.iter().all(|t| t.last() == Some(&LookupResult::Hit)));
    b.finish(&ctx);

    // Session 2 between the same two processes (same identities and incarnations, fresh
    // nonces), fetching the same request id and round.
    peer.new_session(&b.p2p, 2, || b.mgr.on_schedule_end(&end()).unwrap());
    let second = keys(10, 2);
    let ctx = b.prefiller_ctx_to("b-2", "kv", &host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    let f2 = b.step_until_fetch(&ctx, &second, &peer);
    assert_eq!((f2.kv.as_str(), f2.round), ("kv", f1.round));
    // The captured bytes, replayed.
    let mut conn = peer.data_conn(peer.instance);
    assert_eq!(push(&mut conn, &captured), None);
    // Frames for this very fetch, but under the first session's key.
    let mut conn = peer.data_conn(peer.instance);
    assert_eq!(push(&mut conn, &peer.transfer_bytes(&key1, &f2, 2)), None);
    wait_for("both refusals", || b.p2p.auth_failures() == 2);
    peer.transfer_done(&f2, false);
    let trace = b.pull_until_settled(&ctx, &second);
    assert!(
        trace.iter().all(|t| t.last() == Some(&LookupResult::Miss)),
        "{trace:?}"
    );
    b.finish(&ctx);
    b.wait_clean();
    assert!(b.rows_untouched(&f2.rows), "a replayed byte reached a row");
    assert_eq!(b.p2p.chunks_received(), 2, "only session 1's chunks");
}

fn dummy_connect() -> tier_p2p::wire::Connect {
    tier_p2p::wire::Connect {
        wire_version: tier_p2p::wire::WIRE_VERSION,
        peer_id: "x:1".into(),
        instance: 0,
        nonce: tier_p2p::wire::Bin(vec![0; 32]),
        data_addr: "x:2".into(),
        chunk_bytes: CHUNK as u64,
        num_chunks: ROWS as u64,
        layout_fingerprint: "layout".into(),
        hash_seed: "seed".into(),
        auth: tier_p2p::wire::Bin::default(),
    }
}
