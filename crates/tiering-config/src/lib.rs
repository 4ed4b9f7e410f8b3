//! # tiering-config
//!
//! Tier chain files (`docs/ARCHITECTURE.md`, "Plugins and chains"): TOML that names a primary
//! tier and an ordered chain of secondaries, checked with file:line:key errors and built into a
//! `TieringManager`.
//!
//! ```toml
//! [primary]
//! type = "cpu"
//! capacity = "2GiB"
//!
//! [[secondary]]
//! type = "disk"
//! path = "${tmpdir}/kvtier-${pid}"
//! capacity = "64GiB"
//! admission = "after_first_reuse"           # the default for local storage
//! backpressure = { high_water_per_mib = "1s", low_water_per_mib = "500ms" }
//!
//! [[secondary]]
//! type = "my-tier"
//! library = "target/release/libmy_tier.so"   # dynamic; omit for a linked-in tier
//!
//! [control_plane]
//! thread = true
//! idle_wait = "1ms"
//!
//! [cost]                          # optional: load-versus-recompute decisions
//! recompute_per_token = "250ns"
//! tokens_per_chunk = 16
//! ```
//!
//! [`ChainConfig::parse`] checks the chain's own structure; [`ChainConfig::resolve`] finds every
//! type (loading libraries); [`ChainConfig::build`] constructs the tiers and the manager. Each
//! tier checks its own options (with `tiering_core::options::parse_options`). A relative `library` path is relative to
//! the working directory. In a chain read from a file ([`ChainConfig::load`]), a tier's relative
//! `path` is relative to the chain file's directory, and `path = ""` is that directory.
//! [`ChainConfig::validate`] checks a chain without building it, reporting every error.

mod builder;
mod chain;
mod cost;
mod error;
mod gates;
mod spanned;
mod validate;

pub use builder::{BuiltChain, ResolvedChain, TierSource};
pub use chain::{ChainConfig, ControlPlaneSpec, TierPosition, TierSpec};
pub use error::{ChainError, ChainErrorKind};

#[cfg(test)]
mod chain_tests;
