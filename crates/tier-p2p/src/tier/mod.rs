//! [`P2pTier`]: the `SecondaryTier` that lets peers share chunks.
//!
//! Every method runs under the manager lock and returns at once: control messages are sent
//! and (in `pump`) received on the calling thread without blocking; the tier's own threads
//! (a ZeroMQ I/O thread for connection events and the inbound backstop, the data-plane
//! listener, connection and sender threads) report through channels and wake the manager's
//! control plane. Each call first drains those channels and the control socket (`pump`), so
//! the state machines only ever run on the thread that holds the lock.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tiering_core::{
    ControlWaker, JobResult, KeyMap, Locality, LookupResult, Medium, OffloadKey, OffloadPolicy,
    ParentManager, ReqContext, SecondaryTier, TierError, TierInfo, TierStats, TransferJob, arena::ChunkArena,
};

mod events;

use crate::core::Core;
use crate::dataplane::dest::DestTable;
use crate::dataplane::receiver::Receiver;
use crate::error::P2pError;
use crate::handle::P2pHandle;
use crate::notify::Notifier;
use crate::options::{P2pTierOptions, split_host_port};
use crate::params::params;
use crate::resolve::Resolved;
use crate::server::release;
use crate::session::Session;
use crate::stats::P2pCounters;
use crate::supply::{Parked, Supply};
use crate::transport::{ControlTransport, IoEvent};

/// The peer-to-peer secondary tier. See the crate docs.
pub struct P2pTier {
    core: Core,
    sessions: HashMap<String, Session>,
    retiring: Vec<Session>,
    /// (peer, kv request id) of consumer requests that must miss from now on.
    failed_reqs: HashSet<(String, String)>,
    info: TierInfo,
    shut_down: bool,
    /// Inbound messages taken from the I/O thread so far (compared with its counter, so an
    /// idle step-driven engine keeps stepping while a peer's message waits).
    consumed: u64,
}

impl P2pTier {
    /// Binds the control and data sockets and starts the I/O threads. `arena` is the primary
    /// tier's arena: its chunk size is announced (and checked) at handshake, and its rows are
    /// the ones fetches write into.
    ///
    /// # Errors
    /// Bad options (no shared secret without `insecure`, an empty `hash_seed` or
    /// `layout_fingerprint`), or a socket that cannot be bound.
    pub fn new(options: P2pTierOptions, arena: &ChunkArena) -> Result<Self, P2pError> {
        let secret = options.resolve_secret()?;
        options.check_identity()?;
        let notifier = Notifier::default();
        // Identities on the wire are `ip:port`: a host name in `bind` or `advertise` is
        // resolved once, here, as peers resolve the names they are given.
        let bind = crate::canonical_peer(&options.bind)
            .map_err(|e| P2pError::Config(format!("bind = {:?}: {e}", options.bind)))?;
        let advertise = match &options.advertise {
            Some(a) => {
                let c = crate::canonical_peer(&format!("{a}:0"))
                    .map_err(|e| P2pError::Config(format!("advertise = {a:?}: {e}")))?;
                Some(c.rsplit_once(':').map_or(c.clone(), |(h, _)| h.to_owned()))
            }
            None => None,
        };
        let transport = ControlTransport::start(
            &bind,
            advertise.as_deref(),
            &options.heartbeat,
            options.send_hwm,
            &options.inbound,
            notifier.clone(),
        )?;
        let data_bind = match &options.data_bind {
            Some(b) => b.clone(),
            None => {
                let (host, _) = split_host_port(&bind)
                    .ok_or_else(|| P2pError::Config(format!("bad bind address {:?}", options.bind)))?;
                format!("{host}:0")
            }
        };
        let dest = Arc::new(DestTable::new(notifier.clone()));
        let data_counters = Arc::default();
        let receiver = Receiver::start(
            &data_bind,
            Arc::clone(&dest),
            Arc::clone(&data_counters),
            options.deadlines.handshake(),
        )?;
        let info = TierInfo::new(options.name.clone(), Some(Medium::Cpu), Some(Locality::Remote));
        let peers = options.peers.clone();
        let core = Core::new(
            options,
            secret,
            transport,
            receiver,
            dest,
            notifier,
            data_counters,
            arena.chunk_bytes() as u64,
            arena.num_chunks() as u64,
        );
        tracing::info!(id = %core.local_id, data = %core.data_addr, "p2p tier listening");
        let mut tier = Self {
            core,
            sessions: HashMap::new(),
            retiring: Vec::new(),
            failed_reqs: HashSet::new(),
            info,
            shut_down: false,
            consumed: 0,
        };
        // Peers named at start are dialled like any other: a refused port and a black-holed
        // one both fail their session at the handshake deadline (`PeerFailure::Unreachable`);
        // neither fails the start. A name that does not resolve is recorded the same way.
        for p in peers {
            match crate::canonical_peer(&p) {
                Ok(c) => {
                    tier.session(&c);
                }
                Err(reason) => tier
                    .core
                    .failures
                    .record(crate::PeerFailure::Unreachable { peer: p, reason }),
            }
        }
        Ok(tier)
    }

    /// This node's identity (`host:port` of its control socket), the address peers dial.
    #[must_use]
    pub fn local_id(&self) -> &str {
        &self.core.local_id
    }

    /// A handle for watching the tier after the manager took it.
    #[must_use]
    pub fn handle(&self) -> P2pHandle {
        P2pHandle {
            local_id: self.core.local_id.clone(),
            data_addr: self.core.data_addr.clone(),
            counters: Arc::clone(&self.core.counters),
            transport: Arc::clone(&self.core.transport.counters),
            data: Arc::clone(&self.core.data_counters),
            faults: Arc::clone(&self.core.faults),
            last_error: Arc::clone(&self.core.last_error),
            failures: self.core.failures.clone(),
        }
    }

    /// The live session toward `peer`, opened if needed (never toward this node itself).
    fn session(&mut self, peer: &str) -> Option<&mut Session> {
        if peer == self.core.local_id || self.shut_down {
            return None;
        }
        if !self.sessions.contains_key(peer) {
            let s = Session::open(&mut self.core, peer);
            self.sessions.insert(peer.to_owned(), s);
        }
        self.sessions.get_mut(peer)
    }

    fn kill(&mut self, peer: &str, reason: &str, notify: bool) {
        self.end_session(peer, reason, notify, reason == crate::failure::SHUTTING_DOWN);
    }

    /// Ends the session with `peer`; `orderly` when either side shut down.
    fn end_session(&mut self, peer: &str, reason: &str, notify: bool, orderly: bool) {
        let Some(mut s) = self.sessions.remove(peer) else {
            return;
        };
        for kv in s.kill(&mut self.core, reason, notify, orderly) {
            self.failed_reqs.insert((peer.to_owned(), kv));
        }
        self.retiring.push(s);
    }

    /// Drains the I/O threads' reports and runs timers. Non-blocking.
    fn pump(&mut self) {
        while let Some(ev) = self.core.transport.try_event() {
            match ev {
                IoEvent::Message { peer, msg } => {
                    self.consumed += 1;
                    self.on_message(&peer, msg);
                }
                IoEvent::Flooded { peer } => {
                    P2pCounters::bump(&self.core.counters.peers_flooded);
                    let m = format!("peer {peer} flooded the control socket; disconnected");
                    self.core.record_error(m.clone());
                    self.kill(&peer, &m, true);
                }
                IoEvent::Dead {
                    peer,
                    generation,
                    reason,
                } => {
                    if self
                        .sessions
                        .get(&peer)
                        .is_some_and(|s| s.generation == generation)
                    {
                        let f = self.lost(&peer, reason);
                        self.fail(&peer, f, false);
                    }
                }
            }
        }
        // Drained: the control thread's wait may end on the ROUTER again.
        self.core.transport.end_pump();
        for (peer, generation, reason) in std::mem::take(&mut self.core.dead_links) {
            if self
                .sessions
                .get(&peer)
                .is_some_and(|s| s.generation == generation)
            {
                let f = self.lost(&peer, reason);
                self.fail(&peer, f, false);
            }
        }
        while let Ok(ev) = self.core.data_rx.try_recv() {
            self.on_data_event(ev);
        }
        let now = Instant::now();
        let mut doomed = Vec::new();
        for s in self.sessions.values_mut() {
            if let Some(reason) = s.tick(&mut self.core, now) {
                doomed.push((s.peer.clone(), reason));
            }
        }
        for (peer, reason) in doomed {
            let f = crate::PeerFailure::Unreachable {
                peer: peer.clone(),
                reason,
            };
            self.fail(&peer, f, true);
        }
        for s in &mut self.retiring {
            s.client.finish_quiescent(&mut self.core, &s.peer.clone());
        }
        self.retiring.retain(|s| {
            let keep = !s.quiescent();
            if !keep {
                tracing::debug!(peer = %s.peer, generation = s.generation, "retired session dropped");
            }
            keep
        });
        let limit = self.core.opts.deadlines.unbound_park();
        let stale: Vec<String> = self
            .core
            .parked
            .iter()
            .filter(|(_, p)| now.duration_since(p.since) >= limit)
            .map(|(k, _)| k.clone())
            .collect();
        for kv in stale {
            if let Some(p) = self.core.parked.remove(&kv) {
                tracing::warn!(%kv, "parked chunks were never fetched; releasing them");
                release_parked(&mut self.core, p);
            }
        }
    }

    fn outstanding(&self) -> usize {
        self.loads_in_flight() + self.core.store_jobs.len()
    }

    /// Loads in flight over every session, live or retiring.
    fn loads_in_flight(&self) -> usize {
        self.sessions
            .values()
            .chain(&self.retiring)
            .map(|s| s.client.loads_in_flight())
            .sum()
    }

    /// Releases every pin that no transfer is using (for drain and shutdown).
    fn release_idle_supply(&mut self) {
        for s in self.sessions.values_mut() {
            s.release_idle(&mut self.core);
        }
        for (_, p) in std::mem::take(&mut self.core.parked) {
            release_parked(&mut self.core, p);
        }
    }

    fn wait_outstanding(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.pump();
            if self.outstanding() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A request's source with its peer name resolved.
enum Src {
    /// The request pulls from no peer.
    None,
    /// The peer's name is still resolving.
    Pending,
    /// The peer's name does not resolve.
    Failed,
    /// `peer` is the canonical `ip:port`.
    Ready(crate::params::Source),
}

impl P2pTier {
    fn source(&mut self, ctx: &ReqContext) -> Src {
        let Some(mut src) = params(ctx).source else {
            return Src::None;
        };
        match self.core.resolver.resolve(&src.peer) {
            Resolved::Pending => Src::Pending,
            Resolved::Done(Ok(canonical)) => {
                src.peer = canonical;
                Src::Ready(src)
            }
            Resolved::Done(Err(reason)) => {
                if self.core.failures.get(&src.peer).is_none() {
                    self.core.failures.record(crate::PeerFailure::Unreachable {
                        peer: src.peer,
                        reason,
                    });
                }
                Src::Failed
            }
        }
    }

    /// Tears a session down and records why, as its consumer sees it.
    pub(super) fn fail(&mut self, peer: &str, failure: crate::PeerFailure, notify: bool) {
        let reason = failure.to_string();
        let orderly = failure.is_shutdown_goodbye();
        if self.sessions.contains_key(peer) {
            self.core.failures.record(failure);
        }
        self.end_session(peer, &reason, notify, orderly);
    }

    /// How the loss of `peer`'s connection looks to a consumer: unreachable if the session
    /// never became ready, else the producer went away.
    pub(super) fn lost(&self, peer: &str, reason: String) -> crate::PeerFailure {
        let peer = peer.to_owned();
        if self.sessions.get(&peer).is_some_and(Session::ready) {
            crate::PeerFailure::ProducerDied { peer, reason }
        } else {
            crate::PeerFailure::Unreachable { peer, reason }
        }
    }
}

fn release_parked(core: &mut Core, p: Parked) {
    let mut map: KeyMap<Supply> = KeyMap::default();
    for (k, s) in p.items {
        if let Some(dup) = map.insert(k, s) {
            let mut one = KeyMap::default();
            one.insert(k, dup);
            release(core, one);
        }
    }
    release(core, map);
}

impl SecondaryTier for P2pTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        // Peers are served, and their fetches answered, while the model runs.
        true
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.core.transport.set_waker(&waker);
        self.core.notifier.set(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        let src = match self.source(ctx) {
            Src::None => return LookupResult::Miss,
            Src::Pending => return LookupResult::Retry,
            Src::Failed => {
                P2pCounters::bump(&self.core.counters.misses);
                return LookupResult::Miss;
            }
            Src::Ready(src) => src,
        };
        let id = (src.peer.clone(), src.kv_request_id.clone());
        let miss = |c: &P2pCounters| {
            P2pCounters::bump(&c.misses);
            LookupResult::Miss
        };
        if self.failed_reqs.contains(&id) {
            return miss(&self.core.counters);
        }
        let deadline = self.core.opts.deadlines.lookup();
        // The session opens here when the peer's name was still resolving at
        // `on_new_request`.
        if self.session(&src.peer).is_none() {
            return miss(&self.core.counters);
        }
        let Some(s) = self.sessions.get_mut(&src.peer) else {
            return miss(&self.core.counters);
        };
        if src.eager {
            // No probe, but a key that already failed to load misses for the rest of the
            // request: asking again would only fail the same way.
            if s.client.failed_before(&src.kv_request_id, key) {
                return miss(&self.core.counters);
            }
            P2pCounters::bump(&self.core.counters.hits);
            return LookupResult::Hit;
        }
        match s.client.probe(&src.kv_request_id, key, Instant::now(), deadline) {
            Ok(LookupResult::Hit) => {
                P2pCounters::bump(&self.core.counters.hits);
                LookupResult::Hit
            }
            Ok(LookupResult::Miss) => miss(&self.core.counters),
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(peer = %src.peer, kv = %src.kv_request_id, "peer lookup deadline passed; falling back to miss");
                P2pCounters::bump(&self.core.counters.lookup_timeouts);
                s.client.fail(&src.kv_request_id);
                self.core.failures.record(crate::PeerFailure::Deadline {
                    peer: src.peer.clone(),
                    what: "lookup",
                });
                self.failed_reqs.insert(id);
                miss(&self.core.counters)
            }
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        match params(&job.req).decoder {
            None => {
                // A symmetric producer serves from lookups, not from cascades: nothing to keep.
                self.core.finished.push(JobResult::ok(job.id, 0, Duration::ZERO));
            }
            Some(None) => {
                tracing::warn!(job = %job.id, "remote_decoder without kv_request_id; store failed");
                self.core.finished.push(JobResult::failed(job.id, Duration::ZERO));
            }
            Some(Some(kv)) => {
                let Ok(reads) = job.rows.into_reads() else {
                    self.core.finished.push(JobResult::failed(job.id, Duration::ZERO));
                    return;
                };
                self.core.add_store_job(job.id, job.keys.clone());
                let mut items: Vec<(OffloadKey, Supply)> = job
                    .keys
                    .iter()
                    .zip(reads)
                    .map(|(k, src)| (*k, Supply { job: job.id, src }))
                    .collect();
                // A consumer's fetch may already be waiting for these chunks (the hand-off):
                // take in what the peers sent so far, then serve it from this very call.
                self.pump();
                for s in self.sessions.values_mut() {
                    if items.is_empty() {
                        break;
                    }
                    if s.waits_for(&kv) {
                        items = s.offer(&mut self.core, &kv, items);
                    }
                }
                if items.is_empty() {
                    return;
                }
                let parked = self.core.parked.entry(kv).or_insert_with(|| Parked {
                    since: Instant::now(),
                    items: Vec::new(),
                });
                parked.items.extend(items);
            }
        }
    }

    fn submit_load(&mut self, job: TransferJob) {
        let Src::Ready(src) = self.source(&job.req) else {
            self.core.finished.push(JobResult::failed(job.id, Duration::ZERO));
            return;
        };
        if job.keys.is_empty() {
            self.core.finished.push(JobResult::ok(job.id, 0, Duration::ZERO));
            return;
        }
        let id = (src.peer.clone(), src.kv_request_id.clone());
        let live =
            !self.failed_reqs.contains(&id) && self.sessions.get(&src.peer).is_some_and(|s| s.dead.is_none());
        if !live {
            self.failed_reqs.insert(id);
            self.core.finished.push(JobResult::failed(job.id, Duration::ZERO));
            return;
        }
        let Some(s) = self.sessions.get_mut(&src.peer) else {
            return;
        };
        let auth = Arc::clone(&s.inbound);
        match s.client.start_load(
            &mut self.core,
            &src.peer,
            &src.kv_request_id,
            job,
            src.eager,
            auth,
        ) {
            Ok(fetch) => s.send(&mut self.core, fetch),
            Err(result) => self.core.finished.push(result),
        }
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.pump();
        out.append(&mut self.core.finished);
    }

    fn has_pending_work(&self) -> bool {
        !self.core.finished.is_empty()
            || !self.core.store_jobs.is_empty()
            || !self.core.finish_ctxs.is_empty()
            || !self.core.parked.is_empty()
            || !self.retiring.is_empty()
            || self.sessions.values().any(Session::has_work)
            || self
                .core
                .transport
                .counters
                .messages_in
                .load(std::sync::atomic::Ordering::Relaxed)
                > self.consumed
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        let p = params(ctx);
        if let Src::Ready(src) = self.source(ctx) {
            let _ = self.session(&src.peer);
        }
        if p.decoder.is_some() {
            OffloadPolicy::RequestLevel
        } else {
            OffloadPolicy::ChunkLevel
        }
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        let Src::Ready(src) = self.source(ctx) else {
            return;
        };
        if let Some(s) = self.sessions.get_mut(&src.peer) {
            let out = s.client.finish(&self.core, &src.kv_request_id);
            s.send_all(&mut self.core, out);
        }
        self.failed_reqs.remove(&(src.peer, src.kv_request_id));
    }

    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        self.pump();
        for ctx in std::mem::take(&mut self.core.finish_ctxs) {
            if let Err(e) = parent.on_request_finished(&ctx) {
                tracing::error!(error = %e, "releasing a peer lookup context failed");
            }
        }
        for s in self.sessions.values_mut() {
            s.serve(&mut self.core, parent);
        }
        Ok(())
    }

    fn on_schedule_end(&mut self) {
        for s in self.sessions.values_mut() {
            s.flush_lookups(&mut self.core);
        }
    }

    fn drain_jobs(&mut self) {
        self.release_idle_supply();
        let drain = self.core.drain();
        if self.wait_outstanding(drain) {
            return;
        }
        tracing::warn!("p2p transfers still running after {drain:?}; closing every session");
        let peers: Vec<String> = self.sessions.keys().cloned().collect();
        for p in peers {
            self.kill(&p, "draining", true);
        }
        if !self.wait_outstanding(drain) {
            tracing::error!(
                outstanding = self.outstanding(),
                "p2p jobs still outstanding after the drain"
            );
        }
    }

    fn stats(&self) -> TierStats {
        let mut s = crate::handle::tier_stats(
            &self.info.name,
            &self.handle(),
            self.sessions.len(),
            self.retiring.len(),
        );
        // What `has_pending_work` waits for, part by part: a run that cannot drain says which.
        let loads = self.loads_in_flight();
        let transfers: usize = self
            .sessions
            .values()
            .chain(&self.retiring)
            .map(|s| s.server.transfers_in_flight())
            .sum();
        let busy = self.sessions.values().filter(|s| s.has_work()).count();
        for (k, v) in [
            ("pending_loads", loads),
            ("pending_transfers", transfers),
            ("pending_store_jobs", self.core.store_jobs.len()),
            ("pending_parked", self.core.parked.len()),
            ("pending_finish_ctxs", self.core.finish_ctxs.len()),
            ("sessions_with_work", busy),
        ] {
            s.extra.insert(k.to_owned(), v as f64);
        }
        s
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        if self.shut_down {
            return Ok(());
        }
        let peers: Vec<String> = self.sessions.keys().cloned().collect();
        for p in peers {
            self.kill(&p, crate::failure::SHUTTING_DOWN, true);
        }
        self.release_idle_supply();
        let drain = self.core.drain();
        let _ = self.wait_outstanding(drain);
        self.shut_down = true;
        self.core.transport.shutdown();
        // Joining the receivers proves every destination row is checked back in.
        self.core.receiver.shutdown();
        for j in std::mem::take(&mut self.core.joins) {
            let _ = j.join();
        }
        self.pump();
        let out = self.core.dest.wait_idle(Duration::ZERO);
        if out > 0 {
            return Err(P2pError::NotQuiescent(out).into());
        }
        Ok(())
    }
}

impl Drop for P2pTier {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "p2p tier shutdown on drop failed");
        }
    }
}
