//! What a fetched round owes the consumer, and the transfers that carry it.
//!
//! The producer role's per-round state holds these and the fetch handling (`fetch`) fills and
//! settles them; they sit below both so that the role's state does not depend on the code that
//! handles fetches.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use tiering_core::{JobId, KeyMap, OffloadKey};

use crate::wire::Message;

/// What a fetched round still owes the consumer.
pub(crate) struct Demand {
    /// The consumer's reserved row for each key of the fetch, by position.
    pub(crate) rows: Vec<u32>,
    /// Per position, whether the chunk was delivered; reported in `transfer_done`.
    pub(crate) key_ok: Vec<bool>,
    /// Keys no chunk has reached yet, with their position in the fetch.
    pub(crate) missing: KeyMap<usize>,
    /// When the missing keys fail.
    pub(crate) deadline: Instant,
    /// Shared with the round's write jobs, so that an abort stops the sender between chunks.
    pub(crate) cancel: Arc<AtomicBool>,
    /// The consumer aborted the round: it ends with `abort_ack` instead of `transfer_done`.
    pub(crate) abort_requested: bool,
    /// Transfers of the round still on the data plane; the round is answered only after they
    /// report, since until then a write may still touch the consumer's rows.
    pub(crate) in_flight: usize,
}

impl Demand {
    /// The round's final answer, once nothing is missing or in flight.
    pub(crate) fn answer(&self, kv: &str, round: u64) -> Option<Message> {
        if !self.missing.is_empty() || self.in_flight > 0 {
            return None;
        }
        Some(if self.abort_requested {
            Message::AbortAck {
                kv_request_id: kv.to_owned(),
                round_seq: round,
            }
        } else {
            Message::TransferDone {
                kv_request_id: kv.to_owned(),
                round_seq: round,
                success: self.key_ok.iter().all(|&o| o),
                key_ok: self.key_ok.clone(),
            }
        })
    }

    /// Whether keys still wait for chunks a later store may bring.
    pub(crate) fn waiting(&self) -> bool {
        !self.missing.is_empty() && !self.abort_requested
    }
}

/// One transfer on the data plane.
pub(crate) struct InFlight {
    /// The kv request id of the round the transfer belongs to.
    pub(crate) kv: String,
    /// The round the transfer belongs to.
    pub(crate) round: u64,
    /// (position in the fetch, key, store job) of each chunk, in send order.
    pub(crate) items: Vec<(usize, OffloadKey, JobId)>,
}
