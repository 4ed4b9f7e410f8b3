//! The completion channel: how copy workers in other processes (one per GPU rank) report
//! finished device→primary stores to the manager, so its control thread can complete and
//! cascade them while the model runs (`docs/ARCHITECTURE.md`, "Worker processes").
//!
//! Transport: a Unix stream socket; the manager binds it ([`TieringManager::open_completion_channel`](crate::TieringManager::open_completion_channel)),
//! each worker connects with a [`WorkerReporter`]. Every message is a 12-byte header — magic
//! `KVTC`, version, kind, payload length (little endian) — and a payload:
//! - `hello` (first message): the worker's rank and the fingerprint of the arena it copies into;
//!   a rank outside `reporters` or another arena's fingerprint is refused;
//! - `stored`: a success flag and the keys (32-byte hash + group index each);
//! - `goodbye`: a clean exit.
//!
//! A malformed or foreign message is rejected and counted, and the connection is closed. A
//! worker whose connection ends without `goodbye` is treated as dead: the stores it had not
//! reported fail once `ManagerConfig::worker_deadline` passes, unless it reconnects first.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::arena::ChunkArena;
use crate::key::{KEY_BYTES, OffloadKey};
use crate::manager::{CompletionQueue, WorkerEvent};
use crate::waker::ControlWaker;

const MAGIC: [u8; 4] = *b"KVTC";
const VERSION: u16 = 1;
const HEADER: usize = 12;
const KIND_HELLO: u8 = 1;
const KIND_STORED: u8 = 2;
const KIND_GOODBYE: u8 = 3;
/// Bytes per key on the wire: the hash and the group index.
const WIRE_KEY: usize = KEY_BYTES;
/// Largest payload accepted (about 460 000 keys); larger ones are refused before allocating.
pub const MAX_PAYLOAD: usize = 16 << 20;

/// The fingerprint of an arena's identity (geometry and backing file), which a worker presents
/// in its `hello` so a worker of another arena cannot report into this manager.
#[must_use]
pub fn fingerprint(num_chunks: usize, chunk_bytes: usize, path: Option<&Path>) -> u64 {
    // FNV-1a: stable across processes and builds, which a std hasher is not.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    mix(&(num_chunks as u64).to_le_bytes());
    mix(&(chunk_bytes as u64).to_le_bytes());
    if let Some(p) = path {
        mix(p.as_os_str().as_encoded_bytes());
    }
    h
}

/// The fingerprint of `arena` (see [`fingerprint`]).
#[must_use]
pub fn arena_fingerprint(arena: &ChunkArena) -> u64 {
    fingerprint(arena.num_chunks(), arena.chunk_bytes(), arena.shared_path())
}

fn header(kind: u8, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = kind;
    h[8..12].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    h
}

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The header's magic is wrong: not a kvtier worker.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("unsupported version {0}")]
    BadVersion(u16),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    BadKind(u8),
    /// A payload over [`MAX_PAYLOAD`].
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    /// A payload whose length does not fit its kind.
    #[error("malformed {0} payload")]
    Malformed(&'static str),
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The worker's rank and arena fingerprint.
    Hello {
        /// 0-based tensor-parallel rank.
        rank: u32,
        /// [`fingerprint`] of the worker's arena.
        fingerprint: u64,
    },
    /// Finished copies.
    Stored {
        /// Whether the copies succeeded.
        success: bool,
        /// The keys copied.
        keys: Vec<OffloadKey>,
    },
    /// Clean exit.
    Goodbye,
}

/// Checks a header; returns the kind and the payload length.
///
/// # Errors
/// Wrong magic, version or kind, or a payload over the limit.
pub fn decode_header(h: &[u8; HEADER]) -> Result<(u8, usize), WireError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(WireError::BadVersion(version));
    }
    let kind = h[6];
    if !matches!(kind, KIND_HELLO | KIND_STORED | KIND_GOODBYE) {
        return Err(WireError::BadKind(kind));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLarge(len));
    }
    Ok((kind, len))
}

/// Decodes a payload of `kind`.
///
/// # Errors
/// A payload whose length or content does not fit its kind.
pub fn decode_payload(kind: u8, p: &[u8]) -> Result<Message, WireError> {
    match kind {
        KIND_HELLO => {
            let (Some(rank), Some(fp)) = (p.get(..4), p.get(4..12)) else {
                return Err(WireError::Malformed("hello"));
            };
            if p.len() != 12 {
                return Err(WireError::Malformed("hello"));
            }
            Ok(Message::Hello {
                rank: u32::from_le_bytes(rank.try_into().map_err(|_| WireError::Malformed("hello"))?),
                fingerprint: u64::from_le_bytes(fp.try_into().map_err(|_| WireError::Malformed("hello"))?),
            })
        }
        KIND_STORED => {
            let Some((&flag, rest)) = p.split_first() else {
                return Err(WireError::Malformed("stored"));
            };
            if flag > 1 || rest.len() % WIRE_KEY != 0 {
                return Err(WireError::Malformed("stored"));
            }
            let mut keys = Vec::with_capacity(rest.len() / WIRE_KEY);
            for chunk in rest.chunks_exact(WIRE_KEY) {
                let key = OffloadKey::from_bytes(chunk).ok_or(WireError::Malformed("stored"))?;
                keys.push(key);
            }
            Ok(Message::Stored {
                success: flag == 1,
                keys,
            })
        }
        KIND_GOODBYE if p.is_empty() => Ok(Message::Goodbye),
        KIND_GOODBYE => Err(WireError::Malformed("goodbye")),
        other => Err(WireError::BadKind(other)),
    }
}

/// Encodes a message (header and payload).
#[must_use]
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut payload = Vec::new();
    let kind = match msg {
        Message::Hello { rank, fingerprint } => {
            payload.extend_from_slice(&rank.to_le_bytes());
            payload.extend_from_slice(&fingerprint.to_le_bytes());
            KIND_HELLO
        }
        Message::Stored { success, keys } => {
            payload.reserve(1 + keys.len() * WIRE_KEY);
            payload.push(u8::from(*success));
            for k in keys {
                payload.extend_from_slice(&k.to_bytes());
            }
            KIND_STORED
        }
        Message::Goodbye => KIND_GOODBYE,
    };
    let mut out = header(kind, payload.len()).to_vec();
    out.extend_from_slice(&payload);
    out
}

/// A copy worker's connection to the manager's completion channel.
#[derive(Debug)]
pub struct WorkerReporter {
    stream: UnixStream,
    rank: u32,
}

impl WorkerReporter {
    /// Connects to the channel at `path` as `rank`, presenting the arena `fingerprint`.
    ///
    /// # Errors
    /// The socket cannot be reached or written.
    pub fn connect(path: &Path, rank: u32, fingerprint: u64) -> io::Result<Self> {
        let mut stream = UnixStream::connect(path)?;
        stream.write_all(&encode(&Message::Hello { rank, fingerprint }))?;
        Ok(Self { stream, rank })
    }

    /// This worker's rank.
    #[must_use]
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Reports that the copies of `keys` into their rows finished (or failed). Large batches
    /// are split so each message stays under the payload limit.
    ///
    /// # Errors
    /// The manager closed the channel.
    pub fn report(&mut self, keys: &[OffloadKey], success: bool) -> io::Result<()> {
        let per_message = (MAX_PAYLOAD - 1) / WIRE_KEY;
        for batch in keys.chunks(per_message.max(1)) {
            self.stream.write_all(&encode(&Message::Stored {
                success,
                keys: batch.to_vec(),
            }))?;
        }
        Ok(())
    }

    /// Says goodbye (so the manager does not fail this rank's stores) and closes.
    ///
    /// # Errors
    /// The manager closed the channel first.
    pub fn close(mut self) -> io::Result<()> {
        self.stream.write_all(&encode(&Message::Goodbye))?;
        self.stream.flush()
    }
}

struct Connections {
    streams: Vec<UnixStream>,
    readers: Vec<JoinHandle<()>>,
}

/// The manager's end of the channel: an accept thread and one reader thread per worker.
pub(crate) struct ChannelServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Connections>>,
}

struct ReaderCtx {
    fingerprint: u64,
    reporters: u32,
    queue: Arc<CompletionQueue>,
    waker: ControlWaker,
}

impl ChannelServer {
    pub(crate) fn bind(
        path: &Path,
        fingerprint: u64,
        reporters: u32,
        queue: Arc<CompletionQueue>,
        waker: ControlWaker,
    ) -> io::Result<Self> {
        if path.exists() {
            // A socket file nobody listens on is left over from a dead manager: reclaim it. One
            // that answers belongs to a live manager.
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another manager listens there",
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Connections {
            streams: Vec::new(),
            readers: Vec::new(),
        }));
        let ctx = Arc::new(ReaderCtx {
            fingerprint,
            reporters: reporters.max(1),
            queue,
            waker,
        });
        let accept = {
            let stop = Arc::clone(&stop);
            let conns = Arc::clone(&conns);
            std::thread::Builder::new()
                .name("kvtier-channel".into())
                .spawn(move || accept_loop(&listener, &stop, &conns, &ctx))?
        };
        Ok(Self {
            path: path.to_owned(),
            stop,
            accept: Some(accept),
            conns,
        })
    }

    /// Stops accepting, closes every connection, joins the threads and removes the socket.
    pub(crate) fn stop(mut self) {
        self.shutdown_threads();
    }

    fn shutdown_threads(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept with a connection of our own.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let (streams, readers) = {
            let mut c = self.conns.lock();
            (std::mem::take(&mut c.streams), std::mem::take(&mut c.readers))
        };
        for s in &streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for r in readers {
            let _ = r.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ChannelServer {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.shutdown_threads();
        }
    }
}

fn accept_loop(listener: &UnixListener, stop: &AtomicBool, conns: &Mutex<Connections>, ctx: &Arc<ReaderCtx>) {
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "completion channel: accept failed");
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let ctx = Arc::clone(ctx);
        let spawned = std::thread::Builder::new()
            .name("kvtier-channel-worker".into())
            .spawn(move || read_worker(stream, &ctx));
        match spawned {
            Ok(handle) => {
                let mut c = conns.lock();
                c.streams.push(clone);
                c.readers.push(handle);
            }
            Err(e) => tracing::warn!(error = %e, "completion channel: cannot start a reader"),
        }
    }
}

fn read_message(stream: &mut UnixStream) -> Result<Option<Message>, WireError> {
    let mut h = [0u8; HEADER];
    match stream.read_exact(&mut h) {
        Ok(()) => {}
        Err(_) => return Ok(None),
    }
    let (kind, len) = decode_header(&h)?;
    let mut payload = vec![0u8; len];
    if stream.read_exact(&mut payload).is_err() {
        return Ok(None);
    }
    decode_payload(kind, &payload).map(Some)
}

fn read_worker(mut stream: UnixStream, ctx: &ReaderCtx) {
    let reject = |why: &str| {
        tracing::warn!(reason = why, "completion channel: message rejected");
        ctx.queue.push(WorkerEvent::Rejected);
        ctx.waker.wake();
    };
    let rank = match read_message(&mut stream) {
        Ok(Some(Message::Hello { rank, fingerprint }))
            if fingerprint == ctx.fingerprint && rank < ctx.reporters =>
        {
            rank
        }
        Ok(Some(Message::Hello { rank, fingerprint })) => {
            reject(&format!(
                "hello from rank {rank} with arena fingerprint {fingerprint:#x}: not this manager's arena or rank out of range"
            ));
            return;
        }
        Ok(Some(_)) => {
            reject("the first message was not a hello");
            return;
        }
        Ok(None) => return,
        Err(e) => {
            reject(&e.to_string());
            return;
        }
    };
    ctx.queue.push(WorkerEvent::Joined { rank });
    loop {
        match read_message(&mut stream) {
            Ok(Some(Message::Stored { success, keys })) => {
                ctx.queue.push(WorkerEvent::Stored { rank, keys, success });
                ctx.waker.wake();
            }
            Ok(Some(Message::Goodbye)) => {
                ctx.queue.push(WorkerEvent::Left { rank, clean: true });
                ctx.waker.wake();
                return;
            }
            Ok(Some(Message::Hello { .. })) => {
                reject("a second hello");
                break;
            }
            Ok(None) => break,
            Err(e) => {
                reject(&e.to_string());
                break;
            }
        }
    }
    ctx.queue.push(WorkerEvent::Left { rank, clean: false });
    ctx.waker.wake();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for msg in [
            Message::Hello {
                rank: 3,
                fingerprint: 0xdead_beef,
            },
            Message::Stored {
                success: true,
                keys: vec![OffloadKey::from_u64(1), OffloadKey::new([7; 32], 2)],
            },
            Message::Stored {
                success: false,
                keys: vec![],
            },
            Message::Goodbye,
        ] {
            let bytes = encode(&msg);
            let h: [u8; HEADER] = bytes[..HEADER].try_into().unwrap();
            let (kind, len) = decode_header(&h).unwrap();
            assert_eq!(len, bytes.len() - HEADER);
            assert_eq!(decode_payload(kind, &bytes[HEADER..]).unwrap(), msg);
        }
    }

    #[test]
    fn bad_headers_and_payloads_are_refused() {
        let mut h = header(KIND_STORED, 10);
        h[0] = b'X';
        assert!(matches!(decode_header(&h), Err(WireError::BadMagic(_))));
        let h = header(9, 0);
        assert_eq!(decode_header(&h), Err(WireError::BadKind(9)));
        let mut h = header(KIND_STORED, 0);
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_header(&h), Err(WireError::TooLarge(_))));
        assert_eq!(
            decode_payload(KIND_STORED, &[1, 2, 3]),
            Err(WireError::Malformed("stored"))
        );
        assert_eq!(
            decode_payload(KIND_STORED, &[2]),
            Err(WireError::Malformed("stored"))
        );
        assert_eq!(
            decode_payload(KIND_HELLO, &[0; 11]),
            Err(WireError::Malformed("hello"))
        );
        assert_eq!(
            decode_payload(KIND_GOODBYE, &[0]),
            Err(WireError::Malformed("goodbye"))
        );
    }
}
