//! The manager's end of the completion channel: a non-blocking listener and connections, read
//! by whoever applies completions (see the module docs of [`crate::channel`]).

use std::io::{self, ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::reports::{CompletionQueue, WorkerEvent};
use super::wire::{HEADER, Message, decode_header, decode_payload};
use crate::waker::{ControlWaker, FdWatch};

/// Bytes read from one connection per [`ChannelServer::drain`]: a flooding worker cannot keep
/// the manager's lock for long; what is left is read by the next drain, which the waker
/// brings forward.
const READ_BUDGET: usize = 1 << 20;

/// Where a connection is in its conversation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Connected; the next message must be `hello`.
    Greeting,
    /// Introduced as this rank.
    Joined(u32),
}

/// One worker's connection.
struct Connection {
    /// Declared before the stream: the watch must end before its descriptor closes.
    watch: Option<FdWatch>,
    stream: UnixStream,
    /// Bytes received and not yet parsed (at most one message's worth plus one read).
    buf: Vec<u8>,
    phase: Phase,
}

/// What reading a connection concluded.
enum Verdict {
    /// Still open.
    Open,
    /// Closed; the connection is dropped.
    Closed,
}

/// The manager's end of the channel.
pub(crate) struct ChannelServer {
    path: PathBuf,
    fingerprint: u64,
    reporters: u32,
    waker: ControlWaker,
    /// Declared before the listener, as [`Connection::watch`].
    listener_watch: Option<FdWatch>,
    listener: UnixListener,
    connections: Vec<Connection>,
    scratch: Box<[u8]>,
    removed: bool,
}

impl ChannelServer {
    /// Binds the socket at `path` (reclaiming a socket file no manager listens on).
    pub(crate) fn bind(
        path: &Path,
        fingerprint: u64,
        reporters: u32,
        waker: ControlWaker,
    ) -> io::Result<Self> {
        if path.exists() {
            // A socket file nobody listens on is left over from a dead manager: reclaim it. One
            // that answers belongs to a live manager.
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    ErrorKind::AddrInUse,
                    "another manager listens there",
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let listener_watch = watch(&waker, listener.as_raw_fd());
        Ok(Self {
            path: path.to_owned(),
            fingerprint,
            reporters: reporters.max(1),
            waker,
            listener_watch,
            listener,
            connections: Vec::new(),
            scratch: vec![0u8; 64 << 10].into_boxed_slice(),
            removed: false,
        })
    }

    /// Accepts waiting workers and reads what every connection has sent, queueing the events
    /// on `queue`. Never blocks.
    pub(crate) fn drain(&mut self, queue: &CompletionQueue) {
        self.accept();
        let mut i = 0;
        while i < self.connections.len() {
            match self.read_connection(i, queue) {
                Verdict::Open => i += 1,
                Verdict::Closed => {
                    self.connections.swap_remove(i);
                }
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(error = %e, "completion channel: cannot use a worker's connection");
                        continue;
                    }
                    let watch = watch(&self.waker, stream.as_raw_fd());
                    self.connections.push(Connection {
                        watch,
                        stream,
                        buf: Vec::new(),
                        phase: Phase::Greeting,
                    });
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(error = %e, "completion channel: accept failed");
                    break;
                }
            }
        }
        if let Some(w) = &self.listener_watch {
            w.arm();
        }
    }

    /// Reads connection `i` until it would block (or its budget is spent) and handles every
    /// complete message.
    fn read_connection(&mut self, i: usize, queue: &CompletionQueue) -> Verdict {
        let conn = &mut self.connections[i];
        let mut read = 0;
        let mut ended = false;
        while read < READ_BUDGET {
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => {
                    conn.buf.extend_from_slice(&self.scratch[..n]);
                    read += n;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    ended = true;
                    break;
                }
            }
        }
        if read >= READ_BUDGET {
            // More may be waiting: come back soon rather than hold the lock now.
            self.waker.wake();
        }
        let verdict = self.parse(i, queue);
        let conn = &mut self.connections[i];
        match verdict {
            Verdict::Closed => Verdict::Closed,
            Verdict::Open if ended => {
                if let Phase::Joined(rank) = conn.phase {
                    queue.push(WorkerEvent::Left { rank, clean: false });
                }
                Verdict::Closed
            }
            Verdict::Open => {
                if let Some(w) = &conn.watch {
                    w.arm();
                }
                Verdict::Open
            }
        }
    }

    /// Handles the complete messages in connection `i`'s buffer.
    fn parse(&mut self, i: usize, queue: &CompletionQueue) -> Verdict {
        let (fingerprint, reporters) = (self.fingerprint, self.reporters);
        let conn = &mut self.connections[i];
        let mut at = 0;
        let verdict = loop {
            let Some(h) = conn.buf.get(at..).and_then(<[u8]>::first_chunk::<HEADER>) else {
                break Verdict::Open;
            };
            let (kind, len) = match decode_header(h) {
                Ok(v) => v,
                Err(e) => break reject(conn.phase, queue, &e.to_string()),
            };
            let Some(payload) = conn.buf.get(at + HEADER..at + HEADER + len) else {
                break Verdict::Open;
            };
            let message = match decode_payload(kind, payload) {
                Ok(m) => m,
                Err(e) => break reject(conn.phase, queue, &e.to_string()),
            };
            at += HEADER + len;
            match (conn.phase, message) {
                (
                    Phase::Greeting,
                    Message::Hello {
                        rank,
                        fingerprint: fp,
                    },
                ) => {
                    if fp != fingerprint || rank >= reporters {
                        break reject(
                            conn.phase,
                            queue,
                            &format!(
                                "hello from rank {rank} with arena fingerprint {fp:#x}: not this manager's arena or rank out of range"
                            ),
                        );
                    }
                    conn.phase = Phase::Joined(rank);
                    queue.push(WorkerEvent::Joined { rank });
                }
                (Phase::Greeting, _) => break reject(conn.phase, queue, "the first message was not a hello"),
                (Phase::Joined(rank), Message::Stored { success, keys }) => {
                    queue.push(WorkerEvent::Stored { rank, keys, success });
                }
                (Phase::Joined(rank), Message::Goodbye) => {
                    queue.push(WorkerEvent::Left { rank, clean: true });
                    break Verdict::Closed;
                }
                (Phase::Joined(_), Message::Hello { .. }) => {
                    break reject(conn.phase, queue, "a second hello");
                }
            }
        };
        conn.buf.drain(..at.min(conn.buf.len()));
        verdict
    }

    /// Stops accepting, closes every connection and removes the socket.
    pub(crate) fn stop(mut self) {
        self.close();
    }

    fn close(&mut self) {
        self.connections.clear();
        self.listener_watch = None;
        if !self.removed {
            self.removed = true;
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ChannelServer {
    fn drop(&mut self) {
        self.close();
    }
}

/// Counts a rejected message and ends the connection (a joined rank leaves uncleanly).
fn reject(phase: Phase, queue: &CompletionQueue, why: &str) -> Verdict {
    tracing::warn!(reason = why, "completion channel: message rejected");
    queue.push(WorkerEvent::Rejected);
    if let Phase::Joined(rank) = phase {
        queue.push(WorkerEvent::Left { rank, clean: false });
    }
    Verdict::Closed
}

/// A watch of `fd` on the control thread's waker; `None` (logged) when the waker cannot poll,
/// in which case the descriptor is still read at every sweep and step.
fn watch(waker: &ControlWaker, fd: std::os::fd::RawFd) -> Option<FdWatch> {
    match waker.watch_fd(fd) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "completion channel: the control thread cannot watch a socket; reports wait for its next sweep");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::channel::wire::encode;
    use crate::key::OffloadKey;

    const FP: u64 = 0x5eed;

    struct Rig {
        server: ChannelServer,
        queue: CompletionQueue,
        path: PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Rig {
        fn new(reporters: u32) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.sock");
            let server = ChannelServer::bind(&path, FP, reporters, ControlWaker::new()).unwrap();
            Self {
                server,
                queue: CompletionQueue::default(),
                path,
                _dir: dir,
            }
        }

        fn connect(&self) -> UnixStream {
            UnixStream::connect(&self.path).unwrap()
        }

        /// Drains until `n` events are queued (the writes are local, so a few drains suffice)
        /// and returns every event queued.
        fn events(&mut self, n: usize) -> Vec<WorkerEvent> {
            let mut all = Vec::new();
            for _ in 0..1000 {
                self.server.drain(&self.queue);
                all.extend(self.queue.take());
                if all.len() >= n {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            all
        }
    }

    fn hello(rank: u32, fingerprint: u64) -> Vec<u8> {
        encode(&Message::Hello { rank, fingerprint })
    }

    fn stored(keys: &[OffloadKey]) -> Vec<u8> {
        encode(&Message::Stored {
            success: true,
            keys: keys.to_vec(),
        })
    }

    #[test]
    fn a_message_split_across_writes_is_applied_once_whole() {
        let mut rig = Rig::new(2);
        let mut w = rig.connect();
        w.write_all(&hello(1, FP)).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Joined { rank: 1 }]);
        let msg = stored(&[OffloadKey::from_u64(7), OffloadKey::from_u64(8)]);
        let (a, b) = msg.split_at(HEADER + 5);
        w.write_all(a).unwrap();
        rig.server.drain(&rig.queue);
        assert!(rig.queue.take().is_empty(), "half a message is not an event");
        w.write_all(b).unwrap();
        assert_eq!(
            rig.events(1),
            vec![WorkerEvent::Stored {
                rank: 1,
                keys: vec![OffloadKey::from_u64(7), OffloadKey::from_u64(8)],
                success: true,
            }]
        );
        w.write_all(&encode(&Message::Goodbye)).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Left { rank: 1, clean: true }]);
        assert!(
            rig.server.connections.is_empty(),
            "a goodbye closes the connection"
        );
    }

    #[test]
    fn several_workers_and_messages_in_one_drain_keep_their_order() {
        let mut rig = Rig::new(2);
        let (mut w0, mut w1) = (rig.connect(), rig.connect());
        let mut burst = hello(0, FP);
        for n in 0..50 {
            burst.extend(stored(&[OffloadKey::from_u64(n)]));
        }
        w0.write_all(&burst).unwrap();
        w1.write_all(&hello(1, FP)).unwrap();
        let events = rig.events(52);
        let rank0: Vec<&WorkerEvent> = events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    WorkerEvent::Joined { rank: 0 } | WorkerEvent::Stored { rank: 0, .. }
                )
            })
            .collect();
        assert_eq!(rank0.len(), 51);
        assert_eq!(*rank0[0], WorkerEvent::Joined { rank: 0 });
        for (n, e) in rank0[1..].iter().enumerate() {
            let WorkerEvent::Stored { keys, .. } = e else {
                panic!("{e:?}");
            };
            assert_eq!(keys, &vec![OffloadKey::from_u64(n as u64)], "in the order sent");
        }
        assert!(events.contains(&WorkerEvent::Joined { rank: 1 }));
    }

    #[test]
    fn malformed_and_foreign_messages_are_rejected_and_end_the_connection() {
        let mut rig = Rig::new(2);
        // Another arena's fingerprint: refused at the hello, no rank joined.
        let mut foreign = rig.connect();
        foreign.write_all(&hello(0, FP ^ 1)).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Rejected]);
        // A rank outside `reporters`.
        let mut far = rig.connect();
        far.write_all(&hello(2, FP)).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Rejected]);
        // Garbage after a valid hello: rejected, and the rank leaves uncleanly.
        let mut bad = rig.connect();
        bad.write_all(&hello(1, FP)).unwrap();
        bad.write_all(b"not a kvtier header").unwrap();
        assert_eq!(
            rig.events(3),
            vec![
                WorkerEvent::Joined { rank: 1 },
                WorkerEvent::Rejected,
                WorkerEvent::Left {
                    rank: 1,
                    clean: false
                }
            ]
        );
        assert!(rig.server.connections.is_empty());
        // A message before the hello.
        let mut rude = rig.connect();
        rude.write_all(&stored(&[OffloadKey::from_u64(1)])).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Rejected]);
    }

    #[test]
    fn a_worker_that_vanishes_leaves_uncleanly_and_one_that_never_spoke_leaves_nothing() {
        let mut rig = Rig::new(1);
        let silent = rig.connect();
        let mut w = rig.connect();
        w.write_all(&hello(0, FP)).unwrap();
        assert_eq!(rig.events(1), vec![WorkerEvent::Joined { rank: 0 }]);
        drop(silent);
        drop(w);
        assert_eq!(
            rig.events(1),
            vec![WorkerEvent::Left {
                rank: 0,
                clean: false
            }]
        );
        assert!(rig.server.connections.is_empty());
    }

    #[test]
    fn a_readable_connection_wakes_the_waiting_control_thread() {
        let waker = ControlWaker::new();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let mut server = ChannelServer::bind(&path, FP, 1, waker.clone()).unwrap();
        let queue = CompletionQueue::default();
        let mut w = UnixStream::connect(&path).unwrap();
        // The listener's readiness ends a wait; the drain accepts and re-arms.
        assert!(waker.wait(std::time::Duration::from_secs(10)));
        server.drain(&queue);
        // Registering the new connection's watch wakes once (a waiter in the plain mode goes
        // round); after that, an idle channel does not end waits.
        let _ = waker.wait(std::time::Duration::ZERO);
        assert!(
            !waker.wait(std::time::Duration::from_millis(20)),
            "nothing more to read"
        );
        w.write_all(&hello(0, FP)).unwrap();
        assert!(
            waker.wait(std::time::Duration::from_secs(10)),
            "the report ends the wait"
        );
        server.drain(&queue);
        assert_eq!(queue.take(), vec![WorkerEvent::Joined { rank: 0 }]);
    }

    #[test]
    fn stopping_removes_the_socket() {
        let rig = Rig::new(1);
        let path = rig.path.clone();
        assert!(path.exists());
        rig.server.stop();
        assert!(!path.exists());
    }
}
