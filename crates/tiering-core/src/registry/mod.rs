//! The static tier registry: tier crates register named factories with [`register_tier!`](crate::register_tier), and
//! the chain builder looks tier types up by name.
//!
//! Registration uses `inventory`, so it happens before `main` without any central list. The
//! linker only keeps a tier crate's registration when something references that crate, so the
//! final binary (and every test binary that builds chains) names each tier crate it wants:
//!
//! ```ignore
//! use tier_disk as _;
//! ```
//!
//! A factory receives the tier's own options — its TOML table without the chain-level keys
//! `type` and `library` — and a context describing what it is built into. Each tier deserialises
//! its table itself, with `#[serde(deny_unknown_fields)]`; [`crate::options::parse_options`] does
//! that and turns the serde error into a [`TierError::Config`] naming the offending key.
//!
//! ```ignore
//! fn build(options: &toml::Table, ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
//!     let opts: MyOptions = tiering_core::options::parse_options(options)?;
//!     Ok(Box::new(MyTier::new(opts, ctx)?))
//! }
//! tiering_core::register_tier!(secondary "my-tier" => build);
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::arena::ChunkArena;
use crate::error::TierError;
use crate::tier::{PrimaryTier, SecondaryTier};
use crate::waker::ControlWaker;

#[doc(hidden)]
pub use inventory as __inventory;

/// What a primary-tier factory is built with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PrimaryContext {
    /// Payload bytes of one chunk (the engine's geometry); the tier sizes its arena rows with it.
    pub chunk_bytes: usize,
}

impl PrimaryContext {
    /// A context for chunks of `chunk_bytes` bytes.
    #[must_use]
    pub fn new(chunk_bytes: usize) -> Self {
        Self { chunk_bytes }
    }
}

/// What a secondary-tier factory is built with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SecondaryContext {
    /// The primary tier's arena: its geometry (`num_chunks`, `chunk_bytes`, `row_stride`) is what
    /// the tier's jobs will grant rows of.
    pub arena: Arc<ChunkArena>,
    /// The manager's control-plane waker; the manager also hands it over through
    /// [`SecondaryTier::set_waker`], so a tier may use either.
    pub waker: ControlWaker,
    /// Payload bytes of one chunk (equal to `arena.chunk_bytes()`).
    pub chunk_bytes: usize,
}

impl SecondaryContext {
    /// A context over `arena`, waking `waker`.
    #[must_use]
    pub fn new(arena: Arc<ChunkArena>, waker: ControlWaker) -> Self {
        let chunk_bytes = arena.chunk_bytes();
        Self {
            arena,
            waker,
            chunk_bytes,
        }
    }
}

/// Builds a primary tier from its options table.
pub type PrimaryFactory = fn(&toml::Table, &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError>;

/// Builds a secondary tier from its options table.
pub type SecondaryFactory = fn(&toml::Table, &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError>;

/// Checks a tier's options table without building the tier: parses it and checks its values,
/// but allocates no storage, opens no files and binds or dials no sockets (what `kvtier check`
/// runs). Returns every error found, each naming its key in backquotes so the chain's checker
/// can point at the key's line.
pub type OptionsValidator = fn(&toml::Table) -> Result<(), Vec<TierError>>;

/// A registered factory: which role the tier type plays and how to build it.
#[derive(Clone, Copy)]
pub enum TierFactory {
    /// A primary (CPU) tier type.
    Primary(PrimaryFactory),
    /// A secondary tier type.
    Secondary(SecondaryFactory),
}

impl TierFactory {
    /// `"primary"` or `"secondary"`.
    #[must_use]
    pub fn role(&self) -> &'static str {
        match self {
            Self::Primary(_) => "primary",
            Self::Secondary(_) => "secondary",
        }
    }
}

impl fmt::Debug for TierFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.role())
    }
}

/// One registration, as submitted by [`register_tier!`](crate::register_tier).
#[derive(Debug)]
pub struct TierRegistration {
    /// The tier type name used in chain files (`type = "…"`).
    pub name: &'static str,
    /// The package that registered it (`CARGO_PKG_NAME` of the registering crate).
    pub crate_name: &'static str,
    /// The factory.
    pub factory: TierFactory,
    /// The validate-only hook, if the tier type has one (see [`TierRegistration::validate`]).
    pub validator: Option<OptionsValidator>,
}

impl TierRegistration {
    /// A primary-tier registration (what [`register_tier!`](crate::register_tier) expands to).
    #[must_use]
    pub const fn primary(name: &'static str, crate_name: &'static str, factory: PrimaryFactory) -> Self {
        Self {
            name,
            crate_name,
            factory: TierFactory::Primary(factory),
            validator: None,
        }
    }

    /// A secondary-tier registration (what [`register_tier!`](crate::register_tier) expands to).
    #[must_use]
    pub const fn secondary(name: &'static str, crate_name: &'static str, factory: SecondaryFactory) -> Self {
        Self {
            name,
            crate_name,
            factory: TierFactory::Secondary(factory),
            validator: None,
        }
    }

    /// This registration with a validate-only hook.
    #[must_use]
    pub const fn with_validator(mut self, validator: OptionsValidator) -> Self {
        self.validator = Some(validator);
        self
    }

    /// Checks `options` with the type's validate-only hook, without building anything. A type
    /// registered without a hook accepts any table here (its factory still checks it when the
    /// chain is built); [`TierRegistration::validates`] tells the two apart.
    ///
    /// # Errors
    /// Every error the hook found.
    pub fn validate(&self, options: &toml::Table) -> Result<(), Vec<TierError>> {
        match self.validator {
            Some(check) => check(options),
            None => Ok(()),
        }
    }

    /// Whether the type has a validate-only hook (else only building it checks its options).
    #[must_use]
    pub fn validates(&self) -> bool {
        self.validator.is_some()
    }
}

inventory::collect!(TierRegistration);

/// Registers a tier type with the static registry.
///
/// ```ignore
/// tiering_core::register_tier!(primary "cpu" => build_cpu_tier);
/// tiering_core::register_tier!(secondary "disk" => build_disk_tier);
/// ```
///
/// A tier type that can check its options without being built (for `kvtier check`) names its
/// [`OptionsValidator`] too:
///
/// ```ignore
/// tiering_core::register_tier!(secondary "disk" => build_disk_tier, validate = validate_disk_options);
/// ```
///
/// The factory is a path or closure coercible to [`PrimaryFactory`] or [`SecondaryFactory`].
/// Write it at module level (not inside a function). The registering package's name is recorded
/// so a duplicate type name can name both crates.
#[macro_export]
macro_rules! register_tier {
    (primary $name:literal => $factory:expr $(,)?) => {
        $crate::registry::__inventory::submit! {
            $crate::registry::TierRegistration::primary($name, ::core::env!("CARGO_PKG_NAME"), $factory)
        }
    };
    (secondary $name:literal => $factory:expr $(,)?) => {
        $crate::registry::__inventory::submit! {
            $crate::registry::TierRegistration::secondary($name, ::core::env!("CARGO_PKG_NAME"), $factory)
        }
    };
    (primary $name:literal => $factory:expr, validate = $validator:expr $(,)?) => {
        $crate::registry::__inventory::submit! {
            $crate::registry::TierRegistration::primary($name, ::core::env!("CARGO_PKG_NAME"), $factory)
                .with_validator($validator)
        }
    };
    (secondary $name:literal => $factory:expr, validate = $validator:expr $(,)?) => {
        $crate::registry::__inventory::submit! {
            $crate::registry::TierRegistration::secondary($name, ::core::env!("CARGO_PKG_NAME"), $factory)
                .with_validator($validator)
        }
    };
}

/// Errors of the registry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Two registrations share a type name.
    #[error("tier type `{name}` is registered twice: by crate `{first_crate}` and by crate `{second_crate}`")]
    Duplicate {
        /// The type name.
        name: &'static str,
        /// One registering crate.
        first_crate: &'static str,
        /// The other registering crate.
        second_crate: &'static str,
    },
}

/// The tier types known to this process, by name.
#[derive(Debug, Default)]
pub struct Registry {
    entries: BTreeMap<&'static str, &'static TierRegistration>,
}

static GLOBAL: OnceLock<Result<Registry, RegistryError>> = OnceLock::new();

impl Registry {
    /// Every type registered with [`register_tier!`](crate::register_tier) in the linked crates.
    ///
    /// # Errors
    /// Two crates registered the same type name.
    pub fn global() -> Result<&'static Self, RegistryError> {
        GLOBAL
            .get_or_init(|| Self::from_registrations(inventory::iter::<TierRegistration>))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A registry over an explicit set of registrations (the global one uses every submitted
    /// registration).
    ///
    /// # Errors
    /// Two registrations share a name; the error names both crates, in a deterministic order.
    pub fn from_registrations(
        regs: impl IntoIterator<Item = &'static TierRegistration>,
    ) -> Result<Self, RegistryError> {
        let mut entries: BTreeMap<&'static str, &'static TierRegistration> = BTreeMap::new();
        for reg in regs {
            if let Some(prev) = entries.get(reg.name) {
                // inventory's order is unspecified; sort so the message is stable.
                let (first_crate, second_crate) = if prev.crate_name <= reg.crate_name {
                    (prev.crate_name, reg.crate_name)
                } else {
                    (reg.crate_name, prev.crate_name)
                };
                return Err(RegistryError::Duplicate {
                    name: reg.name,
                    first_crate,
                    second_crate,
                });
            }
            entries.insert(reg.name, reg);
        }
        Ok(Self { entries })
    }

    /// The registration of `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&'static TierRegistration> {
        self.entries.get(name).copied()
    }

    /// Every registration, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &'static TierRegistration> + '_ {
        self.entries.values().copied()
    }

    /// The registered names, sorted.
    #[must_use]
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.keys().copied().collect()
    }

    /// Number of registered types.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is registered.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{MemoryPrimary, ScriptedTier};

    // Factories return `Result` because that is the registered signature.
    #[allow(clippy::unnecessary_wraps)]
    fn memory_primary(_: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
        Ok(Box::new(MemoryPrimary::new(8, ctx.chunk_bytes)))
    }

    #[allow(clippy::unnecessary_wraps)]
    fn scripted(_: &toml::Table, _: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
        Ok(Box::new(ScriptedTier::new("scripted").0))
    }

    fn no_keys(options: &toml::Table) -> Result<(), Vec<TierError>> {
        let errors: Vec<TierError> = options
            .keys()
            .map(|k| TierError::Config(format!("unknown key `{k}`")))
            .collect();
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    crate::register_tier!(primary "registry-test-primary" => memory_primary);
    crate::register_tier!(secondary "registry-test-secondary" => scripted, validate = no_keys);

    static DUP_A: TierRegistration = TierRegistration::secondary("dup", "crate-b", scripted);
    static DUP_B: TierRegistration = TierRegistration::secondary("dup", "crate-a", scripted);
    static OTHER: TierRegistration = TierRegistration::primary("other", "crate-c", memory_primary);

    #[test]
    fn submitted_registrations_are_found_with_their_crate() {
        let reg = Registry::global().unwrap();
        let p = reg.get("registry-test-primary").unwrap();
        assert_eq!(p.crate_name, "tiering-core");
        assert!(matches!(p.factory, TierFactory::Primary(_)));
        let s = reg.get("registry-test-secondary").unwrap();
        assert_eq!(s.factory.role(), "secondary");
        assert!(reg.get("nope").is_none());
        let names = reg.names();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted);
    }

    #[test]
    fn factories_build_tiers() {
        let reg = Registry::global().unwrap();
        let TierFactory::Primary(f) = reg.get("registry-test-primary").unwrap().factory else {
            panic!("primary expected");
        };
        let primary = f(&toml::Table::new(), &PrimaryContext::new(64)).unwrap();
        assert_eq!(primary.arena().chunk_bytes(), 64);
        let TierFactory::Secondary(f) = reg.get("registry-test-secondary").unwrap().factory else {
            panic!("secondary expected");
        };
        let ctx = SecondaryContext::new(Arc::clone(primary.arena()), ControlWaker::new());
        assert_eq!(ctx.chunk_bytes, 64);
        assert_eq!(f(&toml::Table::new(), &ctx).unwrap().info().name, "scripted");
    }

    #[test]
    fn a_validator_reports_every_error_and_a_type_without_one_accepts() {
        let reg = Registry::global().unwrap();
        let checked = reg.get("registry-test-secondary").unwrap();
        assert!(checked.validates());
        assert!(checked.validate(&toml::Table::new()).is_ok());
        let bad: toml::Table = "a = 1\nb = 2".parse().unwrap();
        let errors = checked.validate(&bad).unwrap_err();
        assert_eq!(errors.len(), 2);
        assert!(errors[1].to_string().contains("`b`"), "{}", errors[1]);
        let unchecked = reg.get("registry-test-primary").unwrap();
        assert!(!unchecked.validates());
        assert!(unchecked.validate(&bad).is_ok());
    }

    #[test]
    fn duplicate_names_are_an_error_naming_both_crates() {
        let err = Registry::from_registrations([&OTHER, &DUP_A, &DUP_B]).unwrap_err();
        assert_eq!(
            err,
            RegistryError::Duplicate {
                name: "dup",
                first_crate: "crate-a",
                second_crate: "crate-b"
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("`dup`") && msg.contains("crate-a") && msg.contains("crate-b"),
            "{msg}"
        );
        assert_eq!(Registry::from_registrations([&OTHER, &DUP_A]).unwrap().len(), 2);
    }
}
