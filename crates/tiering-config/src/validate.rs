//! Validating a chain without building it (`kvtier check`): every tier's type, every tier's
//! options, capacities, names and paths — all errors, not just the first — without allocating,
//! creating files or binding sockets.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use super::builder::{TierSource, locate};
use super::chain::{ChainConfig, TierPosition, TierSpec};
use super::error::{ChainError, ChainErrorKind};
use tiering_core::TierError;
use tiering_core::options::ByteSize;
use tiering_core::registry::Registry;

/// The largest capacity a tier without a backing device of its own (a network tier) may claim.
const CAPACITY_BOUND: u64 = 1 << 50;

impl ChainConfig {
    /// Every error of the chain, in file order: an unknown or misplaced tier type, every error
    /// the type's validate-only hook ([`TierRegistration::validate`](tiering_core::registry::TierRegistration::validate),
    /// or for a tier library its validate entry,
    /// [`LoadedLibrary::validate_options`](tiering_plugin::LoadedLibrary::validate_options), which
    /// loads the library but builds no tier) finds in its options, a `capacity` of zero or larger than the machine (physical
    /// memory for the primary, the filesystem under `path` for a tier with a path, 1 PiB
    /// otherwise), two tiers with one name, two tiers on one `path`. Nothing is built.
    ///
    /// A tier's name is its `name` option, or its type when it has none (the default of the
    /// shipped tiers).
    #[must_use]
    pub fn validate(&self, registry: &Registry) -> Vec<ChainError> {
        let mut errors = Vec::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut paths: HashMap<PathBuf, usize> = HashMap::new();
        for spec in self.tiers() {
            match self.resolve_tier(spec, registry) {
                Err(e) => errors.push(e),
                #[cfg(feature = "libraries")]
                Ok(TierSource::Library(lib)) => match lib.validate_options(&spec.options) {
                    // No validate entry: only building the tier checks its options.
                    None => {}
                    Some(Ok(problems)) => errors.extend(problems.into_iter().map(|p| {
                        let kind = ChainErrorKind::Tier(TierError::Config(p.message));
                        match p.key.filter(|k| spec.key_line(k).is_some()) {
                            Some(key) => self.at_key(spec, &key, kind),
                            None => locate(self, spec, kind),
                        }
                    })),
                    Some(Err(e)) => errors.push(locate(self, spec, ChainErrorKind::Plugin(e))),
                },
                Ok(TierSource::Linked { .. }) => {
                    if let Some(Err(found)) = registry.get(&spec.tier_type).map(|r| r.validate(&spec.options))
                    {
                        errors.extend(
                            found
                                .into_iter()
                                .map(|e: TierError| locate(self, spec, ChainErrorKind::Tier(e))),
                        );
                    }
                }
            }
            if let Some(e) = self.check_capacity(spec) {
                errors.push(e);
            }
            let name = match spec.options.get("name") {
                Some(toml::Value::String(n)) => n.clone(),
                _ => spec.tier_type.clone(),
            };
            if let Some(first) = names.insert(name.clone(), spec.line) {
                errors.push(self.at_key(
                    spec,
                    "name",
                    ChainErrorKind::Invalid(format!(
                        "two tiers are named `{name}` (the other at line {first}); tier names must be unique \
                         within a chain (set `name`)"
                    )),
                ));
            }
            if let Some(toml::Value::String(p)) = spec.options.get("path") {
                let normal = normalise(Path::new(p));
                if let Some(first) = paths.insert(normal, spec.line) {
                    errors.push(self.at_key(
                        spec,
                        "path",
                        ChainErrorKind::Invalid(format!(
                            "`path` {p:?} is also used by the tier at line {first}; two tiers cannot share \
                             a directory (each locks its own slab)"
                        )),
                    ));
                }
            }
        }
        errors.sort_by_key(|e| e.line);
        errors
    }

    fn at_key(&self, spec: &TierSpec, key: &str, kind: ChainErrorKind) -> ChainError {
        ChainError::file(&self.source, kind)
            .at_line(Some(spec.key_line(key).unwrap_or(spec.line)))
            .in_tier(&spec.describe())
            .with_key(key)
    }

    fn check_capacity(&self, spec: &TierSpec) -> Option<ChainError> {
        let bytes = match spec.options.get("capacity")? {
            // A malformed size is the tier's options check to report.
            toml::Value::String(s) => s.parse::<ByteSize>().ok()?.bytes(),
            toml::Value::Integer(0) => 0,
            // A count (of chunks, for the cpu tier) has no byte bound here.
            _ => return None,
        };
        let invalid = |m: String| Some(self.at_key(spec, "capacity", ChainErrorKind::Invalid(m)));
        if bytes == 0 {
            return invalid("`capacity` is zero: a tier must hold at least one chunk".into());
        }
        let (bound, what) = if spec.position == TierPosition::Primary {
            (physical_memory()?, "this machine's physical memory".to_owned())
        } else if let Some(toml::Value::String(p)) = spec.options.get("path") {
            let (size, fs) = filesystem_size(Path::new(p))?;
            (size, format!("the filesystem at {} ", fs.display()))
        } else {
            (CAPACITY_BOUND, "1 PiB".to_owned())
        };
        (bytes > bound).then(|| {
            self.at_key(
                spec,
                "capacity",
                ChainErrorKind::Invalid(format!(
                    "`capacity` {} is larger than {} ({})",
                    ByteSize(bytes),
                    what.trim_end(),
                    ByteSize(bound)
                )),
            )
        })
    }
}

/// `path` with `.` and `..` folded (lexically: the directories need not exist).
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn physical_memory() -> Option<u64> {
    // SAFETY: `sysconf` only reads system configuration.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let pages = u64::try_from(pages).ok()?;
    let page = u64::try_from(page).ok()?;
    pages.checked_mul(page)
}

/// The total size of the filesystem that holds `path` (or would: its nearest existing
/// ancestor), and that ancestor.
fn filesystem_size(path: &Path) -> Option<(u64, PathBuf)> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain data; all-zero is a valid value for it to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &raw mut st) } != 0 {
        return None;
    }
    Some((st.f_blocks.checked_mul(st.f_frsize)?, existing.to_path_buf()))
}
