//! Records the compiler version and target triple, which make up the build fingerprint that tier
//! libraries carry (see `plugin::BUILD_FINGERPRINT`).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "rustc (unknown version)".to_owned(), |v| v.trim().to_owned());
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown-target".to_owned());
    println!("cargo:rustc-env=KVTIER_RUSTC_VERSION={version}");
    println!("cargo:rustc-env=KVTIER_TARGET={target}");
}
