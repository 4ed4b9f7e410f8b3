//! Shared helpers of the workspace tests: building the tier libraries the plugin tests load, and
//! an in-memory primary tier registered for chains.

#![allow(dead_code)]

pub mod sim;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use serde::Deserialize;
use tiering_core::options::parse_options;
use tiering_core::testing::MemoryPrimary;
use tiering_core::{PrimaryTier, TierError, TieringManager, registry::PrimaryContext};

/// Builds `tier-example` (its `cdylib` and the fault libraries among its examples) once per
/// process and returns the directory holding `libtier_example.so`.
///
/// The build uses its own target directory under this test binary's target directory: the
/// outer `cargo` may still hold the lock on its own one (under `cargo test` it does), and the
/// libraries do not need the test profile anyway — the boundary is a C ABI.
pub fn plugin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        // <target>/<profile>/deps/<test> → <target>/<profile>/kvtier-plugin-libs
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test executable lives in <target>/<profile>/deps");
        let target = profile_dir.join("kvtier-plugin-libs");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let out = Command::new(cargo)
            .args([
                "build",
                "--offline",
                "-p",
                "tier-example",
                "--lib",
                "--examples",
                "--manifest-path",
            ])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target)
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("CARGO_BUILD_TARGET")
            .output()
            .expect("run cargo to build the tier libraries");
        assert!(
            out.status.success(),
            "building the tier libraries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        target.join("debug")
    })
}

/// The example tier as a shared library.
pub fn example_library() -> PathBuf {
    plugin_dir().join(format!(
        "{}tier_example{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

/// One of the deliberately broken libraries (`fault_bad_abi`, `fault_no_entry`, `fault_panicky`).
pub fn fault_library(name: &str) -> PathBuf {
    plugin_dir().join("examples").join(format!(
        "{}{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryOptions {
    chunks: usize,
}

/// Every primary the `itest-memory` factory built, so tests can inspect the arena.
pub static PRIMARIES: Mutex<Vec<MemoryPrimary>> = Mutex::new(Vec::new());

fn memory_primary(options: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
    let o: MemoryOptions = parse_options(options)?;
    let p = MemoryPrimary::new(o.chunks, ctx.chunk_bytes);
    PRIMARIES.lock().push(p.clone());
    Ok(Box::new(p))
}

tiering_core::register_tier!(primary "itest-memory" => memory_primary);

/// The `itest-memory` primary of `manager`, found by its arena. The tests of one binary run in
/// parallel and all register their primaries here, so "the last one built" may be another
/// test's.
pub fn primary_of(manager: &TieringManager) -> MemoryPrimary {
    PRIMARIES
        .lock()
        .iter()
        .find(|p| Arc::ptr_eq(p.arena(), manager.arena()))
        .cloned()
        .expect("the manager's primary is an itest-memory primary")
}

/// Runs the `kvtier` binary with `args` from the workspace root and waits for it.
pub fn kvtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run kvtier")
}

/// A finished command's standard output, then its standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
