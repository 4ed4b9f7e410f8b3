//! Turning a parsed chain into a running [`TieringManager`]: resolve every tier type (registry
//! or library), then construct the primary and the secondaries in order, shutting down what was
//! built, in reverse order, if any step fails.

use std::collections::HashSet;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::chain::{ChainConfig, TierPosition, TierSpec};
use super::error::{ChainError, ChainErrorKind};
use tiering_core::ControlWaker;
use tiering_core::admission::AdmissionConfig;
use tiering_core::options::quoted_words;
use tiering_core::registry::{PrimaryContext, Registry, SecondaryContext, TierFactory};
use tiering_core::{ManagerConfig, TierGateConfig, TieringManager};
use tiering_core::{PrimaryTier, SecondaryTier};
use tiering_core::{TierError, panic_message};
#[cfg(feature = "libraries")]
use tiering_plugin::{LoadedLibrary, PluginError, PluginTier, load_library};

/// Where a tier type of the chain comes from.
#[derive(Clone, Copy, Debug)]
pub enum TierSource {
    /// Registered by a crate linked into this binary.
    Linked {
        /// The registering crate.
        crate_name: &'static str,
        /// Its factory.
        factory: TierFactory,
    },
    /// A loaded tier library.
    #[cfg(feature = "libraries")]
    Library(&'static LoadedLibrary),
}

impl fmt::Display for TierSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Linked { crate_name, .. } => write!(f, "linked in (crate {crate_name})"),
            #[cfg(feature = "libraries")]
            Self::Library(lib) => write!(
                f,
                "library {} (tiering-core {}; built as `{}`)",
                lib.path().display(),
                lib.core_version(),
                lib.fingerprint()
            ),
        }
    }
}

/// A chain whose every tier type is known (libraries loaded and checked).
#[derive(Debug)]
pub struct ResolvedChain<'a> {
    /// The chain.
    pub config: &'a ChainConfig,
    /// The source of each tier, primary first, in chain order.
    pub sources: Vec<TierSource>,
}

pub(crate) fn locate(config: &ChainConfig, spec: &TierSpec, kind: ChainErrorKind) -> ChainError {
    // Point at the key the message is about when it quotes one of the section's keys.
    let message = kind.to_string();
    let key = quoted_words(&message)
        .find(|w| spec.key_line(w).is_some())
        .map(str::to_owned);
    let line = key.as_deref().and_then(|k| spec.key_line(k)).unwrap_or(spec.line);
    let err = ChainError::file(&config.source, kind)
        .at_line(Some(line))
        .in_tier(&spec.describe());
    match key {
        Some(k) => err.with_key(&k),
        None => err,
    }
}

impl ChainConfig {
    /// Resolves every tier type: registered types from `registry`, `library` ones by loading
    /// and checking the library. This is what `kvtier check` validates.
    ///
    /// # Errors
    /// An unknown type (listing the registered ones), a type used in the wrong role, or a
    /// library that cannot be loaded, is of another type, or (with `same_build`) was built
    /// differently.
    pub fn resolve(&self, registry: &Registry) -> Result<ResolvedChain<'_>, ChainError> {
        let sources = self
            .tiers()
            .map(|spec| self.resolve_tier(spec, registry))
            .collect::<Result<_, _>>()?;
        Ok(ResolvedChain {
            config: self,
            sources,
        })
    }

    /// Resolves one tier's type (see [`ChainConfig::resolve`]).
    pub(crate) fn resolve_tier(
        &self,
        spec: &TierSpec,
        registry: &Registry,
    ) -> Result<TierSource, ChainError> {
        {
            let source = if let Some(path) = &spec.library {
                self.resolve_library(spec, path)?
            } else {
                let Some(reg) = registry.get(&spec.tier_type) else {
                    let known = registry
                        .iter()
                        .map(|r| format!("{} ({})", r.name, r.factory.role()))
                        .collect();
                    return Err(ChainError::file(
                        &self.source,
                        ChainErrorKind::UnknownType {
                            tier_type: spec.tier_type.clone(),
                            known,
                        },
                    )
                    .at_line(Some(spec.key_line("type").unwrap_or(spec.line)))
                    .in_tier(&spec.position.to_string())
                    .with_key("type"));
                };
                let wanted_primary = spec.position == TierPosition::Primary;
                if matches!(reg.factory, TierFactory::Primary(_)) != wanted_primary {
                    return Err(ChainError::file(
                        &self.source,
                        ChainErrorKind::WrongRole {
                            tier_type: spec.tier_type.clone(),
                            registered_as: reg.factory.role(),
                        },
                    )
                    .at_line(Some(spec.key_line("type").unwrap_or(spec.line)))
                    .in_tier(&spec.position.to_string())
                    .with_key("type"));
                }
                TierSource::Linked {
                    crate_name: reg.crate_name,
                    factory: reg.factory,
                }
            };
            Ok(source)
        }
    }

    /// Loads and checks the tier library `path` that `spec` names.
    #[cfg(feature = "libraries")]
    fn resolve_library(&self, spec: &TierSpec, path: &std::path::Path) -> Result<TierSource, ChainError> {
        let lib = load_library(path).map_err(|e| self.library_error(spec, e))?;
        if lib.type_name() != spec.tier_type {
            return Err(self.library_error(
                spec,
                PluginError::WrongType {
                    path: path.to_path_buf(),
                    found: lib.type_name().to_owned(),
                    expected: spec.tier_type.clone(),
                },
            ));
        }
        if spec.same_build && !lib.same_build_as_host() {
            return Err(self.library_error(
                spec,
                PluginError::FingerprintMismatch {
                    path: path.to_path_buf(),
                    found: lib.fingerprint().to_owned(),
                    expected: tiering_plugin::BUILD_FINGERPRINT.to_owned(),
                },
            ));
        }
        Ok(TierSource::Library(lib))
    }

    /// Refuses the tier library `spec` names: this build has no loader.
    #[cfg(not(feature = "libraries"))]
    fn resolve_library(&self, spec: &TierSpec, _path: &std::path::Path) -> Result<TierSource, ChainError> {
        Err(ChainError::file(&self.source, ChainErrorKind::LibrariesDisabled)
            .at_line(Some(spec.key_line("library").unwrap_or(spec.line)))
            .in_tier(&spec.describe())
            .with_key("library"))
    }

    #[cfg(feature = "libraries")]
    fn library_error(&self, spec: &TierSpec, e: PluginError) -> ChainError {
        ChainError::file(&self.source, ChainErrorKind::Plugin(e))
            .at_line(Some(spec.key_line("library").unwrap_or(spec.line)))
            .in_tier(&spec.describe())
            .with_key("library")
    }

    /// Resolves the chain against `registry` and builds the manager, for chunks of
    /// `chunk_bytes` bytes.
    ///
    /// # Errors
    /// As [`ChainConfig::resolve`] and [`ResolvedChain::build`].
    pub fn build(&self, registry: &Registry, chunk_bytes: usize) -> Result<TieringManager, ChainError> {
        self.resolve(registry)?.build(chunk_bytes)
    }
}

/// The tiers of a chain, built and not yet handed to a manager — for callers that drive a tier
/// on its own (a benchmark) or want the pieces before composing them.
pub struct BuiltChain {
    /// The primary tier.
    pub primary: Box<dyn PrimaryTier>,
    /// The secondary tiers, in chain order.
    pub secondaries: Vec<Box<dyn SecondaryTier>>,
    /// The waker every secondary was built with.
    pub waker: ControlWaker,
    /// The manager settings of `[control_plane]` and `[cost]`.
    pub manager_config: ManagerConfig,
}

impl BuiltChain {
    /// The manager over these tiers.
    #[must_use]
    pub fn into_manager(self) -> TieringManager {
        TieringManager::with_waker(self.primary, self.secondaries, self.manager_config, self.waker)
    }
}

impl ResolvedChain<'_> {
    /// Builds the tiers and the manager over them (see [`ResolvedChain::build_tiers`]).
    ///
    /// # Errors
    /// As [`ResolvedChain::build_tiers`].
    pub fn build(&self, chunk_bytes: usize) -> Result<TieringManager, ChainError> {
        Ok(self.build_tiers(chunk_bytes)?.into_manager())
    }

    /// Builds the tiers — primary first, then each secondary in chain order, all sharing one
    /// [`ControlWaker`]. If any tier fails to build, the tiers already built are shut down in
    /// reverse order and dropped before the error returns.
    ///
    /// # Errors
    /// A tier's factory refused its options or failed (a panic counts as a failure), or two
    /// tiers share a name; the error points at the tier and, when the message names one of its
    /// keys, at that key's line.
    pub fn build_tiers(&self, chunk_bytes: usize) -> Result<BuiltChain, ChainError> {
        let config = self.config;
        let specs: Vec<&TierSpec> = config.tiers().collect();
        let waker = ControlWaker::new();
        let primary_spec = specs[0];
        let TierSource::Linked {
            factory: TierFactory::Primary(make_primary),
            ..
        } = self.sources[0]
        else {
            return Err(locate(
                config,
                primary_spec,
                ChainErrorKind::Invalid("the primary tier must be a registered primary type".into()),
            ));
        };
        let pctx = PrimaryContext::new(chunk_bytes);
        let mut primary: Box<dyn PrimaryTier> =
            catch_unwind(AssertUnwindSafe(|| make_primary(&primary_spec.options, &pctx)))
                .unwrap_or_else(|p| {
                    Err(TierError::Other(format!(
                        "the factory panicked: {}",
                        panic_message(&*p)
                    )))
                })
                .map_err(|e| locate(config, primary_spec, ChainErrorKind::Tier(e)))?;
        let arena = Arc::clone(primary.arena());
        let mut names: HashSet<String> = HashSet::from([primary.info().name]);
        let mut built: Vec<Box<dyn SecondaryTier>> = Vec::new();
        for (spec, source) in specs[1..].iter().zip(&self.sources[1..]) {
            let ctx = SecondaryContext::new(Arc::clone(&arena), waker.clone());
            let made: Result<Box<dyn SecondaryTier>, ChainErrorKind> = match *source {
                TierSource::Linked {
                    factory: TierFactory::Secondary(f),
                    ..
                } => catch_unwind(AssertUnwindSafe(|| f(&spec.options, &ctx)))
                    .unwrap_or_else(|p| {
                        Err(TierError::Other(format!(
                            "the factory panicked: {}",
                            panic_message(&*p)
                        )))
                    })
                    .map_err(ChainErrorKind::Tier),
                #[cfg(feature = "libraries")]
                TierSource::Library(lib) => PluginTier::create(lib, &spec.options, &ctx)
                    .map(|t| Box::new(t) as Box<dyn SecondaryTier>)
                    .map_err(ChainErrorKind::Plugin),
                TierSource::Linked { .. } => Err(ChainErrorKind::WrongRole {
                    tier_type: spec.tier_type.clone(),
                    registered_as: "primary",
                }),
            };
            // The chain's `medium` / `locality` keys, whatever the tier's type.
            let made = made.map(|t| tiering_core::Redescribed::wrap(t, spec.medium, spec.locality));
            let made = made.and_then(|t| {
                let name = t.info().name;
                if names.insert(name.clone()) {
                    Ok(t)
                } else {
                    let mut t = t;
                    if let Err(e) = t.shutdown() {
                        tracing::warn!(tier = %name, error = %e, "shutting down a refused tier failed");
                    }
                    Err(ChainErrorKind::DuplicateName(name))
                }
            });
            match made {
                Ok(t) => built.push(t),
                Err(kind) => {
                    let err = locate(config, spec, kind);
                    tracing::error!(error = %err, "tier chain construction failed; shutting down the tiers already built");
                    while let Some(mut t) = built.pop() {
                        if let Err(e) = t.shutdown() {
                            tracing::warn!(tier = %t.info().name, error = %e, "shutdown after a failed build");
                        }
                    }
                    if let Err(e) = primary.shutdown() {
                        tracing::warn!(error = %e, "primary shutdown after a failed build");
                    }
                    return Err(err);
                }
            }
        }
        let mut manager_config = config.manager_config();
        for (spec, tier) in specs[1..].iter().zip(&built) {
            let info = tier.info();
            let gate = TierGateConfig {
                admission: Some(
                    spec.admission
                        .clone()
                        .unwrap_or_else(|| AdmissionConfig::default_for(&info)),
                ),
                backpressure: spec.backpressure.clone().unwrap_or_default(),
            };
            manager_config.tier_gates.insert(info.name, gate);
        }
        Ok(BuiltChain {
            primary,
            secondaries: built,
            waker,
            manager_config,
        })
    }
}

impl fmt::Display for ResolvedChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "chain {}", self.config.source)?;
        for (spec, source) in self.config.tiers().zip(&self.sources) {
            writeln!(f, "  {} type \"{}\" — {source}", spec.position, spec.tier_type)?;
            for (k, v) in &spec.options {
                writeln!(f, "      {k} = {v}")?;
            }
            if let Some(a) = &spec.admission {
                writeln!(f, "      admission = {a}")?;
            }
            if let Some(b) = &spec.backpressure {
                writeln!(f, "      backpressure = {b:?}")?;
            }
            if let Some(m) = spec.medium {
                writeln!(f, "      medium = {m:?} (overrides the type's)")?;
            }
            if let Some(l) = spec.locality {
                writeln!(f, "      locality = {l:?} (overrides the type's)")?;
            }
        }
        let cp = &self.config.control_plane;
        write!(
            f,
            "  [control_plane] thread = {}, off_step = {}, reporters = {}, idle_wait = {:?}, lock_timeout = {:?}, \
             tier_timeout = {:?}, worker_deadline = {:?}, on_tier_failure = {:?}, promotion_backoff = {:?}..{:?}",
            cp.thread,
            cp.off_step,
            cp.reporters,
            cp.idle_wait,
            cp.lock_timeout,
            cp.tier_timeout,
            cp.worker_deadline,
            cp.on_tier_failure,
            cp.promotion_backoff,
            cp.promotion_backoff_max
        )
    }
}
