//! What every session shares: the transports, the data plane, the job bookkeeping and the
//! options. Sessions borrow it mutably while they handle a message.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tiering_core::{JobId, JobResult, OffloadKey, ReqContext};

use crate::auth::SharedSecret;
use crate::dataplane::dest::DestTable;
use crate::dataplane::receiver::Receiver;
use crate::dataplane::{DataCounters, DataEvent, Faults};
use crate::failure::FailureLog;
use crate::notify::Notifier;
use crate::options::P2pTierOptions;
use crate::resolve::Resolver;
use crate::stats::P2pCounters;
use crate::supply::Parked;
use crate::transport::ControlTransport;
use crate::wire::Message;

/// A store job (a peer's pins) whose keys are handed out one by one; reported once every key
/// is resolved (delivered or released).
pub(crate) struct StoreJob {
    keys: Vec<OffloadKey>,
    ok: Vec<bool>,
    resolved: Vec<bool>,
    left: usize,
    started: Instant,
    bytes_per_key: u64,
}

/// Shared state of the tier.
pub(crate) struct Core {
    pub(crate) opts: P2pTierOptions,
    pub(crate) secret: SharedSecret,
    pub(crate) local_id: String,
    pub(crate) instance: u64,
    pub(crate) data_addr: String,
    pub(crate) chunk_bytes: u64,
    pub(crate) num_chunks: u64,
    pub(crate) transport: ControlTransport,
    pub(crate) dest: Arc<DestTable>,
    pub(crate) receiver: Receiver,
    pub(crate) data_tx: mpsc::Sender<DataEvent>,
    pub(crate) data_rx: mpsc::Receiver<DataEvent>,
    pub(crate) notifier: Notifier,
    pub(crate) data_counters: Arc<DataCounters>,
    pub(crate) counters: Arc<P2pCounters>,
    pub(crate) faults: Arc<Faults>,
    pub(crate) last_error: Arc<Mutex<Option<String>>>,
    pub(crate) finished: Vec<JobResult>,
    pub(crate) store_jobs: HashMap<JobId, StoreJob>,
    /// Synthetic contexts of peer lookups still owed `on_request_finished` (their session died
    /// or the consumer finished first); released at the next serve.
    pub(crate) finish_ctxs: Vec<ReqContext>,
    pub(crate) joins: Vec<JoinHandle<()>>,
    /// Consumer-side failures per peer (shared with the handle).
    pub(crate) failures: FailureLog,
    /// Peer names to `ip:port`.
    pub(crate) resolver: Resolver,
    /// Connections found dead while sending: (peer, generation, reason).
    pub(crate) dead_links: Vec<(String, u64, String)>,
    /// Producer-side parking (`remote_decoder`), by kv request id.
    pub(crate) parked: HashMap<String, Parked>,
    next_generation: u64,
    next_transfer: u64,
    next_lookup: u64,
}

impl Core {
    #[expect(clippy::too_many_arguments, reason = "built once, by the tier constructor")]
    pub(crate) fn new(
        opts: P2pTierOptions,
        secret: SharedSecret,
        transport: ControlTransport,
        receiver: Receiver,
        dest: Arc<DestTable>,
        notifier: Notifier,
        data_counters: Arc<DataCounters>,
        chunk_bytes: u64,
        num_chunks: u64,
    ) -> Self {
        let (data_tx, data_rx) = mpsc::channel();
        let resolver = Resolver::new(notifier.clone());
        let local_id = transport.local_id.clone();
        let host = local_id
            .rsplit_once(':')
            .map_or("127.0.0.1", |(h, _)| h)
            .to_owned();
        let data_addr = format!("{host}:{}", receiver.local_addr().port());
        let instance = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(40);
        Self {
            opts,
            secret,
            local_id,
            instance,
            data_addr,
            chunk_bytes,
            num_chunks,
            transport,
            dest,
            receiver,
            data_tx,
            data_rx,
            notifier,
            data_counters,
            counters: Arc::default(),
            faults: Arc::default(),
            last_error: Arc::default(),
            finished: Vec::new(),
            store_jobs: HashMap::new(),
            finish_ctxs: Vec::new(),
            joins: Vec::new(),
            parked: HashMap::new(),
            dead_links: Vec::new(),
            failures: FailureLog::default(),
            resolver,
            next_generation: 1,
            next_transfer: 1,
            next_lookup: 0,
        }
    }

    pub(crate) fn generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    pub(crate) fn transfer_id(&mut self) -> u64 {
        self.next_transfer += 1;
        self.next_transfer
    }

    pub(crate) fn lookup_seq(&mut self) -> u64 {
        self.next_lookup += 1;
        self.next_lookup
    }

    /// Sends one message to `peer` now (no gating), from this thread. A failed send marks the
    /// connection dead; the tier tears the session down at its next pump.
    pub(crate) fn send(&mut self, peer: &str, msg: &Message) {
        tracing::trace!(%peer, kind = msg.kind(), "send");
        if let Err((generation, reason)) = self.transport.send(peer, msg) {
            self.dead_links.push((peer.to_owned(), generation, reason));
        }
    }

    /// Records an error for diagnostics.
    pub(crate) fn record_error(&self, msg: String) {
        *self.last_error.lock() = Some(msg);
    }

    pub(crate) fn drain(&self) -> Duration {
        self.opts.deadlines.drain()
    }

    /// Registers a peer store job whose keys will be resolved one by one.
    pub(crate) fn add_store_job(&mut self, id: JobId, keys: Vec<OffloadKey>) {
        let n = keys.len();
        if n == 0 {
            self.finished.push(JobResult::ok(id, 0, Duration::ZERO));
            return;
        }
        self.store_jobs.insert(
            id,
            StoreJob {
                keys,
                ok: vec![false; n],
                resolved: vec![false; n],
                left: n,
                started: Instant::now(),
                bytes_per_key: self.chunk_bytes,
            },
        );
    }

    /// Resolves one key of a store job (`delivered` when the consumer verified it).
    pub(crate) fn resolve_store_key(&mut self, id: JobId, key: &OffloadKey, delivered: bool) {
        tracing::trace!(job = %id, %key, delivered, "store key resolved");
        let Some(job) = self.store_jobs.get_mut(&id) else {
            tracing::error!(job = %id, "a supply entry names an unknown store job");
            return;
        };
        let Some(i) = job
            .keys
            .iter()
            .enumerate()
            .position(|(i, k)| k == key && !job.resolved[i])
        else {
            return;
        };
        job.resolved[i] = true;
        job.ok[i] = delivered;
        job.left -= 1;
        if job.left == 0
            && let Some(job) = self.store_jobs.remove(&id)
        {
            let delivered = job.ok.iter().filter(|&&o| o).count() as u64;
            tracing::debug!(job = %id, delivered, "peer store job finished");
            self.finished.push(JobResult::from_key_outcomes(
                id,
                &job.keys,
                &job.ok,
                delivered * job.bytes_per_key,
                job.started.elapsed(),
            ));
        }
    }
}
