//! The producer side of the data plane: registration (connect to the consumer's listener and
//! greet it, off the scheduler thread) and one sender thread per consumer that pushes chunks
//! straight from pinned arena rows and waits for the consumer's acknowledgement.

use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tiering_core::{OffloadKey, RowRead};

use super::frame::{self, Begin, ChunkHeader, ChunkStatus, Hello};
use super::{DataCounters, DataEvent, Faults};
use crate::auth::DataKey;
use crate::notify::Notifier;

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

/// The tier's handle on one consumer's sender thread.
pub(crate) struct SenderHandle {
    tx: mpsc::Sender<WriteJob>,
    stream: TcpStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SenderHandle {
    /// Queues a transfer. On failure the job is handed back (the thread is gone).
    pub(crate) fn submit(&self, job: WriteJob) -> Result<(), WriteJob> {
        self.tx.send(job).map_err(|e| e.0)
    }

    /// Cuts the connection (the thread fails what it holds and exits) and returns the thread
    /// to join later.
    pub(crate) fn close(mut self) -> Option<JoinHandle<()>> {
        self.stop.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
        self.thread.take()
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
    let handle = SenderHandle {
        tx,
        stream: control,
        stop: Arc::clone(&stop),
        thread: None,
    };
    let _ = reg.events.send(DataEvent::Registered {
        peer: reg.peer.clone(),
        generation: reg.generation,
        handle,
    });
    reg.notifier.wake();
    send_loop(stream, &rx, reg, &stop);
}

fn send_loop(stream: TcpStream, jobs: &mpsc::Receiver<WriteJob>, reg: &Registration, stop: &AtomicBool) {
    let mut reader = match stream.try_clone() {
        Ok(s) => BufReader::new(s),
        Err(_) => return,
    };
    let mut writer = stream;
    let mut broken = false;
    // Ends when the tier drops the handle (channel closed) or the connection breaks.
    while let Ok(job) = jobs.recv() {
        let n = job.items.len();
        let statuses = if broken {
            vec![ChunkStatus::IoError; n]
        } else {
            match push(&mut writer, &mut reader, &job, reg, stop) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(peer = %reg.peer, error = %e, "data transfer failed; the connection is closed");
                    broken = true;
                    let _ = writer.shutdown(Shutdown::Both);
                    vec![ChunkStatus::IoError; n]
                }
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

fn push(
    w: &mut TcpStream,
    r: &mut BufReader<TcpStream>,
    job: &WriteJob,
    reg: &Registration,
    stop: &AtomicBool,
) -> io::Result<Vec<ChunkStatus>> {
    let count = u32::try_from(job.items.len()).map_err(|_| io::Error::other("transfer too large"))?;
    let begin = Begin {
        transfer_id: job.transfer_id,
        kv_request_id: job.req.clone(),
        round: job.round,
        count,
    };
    frame::write_begin(w, &reg.key, &begin)?;
    let mut sent = 0u32;
    for (i, item) in job.items.iter().enumerate() {
        if job.cancel.load(Ordering::Acquire) {
            break;
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
        let corrupt = reg.faults.corrupts(&item.key);
        frame::write_chunk(w, &reg.key, &begin, &header, payload, |t| {
            if corrupt {
                let mut b = *t.as_bytes();
                b[0] ^= 1;
                crate::auth::Tag::from_bytes(b)
            } else {
                t
            }
        })?;
        reg.counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        reg.counters
            .bytes_sent
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        sent += 1;
    }
    frame::write_end(w, sent)?;
    w.flush()?;
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
