//! The `kvtier` binary's chain commands: `tiers`, and `check` over every shipped chain.

mod common;

use common::{kvtier, text};

use std::path::{Path, PathBuf};
use std::process::Command;

fn shipped_chains() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

/// The tier types the binary lists as linked in.
fn linked_types() -> Vec<String> {
    let out = kvtier(&["tiers"]);
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("linked in"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn tiers_lists_linked_types_with_their_crate_and_libraries_with_their_build() {
    let out = kvtier(&["tiers"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let line = t
        .lines()
        .find(|l| l.starts_with("example "))
        .expect("example is listed");
    assert!(
        line.contains("secondary") && line.contains("linked in (crate tier-example)"),
        "{line}"
    );
    assert!(t.contains("host build: tiering-core "), "{t}");

    let lib = common::example_library();
    let out = kvtier(&["tiers", "--library", lib.to_str().unwrap()]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains(&format!("library {}", lib.display())), "{t}");
    assert!(t.contains("same build as this binary"), "{t}");

    let out = kvtier(&["tiers", "--library", "/nonexistent/libx.so"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("/nonexistent/libx.so does not exist"));
}

#[test]
fn check_validates_every_shipped_chain() {
    let files = shipped_chains();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for required in [
        "default.toml",
        "cpu-only.toml",
        "cpu-disk-p2p.toml",
        "cpu-redis.toml",
    ] {
        assert!(
            names.iter().any(|n| n == required),
            "config/{required} is shipped"
        );
    }
    let linked = linked_types();
    for file in &files {
        let out = kvtier(&["check", file.to_str().unwrap()]);
        let t = text(&out);
        // Every type a shipped chain names must be linked into the binary: check must pass.
        let chain = tiering_config::ChainConfig::load(file).unwrap_or_else(|e| panic!("{e}"));
        let missing: Vec<&str> = chain
            .tiers()
            .map(|s| s.tier_type.as_str())
            .filter(|t| !linked.iter().any(|l| l == t))
            .collect();
        if missing.is_empty() {
            assert!(out.status.success(), "{}: {t}", file.display());
            assert!(t.contains("ok"), "{t}");
        } else {
            // Only while a tier crate has not registered its type yet: the failure must say so.
            assert!(!out.status.success(), "{t}");
            assert!(t.contains(&format!("unknown tier type `{}`", missing[0])), "{t}");
        }
    }
}

#[test]
fn check_reports_a_bad_chain_with_its_location_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[primary]\ntype = \"cpu\"\n\n[control_plane]\nthreads = true\n",
    )
    .unwrap();
    let out = kvtier(&["check", bad.to_str().unwrap()]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!(
            "{}:5: [control_plane]: key `threads`: unknown key",
            bad.display()
        )),
        "{t}"
    );
    assert!(t.contains("1 of 1 chain files failed validation"), "{t}");
}

#[test]
fn check_loads_libraries_named_by_a_chain() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("lib.toml");
    let lib = common::example_library();
    // The library is resolved once the primary's type `cpu` is (tier-cpu registers it).
    std::fs::write(
        &chain,
        format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"64MiB\"\n\n[[secondary]]\ntype = \"example\"\nlibrary = \"{}\"\ncapacity = \"1MiB\"\n",
            lib.display()
        ),
    )
    .unwrap();
    let out = kvtier(&["check", chain.to_str().unwrap()]);
    let t = text(&out);
    if linked_types().iter().any(|l| l == "cpu") {
        assert!(out.status.success(), "{t}");
        assert!(
            t.contains(&format!(
                "[[secondary]] #1 type \"example\" — library {}",
                lib.display()
            )),
            "{t}"
        );
    } else {
        assert!(t.contains("unknown tier type `cpu`"), "{t}");
    }
    let broken = dir.path().join("broken.toml");
    std::fs::write(
        &broken,
        format!(
            "[primary]\ntype = \"cpu\"\n\n[[secondary]]\ntype = \"example\"\nlibrary = \"{}\"\n",
            common::fault_library("fault_bad_abi").display()
        ),
    )
    .unwrap();
    let out = kvtier(&["check", broken.to_str().unwrap()]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    if linked_types().iter().any(|l| l == "cpu") {
        assert!(t.contains("implements tier ABI version 999"), "{t}");
    }
}

#[test]
fn the_binary_links_every_tier_crate_it_names() {
    // `use tier_disk as _;` in main.rs is what keeps tier-disk's registration: losing it would
    // silently drop the type.
    let out = kvtier(&["tiers"]);
    let t = text(&out);
    let disk = t
        .lines()
        .find(|l| l.starts_with("disk "))
        .expect("disk is listed");
    assert!(disk.contains("linked in (crate tier-disk)"), "{disk}");
    assert!(
        t.lines().any(|l| l.starts_with("cpu ") && l.contains("primary")),
        "{t}"
    );
}

#[test]
fn check_build_constructs_the_tiers_and_reports_bad_options() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n[[secondary]]\ntype = \"example\"\ncapacity = \"1MiB\"\n",
    )
    .unwrap();
    let out = kvtier(&[
        "check",
        "--build",
        "--chunk-bytes",
        "65536",
        good.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("[[secondary]] #1 type \"example\" — linked in (crate tier-example)"),
        "{t}"
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n[[secondary]]\ntype = \"example\"\ncapacity = \"1MiB\"\nlru = true\n",
    )
    .unwrap();
    // With or without --build, the tier's options are checked (without --build nothing is built).
    for args in [&["check"][..], &["check", "--build"][..]] {
        let mut args = args.to_vec();
        args.push(bad.to_str().unwrap());
        let out = kvtier(&args);
        let t = text(&out);
        assert!(!out.status.success(), "{t}");
        assert!(
            t.contains(&format!(
                "{}:8: [[secondary]] #1 (type \"example\"): key `lru`",
                bad.display()
            )),
            "{t}"
        );
    }
}

#[test]
fn a_library_tiers_log_lines_reach_the_hosts_subscriber() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("lib.toml");
    let lib = common::example_library();
    std::fs::write(
        &chain,
        format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"64MiB\"\n\n[[secondary]]\ntype = \"example\"\nlibrary = \"{}\"\ncapacity = \"1MiB\"\n",
            lib.display()
        ),
    )
    .unwrap();
    let run = |filter: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["check", "--build", chain.to_str().unwrap()])
            .env("RUST_LOG", filter)
            .env("TMPDIR", dir.path())
            .output()
            .expect("run kvtier")
    };
    let out = run("info");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", text(&out));
    // The line the library's `ExampleTier::new` logs, re-emitted by the host under its target.
    let line = stderr
        .lines()
        .find(|l| l.contains("example tier ready"))
        .unwrap_or_else(|| panic!("the library's log line is missing:\n{stderr}"));
    assert!(line.contains("INFO") && line.contains("kvtier::plugin"), "{line}");
    assert!(line.contains("capacity_chunks="), "{line}");
    // Not a terminal: no colour codes.
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    // The host's filter applies to library events too.
    let quiet = run("warn");
    assert!(
        !String::from_utf8_lossy(&quiet.stderr).contains("example tier ready"),
        "{}",
        text(&quiet)
    );
}
