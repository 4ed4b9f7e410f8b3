//! The options types of the tier crates linked into `kvtier`, for `kvtier check`: each tier's
//! table is parsed with its crate's options type (unknown keys refused) without building the
//! tier.

use tiering_core::TierError;
use tiering_core::config::parse_options;

/// Parses `options` as the options of the linked tier type `tier_type`; `None` for a type this
/// binary does not link (a library tier).
#[must_use]
pub fn linked_options(tier_type: &str, options: &toml::Table) -> Option<Result<(), TierError>> {
    Some(match tier_type {
        "cpu" => parse_options::<tier_cpu::CpuTierOptions>(options).map(drop),
        "disk" => parse_options::<tier_disk::DiskTierOptions>(options).map(drop),
        "p2p" => parse_options::<tier_p2p::P2pTierOptions>(options).map(drop),
        "example" => parse_options::<tier_example::ExampleOptions>(options).map(drop),
        _ => return None,
    })
}
