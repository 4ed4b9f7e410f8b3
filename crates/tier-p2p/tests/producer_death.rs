//! The producer dies at each point of a probed fetch: every load the consumer submitted is
//! reported exactly once, no row stays granted, and the tier stops reporting pending work.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::fake_peer::{FakePeer, SeenFetch};
use common::*;
use tier_p2p::P2pCounters;
use tier_p2p::SharedSecret;
use tier_p2p::wire::{Message, decode_keys};
use tiering_core::{LookupResult, ManagerConfig, OffloadKey, PrimaryTier, ReqContext};

/// Where the producer dies.
#[derive(Clone, Copy, Debug)]
enum Point {
    /// The node's `lookup` reached it; no `lookup_resp` left.
    BeforeLookupResp,
    /// It answered the lookup and got the `fetch`; no data-plane byte left.
    AfterFetch,
    /// The transfer's `BEGIN` and its first chunk arrived, nothing more.
    AfterFirstChunk,
    /// It died in the middle of the second chunk's payload (a receiver holds that row).
    MidPayload,
    /// Every row arrived and verified; neither `END` nor `transfer_done` left.
    AfterLastRow,
    /// The transfer was acknowledged; `transfer_done` never left.
    BeforeTransferDone,
}

const N: u64 = 3;

/// The node's next `lookup`, answered nothing yet.
fn wait_lookup(
    node: &mut Node,
    peer: &FakePeer,
    ctx: &ReqContext,
    ks: &[OffloadKey],
) -> (String, Vec<OffloadKey>) {
    let start = Instant::now();
    loop {
        let _ = node.step(ctx, ks);
        if let Some(Message::Lookup {
            kv_request_id, keys, ..
        }) = peer.recv(Duration::from_millis(5))
        {
            return (kv_request_id, decode_keys(&keys).unwrap());
        }
        assert!(start.elapsed() < PATIENCE, "the node never looked up");
    }
}

/// Steps until the node's manager reports no pending work; returns the verdicts seen.
fn settle(node: &mut Node, ctx: &ReqContext, ks: &[OffloadKey]) -> Vec<LookupResult> {
    let start = Instant::now();
    loop {
        let r = node.step(ctx, ks);
        let settled = r
            .iter()
            .all(|v| matches!(v, LookupResult::Hit | LookupResult::Miss));
        if settled && !node.mgr.has_pending_work().unwrap() {
            return r;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the consumer never settled after the producer died: verdicts {r:?}, {} jobs in flight",
            node.mgr.inspect(|s| s.jobs_in_flight())
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn kill_at(point: Point) {
    init_tracing();
    let mut o = opts();
    // Short heartbeats: the dead producer's control connection is noticed quickly.
    o.heartbeat.interval_ms = 50;
    o.heartbeat.timeout_ms = 300;
    let mut b = Node::new(o, ManagerConfig::default());
    let mut peer = FakePeer::new(&b.p2p, SharedSecret::new(SECRET), 7);
    let (host, port) = peer.host_port();
    let ctx = b.pull_ctx_to("b-req", &host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    peer.handshake(|| b.mgr.on_schedule_end(&end()).unwrap());
    let ks = keys(0, N);
    let (kv, asked) = wait_lookup(&mut b, &peer, &ctx, &ks);
    let mut data: Option<TcpStream> = None;
    let mut expect_loads = 0;
    let mut expect_hits = 0;
    if !matches!(point, Point::BeforeLookupResp) {
        peer.send(&Message::LookupResp {
            kv_request_id: kv.clone(),
            keys: tier_p2p::wire::encode_keys(&asked),
            hits: vec![true; asked.len()],
            round_seq: 0,
        });
        let f: SeenFetch = b.step_until_fetch(&ctx, &ks, &peer);
        assert_eq!(f.keys.len() as u64, N, "one fetch of every key");
        expect_loads = 1;
        let key = peer.data_key();
        let bytes = peer.transfer_bytes(&key, &f, 1);
        // BEGIN, then the chunks' frames (all of one length), then END.
        let begin = begin_len(&key, &f);
        let frame = (bytes.len() - begin - end_len()) / (N as usize);
        let upto = match point {
            Point::BeforeLookupResp | Point::AfterFetch => None,
            Point::AfterFirstChunk => Some(begin + frame),
            Point::MidPayload => Some(begin + frame + frame / 2),
            Point::AfterLastRow => Some(begin + frame * N as usize),
            Point::BeforeTransferDone => Some(bytes.len()),
        };
        if let Some(upto) = upto {
            let mut s = peer.data_conn(peer.instance);
            s.write_all(&bytes[..upto]).unwrap();
            s.flush().unwrap();
            match point {
                Point::AfterFirstChunk => wait_for("the first chunk", || b.p2p.chunks_received() == 1),
                Point::MidPayload => {
                    wait_for("the first chunk", || b.p2p.chunks_received() == 1);
                    // Let the receiver check the second row out and read into it.
                    std::thread::sleep(Duration::from_millis(50));
                }
                Point::AfterLastRow => wait_for("every row", || b.p2p.chunks_received() == N),
                Point::BeforeTransferDone => {
                    let (_, statuses) = tier_p2p::dataplane::frame::read_ack(&mut s).unwrap();
                    assert_eq!(statuses.len() as u64, N);
                }
                _ => {}
            }
            data = Some(s);
        }
        // A row that arrived and verified before the death lands (a verified row is never
        // written again); the others fail.
        expect_hits = match point {
            Point::AfterFirstChunk | Point::MidPayload => 1,
            Point::AfterLastRow | Point::BeforeTransferDone => N,
            Point::BeforeLookupResp | Point::AfterFetch => 0,
        };
    }
    // The producer dies: every socket of it closes at once.
    drop(data);
    drop(peer);
    let verdicts = settle(&mut b, &ctx, &ks);
    let h = b.p2p.clone();
    let c = h.counters();
    assert_eq!(
        P2pCounters::get(&c.loads_finished),
        expect_loads,
        "{point:?}: each submitted load is reported exactly once"
    );
    let hits = verdicts.iter().filter(|v| **v == LookupResult::Hit).count() as u64;
    assert_eq!(hits, expect_hits, "{point:?}: {verdicts:?}");
    let stats = b.mgr.stats().unwrap();
    assert_eq!(stats.manager.promoted_keys, expect_hits, "{point:?}");
    assert_eq!(
        stats.manager.failed_promotion_keys,
        expect_loads * N - expect_hits,
        "{point:?}"
    );
    let hit: Vec<OffloadKey> = ks
        .iter()
        .zip(&verdicts)
        .filter(|(_, v)| **v == LookupResult::Hit)
        .map(|(k, _)| *k)
        .collect();
    if !hit.is_empty() {
        for (k, got) in hit.iter().zip(b.read_hits(&ctx, &hit)) {
            assert_eq!(got, pattern(k));
        }
    }
    b.finish(&ctx);
    b.wait_clean();
    assert!(!b.mgr.has_pending_work().unwrap());
    assert_eq!(
        P2pCounters::get(&c.loads_finished),
        expect_loads,
        "{point:?}: never twice"
    );
    let arena = b.primary.arena().clone();
    b.mgr.shutdown().unwrap();
    assert_eq!(arena.granted_rows(), 0);
}

/// The length of a transfer's `BEGIN` frame.
fn begin_len(key: &tier_p2p::auth::DataKey, f: &SeenFetch) -> usize {
    let b = tier_p2p::dataplane::frame::Begin {
        transfer_id: 1,
        kv_request_id: f.kv.clone(),
        round: f.round,
        count: f.keys.len() as u32,
    };
    let mut v = Vec::new();
    tier_p2p::dataplane::frame::write_begin(&mut v, key, &b).unwrap();
    v.len()
}

/// The length of a transfer's `END` frame.
fn end_len() -> usize {
    let mut v = Vec::new();
    tier_p2p::dataplane::frame::write_end(&mut v, N as u32).unwrap();
    v.len()
}

#[test]
fn producer_dies_before_lookup_resp() {
    kill_at(Point::BeforeLookupResp);
}

#[test]
fn producer_dies_after_the_fetch() {
    kill_at(Point::AfterFetch);
}

#[test]
fn producer_dies_after_the_first_chunk() {
    kill_at(Point::AfterFirstChunk);
}

#[test]
fn producer_dies_mid_payload() {
    kill_at(Point::MidPayload);
}

#[test]
fn producer_dies_after_the_last_row() {
    kill_at(Point::AfterLastRow);
}

#[test]
fn producer_dies_before_transfer_done() {
    kill_at(Point::BeforeTransferDone);
}
