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

use tiering_core::options::parse_options;
use tiering_core::{SecondaryTier, TierError, registry::SecondaryContext};

use crate::options::{P2pTierOptions, split_host_port};
use crate::tier::P2pTier;

/// Builds a p2p tier from its chain-file table (every key but `type`).
fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let opts: P2pTierOptions = parse_options(options)?;
    let mut tier = P2pTier::new(opts, &ctx.arena)?;
    tier.set_waker(ctx.waker.clone());
    Ok(Box::new(tier))
}

/// Checks a p2p tier's table without binding or dialling anything (`kvtier check`): the shared
/// secret is configured and present, the handshake identity is set, and every address is
/// `host:port` (names are not resolved here).
fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let opts: P2pTierOptions = parse_options(options).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let mut bad = |m: String| errors.push(TierError::Config(m));
    if opts.secret.is_none() {
        match &opts.secret_env {
            Some(var) if std::env::var_os(var).is_none_or(|v| v.is_empty()) => bad(format!(
                "`secret_env`: environment variable {var:?} is unset or empty; every peer needs the same \
                 shared secret in it"
            )),
            None if !opts.insecure => bad(
                "`secret_env`: a p2p tier needs a shared secret: set secret_env = \"KVTIER_P2P_SECRET\" \
                 (the name of an environment variable holding it), or insecure = true for a loopback demo"
                    .into(),
            ),
            _ => {}
        }
    }
    for (key, v) in [
        ("hash_seed", &opts.hash_seed),
        ("layout_fingerprint", &opts.layout_fingerprint),
    ] {
        if v.trim().is_empty() {
            bad(format!(
                "`{key}` is empty; set it to the same non-empty value on every peer"
            ));
        }
    }
    let addresses = std::iter::once(("bind", &opts.bind))
        .chain(opts.data_bind.iter().map(|a| ("data_bind", a)))
        .chain(opts.peers.iter().map(|a| ("peers", a)));
    for (key, addr) in addresses {
        if split_host_port(addr).is_none() {
            bad(format!("`{key}`: {addr:?} is not host:port"));
        }
    }
    if opts.advertise.as_deref().is_some_and(|a| a.trim().is_empty()) {
        bad("`advertise` is empty; omit it to advertise the bind address".into());
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

tiering_core::register_tier!(secondary "p2p" => build, validate = validate);

#[cfg(test)]
mod tests {
    use tiering_core::registry::TierFactory;
    use tiering_core::{
        ControlWaker,
        arena::ChunkArena,
        registry::{Registry, SecondaryContext},
    };

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
    fn the_validate_hook_reports_every_error_without_binding() {
        let reg = Registry::global().unwrap().get("p2p").unwrap();
        let ok: toml::Table =
            "bind = \"127.0.0.1:1\"\nhash_seed = \"s\"\nlayout_fingerprint = \"f\"\ninsecure = true\npeers = [\"localhost:7100\"]"
                .parse()
                .unwrap();
        reg.validate(&ok).unwrap();
        // Validating twice on one port proves nothing was bound.
        reg.validate(&ok).unwrap();
        let bad: toml::Table = "bind = \"nowhere\"\nhash_seed = \"\"\npeers = [\"a:1\", \"b\"]\nsecret_env = \"KVTIER_P2P_TEST_SURELY_UNSET\""
            .parse()
            .unwrap();
        let text: Vec<String> = reg
            .validate(&bad)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        for needle in [
            "`secret_env`",
            "`hash_seed`",
            "`layout_fingerprint`",
            "`bind`",
            "`peers`: \"b\"",
        ] {
            assert!(
                text.iter().any(|t| t.contains(needle)),
                "{needle} missing from {text:?}"
            );
        }
        assert_eq!(text.len(), 5, "{text:?}");
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
