//! Loading tier libraries: checks before trust, and never unloading.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::ffi::{
    ABI_SYMBOL, ABI_VERSION, ENTRY_SYMBOL, EntryFn, FfiStaticStr, MIN_ABI_VERSION, PluginDescriptor,
    PluginDescriptorV4, TierVTable, ValidateFn,
};
use super::{BUILD_FINGERPRINT, CORE_VERSION, PluginError};

/// A tier library that passed the loader's checks. Lives for the rest of the process: libraries
/// are never unloaded (a tier's threads or thread-locals may still run code from it, and some
/// C libraries cannot unload at all).
#[derive(Debug)]
pub struct LoadedLibrary {
    path: PathBuf,
    type_name: String,
    core_version: String,
    fingerprint: String,
    abi_version: u32,
    pub(super) vtable: TierVTable,
    pub(super) validate: Option<ValidateFn>,
}

impl LoadedLibrary {
    /// Where it was loaded from (as given, or a label for an in-process entry point).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tier type it provides.
    #[must_use]
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    /// The tiering-core version it was built against.
    #[must_use]
    pub fn core_version(&self) -> &str {
        &self.core_version
    }

    /// Its build fingerprint (tiering-core version, compiler, target).
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The tier ABI version it implements ([`MIN_ABI_VERSION`] to [`ABI_VERSION`]).
    #[must_use]
    pub fn abi_version(&self) -> u32 {
        self.abi_version
    }

    /// Whether it has a validate entry (ABI 5 and exported with `validate = …`), so its tiers'
    /// options can be checked without building them ([`LoadedLibrary::validate_options`]).
    #[must_use]
    pub fn validates(&self) -> bool {
        self.validate.is_some()
    }

    /// Whether it was built exactly like this host (same fingerprint).
    #[must_use]
    pub fn same_build_as_host(&self) -> bool {
        self.fingerprint == BUILD_FINGERPRINT
    }
}

static LOADED: OnceLock<Mutex<HashMap<PathBuf, &'static LoadedLibrary>>> = OnceLock::new();

/// Whether this host loads libraries declaring tier ABI `version`.
#[must_use]
pub fn abi_supported(version: u32) -> bool {
    (MIN_ABI_VERSION..=ABI_VERSION).contains(&version)
}

/// `major.minor.patch` → (major, minor).
fn major_minor(v: &str) -> Option<(u64, u64)> {
    let mut it = v.split(['.', '-', '+']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Whether a library built against `theirs` may be used by a host on [`CORE_VERSION`]: the same
/// major version (and, before 1.0, the same minor), as Cargo's compatibility rule.
#[must_use]
pub fn core_compatible(theirs: &str) -> bool {
    match (major_minor(theirs), major_minor(CORE_VERSION)) {
        (Some((a, b)), Some((c, d))) => a == c && (a != 0 || b == d),
        _ => false,
    }
}

/// Checks a descriptor and copies what the host keeps of it.
///
/// # Safety
/// `desc` is null or points to a descriptor that lives for the rest of the process, whose
/// `abi_version` field (the first) can be read whatever its layout.
unsafe fn validate(label: &Path, desc: *const PluginDescriptor) -> Result<LoadedLibrary, PluginError> {
    let path = label.to_path_buf();
    if desc.is_null() {
        return Err(PluginError::BadDescriptor {
            path,
            reason: "the entry point returned a null descriptor".into(),
        });
    }
    // SAFETY: non-null, and the caller guarantees the first field is readable. Only the leading
    // `u32` is read before the version, and with it the layout, is known.
    let abi = unsafe { desc.cast::<u32>().read() };
    // The fields both layouts share, and the validate entry of version 5.
    let (size, expected_size, strings, vtable, validate) = match abi {
        ABI_VERSION => {
            // SAFETY: version 5: the layout is this crate's `PluginDescriptor`.
            let d = unsafe { &*desc };
            let strings = [d.core_version, d.fingerprint, d.type_name];
            (
                d.descriptor_size,
                size_of::<PluginDescriptor>(),
                strings,
                d.vtable,
                d.validate,
            )
        }
        4 => {
            // SAFETY: version 4: the layout is `PluginDescriptorV4`, the prefix of version 5's.
            let d = unsafe { &*desc.cast::<PluginDescriptorV4>() };
            let strings = [d.core_version, d.fingerprint, d.type_name];
            (
                d.descriptor_size,
                size_of::<PluginDescriptorV4>(),
                strings,
                d.vtable,
                None,
            )
        }
        found => {
            return Err(PluginError::AbiMismatch {
                path,
                found,
                expected: ABI_VERSION,
            });
        }
    };
    if size != expected_size {
        return Err(PluginError::BadDescriptor {
            path,
            reason: format!("a version-{abi} descriptor is {expected_size} bytes, but this one is {size}"),
        });
    }
    let [core_version, fingerprint, type_name]: [FfiStaticStr; 3] = strings;
    let text = |s: FfiStaticStr, what: &str| {
        // SAFETY: descriptor strings point to static data of the library, which is never
        // unloaded.
        unsafe { s.0.to_str() }
            .map(str::to_owned)
            .ok_or_else(|| PluginError::BadDescriptor {
                path: label.to_path_buf(),
                reason: format!("the {what} is not UTF-8"),
            })
    };
    let core_version = text(core_version, "core version")?;
    if !core_compatible(&core_version) {
        return Err(PluginError::CoreVersionMismatch {
            path,
            found: core_version,
            expected: CORE_VERSION.to_owned(),
        });
    }
    let fingerprint = text(fingerprint, "fingerprint")?;
    let type_name = text(type_name, "type name")?;
    if type_name.is_empty() {
        return Err(PluginError::BadDescriptor {
            path,
            reason: "the tier type name is empty".into(),
        });
    }
    if fingerprint != BUILD_FINGERPRINT {
        tracing::info!(
            library = %label.display(),
            %fingerprint,
            host = BUILD_FINGERPRINT,
            "tier library built differently from the host (allowed: the boundary is a C ABI)"
        );
    }
    Ok(LoadedLibrary {
        path,
        type_name,
        core_version,
        fingerprint,
        abi_version: abi,
        vtable,
        validate,
    })
}

/// Loads the tier library at `path` (once per canonical path; later calls return the same
/// library).
///
/// Order of checks: the file exists; it is a loadable shared library; it exports
/// [`ABI_SYMBOL`] and its value is a version this host supports ([`MIN_ABI_VERSION`] to
/// [`ABI_VERSION`]) — read as data, before any of the library's functions is called; it exports
/// [`ENTRY_SYMBOL`]; the descriptor's version (the same), size, core version and strings are
/// sound. Calling the entry point only returns the library's static descriptor: no tier is built
/// (that is `create`, called by [`PluginTier::create`](super::PluginTier::create)). Loading runs
/// the library's initialisers (`.init_array`: in a Rust tier library, little more than the
/// `inventory` registrations of the crates it links), so only load libraries you trust, as with
/// any native code.
///
/// # Errors
/// A [`PluginError`] naming the file and the failed check.
pub fn load_library(path: &Path) -> Result<&'static LoadedLibrary, PluginError> {
    if !path.exists() {
        return Err(PluginError::NotFound {
            path: path.to_path_buf(),
        });
    }
    let canonical = path.canonicalize().map_err(|e| PluginError::NotALibrary {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let cache = LOADED.get_or_init(Default::default);
    let mut cache = cache.lock();
    if let Some(lib) = cache.get(&canonical) {
        return Ok(lib);
    }
    // SAFETY: loading native code runs its initialisers; that is the documented trust the
    // operator extends by naming the library in a chain file. Nothing else is assumed here.
    let library = unsafe { libloading::Library::new(&canonical) }.map_err(|e| PluginError::NotALibrary {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let missing = |symbol: &'static str, e: libloading::Error| PluginError::MissingSymbol {
        path: path.to_path_buf(),
        symbol,
        reason: e.to_string(),
    };
    // SAFETY: the symbol is declared by the ABI as a `u32` static; only its address is taken.
    let abi_ptr =
        unsafe { library.get::<*const u32>(ABI_SYMBOL.as_bytes()) }.map_err(|e| missing(ABI_SYMBOL, e))?;
    let abi_ptr: *const u32 = *abi_ptr;
    if abi_ptr.is_null() {
        return Err(PluginError::AbiMismatch {
            path: path.to_path_buf(),
            found: 0,
            expected: ABI_VERSION,
        });
    }
    // SAFETY: a data symbol of the library, mapped while `library` is loaded (forever, below);
    // `u32` has no invalid bit patterns.
    let abi = unsafe { abi_ptr.read_unaligned() };
    if !abi_supported(abi) {
        return Err(PluginError::AbiMismatch {
            path: path.to_path_buf(),
            found: abi,
            expected: ABI_VERSION,
        });
    }
    // SAFETY: every supported ABI version declares the entry symbol with exactly this signature.
    let entry: EntryFn =
        *unsafe { library.get::<EntryFn>(ENTRY_SYMBOL.as_bytes()) }.map_err(|e| missing(ENTRY_SYMBOL, e))?;
    // Never unload: the entry point and everything it returns stay valid forever.
    std::mem::forget(library);
    // SAFETY: the entry point of a library of a supported ABI returns its static descriptor (or
    // null), whose first field is the version.
    let loaded = unsafe { validate(path, entry()) }?;
    if loaded.abi_version != abi {
        return Err(PluginError::BadDescriptor {
            path: path.to_path_buf(),
            reason: format!(
                "`{ABI_SYMBOL}` says tier ABI version {abi}, the descriptor version {}",
                loaded.abi_version
            ),
        });
    }
    let loaded: &'static LoadedLibrary = Box::leak(Box::new(loaded));
    tracing::info!(
        library = %path.display(),
        tier_type = loaded.type_name(),
        fingerprint = loaded.fingerprint(),
        "loaded tier library"
    );
    cache.insert(canonical, loaded);
    Ok(loaded)
}

/// Uses an entry point linked into this process as if it had been loaded from a library
/// (the same checks and the same C-ABI wrapper). For tests of the boundary and for hosts that
/// link a plugin statically but want it isolated behind the C ABI.
///
/// # Errors
/// As [`load_library`]'s descriptor checks.
pub fn from_entry_point(label: &str, entry: EntryFn) -> Result<&'static LoadedLibrary, PluginError> {
    // SAFETY: an `EntryFn` returns a static descriptor (or null) by the ABI's definition.
    let loaded = unsafe { validate(Path::new(label), entry()) }?;
    Ok(Box::leak(Box::new(loaded)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_compatibility_follows_cargo_rules() {
        assert!(core_compatible(CORE_VERSION));
        let (major, minor) = major_minor(CORE_VERSION).unwrap();
        if major == 0 {
            assert!(!core_compatible(&format!("0.{}.0", minor + 1)));
            assert!(core_compatible(&format!("0.{minor}.99")));
        }
        assert!(!core_compatible(&format!("{}.0.0", major + 1)));
        assert!(!core_compatible("garbage"));
    }

    #[test]
    fn missing_and_non_library_files_are_named() {
        let err = load_library(Path::new("/nonexistent/libnothing.so")).unwrap_err();
        assert!(matches!(err, PluginError::NotFound { .. }));
        assert!(err.to_string().contains("/nonexistent/libnothing.so"), "{err}");
        let dir = std::env::temp_dir().join(format!("kvtier-loader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("libfake.so");
        std::fs::write(&fake, b"this is not an ELF file").unwrap();
        let err = load_library(&fake).unwrap_err();
        assert!(matches!(err, PluginError::NotALibrary { .. }), "{err}");
        assert!(err.to_string().contains("libfake.so"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
