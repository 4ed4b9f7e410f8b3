//! The data plane: chunk bytes over TCP, pushed by the producer straight from its pinned arena
//! rows into the consumer's reserved rows.
//!
//! - [`frame`]: the framing and the per-frame MACs;
//! - [`polyval`]: the universal hash under the payload MAC;
//! - `dest`: the consumer's whitelist of reserved rows (and the quiescence rule);
//! - `receiver`: the consumer's listener and connection threads;
//! - `sender`: registration and the producer's per-consumer sender threads, and the events the
//!   data plane reports to the tier;
//! - `counters`, `faults`: the data plane's counters and its fault injection for tests.
//! - `outgoing`: a transfer's wire image, written in steps (the control thread writes a small
//!   transfer itself, without a hop to the sender thread).

pub(crate) mod dest;
pub mod frame;
pub(crate) mod outgoing;
pub mod polyval;
pub(crate) mod receiver;
pub(crate) mod sender;

mod counters;
mod faults;

pub(crate) use counters::DataCounters;
pub use faults::Faults;
pub(crate) use sender::DataEvent;
