//! The gates on cascades to each secondary tier: its admission policy, its backpressure, and
//! the memory of chunks it refused, which a later access may still let through
//! (`docs/ARCHITECTURE.md`, "Admission and backpressure").

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::admission::{
    Access, AdmissionConfig, AdmissionContext, AdmissionPolicy, BackpressureDetector, Clock, LruMap,
};
use crate::job::JobId;
use crate::key::OffloadKey;
use crate::request::TierInfo;
use crate::stats::TierGateStats;

use super::config::ManagerConfig;

/// Refused chunks remembered per tier (least recent forgotten first).
const MAX_REFUSED: usize = 65_536;

const MIB: f64 = 1024.0 * 1024.0;

/// What the gates decided for one cascade.
pub(crate) struct Verdict {
    /// Keys to submit.
    pub(crate) admitted: Vec<OffloadKey>,
    /// The submission is a backpressure probe.
    pub(crate) probe: bool,
}

struct Backpressure {
    detector: BackpressureDetector,
    last_probe: Option<Instant>,
    probe_in_flight: Option<JobId>,
}

struct TierGate {
    policy: Box<dyn AdmissionPolicy>,
    backpressure: Backpressure,
    refused: LruMap<()>,
    stats: TierGateStats,
}

struct Submitted {
    tier: usize,
    at: Instant,
    bytes: u64,
}

/// Every secondary tier's gates, indexed like the chain.
pub(crate) struct Gates {
    tiers: Vec<TierGate>,
    submitted: HashMap<JobId, Submitted>,
    clock: Clock,
}

impl Gates {
    /// Gates for tiers described by `(info, capacity in chunks)`, from `config.tier_gates`.
    pub(crate) fn new(tiers: &[(TierInfo, u64)], config: &ManagerConfig) -> Self {
        let tiers = tiers
            .iter()
            .map(|(info, capacity)| {
                let gate = config.tier_gates.get(&info.name).cloned().unwrap_or_default();
                let admission = gate.admission.unwrap_or_else(AdmissionConfig::always);
                let ctx = AdmissionContext::new(&info.name, Some(*capacity));
                let policy = admission.build(&ctx).unwrap_or_else(|e| {
                    tracing::error!(tier = %info.name, error = %e, "admission policy refused; admitting everything");
                    Box::new(AlwaysAdmit)
                });
                TierGate {
                    policy,
                    backpressure: Backpressure {
                        detector: BackpressureDetector::new(gate.backpressure),
                        last_probe: None,
                        probe_in_flight: None,
                    },
                    refused: LruMap::new(),
                    stats: TierGateStats {
                        tier: info.name.clone(),
                        admission: admission.to_string(),
                        ..TierGateStats::default()
                    },
                }
            })
            .collect();
        Self {
            tiers,
            submitted: HashMap::new(),
            clock: config.gate_clock.clone(),
        }
    }

    /// Tells every tier's policy about an access.
    pub(crate) fn on_access(&mut self, keys: &[OffloadKey], access: Access) {
        for gate in &mut self.tiers {
            gate.policy.on_access(keys, access);
        }
    }

    /// The keys of `keys` tier `idx` refused earlier and would admit now (forgotten as refused;
    /// the caller cascades them or the gates refuse them again).
    pub(crate) fn readmitted(&mut self, idx: usize, keys: &[OffloadKey]) -> Vec<OffloadKey> {
        let Some(gate) = self.tiers.get_mut(idx) else {
            return Vec::new();
        };
        if gate.refused.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for key in keys {
            if gate.refused.contains(key) && !out.contains(key) && gate.policy.admit(key) {
                gate.refused.remove(key);
                out.push(*key);
            }
        }
        out
    }

    /// Decides a cascade of `keys` to tier `idx`: admission first, then backpressure. Refused
    /// and dropped keys are remembered as refused.
    pub(crate) fn check(&mut self, idx: usize, keys: &[OffloadKey], admission: bool) -> Verdict {
        let now = self.clock.now();
        let Some(gate) = self.tiers.get_mut(idx) else {
            return Verdict {
                admitted: keys.to_vec(),
                probe: false,
            };
        };
        let mut admitted = Vec::with_capacity(keys.len());
        for key in keys {
            if !admission || gate.policy.admit(key) {
                admitted.push(*key);
            } else {
                gate.stats.admission_rejections += 1;
                remember(&mut gate.refused, *key);
            }
        }
        if admitted.is_empty() {
            return Verdict {
                admitted,
                probe: false,
            };
        }
        let bp = &mut gate.backpressure;
        if !bp.detector.is_pressured() {
            return Verdict {
                admitted,
                probe: false,
            };
        }
        let probe_due = bp.probe_in_flight.is_none()
            && bp
                .last_probe
                .is_none_or(|t| now.duration_since(t) >= bp.detector.config().probe_interval);
        if probe_due {
            bp.last_probe = Some(now);
            gate.stats.backpressure_probes += 1;
            return Verdict {
                admitted,
                probe: true,
            };
        }
        gate.stats.backpressure_dropped_jobs += 1;
        gate.stats.backpressure_dropped_chunks += admitted.len() as u64;
        for key in admitted {
            remember(&mut gate.refused, key);
        }
        Verdict {
            admitted: Vec::new(),
            probe: false,
        }
    }

    /// A cascade job of `keys` (`bytes` long) went to tier `idx`.
    pub(crate) fn submitted(
        &mut self,
        idx: usize,
        job: JobId,
        keys: &[OffloadKey],
        bytes: u64,
        probe: bool,
        late: bool,
    ) {
        let Some(gate) = self.tiers.get_mut(idx) else {
            return;
        };
        gate.policy.on_cascaded(keys);
        if late {
            gate.stats.late_admissions += keys.len() as u64;
        }
        if probe {
            gate.backpressure.probe_in_flight = Some(job);
        }
        self.submitted.insert(
            job,
            Submitted {
                tier: idx,
                at: self.clock.now(),
                bytes,
            },
        );
    }

    /// A submitted cascade failed before reaching the tier.
    pub(crate) fn not_submitted(&mut self, job: JobId) {
        self.finished(job, false, Duration::ZERO);
    }

    /// A job finished (any job: only cascades are tracked). A successful cascade is a latency
    /// sample of its tier: the submission-to-completion time the tier reported (`reported`,
    /// which includes the job's queueing in the tier), or, when it reported none, the time from
    /// submission to the manager seeing the result. The tier's figure comes first because the
    /// manager's own includes its polling delay: a step-driven manager sees a result only at the
    /// next step, which on an idle engine says nothing about the tier.
    pub(crate) fn finished(&mut self, job: JobId, ok: bool, reported: Duration) {
        let Some(s) = self.submitted.remove(&job) else {
            return;
        };
        let Some(gate) = self.tiers.get_mut(s.tier) else {
            return;
        };
        let bp = &mut gate.backpressure;
        if bp.probe_in_flight == Some(job) {
            bp.probe_in_flight = None;
        }
        if !ok || s.bytes == 0 {
            return;
        }
        let now = self.clock.now();
        let elapsed = if reported.is_zero() {
            now.saturating_duration_since(s.at)
        } else {
            reported
        }
        .as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let per_mib = elapsed / (s.bytes as f64 / MIB);
        if let Some(on) = bp.detector.record(per_mib) {
            let ema = bp.detector.ema_seconds_per_mib().unwrap_or_default();
            if on {
                // The first probe goes out one interval after pressure turned on.
                bp.last_probe = Some(now);
                gate.stats.backpressure_activations += 1;
                tracing::warn!(tier = %gate.stats.tier, ema_seconds_per_mib = ema, "backpressure on: cascades to the tier are dropped");
            } else {
                tracing::info!(tier = %gate.stats.tier, ema_seconds_per_mib = ema, "backpressure off: cascades to the tier resume");
            }
        }
    }

    /// After `reset_cache`: the primary is empty, so refusals are moot; backpressure starts over.
    /// The policies keep their frequency history (the secondaries keep their data).
    pub(crate) fn reset(&mut self) {
        for gate in &mut self.tiers {
            gate.refused.clear();
            gate.backpressure.detector.reset();
            gate.backpressure.last_probe = None;
            gate.backpressure.probe_in_flight = None;
        }
        self.submitted.clear();
    }

    /// Per-tier figures, in chain order.
    pub(crate) fn stats(&self) -> Vec<TierGateStats> {
        self.tiers
            .iter()
            .map(|g| TierGateStats {
                backpressure_active: g.backpressure.detector.is_pressured(),
                store_seconds_per_mib: g.backpressure.detector.ema_seconds_per_mib(),
                ..g.stats.clone()
            })
            .collect()
    }
}

fn remember(refused: &mut LruMap<()>, key: OffloadKey) {
    if refused.touch(&key).is_some() {
        return;
    }
    if refused.len() >= MAX_REFUSED {
        refused.pop_oldest();
    }
    refused.insert(key, ());
}

/// The fallback when a configured policy cannot be built for a tier.
struct AlwaysAdmit;

impl AdmissionPolicy for AlwaysAdmit {
    fn on_access(&mut self, _keys: &[OffloadKey], _access: Access) {}

    fn admit(&mut self, _key: &OffloadKey) -> bool {
        true
    }
}
