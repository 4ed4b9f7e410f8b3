//! Registration of the `disk` tier type with the static tier registry.

use tiering_core::options::parse_options;
use tiering_core::{SecondaryTier, TierError, registry::SecondaryContext};

use crate::options::{DiskGeometry, DiskTierOptions};
use crate::tier::DiskTier;

/// Builds a disk tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: DiskTierOptions = parse_options(options)?;
    let mut tier = DiskTier::open(&opts, DiskGeometry::of_arena(&ctx.arena))?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

/// Checks a disk tier's table without creating its directory or slab (`kvtier check`); the
/// capacity's bound against the filesystem is the chain checker's.
fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let opts: DiskTierOptions = parse_options(options).map_err(|e| vec![e])?;
    let errors: Vec<TierError> = crate::tier::option_errors(&opts)
        .into_iter()
        .map(TierError::from)
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

tiering_core::register_tier!(secondary "disk" => build, validate = validate);

#[cfg(test)]
mod tests {
    use tiering_core::registry::Registry;

    #[test]
    fn the_validate_hook_reports_every_bad_option_without_touching_the_path() {
        let reg = Registry::global().unwrap().get("disk").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("never-created");
        let ok: toml::Table = format!("path = {:?}\ncapacity = \"1GiB\"", path.to_str().unwrap())
            .parse()
            .unwrap();
        reg.validate(&ok).unwrap();
        assert!(!path.exists(), "validation created the tier's directory");
        let bad: toml::Table = "path = \"\"\ncapacity = \"1GiB\"\nio_threads = 0\nname = \"\""
            .parse()
            .unwrap();
        let errors = reg.validate(&bad).unwrap_err();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 3, "{text:?}");
        for key in ["`io_threads`", "`path`", "`name`"] {
            assert!(
                text.iter().any(|t| t.contains(key)),
                "{key} missing from {text:?}"
            );
        }
        let typo: toml::Table = "path = \"/x\"\ncapacity = \"1GiB\"\nsnyc = \"none\""
            .parse()
            .unwrap();
        assert!(reg.validate(&typo).unwrap_err()[0].to_string().contains("snyc"));
    }
}
