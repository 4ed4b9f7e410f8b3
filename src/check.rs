//! `kvtier check`'s validation: every tier of a chain checked by its type's validate-only hook
//! ([`tiering_core::registry::TierRegistration::validate`] for a linked type, the library's validate entry
//! for a tier library — which loads the library but builds no tier) — no allocation, no files,
//! no sockets — plus the chain-level checks (types, roles, capacities, names, paths), all errors
//! reported with file:line:key.

use tiering_config::{ChainConfig, ChainError};
use tiering_core::registry::Registry;
use tiering_plugin::load_library;

/// What checking one chain found.
#[derive(Debug, Default)]
pub struct ChainCheck {
    /// Every error, in file order.
    pub errors: Vec<ChainError>,
    /// Tiers whose options have no validate-only hook to check them (a type registered without
    /// one, or a tier library without a validate entry), one line each, saying whether this run
    /// checks them by building the tier (`build`) or not at all.
    pub unchecked: Vec<String>,
}

/// Checks `chain` against `registry` without building anything. `build` says whether the caller
/// builds the chain afterwards (`check --build`), which only changes the wording of
/// [`ChainCheck::unchecked`].
#[must_use]
pub fn check_chain(chain: &ChainConfig, registry: &Registry, build: bool) -> ChainCheck {
    let errors = chain.validate(registry);
    let unchecked = chain
        .tiers()
        .filter_map(|spec| {
            let why = if let Some(path) = &spec.library {
                // Loaded (once per process) by `validate` above; a library that failed to load
                // is among the errors.
                let lib = load_library(path).ok()?;
                if lib.validates() {
                    return None;
                }
                format!(
                    "the tier library {} (tier ABI {}) has no validate entry",
                    path.display(),
                    lib.abi_version()
                )
            } else if registry.get(&spec.tier_type).is_some_and(|r| !r.validates()) {
                "the type has no validate-only hook".to_owned()
            } else {
                return None;
            };
            let what = if build {
                "options checked only by building the tier (below)"
            } else {
                "options not checked"
            };
            let how = if build {
                ""
            } else {
                "; `kvtier check --build` checks them by building the tier"
            };
            Some(format!(
                "{}:{}: {}: {what}: {why}{how}",
                chain.source,
                spec.line,
                spec.describe()
            ))
        })
        .collect();
    ChainCheck { errors, unchecked }
}
