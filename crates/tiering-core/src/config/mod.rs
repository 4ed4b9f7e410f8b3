//! Tier chain files (`docs/ARCHITECTURE.md`, "Plugins and chains") and the helpers tier
//! factories use to read their options.
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
//! tier checks its own options (with [`parse_options`]). A relative `library` path is relative to
//! the working directory. In a chain read from a file ([`ChainConfig::load`]), a tier's relative
//! `path` is relative to the chain file's directory, and `path = ""` is that directory.
//! [`ChainConfig::validate`] checks a chain without building it, reporting every error.

mod builder;
mod chain;
mod cost;
mod error;
mod gates;
mod units;
mod validate;

pub use builder::{BuiltChain, ResolvedChain, TierSource};
pub use chain::{ChainConfig, ControlPlaneSpec, TierPosition, TierSpec};
pub use error::{ChainError, ChainErrorKind};
pub use units::{ByteSize, HumanDuration, UnitError};

use serde::de::DeserializeOwned;

use crate::error::TierError;

/// Deserialises a tier's options table into `T` (declare `T` with
/// `#[serde(deny_unknown_fields)]`). The error is a [`TierError::Config`] whose message names
/// the offending key in backquotes (serde names unknown and missing keys itself; for a bad value
/// the key is found by its value and prefixed), which the chain builder uses to point at the
/// key's line.
///
/// # Errors
/// An unknown key, a missing key, or a value of the wrong type or format.
pub fn parse_options<T: DeserializeOwned>(options: &toml::Table) -> Result<T, TierError> {
    options.clone().try_into().map_err(|e: toml::de::Error| {
        let message = e.message().trim().to_owned();
        let message = name_key_in_message(options, message);
        let message = if quoted_words(&message).any(|w| options.contains_key(w)) {
            message
        } else {
            match culprit_by_removal::<T>(options) {
                Some(key) => format!("`{key}`: {message}"),
                None => message,
            }
        };
        TierError::Config(message)
    })
}

/// The key whose removal makes `options` parse (or only miss that key): the one a message that
/// names no key is about (serde's "invalid type: string \"two\", expected u16" does not).
fn culprit_by_removal<T: DeserializeOwned>(options: &toml::Table) -> Option<&str> {
    options.keys().map(String::as_str).find(|&key| {
        let mut without = options.clone();
        without.remove(key);
        match without.try_into::<T>() {
            Ok(_) => true,
            Err(e) => e.message().contains(&format!("missing field `{key}`")),
        }
    })
}

/// The backquoted words of an error message.
pub(crate) fn quoted_words(message: &str) -> impl Iterator<Item = &str> {
    message.split('`').skip(1).step_by(2)
}

/// Prefixes `message` with the key it is about when the message only quotes the key's value.
fn name_key_in_message(options: &toml::Table, message: String) -> String {
    if quoted_words(&message).any(|w| options.contains_key(w)) {
        return message;
    }
    let culprit = quoted_words(&message).find_map(|word| {
        options.iter().find_map(|(key, value)| {
            let rendered = match value {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (rendered == word).then_some(key)
        })
    });
    match culprit {
        Some(key) => format!("`{key}`: {message}"),
        None => message,
    }
}

#[cfg(test)]
mod chain_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Opts {
        capacity: ByteSize,
        #[serde(default)]
        eviction: Option<String>,
        #[serde(default)]
        wait: Option<HumanDuration>,
        #[serde(default)]
        workers: Option<u16>,
    }

    fn table(s: &str) -> toml::Table {
        s.parse().unwrap()
    }

    #[test]
    fn errors_name_the_offending_key() {
        let err = |s: &str| match parse_options::<Opts>(&table(s)) {
            Err(TierError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        };
        let m = err("capacity = \"1GiB\"\ncapasity = 3");
        assert!(m.contains("unknown field `capasity`"), "{m}");
        assert!(err("eviction = \"x\"").contains("missing field `capacity`"));
        let m = err("capacity = \"1 gigs\"");
        assert!(m.starts_with("`capacity`: invalid size `1 gigs`"), "{m}");
        let m = err("capacity = true");
        assert!(m.starts_with("`capacity`: invalid type"), "{m}");
        let m = err("capacity = 1\nworkers = \"two\"");
        assert!(m.starts_with("`workers`: invalid type"), "{m}");
        let m = err("capacity = 1\nwait = \"3\"");
        assert!(m.starts_with("`wait`: invalid duration `3`"), "{m}");
    }

    #[test]
    fn valid_options_parse() {
        let o: Opts = parse_options(&table("capacity = \"2GiB\"\nwait = \"1ms\"")).unwrap();
        assert_eq!(o.capacity, ByteSize(2 << 30));
        assert_eq!(o.wait, Some(HumanDuration(std::time::Duration::from_millis(1))));
    }
}
