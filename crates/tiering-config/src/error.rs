//! Errors of chain files: every one names the file, and where known the line, the tier and the
//! key.

use std::fmt;

use tiering_core::TierError;
use tiering_core::registry::RegistryError;
#[cfg(feature = "libraries")]
use tiering_plugin::PluginError;

/// What went wrong.
#[derive(Debug)]
pub enum ChainErrorKind {
    /// The file could not be read.
    Io(std::io::Error),
    /// Not valid TOML.
    Syntax(String),
    /// A structural or value error of the chain itself.
    Invalid(String),
    /// A key the chain does not know.
    UnknownKey {
        /// The key.
        key: String,
        /// The keys allowed there.
        expected: &'static str,
    },
    /// No registered type and no `library` for this `type`.
    UnknownType {
        /// The requested type.
        tier_type: String,
        /// Every registered type with its role, sorted.
        known: Vec<String>,
    },
    /// A primary type used as a secondary or the reverse.
    WrongRole {
        /// The type.
        tier_type: String,
        /// `"primary"` or `"secondary"`: what it is registered as.
        registered_as: &'static str,
    },
    /// Two crates registered the same type.
    Registry(RegistryError),
    /// A tier library could not be loaded or used.
    #[cfg(feature = "libraries")]
    Plugin(PluginError),
    /// The chain names a tier `library`, but this build has no tier-library loader (the
    /// `libraries` feature of tiering-config is off).
    LibrariesDisabled,
    /// The tier's factory refused its options or failed.
    Tier(TierError),
    /// Two tiers of the chain report the same name.
    DuplicateName(String),
}

impl fmt::Display for ChainErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "cannot read the chain file: {e}"),
            Self::Syntax(m) => write!(f, "invalid TOML: {m}"),
            Self::Invalid(m) => f.write_str(m),
            Self::UnknownKey { key, expected } => {
                write!(f, "unknown key `{key}` (expected one of: {expected})")
            }
            Self::UnknownType { tier_type, known } => write!(
                f,
                "unknown tier type `{tier_type}`; registered types: {} (or set `library = \"path/to/lib.so\"` \
                 to load it from a tier library)",
                if known.is_empty() {
                    "(none)".to_owned()
                } else {
                    known.join(", ")
                },
            ),
            Self::WrongRole {
                tier_type,
                registered_as,
            } => write!(
                f,
                "tier type `{tier_type}` is a {registered_as} tier and cannot be used here"
            ),
            Self::Registry(e) => e.fmt(f),
            #[cfg(feature = "libraries")]
            Self::Plugin(e) => e.fmt(f),
            Self::LibrariesDisabled => f.write_str(
                "this build cannot load tier libraries: tiering-config was built without its `libraries` feature",
            ),
            Self::Tier(e) => e.fmt(f),
            Self::DuplicateName(n) => write!(
                f,
                "two tiers are named `{n}`; tier names must be unique within a chain (set `name`)"
            ),
        }
    }
}

/// An error in a chain file, located as precisely as possible.
#[derive(Debug)]
pub struct ChainError {
    /// The file.
    pub file: String,
    /// The 1-based line.
    pub line: Option<usize>,
    /// The tier (position and type).
    pub tier: Option<String>,
    /// The key.
    pub key: Option<String>,
    /// What went wrong (boxed: it is large and errors are rare).
    pub kind: Box<ChainErrorKind>,
}

impl ChainError {
    pub(crate) fn file(file: &str, kind: ChainErrorKind) -> Self {
        Self {
            file: file.to_owned(),
            line: None,
            tier: None,
            key: None,
            kind: Box::new(kind),
        }
    }

    pub(crate) fn at_line(mut self, line: Option<usize>) -> Self {
        self.line = line.or(self.line);
        self
    }

    pub(crate) fn in_tier(mut self, tier: &str) -> Self {
        self.tier = Some(tier.to_owned());
        self
    }

    pub(crate) fn with_key(mut self, key: &str) -> Self {
        self.key = Some(key.to_owned());
        self
    }
}

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(tier) = &self.tier {
            write!(f, ": {tier}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.kind)
    }
}

// No `source()`: the message already includes the cause's text, and a reporter that prints the
// chain (`{:#}` in anyhow) would otherwise repeat it.
impl std::error::Error for ChainError {}
