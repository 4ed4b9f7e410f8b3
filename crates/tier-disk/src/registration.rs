//! Registration of the `disk` tier type with the static tier registry.

use tiering_core::config::parse_options;
use tiering_core::{SecondaryContext, SecondaryTier, TierError};

use crate::options::{DiskGeometry, DiskTierOptions};
use crate::tier::DiskTier;

/// Builds a disk tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: DiskTierOptions = parse_options(options)?;
    let mut tier = DiskTier::open(&opts, DiskGeometry::of_arena(&ctx.arena))?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

tiering_core::register_tier!(secondary "disk" => build);
