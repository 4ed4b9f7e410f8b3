//! `kvtier check`'s validation: every tier of a chain checked by its registered type's
//! validate-only hook ([`tiering_core::TierRegistration::validate`]) — no allocation, no files,
//! no sockets — plus the chain-level checks (types, roles, capacities, names, paths), all errors
//! reported with file:line:key.

use tiering_core::Registry;
use tiering_core::config::{ChainConfig, ChainError};

/// What checking one chain found.
#[derive(Debug, Default)]
pub struct ChainCheck {
    /// Every error, in file order.
    pub errors: Vec<ChainError>,
    /// Tiers whose options could not be checked without building them (a type registered
    /// without a validate hook, or a tier library), one line each.
    pub unchecked: Vec<String>,
}

/// Checks `chain` against `registry` without building anything.
#[must_use]
pub fn check_chain(chain: &ChainConfig, registry: &Registry) -> ChainCheck {
    let errors = chain.validate(registry);
    let unchecked = chain
        .tiers()
        .filter_map(|spec| {
            let why = if spec.library.is_some() {
                "comes from a tier library"
            } else if registry.get(&spec.tier_type).is_some_and(|r| !r.validates()) {
                "has no validate-only hook"
            } else {
                return None;
            };
            Some(format!(
                "{}:{}: {}: options not checked: the type {why} (`check --build` builds it)",
                chain.source,
                spec.line,
                spec.describe()
            ))
        })
        .collect();
    ChainCheck { errors, unchecked }
}
