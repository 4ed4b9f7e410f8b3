//! Parsing a tier chain file: `[primary]`, ordered `[[secondary]]`, `[control_plane]`.
//!
//! The file is parsed with spans, so every error names the file, the line, the key and the
//! tier's position in the chain. Tier sections keep their own keys as a plain [`toml::Table`]
//! for the tier's factory, minus the chain-level keys `type`, `library` and `same_build`.
//!
//! String values may use `${tmpdir}` (the system temporary directory) and `${pid}` (this
//! process's id), so a chain can place scratch data without naming a machine-specific path.
//! A relative `path` option in a chain file is relative to the file's directory (`path = ""`
//! is that directory), not to the working directory.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::error::{ChainError, ChainErrorKind};
use super::gates;
use super::spanned::to_value;
use tiering_core::admission::{AdmissionConfig, BackpressureConfig};
use tiering_core::options::HumanDuration;
use tiering_core::options::quoted_words;
use tiering_core::{Locality, Medium};
use tiering_core::{ManagerConfig, OnTierFailure};

/// Where a tier sits in the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TierPosition {
    /// The `[primary]` section.
    Primary,
    /// The n-th `[[secondary]]` section (0-based; lookup priority order).
    Secondary(usize),
}

impl fmt::Display for TierPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Primary => f.write_str("[primary]"),
            Self::Secondary(i) => write!(f, "[[secondary]] #{}", i + 1),
        }
    }
}

/// One tier section.
#[derive(Clone, Debug)]
pub struct TierSpec {
    /// Its place in the chain.
    pub position: TierPosition,
    /// The `type` key.
    pub tier_type: String,
    /// The `library` key: load the type from this shared library instead of the registry.
    pub library: Option<PathBuf>,
    /// The `same_build` key: refuse a library whose build fingerprint differs from the host's.
    pub same_build: bool,
    /// The tier's own options (every other key).
    pub options: toml::Table,
    /// The `admission` key of a secondary tier (`None`: the default for the tier's medium).
    pub admission: Option<AdmissionConfig>,
    /// The `backpressure` key of a secondary tier (`None`: on, with the defaults).
    pub backpressure: Option<BackpressureConfig>,
    /// The `medium` key of a secondary tier (`"cpu"` or `"storage"`): overrides the medium its
    /// type declares (`None`: the type's).
    pub medium: Option<Medium>,
    /// The `locality` key of a secondary tier (`"local"` or `"remote"`): overrides the
    /// locality its type declares (`None`: the type's).
    pub locality: Option<Locality>,
    /// Line of the section header (1-based).
    pub line: usize,
    key_lines: BTreeMap<String, usize>,
}

impl TierSpec {
    /// The line of `key` in this section, if present.
    #[must_use]
    pub fn key_line(&self, key: &str) -> Option<usize> {
        self.key_lines.get(key).copied()
    }

    /// A short description: position and type.
    #[must_use]
    pub fn describe(&self) -> String {
        format!("{} (type \"{}\")", self.position, self.tier_type)
    }
}

/// The `[control_plane]` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlaneSpec {
    /// Run the control plane on its own thread (`thread`, default true).
    pub thread: bool,
    /// Longest wait between sweeps without a wake (`idle_wait`, default 100ms).
    pub idle_wait: Duration,
    /// Lock wait before re-checking the stop flag (`lock_timeout`, default 1s).
    pub lock_timeout: Duration,
    /// Starvation warning period (`starvation_warning`, default 10s).
    pub starvation_warning: Duration,
    /// Shutdown join timeout (`join_timeout`, default 2s).
    pub join_timeout: Duration,
    /// Complete worker-reported stores and submit peer-driven promotions off the step boundary
    /// (`off_step`, default false; see `ManagerConfig::off_step`).
    pub off_step: bool,
    /// Copy-worker ranks that report each store off-step (`reporters`, default 1).
    pub reporters: u32,
    /// The hung-tier bound (`tier_timeout`, default 10s): a tier's drain or shutdown, and how long a
    /// lock waiter waits on a holder stuck inside one tier call before naming it.
    pub tier_timeout: Duration,
    /// How long the stores of a worker that vanished wait before failing (`worker_deadline`,
    /// default 5s).
    pub worker_deadline: Duration,
    /// What a failing tier costs (`on_tier_failure = "quarantine" | "fail"`, default quarantine).
    pub on_tier_failure: OnTierFailure,
    /// How long lookups skip a tier after a promotion from it failed, at first
    /// (`promotion_backoff`, default 1s; it doubles while the tier keeps failing).
    pub promotion_backoff: Duration,
    /// The longest such back-off (`promotion_backoff_max`, default 30s).
    pub promotion_backoff_max: Duration,
}

impl Default for ControlPlaneSpec {
    fn default() -> Self {
        let d = ManagerConfig::default();
        Self {
            thread: d.control_plane_thread,
            idle_wait: d.idle_wait,
            lock_timeout: d.lock_timeout,
            starvation_warning: d.starvation_warning,
            join_timeout: d.join_timeout,
            off_step: d.off_step,
            reporters: d.reporters,
            tier_timeout: d.tier_timeout,
            worker_deadline: d.worker_deadline,
            on_tier_failure: d.on_tier_failure,
            promotion_backoff: d.promotion_backoff.initial,
            promotion_backoff_max: d.promotion_backoff.max,
        }
    }
}

impl ControlPlaneSpec {
    /// The manager configuration this section describes.
    #[must_use]
    pub fn manager_config(&self) -> ManagerConfig {
        ManagerConfig {
            control_plane_thread: self.thread,
            idle_wait: self.idle_wait,
            lock_timeout: self.lock_timeout,
            starvation_warning: self.starvation_warning,
            join_timeout: self.join_timeout,
            off_step: self.off_step,
            reporters: self.reporters,
            tier_timeout: self.tier_timeout,
            worker_deadline: self.worker_deadline,
            on_tier_failure: self.on_tier_failure,
            promotion_backoff: tiering_core::PromotionBackoffConfig {
                initial: self.promotion_backoff,
                max: self.promotion_backoff_max,
                ..tiering_core::PromotionBackoffConfig::default()
            },
            ..ManagerConfig::default()
        }
    }
}

/// A parsed chain file.
#[derive(Clone, Debug)]
pub struct ChainConfig {
    /// The file's name, as errors show it.
    pub source: String,
    /// The primary tier.
    pub primary: TierSpec,
    /// The secondary tiers, in lookup-priority order.
    pub secondaries: Vec<TierSpec>,
    /// The control plane.
    pub control_plane: ControlPlaneSpec,
    /// The `[cost]` section: load-versus-recompute decisions (default: none).
    pub cost: tiering_core::CostConfig,
}

/// Byte offset → 1-based line number.
struct Lines<'a>(&'a str);

impl Lines<'_> {
    fn of(&self, offset: usize) -> usize {
        let end = offset.min(self.0.len());
        self.0.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count() + 1
    }

    fn of_span(&self, span: &Range<usize>) -> usize {
        self.of(span.start)
    }

    /// The nearest line at or above `line` (1-based) that starts with `header`.
    fn header_at_or_above(&self, line: usize, header: &str) -> Option<usize> {
        let all: Vec<&str> = self.0.lines().collect();
        (1..=line.min(all.len()))
            .rev()
            .find(|&l| all[l - 1].trim_start().starts_with(header))
    }
}

/// Expands `${tmpdir}` and `${pid}` in every string of `value`.
fn expand(value: &mut toml::Value) {
    match value {
        toml::Value::String(s) if s.contains("${") => {
            let tmp = std::env::temp_dir();
            *s = s
                .replace("${tmpdir}", &tmp.to_string_lossy())
                .replace("${pid}", &std::process::id().to_string());
        }
        toml::Value::Array(a) => a.iter_mut().for_each(expand),
        toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| expand(v)),
        _ => {}
    }
}

/// The lines of the keys of a table value (an inline table or a `[secondary.x]` section).
fn nested_key_lines(lines: &Lines<'_>, value: &Spanned<DeValue<'_>>) -> BTreeMap<String, usize> {
    value
        .get_ref()
        .as_table()
        .map(|t| {
            t.iter()
                .map(|(k, _)| (k.get_ref().to_string(), lines.of_span(&k.span())))
                .collect()
        })
        .unwrap_or_default()
}

impl ChainConfig {
    /// Reads and parses the chain file at `path`.
    ///
    /// # Errors
    /// The file cannot be read, or [`ChainConfig::parse`] fails.
    pub fn load(path: &Path) -> Result<Self, ChainError> {
        let source = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|e| ChainError::file(&source, ChainErrorKind::Io(e)))?;
        let mut config = Self::parse(&source, &text)?;
        let base = path.parent().unwrap_or(Path::new(""));
        let base = if base.as_os_str().is_empty() {
            Path::new(".")
        } else {
            base
        };
        config.anchor_paths(base);
        Ok(config)
    }

    /// Makes every tier's relative `path` option relative to `base` (the chain file's
    /// directory); `path = ""` becomes `base` itself. Absolute paths are kept.
    pub fn anchor_paths(&mut self, base: &Path) {
        for spec in std::iter::once(&mut self.primary).chain(&mut self.secondaries) {
            if let Some(toml::Value::String(p)) = spec.options.get_mut("path")
                && Path::new(p.as_str()).is_relative()
            {
                *p = base.join(p.as_str()).to_string_lossy().into_owned();
            }
        }
    }

    /// Parses chain-file text; `source` names it in errors.
    ///
    /// # Errors
    /// TOML syntax, a missing or repeated `[primary]`, a missing `type`, an unknown top-level or
    /// `[control_plane]` key, or a bad value — each naming the file, line, key and tier.
    pub fn parse(source: &str, text: &str) -> Result<Self, ChainError> {
        let lines = Lines(text);
        let doc = DeTable::parse(text).map_err(|e| {
            let line = e.span().map(|s| lines.of_span(&s));
            let message = e.message().trim().to_owned();
            let line_text = line
                .and_then(|l| text.lines().nth(l - 1))
                .unwrap_or_default()
                .trim();
            let kind = if message.contains("duplicate key") && line_text.starts_with("[primary]") {
                ChainErrorKind::Invalid("two [primary] sections: a chain has exactly one primary tier".into())
            } else {
                ChainErrorKind::Syntax(message)
            };
            ChainError::file(source, kind).at_line(line)
        })?;
        let doc = doc.into_inner();
        let mut primary = None;
        let mut secondaries = Vec::new();
        let mut control_plane = ControlPlaneSpec::default();
        let mut cost = tiering_core::CostConfig::default();
        for (key, value) in &doc {
            let line = lines.of_span(&key.span());
            let err = |kind| {
                ChainError::file(source, kind)
                    .at_line(Some(line))
                    .with_key(key.get_ref())
            };
            match &**key.get_ref() {
                "primary" => {
                    let Some(t) = value.get_ref().as_table() else {
                        return Err(err(ChainErrorKind::Invalid(
                            "`primary` must be a single [primary] table (a chain has exactly one primary tier)".into(),
                        )));
                    };
                    primary = Some(Self::tier(source, &lines, TierPosition::Primary, line, t)?);
                }
                "secondary" => {
                    let Some(items) = value.get_ref().as_array() else {
                        return Err(err(ChainErrorKind::Invalid(
                            "`secondary` must be an array of tables: write each as [[secondary]]".into(),
                        )));
                    };
                    for (i, item) in items.iter().enumerate() {
                        let item_line = lines.of_span(&item.span());
                        let Some(t) = item.get_ref().as_table() else {
                            return Err(ChainError::file(
                                source,
                                ChainErrorKind::Invalid(
                                    "each secondary tier must be a [[secondary]] table".into(),
                                ),
                            )
                            .at_line(Some(item_line)));
                        };
                        // The header is the nearest `[[secondary]]` line at or above the
                        // table's first key (comments or blank lines may sit between).
                        let first_key = t
                            .iter()
                            .map(|(k, _)| lines.of_span(&k.span()))
                            .min()
                            .unwrap_or(item_line);
                        let header = lines
                            .header_at_or_above(first_key, "[[secondary]]")
                            .unwrap_or(first_key);
                        secondaries.push(Self::tier(source, &lines, TierPosition::Secondary(i), header, t)?);
                    }
                }
                "control_plane" => {
                    let Some(t) = value.get_ref().as_table() else {
                        return Err(err(ChainErrorKind::Invalid(
                            "`control_plane` must be a table".into(),
                        )));
                    };
                    control_plane = Self::control_plane(source, &lines, t)?;
                }
                "cost" => {
                    let Some(t) = value.get_ref().as_table() else {
                        return Err(err(ChainErrorKind::Invalid("`cost` must be a table".into())));
                    };
                    cost = super::cost::parse(source, &|span| lines.of_span(span), line, t)?;
                }
                other => {
                    return Err(err(ChainErrorKind::UnknownKey {
                        key: other.to_owned(),
                        expected: "primary, secondary, control_plane, cost",
                    }));
                }
            }
        }
        let primary = primary.ok_or_else(|| {
            ChainError::file(
                source,
                ChainErrorKind::Invalid("no [primary] section: a chain needs a primary tier".into()),
            )
        })?;
        Ok(Self {
            source: source.to_owned(),
            primary,
            secondaries,
            control_plane,
            cost,
        })
    }

    fn tier(
        source: &str,
        lines: &Lines<'_>,
        position: TierPosition,
        header_line: usize,
        table: &DeTable<'_>,
    ) -> Result<TierSpec, ChainError> {
        let mut spec = TierSpec {
            position,
            tier_type: String::new(),
            library: None,
            same_build: false,
            options: toml::Table::new(),
            admission: None,
            backpressure: None,
            medium: None,
            locality: None,
            line: header_line,
            key_lines: BTreeMap::new(),
        };
        let mut type_seen = false;
        for (key, value) in table {
            let name = key.get_ref().to_string();
            let line = lines.of_span(&key.span());
            spec.key_lines.insert(name.clone(), line);
            let err = |kind| {
                ChainError::file(source, kind)
                    .at_line(Some(line))
                    .in_tier(&spec.describe_partial())
                    .with_key(&name)
            };
            let mut v = to_value(value).map_err(|m| err(ChainErrorKind::Invalid(m)))?;
            expand(&mut v);
            match name.as_str() {
                "type" => {
                    let toml::Value::String(t) = v else {
                        return Err(err(ChainErrorKind::Invalid("`type` must be a string".into())));
                    };
                    spec.tier_type = t;
                    type_seen = true;
                }
                "library" => {
                    if position == TierPosition::Primary {
                        return Err(err(ChainErrorKind::Invalid(
                            "the primary tier cannot come from a library (only secondary tiers can)".into(),
                        )));
                    }
                    let toml::Value::String(p) = v else {
                        return Err(err(ChainErrorKind::Invalid(
                            "`library` must be a path string".into(),
                        )));
                    };
                    spec.library = Some(PathBuf::from(p));
                }
                "same_build" => {
                    let toml::Value::Boolean(b) = v else {
                        return Err(err(ChainErrorKind::Invalid(
                            "`same_build` must be true or false".into(),
                        )));
                    };
                    spec.same_build = b;
                }
                "medium" | "locality" => {
                    if position == TierPosition::Primary {
                        return Err(err(ChainErrorKind::Invalid(format!(
                            "`{name}` describes a secondary tier for request tier filters; the primary tier is always CPU and local"
                        ))));
                    }
                    let word = v.as_str().map(str::to_ascii_lowercase);
                    if name == "medium" {
                        spec.medium = Some(match word.as_deref() {
                            Some("cpu") => Medium::Cpu,
                            Some("storage") => Medium::Storage,
                            _ => {
                                return Err(err(ChainErrorKind::Invalid(format!(
                                    "`medium` must be \"cpu\" or \"storage\", found {v}"
                                ))));
                            }
                        });
                    } else {
                        spec.locality = Some(match word.as_deref() {
                            Some("local") => Locality::Local,
                            Some("remote") => Locality::Remote,
                            _ => {
                                return Err(err(ChainErrorKind::Invalid(format!(
                                    "`locality` must be \"local\" or \"remote\", found {v}"
                                ))));
                            }
                        });
                    }
                }
                "admission" | "backpressure" => {
                    if position == TierPosition::Primary {
                        return Err(err(ChainErrorKind::Invalid(format!(
                            "`{name}` gates cascades to a secondary tier; the primary tier has none"
                        ))));
                    }
                    let nested = nested_key_lines(lines, value);
                    let nested_err = |kind: ChainErrorKind| {
                        let message = kind.to_string();
                        let inner = quoted_words(&message)
                            .find(|w| nested.contains_key(*w))
                            .map(str::to_owned);
                        let at = inner
                            .as_deref()
                            .and_then(|k| nested.get(k))
                            .copied()
                            .unwrap_or(line);
                        let key = inner.map_or_else(|| name.clone(), |k| format!("{name}.{k}"));
                        ChainError::file(source, kind)
                            .at_line(Some(at))
                            .in_tier(&spec.describe_partial())
                            .with_key(&key)
                    };
                    if name == "admission" {
                        spec.admission = Some(gates::admission(v).map_err(nested_err)?);
                    } else {
                        spec.backpressure = Some(gates::backpressure(v).map_err(nested_err)?);
                    }
                }
                _ => {
                    spec.options.insert(name.clone(), v);
                }
            }
        }
        if !type_seen || spec.tier_type.is_empty() {
            return Err(ChainError::file(
                source,
                ChainErrorKind::Invalid("missing `type`: every tier section names its tier type".into()),
            )
            .at_line(Some(header_line))
            .in_tier(&position.to_string()));
        }
        Ok(spec)
    }

    fn control_plane(
        source: &str,
        lines: &Lines<'_>,
        table: &DeTable<'_>,
    ) -> Result<ControlPlaneSpec, ChainError> {
        let mut spec = ControlPlaneSpec::default();
        for (key, value) in table {
            let name = key.get_ref().to_string();
            let line = lines.of_span(&key.span());
            let err = |kind| {
                ChainError::file(source, kind)
                    .at_line(Some(line))
                    .in_tier("[control_plane]")
                    .with_key(&name)
            };
            let v = to_value(value).map_err(|m| err(ChainErrorKind::Invalid(m)))?;
            let duration = |v: toml::Value| -> Result<Duration, ChainError> {
                match v {
                    toml::Value::String(s) => s
                        .parse::<HumanDuration>()
                        .map(HumanDuration::get)
                        .map_err(|e| err(ChainErrorKind::Invalid(e.to_string()))),
                    other => Err(err(ChainErrorKind::Invalid(format!(
                        "expected a duration like \"1ms\", found {}",
                        other.type_str()
                    )))),
                }
            };
            match name.as_str() {
                "thread" | "off_step" => {
                    let toml::Value::Boolean(b) = v else {
                        return Err(err(ChainErrorKind::Invalid(format!(
                            "`{name}` must be true or false"
                        ))));
                    };
                    if name == "thread" {
                        spec.thread = b;
                    } else {
                        spec.off_step = b;
                    }
                }
                "idle_wait" => spec.idle_wait = duration(v)?,
                "tier_timeout" => spec.tier_timeout = duration(v)?,
                "worker_deadline" => spec.worker_deadline = duration(v)?,
                "reporters" => {
                    spec.reporters = match v {
                        toml::Value::Integer(n) if (1..=64).contains(&n) => u32::try_from(n).unwrap_or(1),
                        other => {
                            return Err(err(ChainErrorKind::Invalid(format!(
                                "`reporters` must be an integer from 1 to 64 (the copy workers' world size), found {other}"
                            ))));
                        }
                    };
                }
                "on_tier_failure" => {
                    spec.on_tier_failure = match v.as_str() {
                        Some("quarantine") => OnTierFailure::Quarantine,
                        Some("fail") => OnTierFailure::Fail,
                        _ => {
                            return Err(err(ChainErrorKind::Invalid(format!(
                                "`on_tier_failure` must be \"quarantine\" or \"fail\", found {v}"
                            ))));
                        }
                    };
                }
                "lock_timeout" => spec.lock_timeout = duration(v)?,
                "starvation_warning" => spec.starvation_warning = duration(v)?,
                "join_timeout" => spec.join_timeout = duration(v)?,
                "promotion_backoff" | "promotion_backoff_max" => {
                    let d = duration(v)?;
                    if d.is_zero() {
                        return Err(err(ChainErrorKind::Invalid(format!(
                            "`{name}` must be longer than zero (a failed promotion would be retried at once)"
                        ))));
                    }
                    if name == "promotion_backoff" {
                        spec.promotion_backoff = d;
                    } else {
                        spec.promotion_backoff_max = d;
                    }
                }
                other => {
                    return Err(err(ChainErrorKind::UnknownKey {
                        key: other.to_owned(),
                        expected: "thread, off_step, reporters, idle_wait, lock_timeout, starvation_warning, join_timeout, tier_timeout, worker_deadline, on_tier_failure, promotion_backoff, promotion_backoff_max",
                    }));
                }
            }
        }
        if spec.promotion_backoff_max < spec.promotion_backoff {
            let line = table
                .iter()
                .find(|(k, _)| *k.get_ref() == "promotion_backoff_max")
                .or_else(|| table.iter().find(|(k, _)| *k.get_ref() == "promotion_backoff"))
                .map(|(k, _)| lines.of_span(&k.span()));
            return Err(ChainError::file(
                source,
                ChainErrorKind::Invalid(format!(
                    "`promotion_backoff_max` ({:?}) is shorter than `promotion_backoff` ({:?})",
                    spec.promotion_backoff_max, spec.promotion_backoff
                )),
            )
            .at_line(line)
            .in_tier("[control_plane]")
            .with_key("promotion_backoff_max"));
        }
        Ok(spec)
    }

    /// The manager configuration of `[control_plane]` and `[cost]`.
    #[must_use]
    pub fn manager_config(&self) -> ManagerConfig {
        ManagerConfig {
            cost: self.cost,
            ..self.control_plane.manager_config()
        }
    }

    /// Every tier, primary first, in chain order.
    pub fn tiers(&self) -> impl Iterator<Item = &TierSpec> {
        std::iter::once(&self.primary).chain(&self.secondaries)
    }
}

impl TierSpec {
    fn describe_partial(&self) -> String {
        if self.tier_type.is_empty() {
            self.position.to_string()
        } else {
            self.describe()
        }
    }
}
