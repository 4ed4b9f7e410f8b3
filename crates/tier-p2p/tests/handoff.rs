//! The prefill→decode hand-off: the decoder's fetch reaches the producer before the producer's
//! store of those chunks completed. The fetch waits on the producer and is served from the
//! `submit_store` that brings the chunks — with off-step completions, before the producer's
//! engine makes another call; step-reported, only at its next `complete_store`.

mod common;

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use tier_p2p::{P2pCounters, P2pHandle};
use tiering_core::{LookupResult, ManagerConfig, OffloadKey, PrimaryTier, ReqContext};

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    P2pCounters::get(c)
}

fn off_step() -> ManagerConfig {
    ManagerConfig {
        off_step: true,
        ..ManagerConfig::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    FetchWaiting,
    CopyReported,
    ConsumerDone,
    ProducerNextCall,
}

type Log = Arc<Mutex<Vec<Event>>>;

/// What the decoder got: each key's distinct verdicts, and the bytes of the keys that hit.
struct Pulled {
    trace: Vec<Vec<LookupResult>>,
    bytes: Vec<(OffloadKey, Vec<u8>)>,
}

/// The decoder: pulls `ks` of hand-off `kv` from `from` without probing, logs `ConsumerDone`
/// and signals `done` once every key settled, then reads the hits and cleans up.
fn decoder(
    mut b: Node,
    from: P2pHandle,
    kv: &'static str,
    ks: Vec<OffloadKey>,
    log: Log,
    done: mpsc::Sender<()>,
) -> JoinHandle<(Node, Pulled)> {
    std::thread::spawn(move || {
        let ctx = b.prefiller_ctx("decode", kv, &from);
        b.mgr.on_new_request(&ctx).unwrap();
        let trace = b.pull_until_settled(&ctx, &ks);
        log.lock().push(Event::ConsumerDone);
        let _ = done.send(());
        let hits: Vec<OffloadKey> = ks
            .iter()
            .zip(&trace)
            .filter(|(_, t)| t.last() == Some(&LookupResult::Hit))
            .map(|(k, _)| *k)
            .collect();
        let bytes = b.read_hits(&ctx, &hits);
        b.finish(&ctx);
        b.wait_clean();
        let bytes = hits.into_iter().zip(bytes).collect();
        (b, Pulled { trace, bytes })
    })
}

fn assert_all_delivered(p: &Pulled, ks: &[OffloadKey]) {
    for t in &p.trace {
        assert_eq!(t, &[LookupResult::HitPending, LookupResult::Hit], "{:?}", p.trace);
    }
    assert_eq!(p.bytes.len(), ks.len());
    for (k, got) in &p.bytes {
        assert_eq!(got, &pattern(k), "bytes of {k}");
    }
}

fn wait_fetch_waiting(a: &Node, log: &Log) {
    wait_for("the decoder's fetch to wait on the producer", || {
        count(&a.p2p.counters().fetches_waited) == 1
    });
    log.lock().push(Event::FetchWaiting);
}

#[test]
fn with_off_step_a_waiting_fetch_is_answered_before_the_producers_next_engine_call() {
    init_tracing();
    let mut a = Node::new(opts(), off_step());
    let copier = a.mgr.store_completion_sender();
    let b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, 4);
    let pctx = decoder_ctx("prefill", "pd-1");
    a.mgr.on_new_request(&pctx).unwrap();
    // The prefill step: the device copy of the new chunks is in flight when the model starts.
    let stored = a.start_store(&pctx, &ks);
    let log = Log::default();
    let (done_tx, done_rx) = mpsc::channel();
    let consumer = decoder(b, a.p2p.clone(), "pd-1", ks.clone(), Arc::clone(&log), done_tx);
    wait_fetch_waiting(&a, &log);
    // The copy worker finishes. From here on the producer's engine makes no call until the
    // decoder has everything.
    log.lock().push(Event::CopyReported);
    copier.report(&stored, true);
    done_rx
        .recv_timeout(PATIENCE)
        .expect("the decoder was served without a producer step");
    log.lock().push(Event::ProducerNextCall);
    a.mgr.complete_store(&stored, &pctx, true).unwrap();
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    let (_b, pulled) = consumer.join().unwrap();
    assert_all_delivered(&pulled, &ks);
    assert_eq!(
        *log.lock(),
        [
            Event::FetchWaiting,
            Event::CopyReported,
            Event::ConsumerDone,
            Event::ProducerNextCall
        ]
    );
    assert_eq!(
        count(&a.p2p.counters().keys_handed_off),
        4,
        "served from submit_store, not parked"
    );
    let m = a.mgr.stats().unwrap().manager;
    // Counted per key: the four keys were completed off-step, and the engine's report of each
    // was absorbed.
    assert_eq!(m.off_step_store_completions, 4);
    assert_eq!(m.duplicate_store_reports, 4, "the engine's report was absorbed");
    a.wait_clean();
}

#[test]
fn step_reported_a_waiting_fetch_is_answered_only_after_the_producers_complete_store() {
    init_tracing();
    // The control thread runs (it takes the fetch in while the model runs) but store
    // completions come only from the engine.
    let mut a = Node::new(opts(), ManagerConfig::default());
    let b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(10, 3);
    let pctx = decoder_ctx("prefill", "pd-2");
    a.mgr.on_new_request(&pctx).unwrap();
    let stored = a.start_store(&pctx, &ks);
    let log = Log::default();
    let (done_tx, done_rx) = mpsc::channel();
    let consumer = decoder(b, a.p2p.clone(), "pd-2", ks.clone(), Arc::clone(&log), done_tx);
    wait_fetch_waiting(&a, &log);
    // A window in which a wrongly early answer would show up in the log.
    let early = done_rx.recv_timeout(Duration::from_millis(300)).is_ok();
    log.lock().push(Event::ProducerNextCall);
    a.mgr.complete_store(&stored, &pctx, true).unwrap();
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    if !early {
        done_rx.recv_timeout(PATIENCE).expect("the decoder is served");
    }
    let (_b, pulled) = consumer.join().unwrap();
    assert_all_delivered(&pulled, &ks);
    assert_eq!(
        *log.lock(),
        [Event::FetchWaiting, Event::ProducerNextCall, Event::ConsumerDone]
    );
    assert_eq!(
        count(&a.p2p.counters().keys_handed_off),
        3,
        "the engine's cascade served the waiting fetch from submit_store"
    );
    a.wait_clean();
}

#[test]
fn a_waiting_fetch_whose_chunks_never_come_fails_them_at_the_deadline_and_delivers_the_rest() {
    init_tracing();
    let mut o = opts();
    o.deadlines.load_ms = 300;
    let mut a = Node::new(o, ManagerConfig::default());
    let b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(20, 4);
    let pctx = decoder_ctx("prefill", "pd-3");
    a.mgr.on_new_request(&pctx).unwrap();
    // Only the first two chunks are ever stored; they are parked before the fetch comes.
    let stored = a.start_store(&pctx, &ks[..2]);
    a.mgr.complete_store(&stored, &pctx, true).unwrap();
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    let log = Log::default();
    let (done_tx, _done_rx) = mpsc::channel();
    let consumer = decoder(b, a.p2p.clone(), "pd-3", ks.clone(), log, done_tx);
    let (mut b, pulled) = consumer.join().unwrap();
    for t in &pulled.trace[..2] {
        assert_eq!(t.last(), Some(&LookupResult::Hit), "{:?}", pulled.trace);
    }
    for t in &pulled.trace[2..] {
        assert_eq!(
            t,
            &[LookupResult::HitPending, LookupResult::Miss],
            "{:?}",
            pulled.trace
        );
    }
    assert_eq!(pulled.bytes.len(), 2);
    for (k, got) in &pulled.bytes {
        assert_eq!(got, &pattern(k));
    }
    assert_eq!(count(&a.p2p.counters().fetches_waited), 1);
    assert_eq!(count(&a.p2p.counters().wait_timeouts), 2);
    let m = b.mgr.stats().unwrap().manager;
    assert_eq!(m.promoted_keys, 2, "a Partial result promoted the delivered keys");
    assert_eq!(m.failed_promotion_keys, 2);
    assert_eq!(
        count(&b.p2p.counters().aborts_sent),
        0,
        "the producer answered; no abort"
    );
    b.wait_clean();
    a.wait_clean();
}

#[test]
fn a_waiting_fetch_is_completed_by_several_stores_in_turn() {
    init_tracing();
    let mut a = Node::new(opts(), ManagerConfig::default());
    let b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(70, 4);
    let pctx = decoder_ctx("prefill", "pd-8");
    a.mgr.on_new_request(&pctx).unwrap();
    // Chunked prefill: the first two chunks are stored (and parked) before the fetch comes.
    let first = a.start_store(&pctx, &ks[..2]);
    a.mgr.complete_store(&first, &pctx, true).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    let log = Log::default();
    let (done_tx, done_rx) = mpsc::channel();
    let consumer = decoder(b, a.p2p.clone(), "pd-8", ks.clone(), Arc::clone(&log), done_tx);
    wait_fetch_waiting(&a, &log);
    // The parked pair leaves at once; each later step's store sends its own share.
    for k in &ks[2..] {
        let stored = a.start_store(&pctx, std::slice::from_ref(k));
        a.mgr.complete_store(&stored, &pctx, true).unwrap();
        a.mgr.on_schedule_end(&end()).unwrap();
    }
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    done_rx.recv_timeout(PATIENCE).expect("the decoder is served");
    let (_b, pulled) = consumer.join().unwrap();
    assert_all_delivered(&pulled, &ks);
    assert_eq!(count(&a.p2p.counters().keys_handed_off), 2);
    assert_eq!(count(&a.p2p.counters().wait_timeouts), 0);
    assert_eq!(
        a.p2p.chunks_sent(),
        4,
        "three transfers of one round, no chunk twice"
    );
    a.wait_clean();
}

/// Producer `a` (off-step) with a store in flight, and the decoder's fetch waiting for it.
struct Waiting {
    a: Node,
    copier: tiering_core::StoreCompletionSender,
    pctx: ReqContext,
    stored: Vec<OffloadKey>,
    ks: Vec<OffloadKey>,
    consumer: JoinHandle<(Node, Pulled)>,
}

fn waiting(kv: &'static str, first: u64, producer_opts: tier_p2p::P2pTierOptions) -> Waiting {
    init_tracing();
    let mut a = Node::new(producer_opts, off_step());
    let copier = a.mgr.store_completion_sender();
    let b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(first, 3);
    let pctx = decoder_ctx("prefill", kv);
    a.mgr.on_new_request(&pctx).unwrap();
    let stored = a.start_store(&pctx, &ks);
    let log = Log::default();
    let (done_tx, _done_rx) = mpsc::channel();
    let consumer = decoder(b, a.p2p.clone(), kv, ks.clone(), Arc::clone(&log), done_tx);
    wait_fetch_waiting(&a, &log);
    Waiting {
        a,
        copier,
        pctx,
        stored,
        ks,
        consumer,
    }
}

#[test]
fn reset_of_the_producer_with_a_waiting_fetch_and_a_reported_copy_delivers_everything() {
    let Waiting {
        mut a,
        copier,
        pctx,
        stored,
        ks,
        consumer,
    } = waiting("pd-4", 30, opts());
    // The copy is reported and the cache reset right away: whichever of the control thread and
    // the reset applies the completion, its cascade serves the fetch and the drain waits for it.
    copier.report(&stored, true);
    a.mgr.reset_cache().unwrap();
    let (_b, pulled) = consumer.join().unwrap();
    assert_all_delivered(&pulled, &ks);
    // reset_cache forgot the store: the engine's late report of it is refused and changes
    // nothing.
    assert!(matches!(
        a.mgr.complete_store(&stored, &pctx, true),
        Err(tiering_core::ManagerError::NoPendingStore(_))
    ));
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    a.wait_clean();
}

#[test]
fn reset_of_the_producer_with_a_waiting_fetch_and_nothing_stored_answers_it_at_once() {
    // A load deadline far beyond the test's patience: only the reset can end the wait.
    let mut o = opts();
    o.deadlines.load_ms = 10 * PATIENCE.as_millis() as u64;
    let Waiting {
        mut a,
        pctx,
        stored,
        consumer,
        ..
    } = waiting("pd-5", 40, o);
    a.mgr.reset_cache().unwrap();
    let (_b, pulled) = consumer.join().unwrap();
    for t in &pulled.trace {
        assert_eq!(
            t,
            &[LookupResult::HitPending, LookupResult::Miss],
            "{:?}",
            pulled.trace
        );
    }
    assert_eq!(count(&a.p2p.counters().wait_timeouts), 0);
    let _ = stored;
    a.mgr.on_request_finished(&pctx).unwrap();
    a.mgr.on_schedule_end(&end()).unwrap();
    a.wait_clean();
}

#[test]
fn shutdown_of_the_producer_with_a_waiting_fetch_and_a_reported_copy_delivers_everything() {
    let Waiting {
        mut a,
        copier,
        pctx: _,
        stored,
        ks,
        consumer,
    } = waiting("pd-6", 50, opts());
    copier.report(&stored, true);
    let arena = a.primary.arena().clone();
    a.mgr.shutdown().unwrap();
    assert_eq!(a.primary.total_pins(), 0, "no pin survives the producer");
    assert_eq!(arena.granted_rows(), 0, "no row grant survives the producer");
    let (_b, pulled) = consumer.join().unwrap();
    assert_all_delivered(&pulled, &ks);
}

#[test]
fn shutdown_of_the_producer_with_a_waiting_fetch_and_nothing_stored_leaks_nothing() {
    let mut o = opts();
    o.deadlines.load_ms = 10 * PATIENCE.as_millis() as u64;
    let Waiting { mut a, consumer, .. } = waiting("pd-7", 60, o);
    let arena = a.primary.arena().clone();
    a.mgr.shutdown().unwrap();
    assert_eq!(a.primary.total_pins(), 0);
    assert_eq!(arena.granted_rows(), 0);
    let (_b, pulled) = consumer.join().unwrap();
    for t in &pulled.trace {
        assert_eq!(t.last(), Some(&LookupResult::Miss), "{:?}", pulled.trace);
    }
}
