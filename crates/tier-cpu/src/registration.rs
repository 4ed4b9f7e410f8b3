//! Registration of the `cpu` primary tier type with the static tier registry.
//!
//! ```toml
//! [primary]
//! type = "cpu"
//! capacity = "2GiB"      # or a chunk count
//! eviction = "arc"       # lru | arc | s3fifo
//! ```
//!
//! The table (without `type`) deserialises into [`CpuTierOptions`]; unknown keys, bad sizes and
//! unknown policies are configuration errors naming the key.

use tiering_core::options::parse_options;
use tiering_core::{PrimaryTier, TierError, registry::PrimaryContext};

use crate::{CpuTier, CpuTierOptions};

/// Builds a CPU tier from its chain-file table for the engine's chunk size.
fn build(options: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
    let opts: CpuTierOptions = parse_options(options)?;
    Ok(Box::new(CpuTier::from_options(&opts, ctx.chunk_bytes)?))
}

/// Checks a CPU tier's table without allocating its arena (`kvtier check`); the capacity's
/// bound against physical memory is the chain checker's.
fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    parse_options::<CpuTierOptions>(options)
        .map(drop)
        .map_err(|e| vec![e])
}

tiering_core::register_tier!(primary "cpu" => build, validate = validate);

#[cfg(test)]
mod tests {
    use tiering_core::registry::{PrimaryFactory, TierFactory};
    use tiering_core::{
        TierError,
        registry::{PrimaryContext, Registry},
    };

    fn factory() -> PrimaryFactory {
        let reg = Registry::global().unwrap().get("cpu").expect("cpu is registered");
        assert_eq!(reg.crate_name, "tier-cpu");
        match reg.factory {
            TierFactory::Primary(f) => f,
            TierFactory::Secondary(_) => panic!("cpu registered as a secondary"),
        }
    }

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn the_registered_factory_builds_a_tier_from_its_table() {
        let tier = factory()(
            &table("capacity = \"1MiB\"\neviction = \"arc\""),
            &PrimaryContext::new(4096),
        )
        .unwrap();
        assert_eq!(tier.arena().num_chunks(), 256);
        assert_eq!(tier.info().name, "cpu");
        let tier = factory()(&table("capacity = 8"), &PrimaryContext::new(64)).unwrap();
        assert_eq!(tier.arena().num_chunks(), 8);
    }

    #[test]
    fn the_validate_hook_checks_the_table_without_building() {
        let reg = Registry::global().unwrap().get("cpu").unwrap();
        assert!(reg.validates());
        reg.validate(&table("capacity = \"1TiB\"\neviction = \"arc\""))
            .unwrap();
        let errors = reg
            .validate(&table("capacity = 4\neviction = \"mru\""))
            .unwrap_err();
        assert!(errors[0].to_string().contains("eviction"), "{}", errors[0]);
        let errors = reg
            .validate(&table("capacity = 4\nworkers = \"two\""))
            .unwrap_err();
        assert!(errors[0].to_string().contains("`workers`"), "{}", errors[0]);
        let errors = reg.validate(&table("capacity = 4\neviction = 3")).unwrap_err();
        assert_eq!(
            errors[0].to_string(),
            "invalid configuration: `eviction`: expected a string (\"lru\", \"arc\" or \"s3fifo\"), \
             found an integer 3"
        );
    }

    #[test]
    fn bad_tables_are_configuration_errors_naming_the_problem() {
        let err = |text: &str| match factory()(&table(text), &PrimaryContext::new(4096)) {
            Err(TierError::Config(m)) => m,
            Err(other) => panic!("not a config error: {other}"),
            Ok(_) => panic!("{text:?} was accepted"),
        };
        assert!(err("capacity = 4\ncolour = \"blue\"").contains("colour"));
        assert!(err("capacity = 4\neviction = \"mru\"").contains("unknown eviction policy"));
        assert!(err("capacity = \"lots\"").contains("invalid capacity"));
        assert!(err("capacity = 0").contains("zero capacity"));
        assert!(err("capacity = \"1PiB\"").contains("invalid capacity"));
        assert!(err("capacity = \"1024TiB\"").contains("exceeds"));
    }
}
