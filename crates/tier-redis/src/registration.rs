//! Registration of the `redis` tier type with the static tier registry.

use tiering_core::options::parse_options;
use tiering_core::{SecondaryTier, TierError, registry::SecondaryContext};

use crate::options::RedisTierOptions;
use crate::tier::RedisTier;

/// Builds a Redis tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: RedisTierOptions = parse_options(options)?;
    let mut tier = RedisTier::connect(&opts, ctx.chunk_bytes)?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

/// Checks a Redis tier's table without connecting (`kvtier check`): its values, every URL's
/// syntax, and that `password_env` names a set variable.
fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let opts: RedisTierOptions = parse_options(options).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    if let Err(e) = opts.validate() {
        errors.push(TierError::from(e));
    }
    // Parses the URLs and reads the password variable; opens no connection.
    if let Err(e) = crate::conn::Endpoint::new(&opts) {
        errors.push(TierError::from(e));
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

tiering_core::register_tier!(secondary "redis" => build, validate = validate);
