//! A busy producer (no engine calls while its model "runs") still serves a pull when its
//! control-plane thread is on; step-driven, the pull waits for its next step. A load lands
//! when its rows verified, not a control hop later when the producer says so.

mod common;

use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::fake_peer::{FakePeer, push};
use common::*;
use parking_lot::Mutex;
use tier_p2p::SharedSecret;
use tier_p2p::dataplane::frame::ChunkStatus;
use tiering_core::{LookupResult, ManagerConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    ProducerBusy,
    ConsumerDone,
    ProducerNextStep,
}

/// The producer stores, ends its step, then makes no engine call for up to `busy` (or until the
/// consumer is done); then it steps again until the consumer is done.
fn run(producer: ManagerConfig, busy: Duration) -> Vec<Event> {
    init_tracing();
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut a = Node::new(opts(), producer);
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 8);
    a.store("a-req", &ks);
    log.lock().push(Event::ProducerBusy);
    let (done_tx, done_rx) = mpsc::channel();
    let ha = a.p2p.clone();
    let blog = Arc::clone(&log);
    let consumer = std::thread::spawn(move || {
        let ctx = b.pull_ctx("b-req", &ha);
        b.mgr.on_new_request(&ctx).unwrap();
        let trace = b.pull_until_settled(&ctx, &ks);
        blog.lock().push(Event::ConsumerDone);
        let _ = done_tx.send(());
        assert!(
            trace.iter().all(|t| t.last() == Some(&LookupResult::Hit)),
            "{trace:?}"
        );
        let bytes = b.read_hits(&ctx, &ks);
        for (k, got) in ks.iter().zip(&bytes) {
            assert_eq!(got, &pattern(k));
        }
        b.finish(&ctx);
        b.wait_clean();
    });
    // The model step: no manager call at all.
    let finished_while_busy = done_rx.recv_timeout(busy).is_ok();
    log.lock().push(Event::ProducerNextStep);
    if !finished_while_busy {
        loop {
            a.mgr.on_schedule_end(&end()).unwrap();
            if done_rx.recv_timeout(Duration::from_millis(1)).is_ok() {
                break;
            }
        }
    }
    consumer.join().unwrap();
    a.wait_clean();
    log.lock().clone()
}

#[test]
fn with_the_control_thread_a_busy_producer_serves_the_whole_pull() {
    // The producer stays busy until the pull completes (bounded generously); the assertion
    // is that it completed before the producer's next engine call.
    let events = run(ManagerConfig::default(), PATIENCE);
    assert_eq!(
        events,
        [Event::ProducerBusy, Event::ConsumerDone, Event::ProducerNextStep]
    );
}

#[test]
fn step_driven_the_pull_waits_for_the_producers_next_step() {
    let events = run(ManagerConfig::step_driven(), Duration::from_millis(500));
    assert_eq!(
        events,
        [Event::ProducerBusy, Event::ProducerNextStep, Event::ConsumerDone]
    );
}

#[test]
fn a_step_driven_idle_producer_steps_only_while_has_pending_work_and_still_serves() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::step_driven());
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 4);
    a.store("a-req", &ks);
    let (done_tx, done_rx) = mpsc::channel();
    let ha = a.p2p.clone();
    let consumer = std::thread::spawn(move || {
        let ctx = b.pull_ctx("b-req", &ha);
        b.mgr.on_new_request(&ctx).unwrap();
        let trace = b.pull_until_settled(&ctx, &ks);
        let _ = done_tx.send(());
        b.finish(&ctx);
        b.wait_clean();
        trace
    });
    // An idle engine: it steps only when the manager says there is work.
    let mut steps = 0;
    while done_rx.try_recv().is_err() {
        if a.mgr.has_pending_work().unwrap() {
            a.mgr.on_schedule_end(&end()).unwrap();
            steps += 1;
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let trace = consumer.join().unwrap();
    assert!(
        trace.iter().all(|t| t.last() == Some(&LookupResult::Hit)),
        "{trace:?}"
    );
    assert!(steps > 0);
    wait_for("the producer to become idle", || {
        a.mgr.on_schedule_end(&end()).unwrap();
        !a.mgr.has_pending_work().unwrap()
    });
    a.wait_clean();
}

#[test]
fn a_load_lands_once_every_row_verified_without_waiting_for_transfer_done() {
    // The producer pushes every row (each verifies) and never sends `transfer_done`: the
    // consumer's load still lands, since no further write can reach those rows.
    init_tracing();
    let mut b = Node::new(opts(), ManagerConfig::default());
    let mut peer = FakePeer::new(&b.p2p, SharedSecret::new(SECRET), 7);
    let ks = keys(0, 3);
    let (ctx, f) = b.fetch_from_fake(&mut peer, "b-req", "kv-early", &ks);
    let mut conn = peer.data_conn(peer.instance);
    assert_eq!(
        push(&mut conn, &peer.transfer_bytes(&peer.data_key(), &f, 1)),
        Some(vec![ChunkStatus::Ok; 3])
    );
    b.assert_all_landed(&ctx, &ks);
    // A late `transfer_done` for the finished round changes nothing.
    peer.transfer_done(&f, true);
    b.finish(&ctx);
    b.wait_clean();
    assert_eq!(b.p2p.chunks_received(), 3);
}
