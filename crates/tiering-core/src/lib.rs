//! # tiering-core
//!
//! The contracts of kvtier and its orchestrator.
//!
//! An inference engine evicts KV blocks from the device; kvtier keeps them, in units of
//! fixed-size *chunks* named by [`OffloadKey`], in a CPU [`PrimaryTier`] and cascades them to
//! [`SecondaryTier`]s (disk, peers, third-party stores). A later request that shares a prefix
//! finds them again through [`OffloadingManager::lookup`] on a [`Step`], and the manager
//! promotes them back to the primary tier.
//!
//! [`TieringManager`] composes one primary and an ordered chain of secondaries. Its control
//! plane — polling tiers for finished jobs and letting them serve inbound peer requests — runs on
//! a dedicated thread between scheduler steps, so peers are answered while the model executes.
//!
//! Crate map (every public module; `docs/ARCHITECTURE.md`, "Map", has the crates around it):
//! - [`key`], [`request`], [`outcome`], [`job`], [`event`], [`stats`]: the value types;
//! - [`error`]: the tiers' and the manager's errors;
//! - [`arena`]: the chunk memory and its row grants, in process or shared with workers (the
//!   `tiering-arena` crate, re-exported);
//! - [`tier`], [`offloading`]: the traits (tier contracts, the engine-facing calls);
//! - [`manager`]: the orchestrator, its [`Step`] and its control-plane thread;
//! - [`waker`]: the waker tiers and copy workers signal the control-plane thread with;
//! - [`channel`]: the completion channel copy-worker processes report finished stores on;
//! - [`admission`]: the cascade gates (admission policies, backpressure) and their registry;
//! - [`options`]: the helpers tier factories read their options with (TOML chains themselves
//!   are the `tiering-config` crate's);
//! - [`registry`]: the static tier registry ([`register_tier!`]);
//! - [`ratelog`]: rate-limited warnings for tiers;
//! - [`fetch_trace`]: an opt-in ring of timestamped points that explains slow peer fetches;
//! - `testing` (feature `test-utils`): an in-memory primary, a scriptable secondary, an engine
//!   driver.

pub mod admission;
/// The chunk arena (the `tiering-arena` crate): the row memory every copy goes through.
pub use tiering_arena as arena;
pub mod channel;
pub mod error;
pub mod event;
pub mod fetch_trace;
pub mod job;
pub mod key;
pub mod manager;
pub mod offloading;
pub mod outcome;
pub mod ratelog;
pub mod request;
pub mod stats;
mod sync;
// The model checks of the concurrency protocols (`docs/ARCHITECTURE.md`, "Concurrency checks").
#[cfg(all(test, loom))]
mod loom_models;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod tier;
pub mod waker;

pub use arena::{ArenaError, ArenaOptions, ChunkArena, RowGrant, RowRead, RowWrite};
pub use error::{ControlPlaneFailure, ManagerError, TierError};
pub use event::OffloadingEvent;
pub use job::{JobId, JobKind, JobOutcome, JobResult, TransferJob};
pub use key::{KeyMap, KeySet, OffloadKey};
pub use manager::{
    CostConfig, LoadSource, ManagerConfig, OnTierFailure, RecomputeCost, Step, StoreCompletionSender,
    TierGateConfig, TieringManager,
};
pub use offloading::OffloadingManager;
pub use outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
pub use request::{Locality, Medium, ReqContext, RequestId, TierFilter, TierInfo, TierMatcher};
pub use stats::{ManagerCounters, ManagerStats, PromotionDecisions, TierGateStats, TierStats};
pub use tier::{ParentManager, PrimaryTier, SecondaryTier, TierHealth};
pub use waker::{ControlWaker, FdWatch};
pub mod options;
pub mod registry;
pub use arena::ArenaRawParts;
pub use registry::{PrimaryContext, Registry, SecondaryContext, TierRegistration};
