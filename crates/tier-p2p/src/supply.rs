//! The producer's supply: chunks pinned through the `ParentManager` and held until a peer's
//! fetch binds them to its rows.
//!
//! Both the tier's shared state (the `remote_decoder` chunks parked per kv request id, in
//! `core`) and the producer role (a round's chunks, in `server`) hold these; they live here, below
//! both, so that neither has to reach into the other for them.

use std::time::Instant;

use tiering_core::{JobId, OffloadKey, arena::RowRead};

/// A pinned chunk waiting for a fetch.
pub(crate) struct Supply {
    /// The store job that pinned the chunk; resolved per key once the chunk is delivered or
    /// released, so the job reports only when every chunk it pinned has an outcome.
    pub(crate) job: JobId,
    /// The pinned row the chunk is pushed from; dropping it releases the pin.
    pub(crate) src: RowRead,
}

/// Chunks of a `remote_decoder` request, pinned until a fetch for its id binds them.
pub(crate) struct Parked {
    /// When the first chunk was parked: the park deadline counts from here.
    pub(crate) since: Instant,
    /// The parked chunks, in store order (a key may appear twice; the fetch releases the
    /// duplicate).
    pub(crate) items: Vec<(OffloadKey, Supply)>,
}
