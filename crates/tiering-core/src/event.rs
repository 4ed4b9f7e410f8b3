//! Cache events: what a tier stored or removed, for engines that publish KV-cache events.

use crate::key::OffloadKey;
use crate::request::{Locality, Medium};

/// One batch of keys stored in, or removed from, one tier's storage.
///
/// A tier emits events only for storage it owns; a composing manager concatenates its tiers'
/// streams (primary first) and never invents events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadingEvent {
    /// The keys concerned.
    pub keys: Vec<OffloadKey>,
    /// The medium of the emitting tier.
    pub medium: Option<Medium>,
    /// The locality of the emitting tier.
    pub locality: Option<Locality>,
    /// `true` for a removal, `false` for a store.
    pub removed: bool,
    /// The name of the emitting secondary tier; `None` for the primary tier.
    pub ownership: Option<String>,
    /// A removal of metadata only: the keys were reserved but never became readable (a failed
    /// store), so consumers that never saw them stored can ignore it.
    pub metadata_only: bool,
    /// A store whose keys' removal the tier will report too (it evicts them itself), so a
    /// consumer keeps what it knows of the keys until then. `false` for a tier that never
    /// reports removals (a shared store that expires keys on its own).
    pub removal_expected: bool,
}

impl OffloadingEvent {
    /// A store event.
    #[must_use]
    pub fn stored(keys: Vec<OffloadKey>, medium: Option<Medium>, locality: Option<Locality>) -> Self {
        Self {
            keys,
            medium,
            locality,
            removed: false,
            ownership: None,
            metadata_only: false,
            removal_expected: false,
        }
    }

    /// A removal event.
    #[must_use]
    pub fn removed(keys: Vec<OffloadKey>, medium: Option<Medium>, locality: Option<Locality>) -> Self {
        Self {
            removed: true,
            ..Self::stored(keys, medium, locality)
        }
    }

    /// The same event attributed to the named secondary tier.
    #[must_use]
    pub fn owned_by(mut self, tier: impl Into<String>) -> Self {
        self.ownership = Some(tier.into());
        self
    }

    /// The same store event, flagged as one whose removal the tier will report.
    #[must_use]
    pub fn expecting_removal(mut self) -> Self {
        self.removal_expected = !self.removed;
        self
    }

    /// The same event flagged as metadata-only.
    #[must_use]
    pub fn metadata_only(mut self) -> Self {
        self.metadata_only = true;
        self
    }
}
