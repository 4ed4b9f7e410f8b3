//! One session per remote peer: the handshake and send gating, message dispatch, and the two
//! roles (consumer and producer) over one logical control channel.

use std::time::{Duration, Instant};

use tiering_core::{OffloadKey, ParentManager};

use crate::client::ClientRole;
use crate::core::Core;
use crate::dataplane::dest::{AuthSlot, InboundAuth};
use crate::dataplane::frame::{ChunkStatus, Hello};
use crate::dataplane::sender::{Registration, SenderHandle, spawn_registration};
use crate::server::{Fetch, ServerRole};
use crate::stats::P2pCounters;
use crate::supply::Supply;
use crate::wire::{Bin, Connect, Message, WIRE_VERSION, decode_keys};

/// How often an unanswered `connect` is repeated.
const CONNECT_RETRANSMIT: Duration = Duration::from_millis(250);

/// This node's `connect` for one session: a fresh nonce, tagged under the shared secret.
fn our_connect(core: &Core) -> Connect {
    let nonce = crate::auth::nonce().unwrap_or_else(|e| {
        // Nonces need only be unique for key separation; the system source failing is
        // exceptional, and a hash of the incarnation and a counter is still unique.
        static FALLBACK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        tracing::error!(error = %e, "cannot read /dev/urandom; deriving the session nonce");
        let n = FALLBACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut h = blake3::Hasher::new();
        h.update(&core.instance.to_le_bytes());
        h.update(&n.to_le_bytes());
        h.update(core.local_id.as_bytes());
        *h.finalize().as_bytes()
    });
    let mut c = Connect {
        wire_version: WIRE_VERSION,
        peer_id: core.local_id.clone(),
        instance: core.instance,
        nonce: Bin(nonce.to_vec()),
        data_addr: core.data_addr.clone(),
        chunk_bytes: core.chunk_bytes,
        num_chunks: core.num_chunks,
        layout_fingerprint: core.opts.layout_fingerprint.clone(),
        hash_seed: core.opts.hash_seed.clone(),
        auth: Bin::default(),
    };
    c.auth = Bin(core.secret.connect_tag(&c).as_bytes().to_vec());
    c
}

/// Why a session must die.
#[derive(Debug)]
pub(crate) enum SessionError {
    /// The peer broke the protocol.
    Protocol(String),
    /// The peer is incompatible (version, chunk size, fingerprint, hash seed).
    Handshake(String),
    /// The peer said goodbye.
    Closed(String),
}

/// One remote peer.
pub(crate) struct Session {
    pub(crate) peer: String,
    pub(crate) generation: u64,
    /// This node's `connect` of this session (its nonce keys the session).
    ours: Connect,
    /// The peer's verified incarnation and data key, once its `connect` verified; fetches of
    /// this session accept bytes only under it.
    pub(crate) inbound: AuthSlot,
    created: Instant,
    connect_sent: Instant,
    pub(crate) peer_connect: Option<Connect>,
    registered: bool,
    acked: bool,
    outbox: Vec<Message>,
    sender: Option<SenderHandle>,
    pub(crate) dead: Option<String>,
    pub(crate) client: ClientRole,
    pub(crate) server: ServerRole,
}

impl Session {
    /// Opens the outbound connection and sends this node's `connect` at once.
    pub(crate) fn open(core: &mut Core, peer: &str) -> Self {
        let generation = core.generation();
        if let Err(reason) = core.transport.connect(peer, generation) {
            core.dead_links.push((peer.to_owned(), generation, reason));
        }
        let ours = our_connect(core);
        core.send(peer, &Message::Connect(ours.clone()));
        tracing::debug!(%peer, generation, "session opened");
        Self {
            peer: peer.to_owned(),
            generation,
            ours,
            inbound: AuthSlot::default(),
            created: Instant::now(),
            connect_sent: Instant::now(),
            peer_connect: None,
            registered: false,
            acked: false,
            outbox: Vec::new(),
            sender: None,
            dead: None,
            client: ClientRole::default(),
            server: ServerRole::default(),
        }
    }

    /// Both directions are registered and acknowledged.
    pub(crate) fn ready(&self) -> bool {
        self.acked && self.registered && self.peer_connect.is_some()
    }

    /// Sends now once the peer acknowledged us; queues until then.
    pub(crate) fn send(&mut self, core: &mut Core, msg: Message) {
        if self.acked {
            core.send(&self.peer, &msg);
        } else {
            self.outbox.push(msg);
        }
    }

    pub(crate) fn send_all(&mut self, core: &mut Core, msgs: Vec<Message>) {
        for m in msgs {
            self.send(core, m);
        }
    }

    pub(crate) fn dispatch(&mut self, core: &mut Core, msg: Message) -> Result<(), SessionError> {
        if !matches!(msg, Message::Connect(_) | Message::Disconnect { .. }) && self.peer_connect.is_none() {
            return Err(SessionError::Protocol(format!("{} before connect", msg.kind())));
        }
        match msg {
            Message::Connect(c) => self.on_connect(core, c),
            Message::ConnectAck { .. } => {
                if !self.acked {
                    self.acked = true;
                    for m in std::mem::take(&mut self.outbox) {
                        core.send(&self.peer, &m);
                    }
                    self.count_ready(core);
                }
                Ok(())
            }
            Message::Disconnect { reason } => Err(SessionError::Closed(reason)),
            Message::Lookup {
                kv_request_id,
                keys,
                round_seq,
            } => {
                let keys = decode_keys(&keys).map_err(|e| SessionError::Protocol(e.0))?;
                self.server.on_lookup(kv_request_id, round_seq, keys);
                Ok(())
            }
            Message::LookupResp {
                kv_request_id,
                keys,
                hits,
                ..
            } => {
                let keys = decode_keys(&keys).map_err(|e| SessionError::Protocol(e.0))?;
                self.client.on_lookup_resp(&kv_request_id, &keys, &hits);
                Ok(())
            }
            Message::Fetch {
                kv_request_id,
                round_seq,
                keys,
                block_indexes,
                await_stores,
            } => {
                let keys = decode_keys(&keys).map_err(|e| SessionError::Protocol(e.0))?;
                let fetch = Fetch {
                    kv: &kv_request_id,
                    round: round_seq,
                    keys: &keys,
                    rows: &block_indexes,
                    await_stores,
                };
                let out = self
                    .server
                    .on_fetch(core, self.sender.as_ref(), &fetch)
                    .map_err(|e| SessionError::Protocol(e.0))?;
                self.send_all(core, out);
                Ok(())
            }
            Message::TransferDone {
                kv_request_id,
                round_seq,
                key_ok,
                ..
            } => {
                self.client.on_transfer_done(&kv_request_id, round_seq, key_ok);
                Ok(())
            }
            Message::AbortFetch {
                kv_request_id,
                round_seq,
            } => {
                let out = self.server.on_abort_fetch(core, &kv_request_id, round_seq);
                self.send_all(core, out);
                Ok(())
            }
            Message::AbortAck {
                kv_request_id,
                round_seq,
            } => {
                self.client.on_abort_ack(&kv_request_id, round_seq);
                Ok(())
            }
        }
    }

    fn on_connect(&mut self, core: &mut Core, c: Connect) -> Result<(), SessionError> {
        if let Some(old) = &self.peer_connect {
            // An identical retransmission is ignored (it re-registers nothing); a different
            // `connect` from the same incarnation would re-register the peer and corrupt the
            // data-plane state.
            if *old == c {
                return Ok(());
            }
            return Err(SessionError::Protocol(
                "a second, different connect from the same peer".into(),
            ));
        }
        if c.peer_id != self.peer {
            return Err(SessionError::Protocol(format!(
                "connect names {} but came from {}",
                c.peer_id, self.peer
            )));
        }
        if !core.secret.verify_connect(&c) {
            return Err(SessionError::Handshake(format!(
                "peer {} failed authentication: its connect does not verify under this node's \
                 shared secret (a different secret_env value, or insecure on one side only)",
                self.peer
            )));
        }
        let mismatch = if c.wire_version != WIRE_VERSION {
            Some(format!(
                "wire version {} (this node speaks {WIRE_VERSION})",
                c.wire_version
            ))
        } else if c.chunk_bytes != core.chunk_bytes {
            Some(format!(
                "chunk size {} bytes (this node uses {})",
                c.chunk_bytes, core.chunk_bytes
            ))
        } else if c.layout_fingerprint != core.opts.layout_fingerprint {
            Some(format!(
                "layout fingerprint {:?} (this node has {:?})",
                c.layout_fingerprint, core.opts.layout_fingerprint
            ))
        } else if c.hash_seed != core.opts.hash_seed {
            Some(format!(
                "hash seed {:?} (this node has {:?}); every lookup would miss",
                c.hash_seed, core.opts.hash_seed
            ))
        } else {
            None
        };
        if let Some(m) = mismatch {
            return Err(SessionError::Handshake(format!(
                "peer {} is incompatible: {m}",
                self.peer
            )));
        }
        let reg = Registration {
            peer: self.peer.clone(),
            generation: self.generation,
            data_addr: c.data_addr.clone(),
            hello: Hello {
                peer_id: core.local_id.clone(),
                instance: core.instance,
            },
            key: core.secret.data_key(&self.ours, &c),
            connect_timeout: core.opts.deadlines.handshake(),
            io_timeout: core.opts.deadlines.data_io(),
            events: core.data_tx.clone(),
            notifier: core.notifier.clone(),
            counters: core.data_counters.clone(),
            faults: core.faults.clone(),
        };
        let _ = self.inbound.set(InboundAuth {
            instance: c.instance,
            key: core.secret.data_key(&c, &self.ours),
        });
        self.peer_connect = Some(c);
        match spawn_registration(reg) {
            Ok(h) => core.joins.push(h),
            Err(e) => return Err(SessionError::Protocol(format!("cannot start registration: {e}"))),
        }
        Ok(())
    }

    /// The data plane toward the peer is up: acknowledge its `connect`.
    pub(crate) fn on_registered(&mut self, core: &mut Core, handle: SenderHandle) {
        self.sender = Some(handle);
        self.registered = true;
        core.send(
            &self.peer,
            &Message::ConnectAck {
                peer_id: core.local_id.clone(),
            },
        );
        self.count_ready(core);
    }

    fn count_ready(&self, core: &Core) {
        if self.ready() {
            P2pCounters::bump(&core.counters.sessions_ready);
            tracing::info!(peer = %self.peer, "p2p session ready");
        }
    }

    /// Serves the peer's lookups.
    pub(crate) fn serve(&mut self, core: &mut Core, parent: &mut dyn ParentManager) {
        if self.dead.is_some() || !self.server.wants_serving() {
            return;
        }
        let out = self.server.serve(core, &self.peer, parent);
        self.send_all(core, out);
    }

    /// Flushes the step's probes.
    pub(crate) fn flush_lookups(&mut self, core: &mut Core) {
        if self.dead.is_some() {
            return;
        }
        let out = self.client.flush();
        self.send_all(core, out);
    }

    pub(crate) fn on_transfer_finished(
        &mut self,
        core: &mut Core,
        transfer_id: u64,
        statuses: &[ChunkStatus],
    ) {
        let answer = self.dead.is_none();
        let out = self
            .server
            .on_transfer_finished(core, transfer_id, statuses, answer);
        if answer {
            self.send_all(core, out);
        }
    }

    /// Timers and completions. Returns a reason when the session must die.
    pub(crate) fn tick(&mut self, core: &mut Core, now: Instant) -> Option<String> {
        if self.dead.is_none() && !self.ready() {
            if now.duration_since(self.created) >= core.opts.deadlines.handshake() {
                return Some("handshake deadline passed".into());
            }
            // A `connect` can be lost when the peer's socket was being replaced (a restart on
            // the same address); repeat it until the peer answers.
            if (self.peer_connect.is_none() || !self.acked)
                && now.duration_since(self.connect_sent) >= CONNECT_RETRANSMIT
            {
                self.connect_sent = now;
                core.send(&self.peer, &Message::Connect(self.ours.clone()));
            }
        }
        let (out, cut) = self.client.collect(core, &self.peer, now);
        if cut {
            core.receiver.disconnect_peer(&self.peer);
        }
        if self.dead.is_none() {
            self.send_all(core, out);
        }
        let answers = self.server.collect(core, now);
        if self.dead.is_none() {
            self.send_all(core, answers);
        }
        None
    }

    /// Whether a fetch of the peer waits for chunks of `kv` not stored yet.
    pub(crate) fn waits_for(&self, kv: &str) -> bool {
        self.dead.is_none() && self.server.waits_for(kv)
    }

    /// Chunks of `kv` just stored: a fetch of the peer waiting for them gets them now. Returns
    /// the chunks it did not name.
    pub(crate) fn offer(
        &mut self,
        core: &mut Core,
        kv: &str,
        items: Vec<(OffloadKey, Supply)>,
    ) -> Vec<(OffloadKey, Supply)> {
        if self.dead.is_some() {
            return items;
        }
        let (answers, rest) = self.server.offer(core, self.sender.as_ref(), kv, items);
        self.send_all(core, answers);
        rest
    }

    /// Drain: release every pin not in flight and fail every waiting key, answering the rounds
    /// that are complete now.
    pub(crate) fn release_idle(&mut self, core: &mut Core) {
        let answers = self.server.release_idle(core);
        if self.dead.is_none() {
            self.send_all(core, answers);
        }
    }

    /// Tears the session down: no more messages either way, every pin not in flight released,
    /// every load closed (reported once its rows are quiescent). Returns the consumer requests
    /// that must now miss. `orderly`: a shutdown on either side, logged without a warning.
    pub(crate) fn kill(
        &mut self,
        core: &mut Core,
        reason: &str,
        notify_peer: bool,
        orderly: bool,
    ) -> Vec<String> {
        if self.dead.is_some() {
            return Vec::new();
        }
        if orderly {
            tracing::debug!(peer = %self.peer, %reason, "p2p session closed");
        } else {
            tracing::warn!(peer = %self.peer, %reason, "p2p session closed");
        }
        // Counted before the goodbye leaves: a peer that reads it finds the loss counted.
        P2pCounters::bump(&core.counters.sessions_lost);
        if notify_peer {
            core.send(
                &self.peer,
                &Message::Disconnect {
                    reason: reason.to_owned(),
                },
            );
        }
        core.transport.close(&self.peer, self.generation, notify_peer);
        // Cutting both data directions is what proves quiescence: receivers check their rows
        // back in, senders fail what they hold and release the source rows.
        core.receiver.disconnect_peer(&self.peer);
        if let Some(s) = self.sender.take()
            && let Some(j) = s.close()
        {
            core.joins.push(j);
        }
        self.outbox.clear();
        self.dead = Some(reason.to_owned());
        let failed = self.client.on_session_lost(core, &self.peer);
        // Nothing is answered any more: the rounds' answers are dropped.
        let _ = self.server.release_idle(core);
        failed
    }

    /// A dead session may be dropped once nothing of it touches arena rows any more.
    pub(crate) fn quiescent(&self) -> bool {
        self.client.loads_in_flight() == 0 && self.server.transfers_in_flight() == 0
    }

    /// Whether the session needs the engine (or the control thread) to keep going.
    pub(crate) fn has_work(&self) -> bool {
        !self.ready() || self.client.has_work() || self.server.has_work()
    }
}
