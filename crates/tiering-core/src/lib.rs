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
//! Locking: every engine call runs under the manager's one lock. [`TieringManager::step`] takes it
//! for a scheduler step and returns a [`Step`] that carries the calls; the [`OffloadingManager`]
//! methods on the handle take it per call. Inside, the work is done by methods named `…_unlocked`
//! on [`TieringState`] (the state behind the lock): the suffix says the caller already holds the
//! lock, so they never take it again. A [`ParentManager`] handed to a serving tier borrows that
//! state the same way.
//!
//! Paths: the value types, the traits, the manager and its errors are at the crate root; the
//! subsystems a user reaches into are modules. Each item has one public path.
//! - value types: [`OffloadKey`], [`KeyMap`], [`ReqContext`], [`TierInfo`], [`TierFilter`],
//!   [`LookupResult`], [`TransferJob`], [`JobResult`], [`OffloadingEvent`], [`ManagerStats`], …;
//! - contracts: [`PrimaryTier`], [`SecondaryTier`], [`ParentManager`], [`OffloadingManager`];
//! - the orchestrator: [`TieringManager`], [`Step`], [`ManagerConfig`], [`ControlWaker`];
//! - errors: [`TierError`], [`ManagerError`];
//! - [`arena`]: the chunk memory and its row grants, in process or shared with workers (the
//!   `tiering-arena` crate, re-exported);
//! - [`channel`]: the completion channel copy-worker processes report finished stores on;
//! - [`admission`]: the cascade gates (admission policies, backpressure) and their registry;
//! - [`options`]: the helpers tier factories read their options with (TOML chains themselves
//!   are the `tiering-config` crate's);
//! - [`registry`]: the static tier registry ([`register_tier!`]);
//! - [`fetch_trace`]: an opt-in ring of timestamped points that explains slow peer fetches;
//! - `testing` (feature `test-utils`): an in-memory primary, a scriptable secondary, an engine
//!   driver.
//!
//! `docs/ARCHITECTURE.md`, "Map", has the crates around this one and the manager's parts.

pub mod admission;
/// The chunk arena (the `tiering-arena` crate): the row memory every copy goes through.
pub use tiering_arena as arena;
pub mod channel;
mod error;
mod event;
pub mod fetch_trace;
mod job;
mod key;
mod manager;
mod offloading;
pub mod options;
mod outcome;
pub mod registry;
mod request;
mod stats;
mod sync;
// The model checks of the concurrency protocols (`docs/ARCHITECTURE.md`, "Concurrency checks").
#[cfg(all(test, loom))]
mod loom_models;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
mod tier;
mod waker;

pub use error::{ControlPlaneFailure, ManagerError, TierError, panic_message};
pub use event::OffloadingEvent;
pub use job::{JobId, JobKind, JobOutcome, JobResult, TransferJob};
pub use key::{KEY_BYTES, KEY_HASH_BYTES, KeyBuildHasher, KeyHasher, KeyMap, KeySet, OffloadKey};
pub use manager::{
    CostConfig, LoadSource, ManagerConfig, OnTierFailure, PromotionBackoffConfig, RecomputeCost, Step,
    StoreCompletionSender, TierGateConfig, TieringManager, TieringState,
};
pub use offloading::OffloadingManager;
pub use outcome::{LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
pub use request::{
    Locality, Medium, ReqContext, ReqContextBuilder, ReqLiveness, RequestId, TierFilter, TierInfo,
    TierMatcher, TransferParams,
};
pub use stats::{ManagerCounters, ManagerStats, PromotionDecisions, TierGateStats, TierStats};
pub use tier::{ParentManager, PrimaryTier, Redescribed, SecondaryTier, TierHealth};
pub use waker::{ControlWaker, FdWatch};
