//! # tier-disk
//!
//! The persistent disk secondary tier of kvtier: bounded, crash-safe, and never serving wrong
//! bytes.
//!
//! - **Storage**: one slab file (`<path>/kvtier-disk.slab`) of fixed slots. Each slot is
//!   `payload | seal block`; consecutive slots of one job are written or read with one vectored
//!   `pwritev`/`preadv`. The seal carries magic, format version, a monotonically increasing
//!   write sequence, the key, the payload length, an xxh3 of the first payload block and an
//!   xxh3 checksum of seal fields + payload. See [`format`](mod@format).
//! - **Writes never overwrite a live chunk**: a store reserves a free slot (or evicts the least
//!   recently used chunk nobody is reading), writes it, and only then flips the index entry
//!   (after `fdatasync` with `sync = "always"`, after the job's one `fdatasync` with
//!   `sync = "batch"`). A store of a key another job is writing ends as that write does: it
//!   reports nothing before the key is durable.
//! - **Index**: in memory, rebuilt at open by scanning every slot's seal and first payload block;
//!   newest sequence wins, torn or damaged slots become free, a slab of another geometry or
//!   format is refused with a clear error (or wiped with `wipe_on_mismatch = true`). Lookups are
//!   answered synchronously (`Hit`/`Miss`, never `Retry`).
//! - **I/O**: at most `io_threads` `pwritev`/`preadv` calls in flight, straight between the arena
//!   rows and the file, with `O_DIRECT` when the filesystem accepts it (probed at open); for
//!   chunks of 128 KiB and more, twice as many threads serve them, so seal checksums and load
//!   verification run while other calls keep the device busy. Loads and stores
//!   have separate queues; loads go first, with a bound ([`LOADS_PER_STORE`]) so stores still
//!   progress. [`DiskTier::io_cost`] reports queue depths and measured cost per MiB.
//! - **Integrity**: every load verifies the seal and the payload checksum before it is
//!   reported; a bad slot fails its key (partial results), is erased and freed, and the key
//!   becomes a `Miss` (a removal event).
//! - **Errors**: a failing write or read fails its keys cleanly and is logged (rate-limited);
//!   the tier keeps serving. `drain_jobs` cancels queued work (reported failed), waits for running
//!   copies, and returns when every job is reported.
//!
//! Registered with the static tier registry as type `disk`: a chain file's `[[secondary]]`
//! table with `type = "disk"` builds a [`DiskTier`] from the remaining keys
//! ([`DiskTierOptions`]). The final binary must name the crate (`use tier_disk as _;`).
//!
//! The design decisions, including the answers to the 33 disk-tier edge cases of the reference
//! notes, are in `crates/tier-disk/DESIGN.md`.
//!
//! ```no_run
//! use tier_disk::{DiskGeometry, DiskTier, DiskTierOptions};
//!
//! let opts: DiskTierOptions = toml::from_str(r#"
//!     path = "/var/tmp/kvtier"
//!     capacity = "64GiB"
//!     sync = "batch"
//! "#).unwrap();
//! let tier = DiskTier::open(&opts, DiskGeometry { chunk_bytes: 2 << 20, row_stride: 2 << 20 }).unwrap();
//! # drop(tier);
//! ```

mod buf;
pub mod error;
mod exec;
#[cfg(feature = "test-utils")]
pub mod faults;
pub mod format;
#[cfg(test)]
mod fuzz;
mod gate;
mod index;
pub mod meter;
pub mod options;
mod pool;
mod recover;
mod registration;
pub mod shape;
mod shared;
mod slab;
#[cfg(feature = "test-utils")]
pub mod testing;
mod tier;

pub use error::DiskError;
#[cfg(feature = "test-utils")]
pub use faults::FaultInjector;
pub use format::SlabLayout;
pub use meter::{DirectionCost, IoCost};
pub use options::{DirectIo, DiskGeometry, DiskTierOptions, SyncPolicy};
pub use pool::LOADS_PER_STORE;
pub use shape::IoShape;
pub use slab::SLAB_FILE;
pub use tier::{DiskTier, RecoveryReport, SlotLocation};
pub use tiering_core::options::ByteSize;
