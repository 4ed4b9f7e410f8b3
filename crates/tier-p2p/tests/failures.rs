//! Failure paths: each ends with no leaked pin, reservation or row grant on the surviving
//! side(s), and the consumer falling back to `Miss` for what it could not get.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use tier_p2p::P2pCounters;
use tier_p2p::dataplane::frame::{self, Begin, ChunkHeader, ChunkStatus, Hello};
use tier_p2p::wire::{Bin, Connect, Message, WIRE_VERSION};
use tiering_core::{LookupResult, ManagerConfig, PrimaryTier};

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    P2pCounters::get(c)
}

#[test]
fn checksum_mismatch_fails_that_key_only() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 3);
    a.store("a-req", &ks);
    a.p2p.faults().corrupt_key(ks[1]);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    assert_eq!(trace[0].last(), Some(&LookupResult::Hit));
    assert_eq!(
        trace[1],
        [LookupResult::Retry, LookupResult::HitPending, LookupResult::Miss]
    );
    assert_eq!(trace[2].last(), Some(&LookupResult::Hit));
    let stats = b.mgr.stats().unwrap();
    assert_eq!(
        stats.manager.promoted_keys, 2,
        "a Partial result promoted the good keys"
    );
    assert_eq!(stats.manager.failed_promotion_keys, 1);
    assert_eq!(b.p2p.checksum_failures(), 1);
    let good = [ks[0], ks[2]];
    let bytes = b.read_hits(&ctx, &good);
    assert_eq!(bytes[0], pattern(&ks[0]));
    assert_eq!(bytes[1], pattern(&ks[2]));
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn hash_seed_mismatch_fails_the_handshake_loudly_and_the_consumer_misses() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut other = opts();
    other.hash_seed = "another-seed".into();
    let mut b = Node::new(other, ManagerConfig::default());
    let ks = keys(0, 2);
    a.store("a-req", &ks);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    assert!(
        trace
            .iter()
            .all(|t| t == &[LookupResult::Retry, LookupResult::Miss]),
        "{trace:?}"
    );
    wait_for("both sides to refuse", || {
        count(&a.p2p.counters().handshake_failures) >= 1 && count(&b.p2p.counters().handshake_failures) >= 1
    });
    assert!(b.p2p.last_error().unwrap().contains("hash seed"));
    assert_eq!(a.p2p.chunks_sent(), 0);
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn chunk_size_mismatch_fails_the_handshake() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::with_geometry(opts(), ManagerConfig::default(), ROWS, CHUNK * 2);
    a.store("a-req", &keys(0, 1));
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &keys(0, 1));
    assert_eq!(trace[0], [LookupResult::Retry, LookupResult::Miss]);
    wait_for("the refusal", || count(&a.p2p.counters().handshake_failures) >= 1);
    assert!(b.p2p.last_error().unwrap().contains("chunk size"));
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn a_peer_that_never_answers_hits_the_lookup_deadline() {
    init_tracing();
    // A ZeroMQ ROUTER that accepts connections and never says anything.
    let ctx0 = zmq::Context::new();
    let silent = ctx0.socket(zmq::ROUTER).unwrap();
    silent.set_linger(0).unwrap();
    silent.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = silent.get_last_endpoint().unwrap().unwrap();
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let mut o = opts();
    o.deadlines.lookup_ms = 300;
    let mut b = Node::new(o, ManagerConfig::default());
    let ctx = b.pull_ctx_to("b", "127.0.0.1", port);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &keys(0, 2));
    assert!(
        trace
            .iter()
            .all(|t| t == &[LookupResult::Retry, LookupResult::Miss]),
        "{trace:?}"
    );
    assert_eq!(count(&b.p2p.counters().lookup_timeouts), 1);
    assert!(
        matches!(
            b.p2p.peer_failure(&format!("127.0.0.1:{port}")),
            Some(tier_p2p::PeerFailure::Deadline { what: "lookup", .. })
        ),
        "{:?}",
        b.p2p.last_failure()
    );
    // The request keeps missing; no retry storm.
    assert_eq!(
        b.step(&ctx, &keys(0, 2)),
        [LookupResult::Miss, LookupResult::Miss]
    );
    b.finish(&ctx);
    b.wait_clean();
    drop(silent);
}

#[test]
fn write_to_rows_never_reserved_is_rejected_and_nothing_is_written() {
    init_tracing();
    let mut b = Node::new(opts(), ManagerConfig::default());
    let mut s = TcpStream::connect(b.p2p.data_addr()).unwrap();
    frame::write_hello(
        &mut s,
        &Hello {
            peer_id: "127.0.0.1:1".into(),
            instance: 1,
        },
    )
    .unwrap();
    let key = tiering_core::OffloadKey::from_u64(9);
    let payload = pattern(&key);
    let dk = tier_p2p::auth::DataKey::from_bytes([1; 32]);
    let begin = Begin {
        transfer_id: 1,
        kv_request_id: "nobody".into(),
        round: 0,
        count: 2,
    };
    frame::write_begin(&mut s, &dk, &begin).unwrap();
    for (i, row) in [3u32, 4].iter().enumerate() {
        let h = ChunkHeader {
            index: i as u32,
            dst_row: *row,
            key,
            len: payload.len() as u32,
        };
        frame::write_chunk(&mut s, &dk, &begin, &h, &payload, |c| c).unwrap();
    }
    frame::write_end(&mut s, 2).unwrap();
    s.flush().unwrap();
    let (id, statuses) = frame::read_ack(&mut s).unwrap();
    assert_eq!(id, 1);
    assert_eq!(statuses, [ChunkStatus::Rejected, ChunkStatus::Rejected]);
    assert_eq!(b.p2p.chunks_rejected(), 2);
    let arena = b.primary.arena().clone();
    for row in [3, 4] {
        assert!(
            arena.read_row(row).unwrap().iter().all(|&x| x == 0),
            "row {row} was written"
        );
    }
    b.wait_clean();
}

/// Opens a ZeroMQ DEALER posing as peer `id` toward `node`, and a TCP listener as its data
/// plane (so the node's registration succeeds).
fn fake_peer(node: &tier_p2p::P2pHandle) -> (zmq::Context, zmq::Socket, std::net::TcpListener, String) {
    let ctx = zmq::Context::new();
    let data = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let id = format!("127.0.0.1:{}", data.local_addr().unwrap().port());
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_identity(id.as_bytes()).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&format!("tcp://{}", node.local_id())).unwrap();
    (ctx, dealer, data, id)
}

#[test]
fn malformed_frames_are_counted_and_a_malformed_message_drops_only_its_session() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let first = keys(0, 2);
    let second = keys(10, 2);
    a.store("a-req", &first);
    // B's session is up and working.
    let ctx = b.pull_ctx("b-1", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let t = b.pull_until_settled(&ctx, &first);
    assert!(t.iter().all(|t| t.last() == Some(&LookupResult::Hit)));
    b.finish(&ctx);

    let (_zctx, evil, _data, id) = fake_peer(&a.p2p);
    evil.send(&b"\xc1garbage"[..], 0).unwrap();
    evil.send_multipart([&b"two"[..], &b"frames"[..]], 0).unwrap();
    wait_for("malformed frames to be counted", || a.p2p.malformed_frames() >= 2);
    assert_eq!(
        count(&a.p2p.counters().protocol_errors),
        0,
        "frames never reach a session"
    );
    let mut connect = Connect {
        wire_version: WIRE_VERSION,
        peer_id: id.clone(),
        instance: 1,
        nonce: Bin(vec![7; tier_p2p::wire::NONCE_BYTES]),
        data_addr: id.clone(),
        chunk_bytes: CHUNK as u64,
        num_chunks: ROWS as u64,
        layout_fingerprint: "layout".into(),
        hash_seed: "seed".into(),
        auth: Bin::default(),
    };
    connect.auth = Bin(tier_p2p::SharedSecret::new(SECRET)
        .connect_tag(&connect)
        .as_bytes()
        .to_vec());
    evil.send(Message::Connect(connect).encode(), 0).unwrap();
    let bad = Message::Lookup {
        kv_request_id: "x".into(),
        keys: vec![Bin(vec![1, 2, 3])],
        round_seq: 0,
    };
    evil.send(bad.encode(), 0).unwrap();
    wait_for("the evil session to be dropped", || {
        count(&a.p2p.counters().protocol_errors) == 1
    });

    // The other session is unaffected.
    a.store("a-req2", &second);
    let ctx = b.pull_ctx("b-2", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let t = b.pull_until_settled(&ctx, &second);
    assert!(t.iter().all(|t| t.last() == Some(&LookupResult::Hit)), "{t:?}");
    assert_eq!(b.read_hits(&ctx, &second)[1], pattern(&second[1]));
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn producer_killed_mid_transfer() {
    init_tracing();
    // The producer's shutdown drains first; its own transfer is stalled, so keep that short.
    let mut oa = opts();
    oa.deadlines.drain_ms = 200;
    let mut a = Node::new(oa, ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 6);
    a.store("a-req", &ks);
    a.p2p.faults().hold_after_chunks(2);
    let ha = a.p2p.clone();
    let hb = b.p2p.clone();
    let consumer = std::thread::spawn(move || {
        let ctx = b.pull_ctx("b-req", &ha);
        b.mgr.on_new_request(&ctx).unwrap();
        let trace = b.pull_until_settled(&ctx, &ks);
        (b, ctx, ks, trace)
    });
    wait_for("two chunks to land and the producer to stall", || {
        a.p2p.faults().is_holding() && hb.chunks_received() == 2
    });
    let arena = a.primary.arena().clone();
    a.mgr.shutdown().unwrap();
    assert_eq!(arena.granted_rows(), 0, "the dead producer's rows are quiescent");
    drop(a);
    let (mut b, ctx, ks, trace) = consumer.join().unwrap();
    for t in &trace[..2] {
        assert_eq!(t.last(), Some(&LookupResult::Hit), "{trace:?}");
    }
    for t in &trace[2..] {
        assert_eq!(t.last(), Some(&LookupResult::Miss), "{trace:?}");
    }
    assert_eq!(b.read_hits(&ctx, &ks[..2])[0], pattern(&ks[0]));
    b.finish(&ctx);
    b.wait_clean();
    assert!(count(&b.p2p.counters().sessions_lost) >= 1);
    assert!(
        matches!(
            b.p2p.last_failure(),
            Some(tier_p2p::PeerFailure::ProducerDied { .. })
        ),
        "{:?}",
        b.p2p.last_failure()
    );
}

#[test]
fn consumer_killed_mid_transfer() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    // The consumer's shutdown drains first; its producer is stalled, so keep that wait short.
    let mut ob = opts();
    ob.deadlines.drain_ms = 200;
    let mut b = Node::new(ob, ManagerConfig::default());
    let ks = keys(0, 6);
    a.store("a-req", &ks);
    a.p2p.faults().hold_after_chunks(2);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let hb = b.p2p.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let consumer = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Acquire) {
            let _ = b.step(&ctx, &ks);
            std::thread::sleep(Duration::from_millis(1));
        }
        b
    });
    wait_for("the transfer to be mid-way", || {
        a.p2p.faults().is_holding() && hb.chunks_received() == 2
    });
    stop.store(true, std::sync::atomic::Ordering::Release);
    let mut b = consumer.join().unwrap();
    let b_arena = b.primary.arena().clone();
    b.mgr.shutdown().unwrap();
    assert_eq!(
        b_arena.granted_rows(),
        0,
        "the dead consumer's rows are quiescent"
    );
    drop(b);
    // The producer notices, its held sender fails, and every pin comes back.
    a.wait_clean();
    assert!(count(&a.p2p.counters().sessions_lost) >= 1);
}

#[test]
fn producer_restarting_on_the_same_address_serves_the_next_request() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let port = a.p2p.port();
    let ks = keys(0, 2);
    a.store("a-req", &ks);
    let ctx = b.pull_ctx("b-1", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    assert!(
        b.pull_until_settled(&ctx, &ks)
            .iter()
            .all(|t| t.last() == Some(&LookupResult::Hit))
    );
    b.finish(&ctx);
    a.mgr.shutdown().unwrap();
    drop(a);
    wait_for("the consumer to notice", || {
        count(&b.p2p.counters().sessions_lost) >= 1
    });

    let mut o = opts();
    o.bind = format!("127.0.0.1:{port}");
    let mut a2 = Node::new(o, ManagerConfig::default());
    let ks2 = keys(50, 3);
    a2.store("a2-req", &ks2);
    let ctx = b.pull_ctx("b-2", &a2.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let t = b.pull_until_settled(&ctx, &ks2);
    assert!(t.iter().all(|t| t.last() == Some(&LookupResult::Hit)), "{t:?}");
    assert_eq!(b.read_hits(&ctx, &ks2)[2], pattern(&ks2[2]));
    b.finish(&ctx);
    b.wait_clean();
    a2.wait_clean();
}

#[test]
fn a_stalled_fetch_is_aborted_at_the_load_deadline_and_acked_once_quiescent() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut ob = opts();
    ob.deadlines.load_ms = 300;
    let mut b = Node::new(ob, ManagerConfig::default());
    let ks = keys(0, 4);
    a.store("a-req", &ks);
    a.p2p.faults().hold_after_chunks(1);
    let ctx = b.pull_ctx("b-req", &a.p2p);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    // The chunk that arrived before the stall is verified and kept; the rest miss.
    assert_eq!(trace[0].last(), Some(&LookupResult::Hit), "{trace:?}");
    for t in &trace[1..] {
        assert_eq!(t.last(), Some(&LookupResult::Miss), "{trace:?}");
    }
    assert_eq!(count(&b.p2p.counters().aborts_sent), 1);
    assert_eq!(
        count(&b.p2p.counters().sessions_lost),
        0,
        "an abort is not a session failure"
    );
    assert_eq!(b.read_hits(&ctx, &ks[..1])[0], pattern(&ks[0]));
    b.finish(&ctx);
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn parked_chunks_of_a_remote_decoder_request_are_pulled_by_its_prefiller_consumer() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 3);
    // The producer (a prefill leg) parks every chunk of the request for whoever fetches "pd-1".
    let pctx = {
        let serde_json::Value::Object(m) = serde_json::json!({"remote_decoder": {"kv_request_id": "pd-1"}})
        else {
            unreachable!()
        };
        tiering_core::ReqContext::builder(tiering_core::RequestId::local("prefill"))
            .params(m)
            .build()
    };
    assert_eq!(
        a.mgr.on_new_request(&pctx).unwrap(),
        tiering_core::OffloadPolicy::RequestLevel
    );
    let out = a.mgr.prepare_store(&ks, &pctx).unwrap().unwrap();
    let arena = a.primary.arena().clone();
    for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        arena.write_row(c).unwrap().copy_from_slice(&pattern(k));
    }
    a.mgr.complete_store(&out.keys_to_store, &pctx, true).unwrap();
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    // The decoder pulls without probing.
    let dctx = {
        let serde_json::Value::Object(m) = serde_json::json!({"remote_prefiller": {
            "kv_request_id": "pd-1", "host": a.p2p.host(), "port": a.p2p.port()}})
        else {
            unreachable!()
        };
        tiering_core::ReqContext::builder(tiering_core::RequestId::local("decode"))
            .params(m)
            .build()
    };
    b.mgr.on_new_request(&dctx).unwrap();
    let trace = b.pull_until_settled(&dctx, &ks);
    for t in &trace {
        assert_eq!(t, &[LookupResult::HitPending, LookupResult::Hit], "{trace:?}");
    }
    for (k, got) in ks.iter().zip(b.read_hits(&dctx, &ks)) {
        assert_eq!(got, pattern(k));
    }
    b.finish(&dctx);
    b.wait_clean();
    a.wait_clean();
    assert_eq!(count(&a.p2p.counters().lookups_served), 0, "no probe round trip");
}

#[test]
fn parked_chunks_nobody_fetches_are_released_at_the_deadline() {
    init_tracing();
    let mut o = opts();
    o.deadlines.unbound_park_ms = 200;
    let mut a = Node::new(o, ManagerConfig::default());
    let serde_json::Value::Object(m) = serde_json::json!({"remote_decoder": {"kv_request_id": "pd-x"}})
    else {
        unreachable!()
    };
    let pctx = tiering_core::ReqContext::builder(tiering_core::RequestId::local("prefill"))
        .params(m)
        .build();
    a.mgr.on_new_request(&pctx).unwrap();
    let ks = keys(0, 2);
    let out = a.mgr.prepare_store(&ks, &pctx).unwrap().unwrap();
    a.mgr.complete_store(&out.keys_to_store, &pctx, true).unwrap();
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    wait_for("the parked pins to be taken", || a.primary.total_pins() == 2);
    a.wait_clean();
    assert_eq!(count(&a.p2p.counters().supply_released), 2);
}

#[test]
fn an_unreachable_peer_fills_the_bounded_send_queue_and_is_marked_dead_without_blocking() {
    init_tracing();
    // A port nobody listens on: libzmq queues the sends until the high-water mark.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut o = opts();
    o.send_hwm = 1;
    let mut b = Node::new(o, ManagerConfig::default());
    let ctx = b.pull_ctx_to("b", "127.0.0.1", port);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &keys(0, 2));
    assert!(
        trace
            .iter()
            .all(|t| t == &[LookupResult::Retry, LookupResult::Miss]),
        "{trace:?}"
    );
    assert!(
        count(&b.p2p.counters().sessions_lost) >= 1,
        "the full queue marked the peer dead"
    );
    assert_eq!(
        count(&b.p2p.counters().lookup_timeouts),
        0,
        "it did not need the lookup deadline"
    );
    b.finish(&ctx);
    b.wait_clean();
}
