//! The admission-policy registry: policies register a named factory with
//! [`register_admission!`](crate::register_admission) (on `inventory`, like tiers), and a chain
//! names one per secondary tier.

use std::fmt;

use serde::de::DeserializeOwned;

use super::{AdmissionContext, AdmissionPolicy};
use crate::error::TierError;

/// Builds a policy from its options (the `admission` table without `policy`).
pub type AdmissionFactory =
    fn(&toml::Table, &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError>;

/// One registered policy.
#[derive(Debug)]
pub struct AdmissionRegistration {
    /// The name a chain uses.
    pub name: &'static str,
    /// The registering crate.
    pub crate_name: &'static str,
    /// The factory.
    pub factory: AdmissionFactory,
}

impl AdmissionRegistration {
    /// A registration (used by [`register_admission!`](crate::register_admission)).
    #[must_use]
    pub const fn new(name: &'static str, crate_name: &'static str, factory: AdmissionFactory) -> Self {
        Self {
            name,
            crate_name,
            factory,
        }
    }
}

inventory::collect!(AdmissionRegistration);

/// Registers an admission policy factory under a name:
///
/// ```ignore
/// fn build(options: &toml::Table, ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
///     Ok(Box::new(MyPolicy::new(tiering_core::admission::parse_options(options)?)))
/// }
/// tiering_core::register_admission!("my-policy" => build);
/// ```
#[macro_export]
macro_rules! register_admission {
    ($name:literal => $factory:expr $(,)?) => {
        $crate::registry::__inventory::submit! {
            $crate::admission::AdmissionRegistration::new($name, ::core::env!("CARGO_PKG_NAME"), $factory)
        }
    };
}

/// The names of every registered policy, sorted.
#[must_use]
pub fn registered_policies() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = inventory::iter::<AdmissionRegistration>
        .into_iter()
        .map(|r| r.name)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

fn find(name: &str) -> Result<AdmissionFactory, AdmissionError> {
    let mut found = inventory::iter::<AdmissionRegistration>
        .into_iter()
        .filter(|r| r.name == name);
    let Some(first) = found.next() else {
        return Err(AdmissionError::UnknownPolicy {
            name: name.to_owned(),
            known: registered_policies().join(", "),
        });
    };
    if let Some(second) = found.next() {
        return Err(AdmissionError::Duplicate {
            name: first.name,
            first_crate: first.crate_name,
            second_crate: second.crate_name,
        });
    }
    Ok(first.factory)
}

/// Why a policy could not be configured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// No policy of that name is registered.
    #[error("unknown admission policy `{name}`; registered policies: {known}")]
    UnknownPolicy {
        /// The requested name.
        name: String,
        /// The registered names, comma-separated.
        known: String,
    },
    /// Two crates registered the same name.
    #[error(
        "admission policy `{name}` is registered twice: by crate `{first_crate}` and by crate `{second_crate}`"
    )]
    Duplicate {
        /// The name.
        name: &'static str,
        /// One registering crate.
        first_crate: &'static str,
        /// The other.
        second_crate: &'static str,
    },
    /// The policy refused its options; the message names the key in backquotes.
    #[error("{0}")]
    Options(String),
}

/// Deserialises a policy's options (declare `T` with `#[serde(deny_unknown_fields)]`); the
/// error names the offending key, as tier options do.
///
/// # Errors
/// An unknown key, a missing key or a bad value.
pub fn parse<T: DeserializeOwned>(options: &toml::Table) -> Result<T, AdmissionError> {
    crate::options::parse_options(options).map_err(|e| match e {
        TierError::Config(m) => AdmissionError::Options(m),
        other => AdmissionError::Options(other.to_string()),
    })
}

/// A validated policy choice for one tier: the registered name and its options. Each tier
/// gets its own instance from [`AdmissionConfig::build`].
#[derive(Clone)]
pub struct AdmissionConfig {
    policy: String,
    options: toml::Table,
    factory: AdmissionFactory,
}

impl AdmissionConfig {
    /// Looks `policy` up and checks `options` by building the policy once.
    ///
    /// # Errors
    /// An unknown policy, or options the policy refuses.
    pub fn new(policy: &str, options: toml::Table) -> Result<Self, AdmissionError> {
        let factory = find(policy)?;
        factory(&options, &AdmissionContext::default())?;
        Ok(Self {
            policy: policy.to_owned(),
            options,
            factory,
        })
    }

    /// `always`: every chunk is cascaded.
    #[must_use]
    pub fn always() -> Self {
        Self::builtin("always")
    }

    /// `after_first_reuse` with its defaults: the default for local storage tiers.
    #[must_use]
    pub fn after_first_reuse() -> Self {
        Self::builtin("after_first_reuse")
    }

    fn builtin(name: &str) -> Self {
        // The built-in policies are registered by this crate, so they are always in the registry.
        let factory = find(name).unwrap_or_else(|e| panic!("built-in admission policy: {e}"));
        Self {
            policy: name.to_owned(),
            options: toml::Table::new(),
            factory,
        }
    }

    /// The default for a tier: `after_first_reuse` for local storage (a disk: every write
    /// costs bandwidth and device lifetime), `always` for every other tier.
    #[must_use]
    pub fn default_for(info: &crate::request::TierInfo) -> Self {
        use crate::request::{Locality, Medium};
        if info.medium == Some(Medium::Storage) && info.locality != Some(Locality::Remote) {
            Self::after_first_reuse()
        } else {
            Self::always()
        }
    }

    /// The policy's name.
    #[must_use]
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// The policy's options.
    #[must_use]
    pub fn options(&self) -> &toml::Table {
        &self.options
    }

    /// A fresh policy for the tier `ctx` describes.
    ///
    /// # Errors
    /// The factory refused the options for this tier.
    pub fn build(&self, ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
        (self.factory)(&self.options, ctx)
    }
}

impl PartialEq for AdmissionConfig {
    fn eq(&self, other: &Self) -> bool {
        self.policy == other.policy && self.options == other.options
    }
}

impl fmt::Debug for AdmissionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionConfig")
            .field("policy", &self.policy)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for AdmissionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.policy)?;
        for (k, v) in &self.options {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_policies_are_registered() {
        let names = registered_policies();
        for p in ["after_first_reuse", "always", "store_threshold", "tinylfu"] {
            assert!(names.contains(&p), "{p} missing from {names:?}");
        }
    }

    #[test]
    fn unknown_policy_and_bad_options_are_refused_with_the_key() {
        let e = AdmissionConfig::new("lfu", toml::Table::new()).unwrap_err();
        assert!(
            matches!(&e, AdmissionError::UnknownPolicy { known, .. } if known.contains("tinylfu")),
            "{e}"
        );
        let opts: toml::Table = "m = 2".parse().unwrap();
        let e = AdmissionConfig::new("store_threshold", opts).unwrap_err();
        assert!(e.to_string().contains("unknown field `m`"), "{e}");
        let opts: toml::Table = "n = \"two\"".parse().unwrap();
        let e = AdmissionConfig::new("store_threshold", opts).unwrap_err();
        assert!(e.to_string().starts_with("`n`"), "{e}");
        let opts: toml::Table = "n = 2".parse().unwrap();
        let c = AdmissionConfig::new("store_threshold", opts).unwrap();
        assert_eq!(c.to_string(), "store_threshold n=2");
    }
}
