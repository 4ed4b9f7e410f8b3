//! A deliberately broken tier library for the loader's tests: a valid shared library that is
//! not a kvtier tier (it exports neither the ABI version nor the entry point).

/// An unrelated export.
#[unsafe(no_mangle)]
pub extern "C" fn something_else() -> u32 {
    7
}
