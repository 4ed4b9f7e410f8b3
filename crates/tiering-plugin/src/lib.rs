//! # tiering-plugin
//!
//! Secondary tiers in shared libraries (`cdylib`), loaded at run time.
//!
//! A tier library links its own copy of tiering-core, so no Rust type may cross between it and
//! the host: the boundary is a C ABI ([`ffi`]) of `#[repr(C)]` data and `extern "C"` functions.
//! The library exports two symbols: a `u32` static holding the ABI version, which the loader
//! reads before it calls anything, and an entry function returning a static descriptor (ABI
//! version, tiering-core version, build fingerprint, tier type name, and a vtable covering the
//! whole [`SecondaryTier`](tiering_core::SecondaryTier) contract). [`export_tier!`](crate::export_tier)
//! generates both from an ordinary factory; the library's author writes only a normal
//! `SecondaryTier`.
//!
//! - Rows: jobs cross as key/row-id arrays. The library builds a *view* of the host's arena
//!   (same memory, same row locks) and adopts the row grants the host gave up, so its tier
//!   receives a real [`TransferJob`](tiering_core::TransferJob) whose grants lock the host's rows.
//! - Panics: caught on both sides of every call and turned into errors.
//! - Checking options: a library may export a validate-only hook (ABI 5, `export_tier!(… ,
//!   validate = f)`), which `kvtier check` calls through
//!   [`LoadedLibrary::validate_options`] without building a tier. Libraries of ABI 4 still load
//!   and run; they have no such entry.
//! - Lifetime: libraries are never unloaded.
//!
//! All `unsafe` of the boundary is in this crate (plus the arena's raw-grant functions). An
//! engine that links its tiers statically does not depend on it, so it never builds `libloading`;
//! `tiering-config` reaches it for chains whose tiers name a `library`.

mod convert;
pub mod export;
pub mod ffi;
mod host;
mod loader;
mod log;

/// What [`export_tier!`] expands to names these through `$crate`, so a tier library needs only
/// this crate in scope.
#[doc(hidden)]
pub mod __private {
    pub use tiering_core::registry::{OptionsValidator, SecondaryFactory};
}

use std::path::PathBuf;

pub use host::PluginTier;
pub use loader::{LoadedLibrary, abi_supported, core_compatible, from_entry_point, load_library};

/// One problem a tier library's validate entry found in a tier's options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionProblem {
    /// The top-level key it is about, when the library named one.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

/// The tiering-core version of this build.
pub const CORE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// This build's fingerprint: tiering-core version, compiler version and target triple. A
/// library with a different fingerprint is still accepted (the ABI is C), unless the chain asks
/// for `same_build = true`.
pub const BUILD_FINGERPRINT: &str = concat!(
    "tiering-core ",
    env!("CARGO_PKG_VERSION"),
    "; ",
    env!("KVTIER_RUSTC_VERSION"),
    "; ",
    env!("KVTIER_TARGET")
);

/// Why a tier library could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The file does not exist.
    #[error("tier library {} does not exist", path.display())]
    NotFound {
        /// The path as configured.
        path: PathBuf,
    },
    /// The file is not a loadable shared library.
    #[error("{} is not a loadable shared library: {reason}", path.display())]
    NotALibrary {
        /// The path as configured.
        path: PathBuf,
        /// The dynamic loader's message.
        reason: String,
    },
    /// A required symbol is missing: not a kvtier tier library.
    #[error("{} is not a kvtier tier library: symbol `{symbol}` is missing ({reason})", path.display())]
    MissingSymbol {
        /// The path as configured.
        path: PathBuf,
        /// The missing symbol.
        symbol: &'static str,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library implements another version of the ABI.
    #[error(
        "tier library {} implements tier ABI version {found}, but this host loads versions {min} to {expected}; rebuild it against this tiering-core",
        path.display(),
        min = ffi::MIN_ABI_VERSION
    )]
    AbiMismatch {
        /// The path as configured.
        path: PathBuf,
        /// The library's ABI version.
        found: u32,
        /// This host's ABI version.
        expected: u32,
    },
    /// The library was built against an incompatible tiering-core.
    #[error(
        "tier library {} was built against tiering-core {found}, incompatible with this host's {expected}",
        path.display()
    )]
    CoreVersionMismatch {
        /// The path as configured.
        path: PathBuf,
        /// The library's core version.
        found: String,
        /// This host's core version.
        expected: String,
    },
    /// The descriptor is malformed.
    #[error("tier library {} has a malformed descriptor: {reason}", path.display())]
    BadDescriptor {
        /// The path as configured.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `same_build = true` and the fingerprints differ.
    #[error(
        "tier library {} was built as `{found}`, but the chain requires this host's build `{expected}` (same_build = true)",
        path.display()
    )]
    FingerprintMismatch {
        /// The path as configured.
        path: PathBuf,
        /// The library's fingerprint.
        found: String,
        /// This host's fingerprint.
        expected: String,
    },
    /// The library provides another tier type than the chain asked for.
    #[error("tier library {} provides tier type `{found}`, not `{expected}`", path.display())]
    WrongType {
        /// The path as configured.
        path: PathBuf,
        /// The library's type.
        found: String,
        /// The chain's `type`.
        expected: String,
    },
    /// The library's validate entry could not run (it panicked, or the options could not be
    /// handed over).
    #[error("tier library {} could not check the options: {message}", path.display())]
    Validate {
        /// The path as configured.
        path: PathBuf,
        /// What happened.
        message: String,
    },
    /// The library's factory failed or panicked.
    #[error("tier library {} could not build its tier: {message}", path.display())]
    Create {
        /// The path as configured.
        path: PathBuf,
        /// The library's message.
        message: String,
    },
}

#[cfg(test)]
mod tests;
