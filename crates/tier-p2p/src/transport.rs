//! The ZeroMQ control transport: one ROUTER bound per node receives every inbound message, one
//! DEALER per remote peer (identity = this node's `host:port`) carries everything outbound.
//!
//! zmq sockets are not `Sync`, so each socket is used by one thread at a time. The DEALERs
//! belong to the tier (used under the manager lock): a message leaves from the thread that
//! produced it, with no hop to another thread, encoded into a reused buffer. The ROUTER is read
//! by the thread that handles its messages, too: the manager's control thread waits on the
//! ROUTER's descriptor through its waker and reads the socket itself in its sweep, so an
//! inbound message costs no relay through another thread. The tier's I/O thread owns every
//! DEALER's disconnect monitor and is the ROUTER's backstop reader: when the ROUTER stays
//! readable without the tier draining it (the manager lock is held by a long step), it decodes
//! what waits into a queue, bounded overall and per peer, so a flood is still noticed and cut
//! off. While the control thread waits on the ROUTER (one of its waits saw it readable within
//! `WAITER_FRESH`), the I/O thread does not watch it: each message would wake both threads,
//! and on a busy machine the second wake-up delays the one that answers. It looks every
//! `BACKSTOP_CHECK` instead, and reads only when the ROUTER was readable at two looks in a row
//! with no pump of the tier in between. A step-driven manager's waker has no waiting thread:
//! there the I/O thread watches the ROUTER and reads what stays `BACKSTOP_GRACE` unread. A
//! mutex orders the two readers; messages are handled in arrival order. Sends are
//! non-blocking with a bounded high-water mark: a full or dead peer is
//! reported dead, never waited for.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tiering_core::fetch_trace::{self, Point};
use tiering_core::{ControlWaker, FdWatch};

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

/// How long the ROUTER may stay readable, undrained by the tier, before the I/O thread reads
/// it into the queue. Long enough for an idle control thread to wake and drain it first (its
/// wake-up takes a fraction of this on a loaded machine), short enough that a step-driven
/// engine or a flood is noticed promptly.
const BACKSTOP_GRACE: Duration = Duration::from_millis(1);

/// How often the I/O thread looks at the ROUTER while the control thread watches it (see the
/// module docs): a stalled control thread's messages are read within two of these.
const BACKSTOP_CHECK: Duration = Duration::from_millis(20);

/// How long a wait that saw the ROUTER readable counts as proof that a thread waits on the
/// watch (see [`DirectReads`]). A step-driven manager sets a waker that no thread waits on.
const WAITER_FRESH: Duration = Duration::from_millis(100);

/// What the tier tells the I/O thread about its own reads of the ROUTER.
struct DirectReads {
    /// Origin of `waiter_seen_us`.
    epoch: Instant,
    /// When (µs after `epoch`, plus one; 0: never) a pump last found the watch disarmed: a
    /// wait of the control thread saw the ROUTER readable. Within `WAITER_FRESH` of it, a
    /// thread is taken to wait on the watch.
    waiter_seen_us: AtomicU64,
    /// Pumps of the tier (drains of the ROUTER) so far.
    pumps: AtomicU64,
    /// The trace id of the waker the tier was given (0: none), under which the I/O thread
    /// records its wake-ups in the fetch trace.
    waker_trace_id: AtomicU64,
}

impl DirectReads {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            waiter_seen_us: AtomicU64::new(0),
            pumps: AtomicU64::new(0),
            waker_trace_id: AtomicU64::new(0),
        }
    }

    fn micros(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn saw_waiter(&self, now: Instant) {
        self.waiter_seen_us.store(self.micros(now), Ordering::Release);
    }

    fn forget_waiter(&self) {
        self.waiter_seen_us.store(0, Ordering::Release);
    }

    /// Whether a thread waits on the watch (it saw the ROUTER readable lately).
    fn waiter_live(&self, now: Instant) -> bool {
        let seen = self.waiter_seen_us.load(Ordering::Acquire);
        seen != 0 && self.micros(now).saturating_sub(seen) < WAITER_FRESH.as_micros() as u64
    }
}

/// What the tier asks of the I/O thread. The tier owns the DEALERs and sends on them itself
/// (replies leave from the thread that computed them, without a hop); the I/O thread owns the
/// ROUTER and every DEALER's disconnect monitor.
pub(crate) enum IoCommand {
    /// Watch the disconnect monitor of the DEALER toward `peer` of `generation`.
    Watch {
        peer: String,
        generation: u64,
        monitor: zmq::Socket,
    },
    /// Close a DEALER the tier is done with: once its monitor saw the disconnect, or after a
    /// grace period.
    Retire {
        peer: String,
        generation: u64,
        socket: zmq::Socket,
    },
}

/// A DEALER the tier sends on.
struct OutDealer {
    socket: zmq::Socket,
    generation: u64,
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
    /// Messages the I/O thread read and queued because the tier had not drained the ROUTER
    /// within the backstop grace (the rest were read by the thread that handled them).
    pub(crate) relayed: AtomicU64,
}

/// The tier's handle on its control sockets and I/O thread.
pub(crate) struct ControlTransport {
    ctx: zmq::Context,
    dealers: HashMap<String, OutDealer>,
    identity: Vec<u8>,
    heartbeat: Heartbeat,
    send_hwm: i32,
    /// Reused for every encoding (no allocation per message once warm).
    encode_buf: Vec<u8>,
    cmd_tx: mpsc::Sender<IoCommand>,
    wake_tx: UnixStream,
    /// Messages (bounded: `inbound.queue_capacity`).
    messages: mpsc::Receiver<(String, Message)>,
    /// Connection events (as many as connections).
    events: mpsc::Receiver<IoEvent>,
    budget: Arc<InboundBudget>,
    /// The ROUTER, shared with the I/O thread's backstop reads.
    router: Arc<parking_lot::Mutex<RouterReader>>,
    /// The ROUTER's descriptor as the manager's waker watches it (once a waker is set).
    watch: Option<FdWatch>,
    /// Shared with the I/O thread: whether a thread waits on `watch` lately, and the pumps.
    direct: Arc<DirectReads>,
    /// The last read of the ROUTER found it empty. While `watch` stays armed too (no wait
    /// saw the ROUTER readable since) and a thread waits on it, a read would find it empty
    /// again, and is skipped: an empty non-blocking read costs libzmq a system call, and one
    /// sweep pumps several times. A message that arrives meanwhile ends the next wait.
    router_drained: bool,
    /// Messages read straight from the ROUTER since the last `end_pump`.
    direct_reads: usize,
    /// Direct reads per pump (the queue's capacity): one pump never holds the manager lock
    /// for a flood's worth of messages.
    direct_limit: usize,
    notifier: Notifier,
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
        let counters = Arc::new(TransportCounters::default());
        let thread_counters = Arc::clone(&counters);
        let ctx = zmq::Context::new();
        let (reader, bound_port) = RouterReader::bind(&ctx, &endpoint, inbound)
            .map_err(|e| P2pError::Zmq(format!("cannot bind the control socket on {bind}: {e}")))?;
        let router_fd = reader
            .socket
            .get_fd()
            .map_err(|e| P2pError::Zmq(format!("the control socket has no descriptor: {e}")))?;
        let router = Arc::new(parking_lot::Mutex::new(reader));
        let direct = Arc::new(DirectReads::new());
        let io = IoThread {
            _ctx: ctx.clone(),
            router: Arc::clone(&router),
            router_fd,
            readable_since: None,
            direct: Arc::clone(&direct),
            next_check: Instant::now(),
            suspect: None,
            monitors: HashMap::new(),
            closing: Vec::new(),
            limits: inbound.clone(),
            budget: thread_budget,
        };
        let thread_notifier = notifier.clone();
        let thread = std::thread::Builder::new()
            .name("kvtier-p2p-zmq".into())
            .spawn(move || {
                io.run(
                    &cmd_rx,
                    &wake_rx,
                    (&ev_tx, &msg_tx),
                    &thread_notifier,
                    &thread_counters,
                );
            })?;
        let local_id = format!("{}:{bound_port}", advertise.unwrap_or(host));
        Ok(Self {
            ctx,
            dealers: HashMap::new(),
            identity: local_id.clone().into_bytes(),
            heartbeat: heartbeat.clone(),
            send_hwm,
            encode_buf: Vec::with_capacity(4096),
            cmd_tx,
            wake_tx,
            messages,
            events,
            budget,
            router,
            watch: None,
            direct,
            router_drained: false,
            direct_reads: 0,
            direct_limit: inbound.queue_capacity.max(1),
            notifier,
            counters,
            local_id,
            thread: Some(thread),
        })
    }

    /// Lets `waker` end the control thread's wait as soon as the ROUTER is readable: the
    /// thread then reads it itself (see the module docs).
    pub(crate) fn set_waker(&mut self, waker: &ControlWaker) {
        self.watch = None;
        self.direct.forget_waiter();
        self.router_drained = false;
        self.direct
            .waker_trace_id
            .store(waker.trace_id(), Ordering::Relaxed);
        let fd = self.router.lock().socket.get_fd();
        match fd
            .map_err(|e| e.to_string())
            .and_then(|fd| waker.watch_fd(fd).map_err(|e| e.to_string()))
        {
            Ok(w) => self.watch = Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the control socket; inbound messages are relayed by the I/O thread");
            }
        }
    }

    /// Opens (or replaces) the DEALER toward `peer` for session `generation`.
    pub(crate) fn connect(&mut self, peer: &str, generation: u64) -> Result<(), String> {
        tracing::trace!(%peer, generation, "opening a control connection");
        if let Some(old) = self.dealers.remove(peer) {
            self.retire(peer, old);
        }
        let socket = self.ctx.socket(zmq::DEALER).map_err(|e| e.to_string())?;
        let monitor = self.ctx.socket(zmq::PAIR).map_err(|e| e.to_string())?;
        let setup = || -> zmq::Result<()> {
            socket.set_identity(&self.identity)?;
            set_heartbeat(&socket, &self.heartbeat)?;
            socket.set_sndhwm(self.send_hwm)?;
            let endpoint = format!(
                "inproc://kvtier-p2p-monitor-{}",
                MONITOR_SEQ.fetch_add(1, Ordering::Relaxed)
            );
            socket.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED as i32)?;
            monitor.set_linger(0)?;
            monitor.connect(&endpoint)?;
            socket.connect(&format!("tcp://{peer}"))
        };
        setup().map_err(|e| format!("cannot open a control connection: {e}"))?;
        self.command(IoCommand::Watch {
            peer: peer.to_owned(),
            generation,
            monitor,
        });
        self.dealers
            .insert(peer.to_owned(), OutDealer { socket, generation });
        Ok(())
    }

    /// Sends one message to `peer` now, from this thread (non-blocking). On failure the
    /// DEALER is retired and its generation returned with the reason.
    pub(crate) fn send(&mut self, peer: &str, msg: &Message) -> Result<(), (u64, String)> {
        let Some(d) = self.dealers.get(peer) else {
            return Ok(());
        };
        self.encode_buf.clear();
        msg.encode_into(&mut self.encode_buf);
        // Recorded before the send: once the message is on the socket the peer may read and act
        // on it before this thread runs again, and its trace points must not precede this one.
        trace_fetch(msg, Point::FetchSent);
        match d.socket.send(&self.encode_buf[..], zmq::DONTWAIT) {
            Ok(()) => {
                self.counters.messages_out.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.counters.send_failures.fetch_add(1, Ordering::Relaxed);
                let reason = if e == zmq::Error::EAGAIN {
                    "send queue full (peer unreachable or not reading)".to_owned()
                } else {
                    format!("send failed: {e}")
                };
                let generation = d.generation;
                if let Some(d) = self.dealers.remove(peer) {
                    self.retire(peer, d);
                }
                Err((generation, reason))
            }
        }
    }

    /// Closes the DEALER toward `peer` if it still belongs to `generation`; `linger` gives a
    /// just-queued `disconnect` a moment to leave.
    pub(crate) fn close(&mut self, peer: &str, generation: u64, linger: bool) {
        if self.dealers.get(peer).is_some_and(|d| d.generation == generation)
            && let Some(d) = self.dealers.remove(peer)
        {
            if linger {
                // Our goodbye may still be queued: give it a moment to leave. Never when the
                // peer left first: a lingering socket would reconnect to a restarted peer
                // under our identity.
                let _ = d.socket.set_linger(CLOSE_LINGER_MS);
            }
            self.retire(peer, d);
        }
    }

    fn retire(&mut self, peer: &str, d: OutDealer) {
        self.command(IoCommand::Retire {
            peer: peer.to_owned(),
            generation: d.generation,
            socket: d.socket,
        });
    }

    /// Queues a command and wakes the I/O thread.
    fn command(&mut self, cmd: IoCommand) {
        if self.cmd_tx.send(cmd).is_err() {
            return;
        }
        // A full wake-up buffer means the thread is already due to wake; nothing is lost.
        let _ = self.wake_tx.write(&[1]);
    }

    /// The next event, if any (non-blocking): messages first (those the I/O thread queued,
    /// then the ROUTER read directly), then connection events.
    pub(crate) fn try_event(&mut self) -> Option<IoEvent> {
        if let Some(ev) = queued_message(&self.messages, &self.budget) {
            return Some(ev);
        }
        let known_empty = self.router_drained
            && self.watch.as_ref().is_some_and(FdWatch::is_armed)
            && self.direct.waiter_live(Instant::now());
        if self.direct_reads < self.direct_limit && !known_empty {
            let mut router = self.router.lock();
            // The I/O thread queues only while holding the ROUTER: with it held here, a queue
            // found empty means nothing older than the ROUTER's next message waits.
            if let Some(ev) = queued_message(&self.messages, &self.budget) {
                return Some(ev);
            }
            if let Some((peer, msg)) = router.stash.take() {
                self.direct_reads += 1;
                return Some(IoEvent::Message { peer, msg });
            }
            if let Some((peer, msg)) = router.recv_one(&self.counters) {
                self.direct_reads += 1;
                self.router_drained = false;
                trace_fetch(&msg, Point::FetchRead);
                return Some(IoEvent::Message { peer, msg });
            }
            self.router_drained = true;
        }
        self.events.try_recv().ok()
    }

    /// Ends a pump (a drain of `try_event`): re-arms the waker's watch of the ROUTER, and wakes
    /// the control plane again when the pump stopped at its read limit with messages left.
    pub(crate) fn end_pump(&mut self) {
        if self.direct_reads >= self.direct_limit {
            self.notifier.wake();
        }
        self.direct_reads = 0;
        self.direct.pumps.fetch_add(1, Ordering::Release);
        if let Some(w) = &self.watch {
            if !w.is_armed() {
                self.direct.saw_waiter(Instant::now());
            }
            w.arm();
        }
    }

    /// Stops the I/O thread, closing every socket with LINGER 0.
    pub(crate) fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        // No wait may poll the ROUTER's descriptor once the socket closes.
        self.watch = None;
        self.direct.forget_waiter();
        for d in self.dealers.values() {
            let _ = d.socket.set_linger(0);
        }
        self.dealers.clear();
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

/// Records a fetch message's arrival in the fetch trace (when it is on).
#[inline]
fn trace_fetch(msg: &Message, point: Point) {
    if fetch_trace::enabled()
        && let Message::Fetch { kv_request_id, .. } = msg
    {
        fetch_trace::record_request(kv_request_id, point);
    }
}

/// The next message the I/O thread queued, giving its budget back.
fn queued_message(messages: &mpsc::Receiver<(String, Message)>, budget: &InboundBudget) -> Option<IoEvent> {
    let (peer, msg) = messages.try_recv().ok()?;
    budget.release(&peer);
    Some(IoEvent::Message { peer, msg })
}

/// A DEALER being closed, with its monitor when it still has one.
struct Retired {
    _socket: zmq::Socket,
    monitor: zmq::Socket,
    deadline: Instant,
}

/// The ROUTER and what reading it takes, shared by the tier and the I/O thread's backstop.
struct RouterReader {
    socket: zmq::Socket,
    /// Flooding peers and when they may be heard again.
    banned: HashMap<String, Instant>,
    /// A decoded message the I/O thread could not queue (the queue was full); the next reader
    /// takes it before reading the socket again.
    stash: Option<(String, Message)>,
    /// Reused receive buffers (no allocation per frame).
    frame_id: zmq::Message,
    frame_payload: zmq::Message,
}

impl RouterReader {
    fn bind(ctx: &zmq::Context, endpoint: &str, limits: &Inbound) -> zmq::Result<(Self, u16)> {
        let router = ctx.socket(zmq::ROUTER)?;
        // No ZMTP heartbeat of its own (peers' DEALERs heartbeat, and a PING is answered
        // regardless): under ROUTER_HANDOVER a reconnecting peer's old pipe is terminated while
        // its engine lives on with no pipe, stops its input on the next message, and vendored
        // libzmq 4.3.4 then aborts on `!_io_error` (stream_engine_base.cpp:331) when this
        // socket's heartbeat timer calls `out_event` (libzmq #4364, open upstream). The peers'
        // heartbeat TTL still ends such an engine.
        router.set_linger(0)?;
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
                socket: router,
                banned: HashMap::new(),
                stash: None,
                frame_id: zmq::Message::new(),
                frame_payload: zmq::Message::new(),
            },
            port,
        ))
    }

    /// Whether `peer` is banned now (expired bans are dropped).
    fn is_banned(&mut self, peer: &str) -> bool {
        if self.banned.is_empty() {
            return false;
        }
        let now = Instant::now();
        self.banned.retain(|_, until| *until > now);
        self.banned.contains_key(peer)
    }

    /// The next well-formed message from a peer that is not banned, or `None` once the socket
    /// would block. Non-blocking; malformed and banned messages are counted and skipped.
    fn recv_one(&mut self, counters: &TransportCounters) -> Option<(String, Message)> {
        loop {
            match self.socket.recv(&mut self.frame_id, zmq::DONTWAIT) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) => return None,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "control receive failed");
                    return None;
                }
            }
            // The frames of one message arrive together: the rest is there to read.
            let mut frames = 1;
            let mut more = self.frame_id.get_more();
            while more {
                if self.socket.recv(&mut self.frame_payload, 0).is_err() {
                    break;
                }
                frames += 1;
                more = self.frame_payload.get_more();
            }
            if frames != 2 {
                counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(frames, "dropped a control message with a bad frame count");
                continue;
            }
            let Ok(peer) = std::str::from_utf8(&self.frame_id) else {
                counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let peer = peer.to_owned();
            match Message::decode(&self.frame_payload) {
                Ok(msg) => {
                    tracing::trace!(%peer, kind = msg.kind(), "received");
                    counters.messages_in.fetch_add(1, Ordering::Relaxed);
                    if self.is_banned(&peer) {
                        counters.dropped_flood.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    return Some((peer, msg));
                }
                Err(e) => {
                    counters.malformed_frames.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, error = %e, "dropped a malformed control frame");
                }
            }
        }
    }
}

struct IoThread {
    _ctx: zmq::Context,
    router: Arc<parking_lot::Mutex<RouterReader>>,
    /// The ROUTER's descriptor (readable when the socket may have messages).
    router_fd: std::os::fd::RawFd,
    /// Since when the ROUTER has been readable without a backstop read; the descriptor is not
    /// polled meanwhile (it would stay readable and spin the poll).
    readable_since: Option<Instant>,
    /// The tier's own reads of the ROUTER.
    direct: Arc<DirectReads>,
    /// When to look at the ROUTER next while the control thread watches it.
    next_check: Instant,
    /// The tier's pump count when the last look found the ROUTER readable.
    suspect: Option<u64>,
    /// Disconnect monitors of the tier's live DEALERs, by peer, with their generation.
    monitors: HashMap<String, (zmq::Socket, u64)>,
    /// DEALERs being retired: closed only once their monitor saw the disconnect (or after a
    /// grace period). Closing a DEALER while libzmq is still tearing its connection down can
    /// stall the context's I/O thread, and with it every other connection of the node.
    closing: Vec<Retired>,
    limits: Inbound,
    budget: Arc<InboundBudget>,
}

fn set_heartbeat(s: &zmq::Socket, hb: &Heartbeat) -> zmq::Result<()> {
    s.set_heartbeat_ivl(i32::try_from(hb.interval_ms).unwrap_or(i32::MAX))?;
    s.set_heartbeat_timeout(i32::try_from(hb.timeout_ms).unwrap_or(i32::MAX))?;
    s.set_heartbeat_ttl(i32::try_from(hb.ttl_ms).unwrap_or(i32::MAX))?;
    s.set_linger(0)
}

fn millis_ceil(d: Duration) -> i64 {
    i64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i64::MAX)
}

impl IoThread {
    fn run(
        mut self,
        cmds: &mpsc::Receiver<IoCommand>,
        wake: &UnixStream,
        (events, messages): (&mpsc::Sender<IoEvent>, &mpsc::SyncSender<(String, Message)>),
        notifier: &Notifier,
        counters: &TransportCounters,
    ) {
        // Rebuilt only when the set of monitors changes, not per message.
        let mut peers: Vec<String> = Vec::new();
        let mut disconnected = Vec::new();
        let mut stashed = false;
        loop {
            if peers.len() != self.monitors.len() || peers.iter().any(|p| !self.monitors.contains_key(p)) {
                peers = self.monitors.keys().cloned().collect();
            }
            disconnected.clear();
            let watched = self.direct.waiter_live(Instant::now());
            let watch_router = !watched && self.readable_since.is_none() && !stashed;
            let mut router_readable = false;
            {
                let mut items = Vec::with_capacity(3 + peers.len() + self.closing.len());
                items.push(zmq::PollItem::from_fd(wake.as_raw_fd(), zmq::POLLIN));
                for p in &peers {
                    if let Some((m, _)) = self.monitors.get(p) {
                        items.push(m.as_poll_item(zmq::POLLIN));
                    }
                }
                for r in &self.closing {
                    items.push(r.monitor.as_poll_item(zmq::POLLIN));
                }
                if watch_router {
                    items.push(zmq::PollItem::from_fd(self.router_fd, zmq::POLLIN));
                }
                let now = Instant::now();
                let mut timeout = self
                    .closing
                    .iter()
                    .map(|r| millis_ceil(r.deadline.saturating_duration_since(now)) + 1)
                    .min()
                    .unwrap_or(1000);
                if let Some(since) = self.readable_since {
                    timeout = timeout.min(millis_ceil(
                        (since + BACKSTOP_GRACE).saturating_duration_since(now),
                    ));
                }
                if stashed {
                    timeout = timeout.min(1);
                }
                if watched {
                    timeout = timeout.min(millis_ceil(self.next_check.saturating_duration_since(now)));
                }
                let polled = zmq::poll(&mut items, timeout);
                fetch_trace::record(self.direct.waker_trace_id.load(Ordering::Relaxed), Point::IoWoke);
                if let Err(e) = polled {
                    if e != zmq::Error::EINTR {
                        tracing::error!(error = %e, "zmq poll failed; the control I/O thread stops");
                        return;
                    }
                    continue;
                }
                for (i, p) in peers.iter().enumerate() {
                    if items.get(i + 1).is_some_and(zmq::PollItem::is_readable) {
                        disconnected.push(p.clone());
                    }
                }
                if watch_router && items.last().is_some_and(zmq::PollItem::is_readable) {
                    router_readable = true;
                }
            }
            if router_readable {
                self.readable_since = Some(Instant::now());
            }
            self.reap_closing();
            let mut notify = false;
            let backstop_due = self
                .readable_since
                .is_some_and(|since| since.elapsed() >= BACKSTOP_GRACE)
                || (watched && self.stalled_reader());
            if backstop_due || stashed {
                self.readable_since = None;
                let (n, still_stashed) = self.backstop_read(events, messages, counters);
                stashed = still_stashed;
                notify |= n;
            }
            for p in &disconnected {
                notify |= self.drain_monitor(p, events);
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
                    Ok(cmd) => self.handle(cmd),
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

    /// While the control thread watches the ROUTER: whether it was readable at this look and
    /// the last one with no pump of the tier in between (the control thread cannot take the
    /// manager lock). Looks at most every `BACKSTOP_CHECK`.
    fn stalled_reader(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next_check {
            return false;
        }
        self.next_check = now + BACKSTOP_CHECK;
        let mut item = [zmq::PollItem::from_fd(self.router_fd, zmq::POLLIN)];
        let readable = zmq::poll(&mut item, 0).is_ok() && item[0].is_readable();
        if !readable {
            self.suspect = None;
            return false;
        }
        let pumps = self.direct.pumps.load(Ordering::Acquire);
        if self.suspect == Some(pumps) {
            self.suspect = None;
            return true;
        }
        self.suspect = Some(pumps);
        false
    }

    /// Queues one decoded message within the peer's budget. Hands the message back when the
    /// queue is full.
    fn enqueue(
        &self,
        router: &mut RouterReader,
        (peer, msg): (String, Message),
        events: &mpsc::Sender<IoEvent>,
        messages: &mpsc::SyncSender<(String, Message)>,
        counters: &TransportCounters,
    ) -> Option<(String, Message)> {
        if !self.budget.try_take(&peer, self.limits.per_peer_budget) {
            counters.dropped_flood.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, budget = self.limits.per_peer_budget, "a peer floods the control socket; ignoring it");
            router.banned.insert(
                peer.clone(),
                Instant::now() + Duration::from_millis(self.limits.flood_ban_ms),
            );
            let _ = events.send(IoEvent::Flooded { peer });
            return None;
        }
        trace_fetch(&msg, Point::FetchRelayed);
        // Sent, or the tier is gone (nothing to deliver to): either way, go on reading.
        match messages.try_send((peer, msg)) {
            Ok(()) => {
                counters.relayed.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(mpsc::TrySendError::Full((peer, msg))) => {
                self.budget.release(&peer);
                Some((peer, msg))
            }
            Err(mpsc::TrySendError::Disconnected(_)) => None,
        }
    }

    /// Reads what the tier left in the ROUTER into the queue. Returns whether anything was
    /// queued and whether a message is stashed (the queue is full).
    fn backstop_read(
        &self,
        events: &mpsc::Sender<IoEvent>,
        messages: &mpsc::SyncSender<(String, Message)>,
        counters: &TransportCounters,
    ) -> (bool, bool) {
        let mut router = self.router.lock();
        let mut any = false;
        if let Some(m) = router.stash.take() {
            if let Some(m) = self.enqueue(&mut router, m, events, messages, counters) {
                router.stash = Some(m);
                return (any, true);
            }
            any = true;
        }
        while let Some(m) = router.recv_one(counters) {
            any = true;
            if let Some(m) = self.enqueue(&mut router, m, events, messages, counters) {
                router.stash = Some(m);
                return (any, true);
            }
        }
        (any, false)
    }

    /// Reads a DEALER's monitor; a disconnect kills that peer's connection.
    fn drain_monitor(&mut self, peer: &str, events: &mpsc::Sender<IoEvent>) -> bool {
        let Some((monitor, _)) = self.monitors.get(peer) else {
            return false;
        };
        let mut dead = false;
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
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
        if dead && let Some((_, generation)) = self.monitors.remove(peer) {
            let _ = events.send(IoEvent::Dead {
                peer: peer.to_owned(),
                generation,
                reason: "control connection lost".into(),
            });
            return true;
        }
        false
    }

    fn handle(&mut self, cmd: IoCommand) {
        match cmd {
            IoCommand::Watch {
                peer,
                generation,
                monitor,
            } => {
                self.monitors.insert(peer, (monitor, generation));
            }
            IoCommand::Retire {
                peer,
                generation,
                socket,
            } => {
                if self.monitors.get(&peer).is_some_and(|(_, g)| *g == generation)
                    && let Some((monitor, _)) = self.monitors.remove(&peer)
                {
                    self.closing.push(Retired {
                        _socket: socket,
                        monitor,
                        deadline: Instant::now() + CLOSE_GRACE,
                    });
                }
                // Otherwise its disconnect was seen already: it closes now.
            }
        }
    }

    /// Closes retired DEALERs whose disconnect was seen or whose grace period is over.
    fn reap_closing(&mut self) {
        let now = Instant::now();
        self.closing.retain(|r| {
            let mut gone = now >= r.deadline;
            while let Ok(frames) = r.monitor.recv_multipart(zmq::DONTWAIT) {
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
        for r in &self.closing {
            let _ = r._socket.set_linger(0);
        }
        self.monitors.clear();
        self.closing.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_counts_as_live_only_within_the_freshness_window() {
        let d = DirectReads::new();
        let t0 = Instant::now();
        assert!(!d.waiter_live(t0), "never seen");
        d.saw_waiter(t0);
        assert!(d.waiter_live(t0));
        assert!(d.waiter_live(t0 + WAITER_FRESH / 2));
        assert!(
            !d.waiter_live(t0 + WAITER_FRESH * 2),
            "stale: a step-driven manager's waker"
        );
        d.saw_waiter(t0);
        d.forget_waiter();
        assert!(!d.waiter_live(t0), "forgotten when the watch goes");
    }
}
