//! Construction options of a [`TieringManager`](super::TieringManager).

use std::collections::BTreeMap;
use std::time::Duration;

use super::backoff::PromotionBackoffConfig;
use super::cost::CostConfig;
use crate::admission::{AdmissionConfig, BackpressureConfig, Clock};

/// What the manager does with a secondary tier whose control-plane work failed (an error, an
/// invalid job report, or a panic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTierFailure {
    /// The tier leaves the chain: it is no longer looked up, stored to or served; its in-flight
    /// jobs are reported failed and their pins released once the tier has stopped. The manager
    /// keeps serving with the remaining tiers.
    #[default]
    Quarantine,
    /// The control-plane thread stops and the manager falls back to servicing every tier from
    /// the scheduler thread at step end (the tier stays in the chain).
    Fail,
}

/// Construction options of a [`TieringManager`](super::TieringManager).
///
/// Off-step store completions are switched on by one field, [`ManagerConfig::off_step`]
/// (`[control_plane] off_step = true` in a chain file): the engine's copy workers then report
/// every finished device→primary store (in process through a
/// [`StoreCompletionSender`](super::StoreCompletionSender), or from worker processes over the
/// [completion channel](crate::channel)), the control thread completes and cascades it at once,
/// and the engine's own `complete_store` of the same keys is absorbed. With tensor parallelism,
/// [`ManagerConfig::reporters`] is the number of ranks that must all report a key.
#[derive(Clone, Debug, PartialEq)]
pub struct ManagerConfig {
    /// Run the control plane on a dedicated thread (started when the manager is built, if at
    /// least one secondary tier opts in). `false` keeps everything step-driven.
    pub control_plane_thread: bool,
    /// Longest idle wait of the control thread when no tier signals the waker and no tier
    /// deadline is nearer. Tiers that need finer wake-ups report them through
    /// `SecondaryTier::next_deadline`.
    pub idle_wait: Duration,
    /// How long the control thread waits for the lock before re-checking the stop flag.
    pub lock_timeout: Duration,
    /// How often a starved control thread warns.
    pub starvation_warning: Duration,
    /// How long `shutdown` waits for the control thread to exit.
    pub join_timeout: Duration,
    /// How long `shutdown` waits for the lock after that (a control thread stuck in a tier
    /// still holds it).
    pub shutdown_lock_timeout: Duration,
    /// The hung-tier bound: one tier's `drain_jobs` or `shutdown` that takes longer is reported
    /// and abandoned (quarantined), never waited on forever; and a step, handle hook, reset or
    /// shutdown waiting for the lock while its holder has been inside one tier call this long
    /// gives up with `ManagerError::TierTimedOut` naming the tier and the call.
    pub tier_timeout: Duration,
    /// Off-step store completions (see the type's docs).
    pub off_step: bool,
    /// Copy workers (tensor-parallel ranks) that report each store in off-step mode; a key
    /// completes off-step once all of them reported it. At least 1.
    pub reporters: u32,
    /// How long after a reporting worker disconnects without saying goodbye the stores it had
    /// not reported are failed.
    pub worker_deadline: Duration,
    /// What happens to a tier whose control-plane work fails.
    pub on_tier_failure: OnTierFailure,
    /// When a secondary hit is worth promoting and how long the engine waits for it (`[cost]`
    /// in a chain file). The default has no recompute cost: every hit is promoted.
    pub cost: CostConfig,
    /// Admission and backpressure per secondary tier, by tier name (a chain's `admission` and
    /// `backpressure` keys). A tier not named gets [`TierGateConfig::default`]: `always`, with
    /// backpressure on. A chain names every tier, with the defaults for its medium.
    pub tier_gates: BTreeMap<String, TierGateConfig>,
    /// The clock backpressure times cascades with and promotion back-offs are timed by (a
    /// manual one in tests).
    pub gate_clock: Clock,
    /// How long a secondary tier whose promotion failed is skipped by lookups (of the failed
    /// keys, or of every key once its promotions keep failing); `[control_plane]
    /// promotion_backoff` and `promotion_backoff_max` in a chain file.
    pub promotion_backoff: PromotionBackoffConfig,
}

/// The gates on cascades to one secondary tier (`docs/ARCHITECTURE.md`, "Admission and
/// backpressure").
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierGateConfig {
    /// The admission policy; `None` is `always`. A chain fills in
    /// [`AdmissionConfig::default_for`] the tier (`after_first_reuse` for local storage).
    pub admission: Option<AdmissionConfig>,
    /// Backpressure (on by default, vLLM's settings).
    pub backpressure: BackpressureConfig,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            control_plane_thread: true,
            idle_wait: Duration::from_millis(100),
            lock_timeout: Duration::from_secs(1),
            starvation_warning: Duration::from_secs(10),
            join_timeout: Duration::from_secs(2),
            shutdown_lock_timeout: Duration::from_secs(10),
            tier_timeout: Duration::from_secs(10),
            off_step: false,
            reporters: 1,
            worker_deadline: Duration::from_secs(5),
            on_tier_failure: OnTierFailure::Quarantine,
            tier_gates: BTreeMap::new(),
            gate_clock: Clock::system(),
            cost: CostConfig::default(),
            promotion_backoff: PromotionBackoffConfig::default(),
        }
    }
}

impl ManagerConfig {
    /// The fully step-driven configuration (no control thread), for deterministic tests.
    #[must_use]
    pub fn step_driven() -> Self {
        Self {
            control_plane_thread: false,
            ..Self::default()
        }
    }
}
