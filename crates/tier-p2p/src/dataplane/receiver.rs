//! The consumer side of the data plane: a TCP listener and one thread per producer connection,
//! writing each chunk straight into the whitelisted arena row and acknowledging each transfer.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::counters::DataCounters;
use super::dest::{BeginVerdict, DestKey, DestTable};
use super::frame::{self, ChunkStatus, Frame, TransferMac};

type ConnTable = Arc<Mutex<HashMap<u64, (String, TcpStream)>>>;

/// Capacity of a connection's read buffer. The frames between payloads are a few dozen bytes,
/// but a fill of the buffer also takes the payload bytes behind them, which a payload read then
/// copies out once more; a read at least this large and with the buffer empty goes straight
/// into the row. A 64 KiB buffer copied nearly every byte of a 64 KiB chunk twice.
const FRAME_BUFFER: usize = 1024;

/// The listener and its connection threads.
pub(crate) struct Receiver {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: ConnTable,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    listener: Option<JoinHandle<()>>,
}

impl Receiver {
    pub(crate) fn start(
        bind: &str,
        dest: Arc<DestTable>,
        counters: Arc<DataCounters>,
        hello_timeout: Duration,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: ConnTable = Arc::default();
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (s, c, t) = (Arc::clone(&stop), Arc::clone(&conns), Arc::clone(&threads));
        let handle = std::thread::Builder::new()
            .name("kvtier-p2p-accept".into())
            .spawn(move || accept_loop(&listener, &s, &c, &t, &dest, &counters, hello_timeout))?;
        Ok(Self {
            addr,
            stop,
            conns,
            threads,
            listener: Some(handle),
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts every data connection from `peer`: its threads stop at their next read and check
    /// their grants back in, which makes that peer's fetches quiescent.
    pub(crate) fn disconnect_peer(&self, peer: &str) {
        for (p, s) in self.conns.lock().values() {
            if p == peer {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// Stops accepting, cuts every connection and joins every thread.
    pub(crate) fn shutdown(&mut self) {
        let Some(listener) = self.listener.take() else {
            return;
        };
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept; the loop sees the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = listener.join();
        for (_, s) in self.conns.lock().values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: &TcpListener,
    stop: &AtomicBool,
    conns: &ConnTable,
    threads: &Mutex<Vec<JoinHandle<()>>>,
    dest: &Arc<DestTable>,
    counters: &Arc<DataCounters>,
    hello_timeout: Duration,
) {
    static CONN_SEQ: AtomicU64 = AtomicU64::new(0);
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "data-plane accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = CONN_SEQ.fetch_add(1, Ordering::Relaxed);
        let (conns2, dest2, counters2) = (Arc::clone(conns), Arc::clone(dest), Arc::clone(counters));
        let spawned = std::thread::Builder::new()
            .name("kvtier-p2p-recv".into())
            .spawn(move || {
                if let Err(e) = serve_connection(stream, id, &conns2, &dest2, &counters2, hello_timeout) {
                    tracing::debug!(error = %e, "data connection closed");
                }
                conns2.lock().remove(&id);
            });
        match spawned {
            Ok(h) => {
                let mut t = threads.lock();
                t.retain(|h| !h.is_finished());
                t.push(h);
            }
            Err(e) => tracing::error!(error = %e, "cannot spawn a data receiver thread"),
        }
    }
}

fn serve_connection(
    stream: TcpStream,
    id: u64,
    conns: &ConnTable,
    dest: &DestTable,
    counters: &DataCounters,
    hello_timeout: Duration,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(hello_timeout))?;
    let mut reader = BufReader::with_capacity(FRAME_BUFFER, stream.try_clone()?);
    let hello = frame::read_hello(&mut reader)?;
    // Idle connections wait for the next transfer indefinitely; a stalled producer is cut by
    // `disconnect_peer` when its fetch times out.
    stream.set_read_timeout(None)?;
    conns
        .lock()
        .insert(id, (hello.peer_id.clone(), stream.try_clone()?));
    let mut writer = BufWriter::new(stream);
    loop {
        let (begin, tag) = match frame::read_frame(&mut reader)? {
            Frame::Begin(b, t) => (b, t),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected BEGIN, got {other:?}"),
                ));
            }
        };
        let dk = DestKey {
            peer: hello.peer_id.clone(),
            req: begin.kv_request_id.clone(),
            round: begin.round,
        };
        tiering_core::fetch_trace::record_request(&dk.req, tiering_core::fetch_trace::Point::TransferBegun);
        let statuses = match dest.authenticate(&dk, hello.instance, &begin, &tag) {
            BeginVerdict::Unknown => reject_transfer(&mut reader, &dk, &begin, counters)?,
            BeginVerdict::Refused(why) => return Err(refuse(counters, &dk, why)),
            BeginVerdict::Accepted { key, rows } => {
                if begin.count as usize > rows {
                    return Err(refuse(counters, &dk, "more chunks announced than rows reserved"));
                }
                let mut statuses = vec![ChunkStatus::NotSent; begin.count as usize];
                let macs = TransferMac::new(&key, &begin);
                loop {
                    match frame::read_frame(&mut reader)? {
                        Frame::Chunk(h, tag) => {
                            // Checked before the row is touched: without the key, no byte lands.
                            if macs.header_tag(&h) != tag {
                                return Err(refuse(counters, &dk, "a chunk header tag does not verify"));
                            }
                            let Some(slot) = statuses.get_mut(h.index as usize) else {
                                return Err(io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    "chunk index out of range",
                                ));
                            };
                            *slot = receive_chunk(&mut reader, dest, &dk, &macs, &h, counters)?;
                        }
                        Frame::End { .. } => break,
                        Frame::Begin(..) => {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "BEGIN inside a transfer",
                            ));
                        }
                    }
                }
                statuses
            }
        };
        frame::write_ack(&mut writer, begin.transfer_id, &statuses)?;
        writer.flush()?;
    }
}

/// Counts and logs a data connection cut for failing authentication.
fn refuse(counters: &DataCounters, dk: &DestKey, why: &str) -> io::Error {
    counters.auth_failures.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(peer = %dk.peer, req = %dk.req, round = dk.round, reason = why, "data connection refused");
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("data plane authentication failed: {why}"),
    )
}

/// A transfer for no outstanding fetch (a late one after an abort, or a stray): every chunk is
/// skipped unread and reported rejected.
fn reject_transfer(
    reader: &mut BufReader<TcpStream>,
    dk: &DestKey,
    begin: &frame::Begin,
    counters: &DataCounters,
) -> io::Result<Vec<ChunkStatus>> {
    loop {
        match frame::read_frame(reader)? {
            Frame::Chunk(h, _) => {
                if h.index >= begin.count {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "chunk index out of range",
                    ));
                }
                counters.chunks_rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = %dk.peer, req = %dk.req, row = h.dst_row, "rejected a chunk for a row not reserved for it");
                frame::skip_payload(reader, h.len)?;
            }
            Frame::End { .. } => return Ok(vec![ChunkStatus::Rejected; begin.count as usize]),
            Frame::Begin(..) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "BEGIN inside a transfer",
                ));
            }
        }
    }
}

fn receive_chunk(
    reader: &mut BufReader<TcpStream>,
    dest: &DestTable,
    dk: &DestKey,
    macs: &TransferMac,
    h: &frame::ChunkHeader,
    counters: &DataCounters,
) -> io::Result<ChunkStatus> {
    let mut grant = match dest.checkout(dk, h.dst_row, &h.key) {
        Ok(g) => g,
        Err(status) => {
            counters.chunks_rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %dk.peer, req = %dk.req, row = h.dst_row, "rejected a chunk for a row not reserved for it");
            frame::skip_payload(reader, h.len)?;
            return Ok(status);
        }
    };
    if h.len as usize != grant.len() {
        dest.checkin(dk, grant, false);
        frame::skip_payload(reader, h.len)?;
        return Ok(ChunkStatus::BadLength);
    }
    let ok = match frame::read_payload(reader, macs.payload(h), &mut grant[..]) {
        Ok(ok) => ok,
        Err(e) => {
            dest.checkin(dk, grant, false);
            return Err(e);
        }
    };
    dest.checkin(dk, grant, ok);
    if ok {
        tiering_core::fetch_trace::record_request(&dk.req, tiering_core::fetch_trace::Point::ChunkLanded);
        counters.chunks_received.fetch_add(1, Ordering::Relaxed);
        counters
            .bytes_received
            .fetch_add(u64::from(h.len), Ordering::Relaxed);
        Ok(ChunkStatus::Ok)
    } else {
        counters.checksum_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = %dk.peer, key = %h.key, "chunk payload MAC mismatch");
        Ok(ChunkStatus::ChecksumMismatch)
    }
}
