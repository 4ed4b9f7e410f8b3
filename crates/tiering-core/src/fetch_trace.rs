//! A process-wide trace of where a peer fetch is, for benches that explain their slow fetches
//! (`kvtier bench fetch-rtt --explain-slowest`).
//!
//! Tiers and the manager record `(id, point, time)` at the moments a fetch passes through
//! them: its message read off a socket, its chunks bound and pushed, each chunk landing on the
//! consumer, and the wake-ups of the threads that carry it. `id` is a fetch's request id
//! hashed ([`id_of`]) or, for a thread's wake-up, the identity of the waker it sleeps on
//! ([`crate::ControlWaker::trace_id`]). Switched off (the default) a record point costs one
//! relaxed load and a branch; switched on, one `fetch_add` and two stores into a ring of fixed
//! size (old records are overwritten when it wraps). The ring is read with [`take`] once the
//! traced work has stopped: a record written during `take` may be read half-written.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Records kept before the oldest are overwritten (16 bytes each, allocated when enabled).
const CAPACITY: usize = 1 << 16;

static ENABLED: AtomicBool = AtomicBool::new(false);
static HEAD: AtomicU64 = AtomicU64::new(0);
static EPOCH: OnceLock<Instant> = OnceLock::new();
static RING: OnceLock<Box<[Slot]>> = OnceLock::new();

struct Slot {
    id: AtomicU64,
    /// `(ns + 1) << 8 | point`; 0 while empty.
    stamp: AtomicU64,
}

/// A point of a fetch's way (or of a thread carrying it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Point {
    /// The producer read the fetch message off its control socket on the thread that handles
    /// it (the manager's control thread, or the scheduler in a step).
    FetchRead = 1,
    /// The producer's I/O thread read the fetch message (the handling thread had not drained
    /// the socket in time) and queued it.
    FetchRelayed,
    /// The producer's session handled the fetch: what was stored left at once, the rest waits.
    FetchBound,
    /// A store completed on the producer brought chunks a waiting fetch names.
    StoreOffered,
    /// The producer submitted a transfer of the fetch's chunks to its data plane.
    TransferSubmitted,
    /// The producer's sender thread took a transfer up (or the rest of one its submitter
    /// started).
    SenderPicked,
    /// The producer's sender thread read the consumer's acknowledgement of a transfer.
    TransferAcked,
    /// The consumer's receiver read a transfer's first frame.
    TransferBegun,
    /// One chunk landed and verified in the consumer's row.
    ChunkLanded,
    /// Someone signalled a control waker (id: the waker's).
    WakeSignalled,
    /// A control thread's wait on its waker ended with work to do (id: the waker's).
    ControlWoke,
    /// A control thread took the manager lock for a sweep (id: the waker's).
    ControlLocked,
    /// A control thread's sweep ended and released the lock (id: the waker's).
    ControlSwept,
    /// A tier's I/O thread woke from its poll (id: the waker of the manager it serves).
    IoWoke,
    /// The consumer handed the fetch message to its control socket (the peer's ZeroMQ I/O
    /// thread sends it from there). Recorded as the send call starts, so it precedes whatever
    /// the producer does with the message (a send that fails leaves it for a fetch that then
    /// fails, and is in no landed fetch's timeline).
    FetchSent,
}

impl Point {
    const ALL: [Self; 15] = [
        Self::FetchRead,
        Self::FetchRelayed,
        Self::FetchBound,
        Self::StoreOffered,
        Self::TransferSubmitted,
        Self::SenderPicked,
        Self::TransferAcked,
        Self::TransferBegun,
        Self::ChunkLanded,
        Self::WakeSignalled,
        Self::ControlWoke,
        Self::ControlLocked,
        Self::ControlSwept,
        Self::IoWoke,
        Self::FetchSent,
    ];

    fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|p| *p as u8 == v)
    }
}

/// One record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The fetch ([`id_of`] its request id) or the waker.
    pub id: u64,
    /// Where.
    pub point: Point,
    /// When: nanoseconds since the trace's epoch ([`ns_of`]).
    pub ns: u64,
}

/// Switches recording on or off. The first switch-on fixes the epoch of every timestamp.
pub fn enable(on: bool) {
    if on {
        EPOCH.get_or_init(Instant::now);
        RING.get_or_init(|| {
            (0..CAPACITY)
                .map(|_| Slot {
                    id: AtomicU64::new(0),
                    stamp: AtomicU64::new(0),
                })
                .collect()
        });
    }
    ENABLED.store(on, Ordering::Release);
}

/// Whether records are being kept.
#[inline]
#[must_use]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A request id's trace id (64-bit FNV-1a: stable across the two ends of a fetch and cheap;
/// collisions only merge two fetches' records in a bench's explanation).
#[must_use]
pub fn id_of(request_id: &str) -> u64 {
    request_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `at` in trace time: nanoseconds since the epoch (0 before it, or before the first switch-on).
#[must_use]
pub fn ns_of(at: Instant) -> u64 {
    EPOCH.get().map_or(0, |e| {
        u64::try_from(at.saturating_duration_since(*e).as_nanos()).unwrap_or(u64::MAX >> 9)
    })
}

/// Records `point` of `id` now, when recording is on.
#[inline]
pub fn record(id: u64, point: Point) {
    if enabled() {
        record_now(id, point);
    }
}

/// Records `point` of the fetch of `request_id` now, when recording is on.
#[inline]
pub fn record_request(request_id: &str, point: Point) {
    if enabled() {
        record_now(id_of(request_id), point);
    }
}

#[cold]
fn record_now(id: u64, point: Point) {
    let Some(ring) = RING.get() else {
        return;
    };
    let ns = ns_of(Instant::now()).min(u64::MAX >> 9);
    let i = HEAD.fetch_add(1, Ordering::AcqRel) as usize % CAPACITY;
    let slot = &ring[i];
    slot.id.store(id, Ordering::Relaxed);
    slot.stamp
        .store(((ns + 1) << 8) | u64::from(point as u8), Ordering::Release);
}

/// Takes every record kept (the last `CAPACITY` at most), in recording order, and empties the
/// ring. Call it once the traced work has stopped (see the module docs).
#[must_use]
pub fn take() -> Vec<Record> {
    let Some(ring) = RING.get() else {
        return Vec::new();
    };
    let head = HEAD.swap(0, Ordering::AcqRel) as usize;
    let first = head.saturating_sub(CAPACITY);
    let mut out = Vec::with_capacity(head - first);
    for n in first..head {
        let slot = &ring[n % CAPACITY];
        let stamp = slot.stamp.swap(0, Ordering::AcqRel);
        if stamp == 0 {
            continue;
        }
        let Some(point) = Point::from_u8((stamp & 0xff) as u8) else {
            continue;
        };
        out.push(Record {
            id: slot.id.load(Ordering::Relaxed),
            point,
            ns: (stamp >> 8) - 1,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_kept_only_while_enabled_and_taken_in_order() {
        // The only test touching the global ring, so tests running in parallel cannot mix in.
        let _ = take();
        record_request("off", Point::FetchRead);
        enable(true);
        let before = ns_of(Instant::now());
        record_request("kv-1", Point::FetchRead);
        record(7, Point::ControlWoke);
        enable(false);
        record_request("kv-1", Point::ChunkLanded);
        let got = take();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!((got[0].id, got[0].point), (id_of("kv-1"), Point::FetchRead));
        assert_eq!((got[1].id, got[1].point), (7, Point::ControlWoke));
        assert!(got[0].ns >= before && got[1].ns >= got[0].ns);
        assert!(take().is_empty(), "taking empties the ring");
        assert_ne!(id_of("kv-1"), id_of("kv-2"));
        for p in Point::ALL {
            assert_eq!(Point::from_u8(p as u8), Some(p));
        }
    }
}
