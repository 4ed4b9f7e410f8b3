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
//!
//! The manager's end has no threads of its own: the listener and every connection are
//! non-blocking and read by whoever applies completions — the control-plane thread, whose wait
//! ends when one of them is readable (the descriptors are watched by its waker), or the
//! scheduler's poll without one. A report thus wakes one thread, not a reader and then the
//! control thread.

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::arena::ChunkArena;
use crate::key::OffloadKey;

mod reports;
mod server;
mod wire;

pub(crate) use reports::{CompletionQueue, WorkerEvent};

pub(crate) use server::ChannelServer;
use wire::WIRE_KEY;
pub use wire::{MAX_PAYLOAD, Message, WireError, decode_header, decode_payload, encode};

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
