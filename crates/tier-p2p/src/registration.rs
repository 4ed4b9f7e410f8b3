//! Registration of the `p2p` tier type with the static tier registry.
//!
//! ```toml
//! [[secondary]]
//! type = "p2p"
//! bind = "10.0.0.5:5710"        # control socket; the node's identity is advertise:port
//! advertise = "10.0.0.5"
//! hash_seed = "…"               # equal on every peer, non-empty
//! layout_fingerprint = "…"      # equal on every peer, non-empty
//! secret_env = "KVTIER_P2P_SECRET"  # env var holding the shared secret (or insecure = true)
//! [secondary.deadlines]
//! lookup_ms = 8000
//! ```

use tiering_core::config::parse_options;
use tiering_core::{SecondaryContext, SecondaryTier, TierError};

use crate::options::P2pTierOptions;
use crate::tier::P2pTier;

/// Builds a p2p tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: P2pTierOptions = parse_options(options)?;
    let mut tier = P2pTier::new(opts, &ctx.arena)?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

tiering_core::register_tier!(secondary "p2p" => build);

#[cfg(test)]
mod tests {
    use tiering_core::registry::TierFactory;
    use tiering_core::{ChunkArena, ControlWaker, Registry, SecondaryContext};

    fn factory() -> tiering_core::registry::SecondaryFactory {
        let reg = Registry::global().unwrap().get("p2p").expect("p2p is registered");
        match reg.factory {
            TierFactory::Secondary(f) => f,
            TierFactory::Primary(_) => panic!("p2p registered as a primary"),
        }
    }

    #[test]
    fn the_registry_builds_a_p2p_tier_from_toml() {
        let table: toml::Table = toml::from_str(
            r#"
            bind = "127.0.0.1:0"
            hash_seed = "s"
            layout_fingerprint = "f"
            insecure = true
            [deadlines]
            lookup_ms = 100
            "#,
        )
        .unwrap();
        let ctx = SecondaryContext::new(ChunkArena::new(4, 64).unwrap(), ControlWaker::new());
        let tier = factory()(&table, &ctx).unwrap();
        assert_eq!(tier.info().name, "p2p");
    }

    #[test]
    fn a_chain_without_a_secret_or_with_empty_identity_is_refused() {
        let ctx = SecondaryContext::new(ChunkArena::new(4, 64).unwrap(), ControlWaker::new());
        for (chain, needle) in [
            (
                "bind = \"127.0.0.1:0\"\nhash_seed = \"s\"\nlayout_fingerprint = \"f\"",
                "secret_env",
            ),
            (
                "bind = \"127.0.0.1:0\"\nhash_seed = \"s\"\nlayout_fingerprint = \"f\"\nsecret_env = \"KVTIER_P2P_TEST_SURELY_UNSET\"",
                "KVTIER_P2P_TEST_SURELY_UNSET",
            ),
            (
                "bind = \"127.0.0.1:0\"\ninsecure = true\nlayout_fingerprint = \"f\"",
                "hash_seed",
            ),
            (
                "bind = \"127.0.0.1:0\"\ninsecure = true\nhash_seed = \"s\"",
                "layout_fingerprint",
            ),
        ] {
            let table: toml::Table = toml::from_str(chain).unwrap();
            let Err(e) = factory()(&table, &ctx) else {
                panic!("built a p2p tier from {chain:?}")
            };
            assert!(e.to_string().contains(needle), "{chain:?}: {e}");
        }
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let table: toml::Table = toml::from_str(r#"bnd = "127.0.0.1:0""#).unwrap();
        let ctx = SecondaryContext::new(ChunkArena::new(4, 64).unwrap(), ControlWaker::new());
        let Err(e) = factory()(&table, &ctx) else {
            panic!("an unknown key was accepted")
        };
        assert!(e.to_string().contains("bnd"), "{e}");
    }
}
