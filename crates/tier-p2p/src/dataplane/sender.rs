//! The producer side of the data plane: registration (connect to the consumer's listener and
//! greet it, off the scheduler thread) and one sender thread per consumer that pushes chunks
//! straight from pinned arena rows and waits for the consumer's acknowledgement.
//!
//! A small transfer to an idle connection is written by the thread that submits it (the
//! producer's control thread, which has just answered the fetch) as far as the socket takes it
//! without blocking; the sender thread writes the rest, if any, and waits for the ack. The
//! bytes leave without a thread hop, and the control thread never blocks on the socket.

use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tiering_core::{OffloadKey, arena::RowRead};

use super::counters::DataCounters;
use super::faults::Faults;
use super::frame::{self, Begin, ChunkHeader, ChunkStatus, Hello, SPAN, TransferMac};
use super::outgoing::Outgoing;
use crate::auth::DataKey;
use crate::auth::Tag;
use crate::notify::Notifier;

/// What the data-plane threads report to the tier.
pub(crate) enum DataEvent {
    /// A consumer is registered: its sender thread is up.
    Registered {
        peer: String,
        generation: u64,
        handle: SenderHandle,
    },
    /// Registration failed.
    RegistrationFailed {
        peer: String,
        generation: u64,
        reason: String,
    },
    /// A transfer ended; the source rows are released.
    TransferFinished {
        peer: String,
        generation: u64,
        transfer_id: u64,
        statuses: Vec<ChunkStatus>,
    },
    /// The connection to a consumer broke.
    SenderLost { peer: String, generation: u64 },
}

/// One chunk to push.
pub(crate) struct WriteItem {
    pub(crate) key: OffloadKey,
    pub(crate) dst_row: u32,
    pub(crate) src: RowRead,
}

/// One transfer (one fetch round).
pub(crate) struct WriteJob {
    pub(crate) transfer_id: u64,
    pub(crate) req: String,
    pub(crate) round: u64,
    pub(crate) items: Vec<WriteItem>,
    /// Set to stop between chunks (an abort); the rest is reported `NotSent`.
    pub(crate) cancel: Arc<AtomicBool>,
}

impl WriteJob {
    /// The frame that opens this transfer on the wire.
    fn begin(&self) -> io::Result<Begin> {
        let count = u32::try_from(self.items.len()).map_err(|_| io::Error::other("transfer too large"))?;
        Ok(Begin {
            transfer_id: self.transfer_id,
            kv_request_id: self.req.clone(),
            round: self.round,
            count,
        })
    }
}

/// Largest transfer (payload bytes) the submitting thread starts writing itself.
const INLINE_MAX_BYTES: usize = 1 << 20;

/// What the sender thread is handed.
enum Queued {
    /// A transfer to push whole.
    Push(WriteJob),
    /// A transfer the submitting thread started writing: the rest, then the ack.
    Started(WriteJob, io::Result<Outgoing>),
}

/// The tier's handle on one consumer's sender thread.
pub(crate) struct SenderHandle {
    tx: mpsc::Sender<Queued>,
    stream: TcpStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Transfers handed over whose ack the sender thread has not read yet: at zero the
    /// connection is idle and a new transfer may be written by the submitting thread.
    unacked: Arc<AtomicUsize>,
    key: DataKey,
    faults: Arc<Faults>,
    counters: Arc<DataCounters>,
}

impl SenderHandle {
    /// Queues a transfer (a small one to an idle connection is started from this thread). On
    /// failure the job is handed back (the thread is gone).
    pub(crate) fn submit(&self, job: WriteJob) -> Result<(), WriteJob> {
        let idle = self.unacked.load(Ordering::Acquire) == 0;
        let queued = if idle && self.may_start(&job) {
            let started = self.start(&job);
            Queued::Started(job, started)
        } else {
            Queued::Push(job)
        };
        self.unacked.fetch_add(1, Ordering::AcqRel);
        self.tx.send(queued).map_err(|e| {
            self.unacked.fetch_sub(1, Ordering::AcqRel);
            match e.0 {
                Queued::Push(job) | Queued::Started(job, _) => job,
            }
        })
    }

    fn may_start(&self, job: &WriteJob) -> bool {
        let bytes: usize = job.items.iter().map(|i| i.src.len()).sum();
        bytes <= INLINE_MAX_BYTES
            && !job.cancel.load(Ordering::Acquire)
            && !self.stop.load(Ordering::Acquire)
            && !self.faults.holds()
    }

    /// Writes what the socket takes without blocking.
    fn start(&self, job: &WriteJob) -> io::Result<Outgoing> {
        let begin = job.begin()?;
        let mut headers = Vec::with_capacity(job.items.len());
        for (i, item) in job.items.iter().enumerate() {
            headers.push(ChunkHeader {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                dst_row: item.dst_row,
                key: item.key,
                len: u32::try_from(item.src.len()).map_err(|_| io::Error::other("chunk too large"))?,
            });
        }
        let chunks = headers.into_iter().zip(job.items.iter().map(|i| &*i.src));
        let mut out = Outgoing::new(&self.key, &begin, chunks, |h, t| tamper(&self.faults, &h.key, t))?;
        self.faults.count_sent(job.items.len() as u64);
        self.stream.set_nonblocking(true)?;
        let written = out.write_on(&self.stream, |i| &job.items[i].src, &mut || {
            count_sent(&self.counters, job);
        });
        self.stream.set_nonblocking(false)?;
        written?;
        Ok(out)
    }

    /// Cuts the connection (the thread fails what it holds and exits) and returns the thread
    /// to join later.
    pub(crate) fn close(mut self) -> Option<JoinHandle<()>> {
        self.stop.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
        self.thread.take()
    }
}

/// A payload MAC as the fault injection wants it (flipped for a key set to be corrupted).
fn tamper(faults: &Faults, key: &OffloadKey, t: crate::auth::Tag) -> crate::auth::Tag {
    if faults.corrupts(key) {
        let mut b = *t.as_bytes();
        b[0] ^= 1;
        crate::auth::Tag::from_bytes(b)
    } else {
        t
    }
}

/// Everything a registration needs.
pub(crate) struct Registration {
    pub(crate) peer: String,
    pub(crate) generation: u64,
    pub(crate) data_addr: String,
    pub(crate) hello: Hello,
    /// The key of this session's data toward the peer.
    pub(crate) key: DataKey,
    pub(crate) connect_timeout: Duration,
    pub(crate) io_timeout: Duration,
    pub(crate) events: mpsc::Sender<DataEvent>,
    pub(crate) notifier: Notifier,
    pub(crate) counters: Arc<DataCounters>,
    pub(crate) faults: Arc<Faults>,
}

/// Registers a consumer on a new thread, which then becomes its sender thread. The outcome
/// arrives as [`DataEvent::Registered`] or [`DataEvent::RegistrationFailed`].
pub(crate) fn spawn_registration(reg: Registration) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvtier-p2p-send".into())
        .spawn(move || run_registration(&reg))
}

fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to nothing"));
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn run_registration(reg: &Registration) {
    let setup = || -> io::Result<TcpStream> {
        let mut stream = connect(&reg.data_addr, reg.connect_timeout)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(reg.io_timeout))?;
        stream.set_read_timeout(Some(reg.io_timeout))?;
        frame::write_hello(&mut stream, &reg.hello)?;
        Ok(stream)
    };
    let stream = match setup().and_then(|s| s.try_clone().map(|c| (s, c))) {
        Ok(pair) => pair,
        Err(e) => {
            let _ = reg.events.send(DataEvent::RegistrationFailed {
                peer: reg.peer.clone(),
                generation: reg.generation,
                reason: e.to_string(),
            });
            reg.notifier.wake();
            return;
        }
    };
    let (stream, control) = stream;
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let unacked = Arc::new(AtomicUsize::new(0));
    let handle = SenderHandle {
        tx,
        stream: control,
        stop: Arc::clone(&stop),
        thread: None,
        unacked: Arc::clone(&unacked),
        key: reg.key.clone(),
        faults: Arc::clone(&reg.faults),
        counters: Arc::clone(&reg.counters),
    };
    let _ = reg.events.send(DataEvent::Registered {
        peer: reg.peer.clone(),
        generation: reg.generation,
        handle,
    });
    reg.notifier.wake();
    send_loop(stream, &rx, reg, &stop, &unacked);
}

fn send_loop(
    stream: TcpStream,
    jobs: &mpsc::Receiver<Queued>,
    reg: &Registration,
    stop: &AtomicBool,
    unacked: &AtomicUsize,
) {
    let mut reader = match stream.try_clone() {
        Ok(s) => BufReader::new(s),
        Err(_) => return,
    };
    let mut writer = stream;
    let mut broken = false;
    // Ends when the tier drops the handle (channel closed) or the connection breaks.
    while let Ok(queued) = jobs.recv() {
        let (job, outcome) = match queued {
            Queued::Push(job) if broken => (job, None),
            Queued::Push(job) => {
                let r = push(&mut writer, &mut reader, &job, reg, stop);
                (job, Some(r))
            }
            Queued::Started(job, _) if broken => (job, None),
            Queued::Started(job, started) => {
                let r = started.and_then(|out| finish(&writer, &mut reader, &job, out, reg));
                (job, Some(r))
            }
        };
        tiering_core::fetch_trace::record_request(&job.req, tiering_core::fetch_trace::Point::TransferAcked);
        // The socket is idle again: the next transfer may be started by its submitter.
        unacked.fetch_sub(1, Ordering::AcqRel);
        let n = job.items.len();
        let statuses = match outcome {
            None => vec![ChunkStatus::IoError; n],
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                tracing::warn!(peer = %reg.peer, error = %e, "data transfer failed; the connection is closed");
                broken = true;
                let _ = writer.shutdown(Shutdown::Both);
                vec![ChunkStatus::IoError; n]
            }
        };
        // The source rows are released only now: nothing reads them any more.
        drop(job.items);
        let _ = reg.events.send(DataEvent::TransferFinished {
            peer: reg.peer.clone(),
            generation: reg.generation,
            transfer_id: job.transfer_id,
            statuses,
        });
        reg.notifier.wake();
        if broken {
            let _ = reg.events.send(DataEvent::SenderLost {
                peer: reg.peer.clone(),
                generation: reg.generation,
            });
            reg.notifier.wake();
        }
    }
}

/// Writes the rest of a transfer its submitter started, then reads the ack.
fn finish(
    w: &TcpStream,
    r: &mut BufReader<TcpStream>,
    job: &WriteJob,
    mut out: Outgoing,
    reg: &Registration,
) -> io::Result<Vec<ChunkStatus>> {
    tiering_core::fetch_trace::record_request(&job.req, tiering_core::fetch_trace::Point::SenderPicked);
    // The socket blocks here: `false` means its write timeout passed.
    if !out.write_on(w, |i| &job.items[i].src, &mut || {
        count_sent(&reg.counters, job);
    })? {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the data connection stalled",
        ));
    }
    read_ack(r, job)
}

/// Counts a transfer's chunks as pushed.
fn count_sent(counters: &DataCounters, job: &WriteJob) {
    for item in &job.items {
        counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        counters
            .bytes_sent
            .fetch_add(item.src.len() as u64, Ordering::Relaxed);
    }
}

/// Reads a transfer's ack and checks it belongs to `job`.
fn read_ack(r: &mut BufReader<TcpStream>, job: &WriteJob) -> io::Result<Vec<ChunkStatus>> {
    let (id, statuses) = frame::read_ack(r)?;
    if id != job.transfer_id || statuses.len() != job.items.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "ack for transfer {id} does not match transfer {}",
                job.transfer_id
            ),
        ));
    }
    Ok(statuses)
}

fn push(
    w: &mut TcpStream,
    r: &mut BufReader<TcpStream>,
    job: &WriteJob,
    reg: &Registration,
    stop: &AtomicBool,
) -> io::Result<Vec<ChunkStatus>> {
    tiering_core::fetch_trace::record_request(&job.req, tiering_core::fetch_trace::Point::SenderPicked);
    let begin = job.begin()?;
    frame::write_begin(w, &reg.key, &begin)?;
    let macs = TransferMac::new(&reg.key, &begin);
    // A chunk's MAC trailer leaves with the next chunk's header (or with `END`): one write,
    // not three small segments per chunk.
    let mut trailer: Option<Tag> = None;
    let mut sent = 0u32;
    for (i, item) in job.items.iter().enumerate() {
        if job.cancel.load(Ordering::Acquire) {
            break;
        }
        if reg.faults.holds() {
            // A held sender leaves every chunk before the hold complete.
            write_all_vectored(w, &mut [io::IoSlice::new(trailer_bytes(trailer.take().as_ref()))])?;
        }
        reg.faults.before_chunk(stop, &job.cancel)?;
        if job.cancel.load(Ordering::Acquire) {
            break;
        }
        let payload: &[u8] = &item.src;
        let header = ChunkHeader {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            dst_row: item.dst_row,
            key: item.key,
            len: u32::try_from(payload.len()).map_err(|_| io::Error::other("chunk too large"))?,
        };
        let head = frame::chunk_head(&macs, &header);
        let mut mac = macs.payload(&header);
        // The payload leaves in spans of several pieces, each MACed after its write: one
        // write per piece made the consumer sleep and wake once per piece while this thread
        // MACed (2.7 times a raw stream's context switches; see `SPAN`).
        let mut spans = payload.chunks(SPAN);
        let first = spans.next().unwrap_or_default();
        let prev = trailer.take();
        write_all_vectored(
            w,
            &mut [
                io::IoSlice::new(trailer_bytes(prev.as_ref())),
                io::IoSlice::new(&head),
                io::IoSlice::new(first),
            ],
        )?;
        mac.pieces(first);
        for span in spans {
            w.write_all(span)?;
            mac.pieces(span);
        }
        trailer = Some(tamper(&reg.faults, &item.key, mac.finalize()?));
        reg.counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        reg.counters
            .bytes_sent
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        sent += 1;
    }
    let end = frame::end_frame(sent);
    write_all_vectored(
        w,
        &mut [
            io::IoSlice::new(trailer_bytes(trailer.as_ref())),
            io::IoSlice::new(&end),
        ],
    )?;
    w.flush()?;
    read_ack(r, job)
}

fn trailer_bytes(t: Option<&Tag>) -> &[u8] {
    t.map_or(&[], |t| t.as_bytes().as_slice())
}

/// Writes every byte of `bufs` (in as few system calls as the socket allows).
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    // Drops leading empty slices: nothing at all to write is no write (not a `WriteZero`).
    io::IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;

    use tiering_core::arena::ChunkArena;

    use super::*;
    use crate::dataplane::frame::Frame;

    /// A transfer of several pieces per chunk goes out byte for byte as the streaming writer
    /// writes it (each trailer leaves with the next header; a corrupted key's MAC flipped),
    /// and every MAC verifies except the corrupted one.
    #[test]
    fn a_pushed_transfer_matches_the_streaming_writer() {
        // Not a multiple of the piece size: each payload ends with a short piece.
        let chunk = (2 << 20) + 4096;
        let arena = ChunkArena::new(3, chunk).unwrap();
        for c in 0..3u32 {
            let mut row = arena.write_row(c).unwrap();
            for (i, b) in row.iter_mut().enumerate() {
                *b = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(c) as u8;
            }
        }
        let key = DataKey::from_bytes([5; 32]);
        let faults = Arc::new(Faults::default());
        faults.corrupt_key(OffloadKey::from_u64(101));
        let (events, _events_rx) = mpsc::channel();
        let reg = Registration {
            peer: "p".into(),
            generation: 1,
            data_addr: String::new(),
            hello: Hello {
                peer_id: "p".into(),
                instance: 1,
            },
            key: key.clone(),
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(5),
            events,
            notifier: Notifier::default(),
            counters: Arc::default(),
            faults,
        };
        let job = WriteJob {
            transfer_id: 4,
            req: "req".into(),
            round: 2,
            items: (0..3u32)
                .map(|c| WriteItem {
                    key: OffloadKey::from_u64(100 + u64::from(c)),
                    dst_row: 10 + c,
                    src: arena.read_row(c).unwrap(),
                })
                .collect(),
            cancel: Arc::default(),
        };
        let begin = job.begin().unwrap();
        let mut expected = Vec::new();
        frame::write_begin(&mut expected, &key, &begin).unwrap();
        for (i, item) in job.items.iter().enumerate() {
            let h = ChunkHeader {
                index: i as u32,
                dst_row: item.dst_row,
                key: item.key,
                len: chunk as u32,
            };
            frame::write_chunk(&mut expected, &key, &begin, &h, &item.src, |t| {
                tamper(&reg.faults, &item.key, t)
            })
            .unwrap();
        }
        frame::write_end(&mut expected, 3).unwrap();

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut w = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let mut r = BufReader::new(w.try_clone().unwrap());
        let (len, verify_key) = (expected.len(), key.clone());
        let consumer = std::thread::spawn(move || {
            let mut got = vec![0u8; len];
            peer.read_exact(&mut got).unwrap();
            let mut s = got.as_slice();
            let Frame::Begin(b, tag) = frame::read_frame(&mut s).unwrap() else {
                panic!("expected BEGIN")
            };
            assert_eq!(tag, frame::begin_tag(&verify_key, &b));
            let macs = TransferMac::new(&verify_key, &b);
            let mut statuses = Vec::new();
            while let Frame::Chunk(h, tag) = frame::read_frame(&mut s).unwrap() {
                assert_eq!(tag, macs.header_tag(&h));
                let mut dst = vec![0u8; h.len as usize];
                let ok = frame::read_payload(&mut s, macs.payload(&h), &mut dst).unwrap();
                statuses.push(if ok {
                    ChunkStatus::Ok
                } else {
                    ChunkStatus::ChecksumMismatch
                });
            }
            assert!(s.is_empty());
            frame::write_ack(&mut peer, b.transfer_id, &statuses).unwrap();
            got
        });
        let statuses = push(&mut w, &mut r, &job, &reg, &AtomicBool::new(false)).unwrap();
        assert_eq!(
            statuses,
            [ChunkStatus::Ok, ChunkStatus::ChecksumMismatch, ChunkStatus::Ok]
        );
        assert!(
            consumer.join().unwrap() == expected,
            "the bytes differ from the streaming writer's"
        );
        assert_eq!(reg.counters.chunks_sent.load(Ordering::Relaxed), 3);
    }
}
