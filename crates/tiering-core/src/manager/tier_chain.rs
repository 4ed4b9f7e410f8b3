//! The chain of secondary tiers: one slot per tier in lookup-priority order, with the record
//! of the tier call in progress and whether the control thread services the tiers that opted
//! in to it.
//!
//! A slot's tier is absent while the tier serves peers (taken out for the call, which keeps it
//! out of every fan-out by construction) and for good once it is quarantined; every call goes
//! through [`TierChain::call`], the panic boundary for secondary tiers (`super::tier_call`).
//! What a panic leads to (quarantine or an error) is the failure policy's, `super::faults`.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{ManagerError, TierError};
use crate::request::TierInfo;
use crate::tier::SecondaryTier;
use crate::waker::ControlWaker;

use super::tier_call::{Op, TierCalls, catch};

/// One secondary tier in the chain.
struct TierSlot {
    info: TierInfo,
    /// `None` while the tier is serving peers, and for good once it is quarantined.
    tier: Option<Box<dyn SecondaryTier>>,
    /// The tier opted in to the control thread (`SecondaryTier::needs_control_plane`).
    on_control_plane: bool,
    /// Why the tier left the chain, once it did.
    quarantined: Option<String>,
}

/// The secondary tiers (see the module docs).
pub(crate) struct TierChain {
    slots: Vec<TierSlot>,
    /// The secondary tier call in progress, for threads waiting for the lock.
    calls: Arc<TierCalls>,
    /// How long a tier call may block before the tier is abandoned (`tier_timeout`).
    timeout: Duration,
    /// Set while the control-plane thread runs: it alone polls and serves the opted-in tiers.
    control_thread_live: bool,
}

/// What describing the tiers found, for the parts sized by the chain.
pub(crate) struct Described {
    /// Each tier's capacity in chunks (0 for a tier that starts quarantined).
    pub(crate) capacities: Vec<u64>,
    /// Tiers that panicked while described and start quarantined.
    pub(crate) quarantined: u64,
}

impl TierChain {
    /// The chain over `secondaries`; each is handed `waker` first, if given. A secondary that
    /// panics while it is described (`set_waker`, `info`, `needs_control_plane`, `stats`)
    /// starts quarantined.
    pub(crate) fn describe(
        secondaries: Vec<Box<dyn SecondaryTier>>,
        waker: Option<&ControlWaker>,
        timeout: Duration,
    ) -> (Self, Described) {
        let n = secondaries.len();
        let mut slots = Vec::with_capacity(n);
        let mut capacities = Vec::with_capacity(n);
        let mut quarantined = 0;
        for (idx, mut tier) in secondaries.into_iter().enumerate() {
            // The call in progress, read after a panic.
            let op = std::cell::Cell::new(Op::SetWaker);
            let described = catch(|| {
                if let Some(w) = waker {
                    tier.set_waker(w.clone());
                }
                op.set(Op::Info);
                let info = tier.info();
                op.set(Op::NeedsControlPlane);
                let on_control_plane = tier.needs_control_plane();
                op.set(Op::Stats);
                (info, on_control_plane, tier.stats().capacity_chunks)
            });
            match described {
                Ok((info, on_control_plane, capacity)) => {
                    capacities.push(capacity);
                    slots.push(TierSlot {
                        info,
                        on_control_plane,
                        tier: Some(tier),
                        quarantined: None,
                    });
                }
                Err(message) => {
                    let name = format!("secondary #{idx}");
                    let reason = ManagerError::tier(
                        &name,
                        TierError::Panicked {
                            call: op.get().name(),
                            message,
                        },
                    )
                    .to_string();
                    tracing::error!(%reason, "a tier panicked while it was described; it starts quarantined");
                    // Dropping it may panic too; it is gone either way.
                    let _ = catch(move || drop(tier));
                    quarantined += 1;
                    capacities.push(0);
                    slots.push(TierSlot {
                        info: TierInfo::new(&name, None, None),
                        on_control_plane: false,
                        tier: None,
                        quarantined: Some(reason),
                    });
                }
            }
        }
        let names = slots.iter().map(|s| s.info.name.clone()).collect();
        let chain = Self {
            slots,
            calls: Arc::new(TierCalls::new(names)),
            timeout,
            control_thread_live: false,
        };
        (
            chain,
            Described {
                capacities,
                quarantined,
            },
        )
    }

    /// Number of secondary tiers (quarantined ones included).
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the chain has no secondary tier.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether tier `idx` is in its slot (not quarantined, not serving peers right now).
    pub(crate) fn present(&self, idx: usize) -> bool {
        self.slots[idx].tier.is_some()
    }

    /// Tier `idx`'s description.
    pub(crate) fn info(&self, idx: usize) -> &TierInfo {
        &self.slots[idx].info
    }

    /// Tier `idx`'s name.
    pub(crate) fn name(&self, idx: usize) -> &str {
        &self.slots[idx].info.name
    }

    /// Tier `idx`'s name, or `#idx` for an index outside the chain (a tier's report may name
    /// anything).
    pub(crate) fn name_or_index(&self, idx: usize) -> String {
        self.slots
            .get(idx)
            .map_or_else(|| format!("#{idx}"), |s| s.info.name.clone())
    }

    /// Every tier's description, in chain order.
    pub(crate) fn infos(&self) -> impl Iterator<Item = &TierInfo> {
        self.slots.iter().map(|s| &s.info)
    }

    /// Whether tier `idx` opted in to the control thread.
    pub(crate) fn on_control_plane(&self, idx: usize) -> bool {
        self.slots.get(idx).is_some_and(|s| s.on_control_plane)
    }

    /// Whether any tier opted in to the control thread.
    pub(crate) fn any_on_control_plane(&self) -> bool {
        self.slots.iter().any(|s| s.on_control_plane)
    }

    /// Whether the control-plane thread runs (and so owns the opted-in tiers).
    pub(crate) fn control_thread_live(&self) -> bool {
        self.control_thread_live
    }

    /// The control-plane thread started (`true`) or stopped (`false`).
    pub(crate) fn set_control_thread_live(&mut self, live: bool) {
        self.control_thread_live = live;
    }

    /// Whether the control thread (not the scheduler thread) polls and serves tier `idx`.
    pub(crate) fn control_thread_owns(&self, idx: usize) -> bool {
        self.control_thread_live && self.slots[idx].on_control_plane
    }

    /// Calls tier `idx` through the panic boundary, recording the call while it runs. `None`:
    /// the tier is absent. `Some(Err(message))`: it panicked (the caller applies the failure
    /// policy).
    pub(crate) fn call<R>(
        &mut self,
        idx: usize,
        op: Op,
        f: impl FnOnce(&mut dyn SecondaryTier) -> R,
    ) -> Option<Result<R, String>> {
        let tier = self.slots.get_mut(idx)?.tier.as_mut()?;
        let mark = self.calls.enter(idx, op);
        let outcome = catch(|| f(tier.as_mut()));
        self.calls.leave(mark);
        Some(outcome)
    }

    /// Takes tier `idx` out of its slot: to serve peers (put it back with
    /// [`TierChain::put_back`]) or to call it bounded on a helper thread.
    pub(crate) fn take(&mut self, idx: usize) -> Option<Box<dyn SecondaryTier>> {
        self.slots.get_mut(idx)?.tier.take()
    }

    /// Puts tier `idx` back in its slot.
    pub(crate) fn put_back(&mut self, idx: usize, tier: Box<dyn SecondaryTier>) {
        self.slots[idx].tier = Some(tier);
    }

    /// Records a call of tier `idx` (taken out of its slot) as in progress; returns the mark
    /// to hand to [`TierChain::leave`].
    pub(crate) fn enter(&self, idx: usize, op: Op) -> u64 {
        self.calls.enter(idx, op)
    }

    /// Ends the call [`TierChain::enter`] recorded.
    pub(crate) fn leave(&self, mark: u64) {
        self.calls.leave(mark);
    }

    /// The record of the call in progress, shared with the threads that wait for the lock and
    /// with the helper threads of bounded calls.
    pub(crate) fn calls(&self) -> &Arc<TierCalls> {
        &self.calls
    }

    /// How long a blocking tier call may take (`tier_timeout`).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether tier `idx` left the chain.
    pub(crate) fn is_quarantined(&self, idx: usize) -> bool {
        self.slots[idx].quarantined.is_some()
    }

    /// Marks tier `idx` quarantined for `reason`; false if there is no such tier or it already
    /// was. The tier itself stays in its slot until it is retired.
    pub(crate) fn mark_quarantined(&mut self, idx: usize, reason: &str) -> bool {
        let Some(slot) = self.slots.get_mut(idx) else {
            return false;
        };
        if slot.quarantined.is_some() {
            return false;
        }
        slot.quarantined = Some(reason.to_owned());
        true
    }

    /// The names of the quarantined tiers with the reason each left the chain.
    pub(crate) fn quarantined(&self) -> Vec<(String, String)> {
        self.slots
            .iter()
            .filter_map(|s| {
                s.quarantined
                    .as_ref()
                    .map(|why| (s.info.name.clone(), why.clone()))
            })
            .collect()
    }
}
