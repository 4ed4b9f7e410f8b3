//! A deliberately broken tier library for the loader's tests: it declares a tier ABI version
//! no host implements. Its entry point aborts the process, so a loader that called it before
//! checking the version would take the test down with it.

/// A tier ABI version from the future.
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static kvtier_tier_abi_version: u32 = 999;

/// Must never be called: the version check comes first.
#[unsafe(no_mangle)]
pub extern "C" fn kvtier_tier_entry() -> *const u8 {
    std::process::abort()
}
