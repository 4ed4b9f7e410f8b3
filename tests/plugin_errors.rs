//! Chain and library failures, each with a message naming its cause and place.

mod common;

use std::path::Path;

use tiering_config::{ChainConfig, ChainError, ChainErrorKind};
use tiering_core::{
    LookupResult, OffloadKey, OffloadingManager, PrimaryTier, ReqContext, ScheduleEndContext, TieringManager,
};
use tiering_plugin::PluginError;

use tier_example as _;

const CHUNK: usize = 4096;

fn build(text: &str) -> Result<TieringManager, ChainError> {
    ChainConfig::parse("errors.toml", text)?.build(tiering_core::registry::Registry::global().unwrap(), CHUNK)
}

fn build_err(text: &str) -> ChainError {
    match build(text) {
        Ok(_) => panic!("the chain unexpectedly built"),
        Err(e) => e,
    }
}

fn with_library(lib: &Path, tier_type: &str, extra: &str) -> String {
    format!(
        "[primary]\ntype = \"itest-memory\"\nchunks = 8\n\n[[secondary]]\ntype = \"{tier_type}\"\nlibrary = \"{}\"\n{extra}",
        lib.display()
    )
}

#[test]
fn missing_library_file() {
    let e = build_err(&with_library(
        Path::new("/nonexistent/dir/libnope.so"),
        "example",
        "",
    ));
    assert!(
        matches!(*e.kind, ChainErrorKind::Plugin(PluginError::NotFound { .. })),
        "{e}"
    );
    let msg = e.to_string();
    assert!(msg.starts_with("errors.toml:7: [[secondary]] #1"), "{msg}");
    assert!(
        msg.contains("/nonexistent/dir/libnope.so does not exist"),
        "{msg}"
    );
}

#[test]
fn a_file_that_is_not_a_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("libfake.so");
    std::fs::write(&fake, "#!/bin/sh\necho not a library\n").unwrap();
    let e = build_err(&with_library(&fake, "example", ""));
    assert!(
        matches!(*e.kind, ChainErrorKind::Plugin(PluginError::NotALibrary { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("is not a loadable shared library"), "{e}");
}

#[test]
fn a_library_without_the_entry_symbols() {
    let e = build_err(&with_library(
        &common::fault_library("fault_no_entry"),
        "example",
        "",
    ));
    assert!(
        matches!(*e.kind, ChainErrorKind::Plugin(PluginError::MissingSymbol { .. })),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("is not a kvtier tier library: symbol `kvtier_tier_abi_version` is missing"),
        "{e}"
    );
}

#[test]
fn a_library_with_another_abi_version_is_refused_before_any_call() {
    // The library's entry point aborts the process if called: reaching the assertions proves the
    // version was checked first.
    let e = build_err(&with_library(
        &common::fault_library("fault_bad_abi"),
        "example",
        "",
    ));
    assert!(
        matches!(
            *e.kind,
            ChainErrorKind::Plugin(PluginError::AbiMismatch {
                found: 999,
                expected: tiering_plugin::ffi::ABI_VERSION,
                ..
            })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("implements tier ABI version 999"), "{e}");
}

#[test]
fn a_library_of_another_type() {
    let e = build_err(&with_library(&common::example_library(), "disk-ish", ""));
    assert!(
        e.to_string()
            .contains("provides tier type `example`, not `disk-ish`"),
        "{e}"
    );
}

#[test]
fn unknown_option_keys_of_a_loaded_tier_name_their_line() {
    let text = with_library(
        &common::example_library(),
        "example",
        "capacity = \"1MiB\"\ncapasity = \"2MiB\"\n",
    );
    let e = build_err(&text);
    assert_eq!(e.line, Some(9), "{e}");
    assert_eq!(e.key.as_deref(), Some("capasity"));
    assert!(e.to_string().contains("unknown field `capasity`"), "{e}");
}

#[test]
fn a_panicking_lookup_in_a_library_is_an_error_not_an_abort() {
    let mut m = build(&with_library(
        &common::fault_library("fault_panicky"),
        "panicky",
        "",
    ))
    .unwrap();
    let ctx = ReqContext::local("r");
    let mut s = m.step();
    s.on_new_request(&ctx).unwrap();
    assert_eq!(
        s.lookup(&OffloadKey::from_u64(1), &ctx).unwrap(),
        LookupResult::Miss,
        "a panicking library answers Miss"
    );
    // The panic caught in the library is raised again by the host once the call returned, so
    // the manager's tier-call guard quarantines the tier at that lookup, as for a linked-in
    // tier (on_tier_failure = quarantine: no engine error).
    s.on_schedule_end(&ScheduleEndContext::default())
        .unwrap_or_else(|e| panic!("a quarantined panic is no engine error: {e}"));
    drop(s);
    let quarantined = m.inspect(|st| st.quarantined_tiers());
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert!(quarantined[0].1.contains("panicked in lookup"), "{quarantined:?}");
    assert!(
        quarantined[0].1.contains("the panicky tier's lookup gave up"),
        "{quarantined:?}"
    );
    let mut s = m.step();
    assert_eq!(
        s.lookup(&OffloadKey::from_u64(1), &ctx).unwrap(),
        LookupResult::Miss,
        "the manager goes on without the tier"
    );
    s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    drop(s);
    m.shutdown().unwrap();
}

#[test]
fn a_panicking_factory_in_a_library_is_a_build_error() {
    let e = build_err(&with_library(
        &common::fault_library("fault_panicky"),
        "panicky",
        "panic_in = \"factory\"\n",
    ));
    assert!(e.to_string().contains("panicked in the tier's factory"), "{e}");
    assert!(e.to_string().contains("refuses to be built"), "{e}");
}

#[test]
fn same_build_pins_the_fingerprint() {
    // The library is built by the same compiler for the same target, so it passes.
    let m = build(&with_library(
        &common::example_library(),
        "example",
        "capacity = \"1MiB\"\nsame_build = true\n",
    ));
    assert!(m.is_ok());
}

#[test]
fn malformed_toml() {
    let e = ChainConfig::parse("bad.toml", "[primary]\ntype = \"cpu\"\ncapacity = \"2GiB\n").unwrap_err();
    assert!(matches!(*e.kind, ChainErrorKind::Syntax(_)), "{e}");
    assert!(e.to_string().starts_with("bad.toml:3: invalid TOML"), "{e}");
}

#[test]
fn unknown_key_in_a_linked_tier_names_file_line_and_key() {
    let e = build_err(
        "[primary]\ntype = \"itest-memory\"\nchunks = 8\n\n[[secondary]]\ntype = \"example\"\ncapacity = \"1MiB\"\nevict = \"lru\"\n",
    );
    assert_eq!(e.line, Some(8));
    assert!(
        e.to_string().starts_with(
            "errors.toml:8: [[secondary]] #1 (type \"example\"): key `evict`: invalid configuration: unknown field `evict`"
        ),
        "{e}"
    );
}

#[test]
fn unknown_tier_type_lists_the_registered_ones() {
    let e = build_err("[primary]\ntype = \"itest-memory\"\nchunks = 8\n[[secondary]]\ntype = \"tape\"\n");
    let msg = e.to_string();
    assert!(msg.contains("unknown tier type `tape`"), "{msg}");
    assert!(
        msg.contains("example (secondary)") && msg.contains("itest-memory (primary)"),
        "{msg}"
    );
}

#[test]
fn bad_size() {
    let e = build_err(
        "[primary]\ntype = \"itest-memory\"\nchunks = 8\n[[secondary]]\ntype = \"example\"\ncapacity = \"lots\"\n",
    );
    assert_eq!(e.line, Some(6));
    assert_eq!(e.key.as_deref(), Some("capacity"));
    assert!(e.to_string().contains("invalid size `lots`"), "{e}");
}

#[test]
fn two_primary_sections() {
    let e =
        ChainConfig::parse("two.toml", "[primary]\ntype = \"a\"\n\n[primary]\ntype = \"b\"\n").unwrap_err();
    assert!(
        e.to_string().starts_with("two.toml:4: two [primary] sections"),
        "{e}"
    );
}

#[test]
fn a_failing_constructor_shuts_down_the_tiers_already_built() {
    // ex-1 builds (and binds its inbox socket); ex-2 cannot bind into a missing directory. The
    // build fails, and ex-1 is shut down: its socket file is gone.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ex-1.sock");
    // A chunk count no other test of this binary uses tells this test's primary apart from
    // theirs (they run in parallel and register theirs in the same list).
    let e = build_err(&format!(
        "[primary]\ntype = \"itest-memory\"\nchunks = 11\n\
         [[secondary]]\ntype = \"example\"\nname = \"ex-1\"\ncapacity = \"1MiB\"\ninbox = \"{}\"\n\
         [[secondary]]\ntype = \"example\"\nname = \"ex-2\"\ncapacity = \"1MiB\"\ninbox = \"{}/missing/x.sock\"\n",
        sock.display(),
        dir.path().display()
    ));
    assert!(e.to_string().contains("[[secondary]] #2"), "{e}");
    assert!(!sock.exists(), "the first tier was shut down");
    // Only the primary itself (its handle and its shared state) still refers to the arena.
    let primary = {
        let mut built = common::PRIMARIES.lock();
        let at = built
            .iter()
            .position(|p| p.arena().num_chunks() == 11)
            .expect("this test's primary was built");
        built.swap_remove(at)
    };
    assert_eq!(
        std::sync::Arc::strong_count(primary.arena()),
        2,
        "no tier kept the arena"
    );
}

/// Runs `kvtier check [--build] chain.toml` on `chain` in a fresh directory; returns whether it
/// succeeded and its standard error.
fn kvtier_check(chain: &str, build: bool) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chain.toml");
    std::fs::write(&file, chain).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.env("TMPDIR", dir.path()).arg("check");
    if build {
        cmd.arg("--build");
    }
    let out = cmd.arg(&file).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `stderr` has a line naming `chain.toml:<line>`, key `key` and `needle`.
fn reported(stderr: &str, line: usize, key: &str, needle: &str) -> bool {
    let (at, key) = (format!("chain.toml:{line}:"), format!("key `{key}`"));
    stderr
        .lines()
        .any(|l| l.contains(&at) && l.contains(&key) && l.contains(needle))
}

fn cpu_and_library(lib: &Path, tier_type: &str, extra: &str) -> String {
    format!(
        "[primary]\ntype = \"cpu\"\ncapacity = \"4MiB\"\n\n[[secondary]]\ntype = \"{tier_type}\"\nlibrary = \"{}\"\n{extra}",
        lib.display()
    )
}

#[test]
fn check_rejects_bad_options_of_a_library_tier_with_file_line_and_key_without_building_it() {
    let lib = common::example_library();
    // The library's validate entry (ABI 5) checks the options; no tier is built (an inbox socket
    // would be bound by building).
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ex.sock");
    let (ok, stderr) = kvtier_check(
        &cpu_and_library(
            &lib,
            "example",
            &format!(
                "capacity = \"1MiB\"\ninbx = \"/tmp/x\"\ninbox = \"{}\"\n",
                sock.display()
            ),
        ),
        false,
    );
    assert!(!ok, "{stderr}");
    assert!(reported(&stderr, 9, "inbx", "unknown field `inbx`"), "{stderr}");
    assert!(!stderr.contains("options not checked"), "{stderr}");
    assert!(!sock.exists(), "check built the tier");
    let (ok, stderr) = kvtier_check(&cpu_and_library(&lib, "example", "capacity = \"lots\"\n"), false);
    assert!(!ok, "{stderr}");
    assert!(
        reported(&stderr, 8, "capacity", "invalid size `lots`"),
        "{stderr}"
    );
    // Good options pass, with nothing left unchecked.
    let (ok, stderr) = kvtier_check(&cpu_and_library(&lib, "example", "capacity = \"1MiB\"\n"), false);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("not checked"), "{stderr}");
}

#[test]
fn a_panicking_validate_hook_in_a_library_is_a_check_error() {
    let (ok, stderr) = kvtier_check(
        &cpu_and_library(
            &common::fault_library("fault_panicky"),
            "panicky",
            "panic_in = \"validate\"\n",
        ),
        false,
    );
    assert!(!ok, "{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("chain.toml:")
            && l.contains("panicked in the validate hook: the panicky tier's validate hook gave up")),
        "{stderr}"
    );
}

#[test]
fn an_abi_4_library_loads_and_check_says_only_building_checks_its_options() {
    let lib = common::fault_library("legacy_abi4");
    // It still loads and builds.
    let mut m = build(&with_library(&lib, "legacy", "capacity = \"1MiB\"\n")).unwrap();
    assert_eq!(
        m.inspect(|s| s.secondary_infos())
            .into_iter()
            .map(|i| i.name)
            .collect::<Vec<_>>(),
        ["legacy"]
    );
    m.shutdown().unwrap();
    let loaded = tiering_plugin::load_library(&lib).unwrap();
    assert_eq!(loaded.abi_version(), 4);
    assert!(!loaded.validates());
    // Bad options pass `check` (nothing can check them without building), which says so.
    let chain = cpu_and_library(&lib, "legacy", "capacity = \"lots\"\n");
    let (ok, stderr) = kvtier_check(&chain, false);
    assert!(ok, "{stderr}");
    let note = stderr
        .lines()
        .find(|l| l.starts_with("note: "))
        .unwrap_or_else(|| panic!("no note in:\n{stderr}"));
    assert!(note.contains("chain.toml:5: [[secondary]] #1"), "{note}");
    assert!(note.contains("options not checked"), "{note}");
    assert!(note.contains("(tier ABI 4) has no validate entry"), "{note}");
    assert!(note.contains("`kvtier check --build` checks them"), "{note}");
    // `--build` builds the tier, and with it checks the options; the note says so.
    let (ok, stderr) = kvtier_check(&chain, true);
    assert!(!ok, "{stderr}");
    assert!(!stderr.contains("options not checked"), "{stderr}");
    assert!(
        stderr.contains("options checked only by building the tier (below)"),
        "{stderr}"
    );
    assert!(
        reported(&stderr, 8, "capacity", "invalid size `lots`"),
        "{stderr}"
    );
}
