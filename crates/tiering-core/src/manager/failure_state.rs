//! What the manager remembers about failures: the policy chosen for a failing tier
//! (`[control_plane] on_tier_failure`), a tier failure an engine call could not return without
//! misreporting what it did (kept for the step's next call), and the manager's own failure once
//! the primary or its own code panicked (then every engine call returns it).
//!
//! What a failure does to the chain (quarantine, failing a tier's jobs) needs the other parts
//! and is `super::faults`'.

use std::sync::Arc;

use crate::error::ManagerError;

use super::config::OnTierFailure;

/// The failure state (see the module docs).
pub(crate) struct FailureState {
    policy: OnTierFailure,
    /// A tier failure met inside an engine call that could not return it without misreporting
    /// the call itself (a cascade submitted from `complete_store`); the step's next call
    /// returns it.
    deferred: Option<ManagerError>,
    /// Set for good once the primary tier or the manager's own code panicked.
    failed: Option<ManagerError>,
}

impl FailureState {
    /// No failure yet, under `policy`.
    pub(crate) fn new(policy: OnTierFailure) -> Self {
        Self {
            policy,
            deferred: None,
            failed: None,
        }
    }

    /// Whether a failing tier is quarantined (rather than reported and kept).
    pub(crate) fn quarantines(&self) -> bool {
        self.policy == OnTierFailure::Quarantine
    }

    /// Keeps `e` for the step's next call, unless a failure is kept already.
    pub(crate) fn defer(&mut self, e: ManagerError) {
        self.deferred.get_or_insert(e);
    }

    /// The failure kept for this call, once.
    pub(crate) fn take_deferred(&mut self) -> Option<ManagerError> {
        // Checked before taking: moving the (large) error type out on every call showed in
        // per-lookup profiles.
        if self.deferred.is_some() {
            self.deferred.take()
        } else {
            None
        }
    }

    /// The manager's failure once it has failed; `primary_failure` is the primary's reason, if
    /// it panicked (that fails the manager now).
    pub(crate) fn failure(&mut self, primary_failure: Option<&String>) -> Option<ManagerError> {
        if self.failed.is_none()
            && let Some(reason) = primary_failure
        {
            tracing::error!(%reason, "the primary tier panicked: the manager fails");
            self.failed = Some(ManagerError::Failed(Arc::from(reason.as_str())));
        }
        self.failed.clone()
    }

    /// Fails the manager for good after a panic of its own code in `call` (or returns the
    /// failure it already had, `primary_failure` included).
    pub(crate) fn fail_after_panic(
        &mut self,
        call: &str,
        message: &str,
        primary_failure: Option<&String>,
    ) -> ManagerError {
        if let Some(e) = self.failure(primary_failure) {
            return e;
        }
        let reason = format!("the manager panicked in {call}: {message}");
        tracing::error!(%reason, "the manager fails");
        let e = ManagerError::Failed(Arc::from(reason.as_str()));
        self.failed = Some(e.clone());
        e
    }
}
