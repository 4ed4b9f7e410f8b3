//! Registration of the `redis` tier type with the static tier registry.

use tiering_core::config::parse_options;
use tiering_core::{SecondaryContext, SecondaryTier, TierError};

use crate::options::RedisTierOptions;
use crate::tier::RedisTier;

/// Builds a Redis tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: RedisTierOptions = parse_options(options)?;
    let mut tier = RedisTier::connect(&opts, ctx.chunk_bytes)?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

tiering_core::register_tier!(secondary "redis" => build);
