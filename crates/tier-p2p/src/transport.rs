//! The ZeroMQ control transport: one ROUTER bound per node receives every inbound message, one
//! DEALER per remote peer (identity = this node's `host:port`) carries everything outbound.
//!
//! zmq sockets are not `Sync`, so every socket lives on one I/O thread owned by the tier. The
//! tier talks to it with channels and a wake-up socket pair; the thread blocks in `zmq::poll`
//! on the ROUTER, the wake-up fd and every DEALER's disconnect monitor, so it reacts at once
//! and never spins. Sends are non-blocking with a bounded high-water mark: a full or dead peer
//! is reported dead, never waited for.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::P2pError;
use crate::notify::Notifier;
use crate::options::{Heartbeat, Inbound, split_host_port};
use crate::wire::Message;

static MONITOR_SEQ: AtomicU64 = AtomicU64::new(0);

/// Linger of a DEALER closed with a session (not at shutdown), so its last `disconnect` can
/// still reach the peer.
const CLOSE_LINGER_MS: i32 = 200;

/// Longest wait for a retired DEALER's disconnect before it is closed anyway.
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// What the tier asks of the I/O thread.
pub(crate) enum IoCommand {
    /// Open (or replace) the DEALER toward `peer`, tagged with the session generation.
    Connect { peer: String, generation: u64 },
    /// Send one payload to `peer` (dropped, and the peer reported dead, if it has no DEALER).
    Send { peer: String, payload: Vec<u8> },
    /// Close the DEALER toward `peer` if it still belongs to `generation`; `linger` gives a
    /// just-queued `disconnect` a moment to leave.
    Close {
        peer: String,
        generation: u64,
        linger: bool,
    },
}

/// Decoded messages of each peer not handled yet (the per-peer budget).
#[derive(Default)]
pub(crate) struct InboundBudget {
    queued: parking_lot::Mutex<HashMap<String, u32>>,
}

impl InboundBudget {
    /// Takes one unit of `peer`'s budget; `false` when it has `limit` messages waiting already.
    fn try_take(&self, peer: &str, limit: u32) -> bool {
        let mut q = self.queued.lock();
        match q.get_mut(peer) {
            Some(n) if *n >= limit => false,
            Some(n) => {
                *n += 1;
                true
            }
            None => {
                q.insert(peer.to_owned(), 1);
                true
            }
        }
    }

    /// Gives a unit back once the message is handled.
    fn release(&self, peer: &str) {
        let mut q = self.queued.lock();
        if let Some(n) = q.get_mut(peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                q.remove(peer);
            }
        }
    }
}

/// What the I/O thread reports.
#[derive(Debug)]
pub(crate) enum IoEvent {
    /// A decoded message from `peer` (the sender's identity).
    Message { peer: String, msg: Message },
    /// The connection toward `peer` of `generation` is gone.
    Dead {
        peer: String,
        generation: u64,
        reason: String,
    },
    /// `peer` exceeded its inbound budget: its messages are being dropped.
    Flooded { peer: String },
}

/// Counters the I/O thread maintains.
#[derive(Default, Debug)]
pub(crate) struct TransportCounters {
    pub(crate) malformed_frames: AtomicU64,
    pub(crate) messages_in: AtomicU64,
    pub(crate) messages_out: AtomicU64,
    pub(crate) send_failures: AtomicU64,
    /// Messages dropped because their peer was over its budget or banned.
    pub(crate) dropped_flood: AtomicU64,
}

/// The tier's handle on its control I/O thread.
pub(crate) struct ControlTransport {
    cmd_tx: mpsc::Sender<IoCommand>,
    wake_tx: UnixStream,
    /// Messages (bounded: `inbound.queue_capacity`).
    messages: mpsc::Receiver<(String, Message)>,
    /// Connection events (as many as connections).
    events: mpsc::Receiver<IoEvent>,
    budget: Arc<InboundBudget>,
    pub(crate) counters: Arc<TransportCounters>,
    /// The node's identity: `advertise:bound_port`.
    pub(crate) local_id: String,
    thread: Option<JoinHandle<()>>,
}

impl ControlTransport {
    /// Binds the ROUTER and starts the I/O thread.
    pub(crate) fn start(
        bind: &str,
        advertise: Option<&str>,
        heartbeat: &Heartbeat,
        send_hwm: i32,
        inbound: &Inbound,
        notifier: Notifier,
    ) -> Result<Self, P2pError> {
        let (host, port) =
            split_host_port(bind).ok_or_else(|| P2pError::Config(format!("bad bind address {bind:?}")))?;
        let endpoint = if port == 0 {
            format!("tcp://{host}:*")
        } else {
            format!("tcp://{host}:{port}")
        };
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_tx.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (ev_tx, events) = mpsc::channel();
        let (msg_tx, messages) = mpsc::sync_channel(inbound.queue_capacity.max(1));
        let budget = Arc::new(InboundBudget::default());
        let thread_budget = Arc::clone(&budget);
        let limits = inbound.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let counters = Arc::new(TransportCounters::default());
        let hb = heartbeat.clone();
        let id_host = advertise.unwrap_or(host).to_owned();
        let thread_counters = Arc::clone(&counters);
        let thread = std::thread::Builder::new()
            .name("kvtier-p2p-zmq".into())
            .spawn(move || {
                let io = match IoThread::bind(&endpoint, &id_host, &hb, send_hwm, limits, thread_budget) {
                    Ok((io, bound)) => {
                        let _ = ready_tx.send(Ok(bound));
                        io
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                io.run(&cmd_rx, &wake_rx, (&ev_tx, &msg_tx), &notifier, &thread_counters);
            })?;
        let bound_port = match ready_rx.recv() {
            Ok(Ok(port)) => port,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(P2pError::Zmq(format!(
                    "cannot bind the control socket on {bind}: {e}"
                )));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(P2pError::Zmq("the control I/O thread died at start".into()));
            }
        };
        let local_id = format!("{}:{bound_port}", advertise.unwrap_or(host));
        Ok(Self {
            cmd_tx,
            wake_tx,
            messages,
            events,
            budget,
            counters,
            local_id,
            thread: Some(thread),
        })
    }

    /// Queues a command and wakes the I/O thread.
    pub(crate) fn command(&mut self, cmd: IoCommand) {
        if self.cmd_tx.send(cmd).is_err() {
            return;
        }
        // A full wake-up buffer means the thread is already due to wake; nothing is lost.
        let _ = self.wake_tx.write(&[1]);
    }

    /// The next event, if any (non-blocking): messages first, then connection events.
    pub(crate) fn try_event(&mut self) -> Option<IoEvent> {
        if let Ok((peer, msg)) = self.messages.try_recv() {
            self.budget.release(&peer);
            return Some(IoEvent::Message { peer, msg });
        }
        self.events.try_recv().ok()
    }

    /// Stops the I/O thread, closing every socket with LINGER 0.
    pub(crate) fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        // Replacing the sender disconnects the channel: the thread sees it and exits.
        let (dead_tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.cmd_tx, dead_tx));
        let _ = self.wake_tx.write(&[0]);
        if thread.join().is_err() {
            tracing::error!("the p2p control I/O thread panicked");
        }
    }
}

impl Drop for ControlTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Dealer {
    socket: zmq::Socket,
    monitor: zmq::Socket,
    generation: u64,
}

struct IoThread {
    ctx: zmq::Context,
    router: zmq::Socket,
    dealers: HashMap<String, Dealer>,
    /// DEALERs being retired: closed only once their monitor saw the disconnect (or after a
    /// grace period). Closing a DEALER while libzmq is still tearing its connection down can
    /// stall the context's I/O thread, and with it every other connection of the node.
    closing: Vec<(Dealer, Instant)>,
    identity: Vec<u8>,
    heartbeat: Heartbeat,
    send_hwm: i32,
    limits: Inbound,
    budget: Arc<InboundBudget>,
    /// Flooding peers and when they may be heard again.
    banned: HashMap<String, Instant>,
    /// A decoded message waiting for room in the full queue; the ROUTER is not read meanwhile.
    stash: Option<(String, Message)>,
}

fn set_heartbeat(s: &zmq::Socket, hb: &Heartbeat) -> zmq::Result<()> {
    s.set_heartbeat_ivl(i32::try_from(hb.interval_ms).unwrap_or(i32::MAX))?;
    s.set_heartbeat_timeout(i32::try_from(hb.timeout_ms).unwrap_or(i32::MAX))?;
    s.set_heartbeat_ttl(i32::try_from(hb.ttl_ms).unwrap_or(i32::MAX))?;
    s.set_linger(0)
}

impl IoThread {
    fn bind(
        endpoint: &str,
        id_host: &str,
        hb: &Heartbeat,
        send_hwm: i32,
        limits: Inbound,
        budget: Arc<InboundBudget>,
    ) -> zmq::Result<(Self, u16)> {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER)?;
        set_heartbeat(&router, hb)?;
        // Refused by libzmq's decoder from the size prefix, before any allocation.
        router.set_maxmsgsize(limits.max_message_bytes)?;
        // A restarted peer reuses its identity; hand the route over to the new connection.
        router.set_router_handover(true)?;
        router.bind(endpoint)?;
        let last = router.get_last_endpoint()?.map_err(|_| zmq::Error::EINVAL)?;
        let port = last
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or(zmq::Error::EINVAL)?;
        Ok((
            Self {
                ctx,
                router,
                dealers: HashMap::new(),
                closing: Vec::new(),
                identity: format!("{id_host}:{port}").into_bytes(),
                heartbeat: hb.clone(),
                send_hwm,
                limits,
                budget,
                banned: HashMap::new(),
                stash: None,
            },
            port,
        ))
    }

    fn run(
        mut self,
        cmds: &mpsc::Receiver<IoCommand>,
        wake: &UnixStream,
        (events, messages): (&mpsc::Sender<IoEvent>, &mpsc::SyncSender<(String, Message)>),
        notifier: &Notifier,
        counters: &TransportCounters,
    ) {
        loop {
            let peers: Vec<String> = self.dealers.keys().cloned().collect();
            let mut disconnected = Vec::new();
            {
                let mut items = Vec::with_capacity(2 + peers.len());
                items.push(self.router.as_poll_item(zmq::POLLIN));
                items.push(zmq::PollItem::from_fd(wake.as_raw_fd(), zmq::POLLIN));
                for p in &peers {
                    if let Some(d) = self.dealers.get(p) {
                        items.push(d.monitor.as_poll_item(zmq::POLLIN));
                    }
                }
                for (d, _) in &self.closing {
                    items.push(d.monitor.as_poll_item(zmq::POLLIN));
                }
                let timeout = self
                    .closing
                    .iter()
                    .map(|(_, t)| t.saturating_duration_since(Instant::now()).as_millis() as i64 + 1)
                    .min()
                    .unwrap_or(1000)
                    .min(if self.stash.is_some() { 1 } else { 1000 });
                if let Err(e) = zmq::poll(&mut items, timeout) {
                    if e != zmq::Error::EINTR {
                        tracing::error!(error = %e, "zmq poll failed; the control I/O thread stops");
                        return;
                    }
                    continue;
                }
                for (i, p) in peers.iter().enumerate() {
                    if items.get(i + 2).is_some_and(zmq::PollItem::is_readable) {
                        disconnected.push(p.clone());
                    }
                }
            }
            self.reap_closing();
            let mut notify = self.drain_router(events, messages, counters);
            for p in disconnected {
                notify |= self.drain_monitor(&p, events);
            }
            let mut buf = [0u8; 64];
            loop {
                match (&*wake).read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            loop {
                match cmds.try_recv() {
                    Ok(cmd) => notify |= self.handle(cmd, events, counters),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.close_all();
                        return;
                    }
                }
            }
            if notify {
                notifier.wake();
            }
        }
    }

    /// Queues one decoded message within the peer's budget. `false` when the queue is full
    /// (the message is kept in the stash).
    fn enqueue(
        &mut self,
        peer: String,
        msg: Message,
        events: &mpsc::Sender<IoEvent>,
        messages: &mpsc::SyncSender<(String, Message)>,
        counters: &TransportCounters,
    ) -> bool {
        if !self.banned.is_empty() {
            let now = Instant::now();
            self.banned.retain(|_, until| *until > now);
            if self.banned.contains_key(&peer) {
                counters.dropped_flood.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        if !self.budget.try_take(&peer, self.limits.per_peer_budget) {
            counters.dropped_flood.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, budget = self.limits.per_peer_budget, "a peer floods the control socket; ignoring it");
            self.banned.insert(
                peer.clone(),
                Instant::now() + Duration::from_millis(self.limits.flood_ban_ms),
            );
            let _ = events.send(IoEvent::Flooded { peer });
            return true;
        }
        // Sent, or the tier is gone (nothing to deliver to): either way, go on reading.
        if let Err(mpsc::TrySendError::Full((peer, msg))) = messages.try_send((peer, msg)) {
            self.budget.release(&peer);
            self.stash = Some((peer, msg));
            return false;
        }
        true
    }

    fn drain_router(
        &mut self,
        events: &mpsc::Sender<IoEvent>,
        messages: &mpsc::SyncSender<(String, Message)>,
        counters: &TransportCounters,
    ) -> bool {
        let mut any = false;
        if let Some((peer, msg)) = self.stash.take()
            && !self.enqueue(peer, msg, events, messages, counters)
        {
            return any;
        }
        loop {
            let frames = match self.router.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => return any,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "control receive failed");
                    return any;
                }
            };
            let [identity, payload] = frames.as_slice() else {
                counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    frames = frames.len(),
                    "dropped a control message with a bad frame count"
                );
                continue;
            };
            let Ok(peer) = std::str::from_utf8(identity) else {
                counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            match Message::decode(payload) {
                Ok(msg) => {
                    tracing::trace!(%peer, kind = msg.kind(), "received");
                    counters.messages_in.fetch_add(1, Ordering::Relaxed);
                    any = true;
                    if !self.enqueue(peer.to_owned(), msg, events, messages, counters) {
                        return any;
                    }
                }
                Err(e) => {
                    counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, error = %e, "dropped a malformed control frame");
                }
            }
        }
    }

    /// Reads a DEALER's monitor; a disconnect kills that peer's connection.
    fn drain_monitor(&mut self, peer: &str, events: &mpsc::Sender<IoEvent>) -> bool {
        let Some(d) = self.dealers.get(peer) else {
            return false;
        };
        let mut dead = false;
        while let Ok(frames) = d.monitor.recv_multipart(zmq::DONTWAIT) {
            if let Some(head) = frames.first()
                && head.len() >= 2
            {
                let event = u16::from_le_bytes([head[0], head[1]]);
                tracing::trace!(%peer, event = ?zmq::SocketEvent::from_raw(event), "control socket event");
                if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                    dead = true;
                }
            }
        }
        if dead && let Some(d) = self.dealers.remove(peer) {
            let generation = d.generation;
            drop(d);
            let _ = events.send(IoEvent::Dead {
                peer: peer.to_owned(),
                generation,
                reason: "control connection lost".into(),
            });
            return true;
        }
        false
    }

    fn open_dealer(&mut self, peer: &str, generation: u64) -> zmq::Result<Dealer> {
        let socket = self.ctx.socket(zmq::DEALER)?;
        socket.set_identity(&self.identity)?;
        set_heartbeat(&socket, &self.heartbeat)?;
        socket.set_sndhwm(self.send_hwm)?;
        let endpoint = format!(
            "inproc://kvtier-p2p-monitor-{}",
            MONITOR_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        socket.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED as i32)?;
        let monitor = self.ctx.socket(zmq::PAIR)?;
        monitor.set_linger(0)?;
        monitor.connect(&endpoint)?;
        socket.connect(&format!("tcp://{peer}"))?;
        tracing::trace!(%peer, generation, "control connection opened");
        Ok(Dealer {
            socket,
            monitor,
            generation,
        })
    }

    fn handle(
        &mut self,
        cmd: IoCommand,
        events: &mpsc::Sender<IoEvent>,
        counters: &TransportCounters,
    ) -> bool {
        match cmd {
            IoCommand::Connect { peer, generation } => {
                tracing::trace!(%peer, generation, "opening a control connection");
                if let Some(old) = self.dealers.remove(&peer) {
                    self.retire(old);
                }
                match self.open_dealer(&peer, generation) {
                    Ok(d) => {
                        self.dealers.insert(peer, d);
                        false
                    }
                    Err(e) => {
                        let _ = events.send(IoEvent::Dead {
                            peer,
                            generation,
                            reason: format!("cannot open a control connection: {e}"),
                        });
                        true
                    }
                }
            }
            IoCommand::Send { peer, payload } => {
                let Some(d) = self.dealers.get(&peer) else {
                    return false;
                };
                match d.socket.send(payload, zmq::DONTWAIT) {
                    Ok(()) => {
                        counters.messages_out.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                    Err(e) => {
                        counters.send_failures.fetch_add(1, Ordering::Relaxed);
                        let generation = d.generation;
                        if let Some(d) = self.dealers.remove(&peer) {
                            self.retire(d);
                        }
                        let reason = if e == zmq::Error::EAGAIN {
                            "send queue full (peer unreachable or not reading)".to_owned()
                        } else {
                            format!("send failed: {e}")
                        };
                        let _ = events.send(IoEvent::Dead {
                            peer,
                            generation,
                            reason,
                        });
                        true
                    }
                }
            }
            IoCommand::Close {
                peer,
                generation,
                linger,
            } => {
                if self
                    .dealers
                    .get(&peer)
                    .is_some_and(|d| d.generation == generation)
                    && let Some(d) = self.dealers.remove(&peer)
                {
                    if linger {
                        // Our goodbye (`disconnect`) may still be queued: give it a moment to
                        // leave. Never when the peer left first: a lingering socket would
                        // reconnect to a restarted peer under our identity.
                        let _ = d.socket.set_linger(CLOSE_LINGER_MS);
                    }
                    self.retire(d);
                }
                false
            }
        }
    }

    /// Starts closing a DEALER: it is closed once libzmq reports its disconnect, or after a
    /// grace period.
    fn retire(&mut self, d: Dealer) {
        self.closing.push((d, Instant::now() + CLOSE_GRACE));
    }

    /// Closes retired DEALERs whose disconnect was seen or whose grace period is over.
    fn reap_closing(&mut self) {
        let now = Instant::now();
        self.closing.retain(|(d, deadline)| {
            let mut gone = now >= *deadline;
            while let Ok(frames) = d.monitor.recv_multipart(zmq::DONTWAIT) {
                if let Some(head) = frames.first()
                    && head.len() >= 2
                    && u16::from_le_bytes([head[0], head[1]]) == zmq::SocketEvent::DISCONNECTED.to_raw()
                {
                    gone = true;
                }
            }
            !gone
        });
    }

    fn close_all(&mut self) {
        for d in self.dealers.values() {
            let _ = d.socket.set_linger(0);
        }
        self.dealers.clear();
        self.closing.clear();
    }
}
