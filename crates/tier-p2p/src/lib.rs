//! The peer-to-peer secondary tier of kvtier: peers share offloaded chunks.
//!
//! A consumer that misses locally asks a peer that holds the chunks (the peer is named by the
//! request's transfer parameters), and the peer answers from the manager's control-plane
//! thread, without waiting for its next scheduler step.
//!
//! - **Control plane** ([`wire`], `transport`): ZeroMQ, one ROUTER bound per node and one
//!   DEALER per remote peer whose identity is this node's `host:port`; ZMTP heartbeats;
//!   non-blocking sends with a bounded high-water mark; versioned msgpack messages
//!   `connect, connect_ack, disconnect, lookup, lookup_resp, fetch, transfer_done, abort_fetch,
//!   abort_ack`. Messages are sent from the thread that produced them, and read from the
//!   ROUTER by the thread that handles them (the manager's control thread wakes on the
//!   ROUTER's descriptor); the tier's I/O thread watches connections and reads the ROUTER
//!   only while the manager lock keeps the tier from doing so (flood budget).
//! - **Sessions** (`session`, `client`, `server`): one per peer with a consumer and a producer
//!   role: probes batched per step, rounds, pin-before-answer through
//!   [`ParentManager`](tiering_core::ParentManager), per-key results, deadlines.
//! - **Authentication** ([`auth`]): a shared secret authenticates each `connect` and keys a
//!   per-session MAC on every data-plane frame (BLAKE3 keyed mode).
//! - **Data plane** ([`dataplane`]): TCP; the producer pushes chunks (key and MAC per
//!   chunk) straight from its pinned rows into the consumer's reserved rows, which are the only
//!   rows the consumer accepts writes for; `transfer_done` leaves only after the consumer
//!   acknowledged every row, and a row is released only once no write can touch it. The
//!   consumer lands a load as soon as every row arrived and verified (no write can reach a
//!   verified row), without waiting the control hop for `transfer_done`.
//!
//! Request parameters: `remote_kv_source = {kv_request_id, host, port}` (probe, then pull the
//! hits), `remote_prefiller = {…}` (pull everything, no probe) and `remote_decoder =
//! {kv_request_id}` (park this request's stored chunks for whoever fetches that id).
//!
//! The prefill→decode hand-off: a `remote_prefiller` fetch may reach the producer before the
//! producer stored the chunks. Its missing keys then wait (up to the producer's load deadline)
//! and leave from inside the `submit_store` that brings them — the cascade of the producer's
//! store, which with the manager's off-step completions runs on the control thread as soon as
//! the device copy finished, without waiting for the producer's next scheduler step.

pub mod auth;
mod client;
mod core;
pub mod dataplane;
mod error;
mod failure;
mod handle;
mod notify;
mod options;
mod params;
mod registration;
mod resolve;
mod server;
mod session;
mod stats;
mod supply;
mod tier;
mod transport;
pub mod wire;

pub use auth::SharedSecret;
pub use error::P2pError;
pub use failure::PeerFailure;
pub use handle::P2pHandle;
pub use options::{Deadlines, Heartbeat, Inbound, P2pTierOptions};
pub use resolve::canonical_peer;
pub use stats::P2pCounters;
pub use tier::P2pTier;
