//! `kvtier check` validates without building: every error of a chain is reported with
//! file:line:key, and nothing is allocated, created or bound.

use std::path::Path;
use std::process::{Command, Output};

fn check(dir: &Path, chain: &str) -> (Output, String) {
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let file = dir.join("chain.toml");
    std::fs::write(&file, chain).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .env("TMPDIR", &tmp)
        .arg("check")
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

/// Asserts `stderr` has a line naming `chain.toml:<line>` and key `key` with `needle`.
fn assert_reported(stderr: &str, line: usize, key: &str, needle: &str) {
    let at = format!("chain.toml:{line}:");
    let key = format!("key `{key}`");
    assert!(
        stderr
            .lines()
            .any(|l| l.contains(&at) && l.contains(&key) && l.contains(needle)),
        "no line with {at} {key} {needle:?} in:\n{stderr}"
    );
}

const PRIMARY: &str = "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n";

#[test]
fn check_reports_every_error_of_a_chain_with_file_line_and_key_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let chain = format!(
        "{PRIMARY}\
[[secondary]]
type = \"disk\"
name = \"disk\"
path = \"${{tmpdir}}/kvtier-${{pid}}/a\"
capacity = \"0\"
bogus = 1

[[secondary]]
type = \"disk\"
name = \"disk\"
path = \"${{tmpdir}}/kvtier-${{pid}}/a\"
capacity = \"-1GiB\"

[[secondary]]
type = \"disk\"
name = \"big\"
path = \"${{tmpdir}}/kvtier-${{pid}}/b\"
capacity = \"10TB\"
io_threads = \"two\"

[[secondary]]
type = \"p2p\"
name = \"p2p\"
bind = \"127.0.0.1:0\"
peers = []
hash_seed = \"s\"
layout_fingerprint = \"f\"
insecure = true
"
    );
    let (out, stderr) = check(dir.path(), &chain);
    assert!(!out.status.success());
    assert_reported(&stderr, 8, "capacity", "zero");
    assert_reported(&stderr, 9, "bogus", "unknown field");
    assert_reported(&stderr, 13, "name", "two tiers are named `disk`");
    assert_reported(&stderr, 14, "path", "also used by the tier at line 4");
    assert_reported(&stderr, 15, "capacity", "-1GiB");
    assert_reported(&stderr, 21, "capacity", "larger than the filesystem");
    assert_reported(&stderr, 22, "io_threads", "found a string \"two\"");
    assert!(stderr.contains("7 error(s)"), "{stderr}");
    // Validation built nothing: no scratch, no slab.
    let left: Vec<_> = std::fs::read_dir(dir.path().join("tmp"))
        .unwrap()
        .flatten()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn check_rejects_a_primary_larger_than_the_machine_and_an_unknown_type() {
    let dir = tempfile::tempdir().unwrap();
    let chain = "[primary]\ntype = \"cpu\"\ncapacity = \"10TB\"\n\n[[secondary]]\ntype = \"nope\"\n";
    let (out, stderr) = check(dir.path(), chain);
    assert!(!out.status.success());
    assert_reported(&stderr, 3, "capacity", "physical memory");
    assert_reported(&stderr, 6, "type", "unknown tier type `nope`");
}

#[test]
fn check_accepts_the_shipped_chains() {
    for file in [
        "config/default.toml",
        "config/cpu-only.toml",
        "config/cpu-disk-p2p.toml",
        "config/cpu-redis.toml",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("check")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_relative_disk_path_is_relative_to_the_chain_file() {
    let dir = tempfile::tempdir().unwrap();
    let chain =
        format!("{PRIMARY}\n[[secondary]]\ntype = \"disk\"\npath = \"slabs\"\ncapacity = \"16MiB\"\n");
    let file = dir.path().join("chain.toml");
    std::fs::write(&file, chain).unwrap();
    let c = tiering_config::ChainConfig::load(&file).unwrap();
    assert_eq!(
        c.secondaries[0].options["path"].as_str().unwrap(),
        dir.path().join("slabs").to_str().unwrap()
    );
    std::fs::write(
        &file,
        format!("{PRIMARY}\n[[secondary]]\ntype = \"disk\"\npath = \"\"\ncapacity = \"16MiB\"\n"),
    )
    .unwrap();
    let c = tiering_config::ChainConfig::load(&file).unwrap();
    let p = std::path::PathBuf::from(c.secondaries[0].options["path"].as_str().unwrap());
    assert_eq!(
        p.components().collect::<Vec<_>>(),
        dir.path().components().collect::<Vec<_>>()
    );
}

#[test]
fn check_runs_every_shipped_tier_types_validate_hook_and_names_an_unknown_type() {
    let dir = tempfile::tempdir().unwrap();
    let chain = "\
[primary]
type = \"cpu\"
capacity = \"8MiB\"
eviction = \"mru\"

[[secondary]]
type = \"disk\"
path = \"${tmpdir}/kvtier-${pid}/d\"
capacity = \"16MiB\"
io_threads = 0

[[secondary]]
type = \"p2p\"
bind = \"127.0.0.1\"
hash_seed = \"\"
layout_fingerprint = \"f\"
insecure = true

[[secondary]]
type = \"redis\"
url = \"http://not-redis\"
layout_fingerprint = \"f\"
workers = 0

[[secondary]]
type = \"example\"
capacity = \"1MiB\"
inbx = \"/tmp/x\"

[[secondary]]
type = \"vendor-nvme-tier\"
capacity = \"1GiB\"
";
    let (out, stderr) = check(dir.path(), chain);
    assert!(!out.status.success());
    assert_reported(&stderr, 4, "eviction", "mru");
    assert_reported(&stderr, 10, "io_threads", "between 1 and 256");
    assert_reported(&stderr, 14, "bind", "not host:port");
    assert_reported(&stderr, 15, "hash_seed", "empty");
    assert_reported(&stderr, 21, "url", "invalid Redis URL");
    assert_reported(&stderr, 23, "workers", "between 1 and 64");
    assert_reported(&stderr, 28, "inbx", "unknown field");
    assert_reported(&stderr, 31, "type", "unknown tier type `vendor-nvme-tier`");
    assert!(stderr.contains("8 error(s)"), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(dir.path().join("tmp"))
        .unwrap()
        .flatten()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn an_enum_value_of_the_wrong_type_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let chain = "\
[primary]
type = \"cpu\"
capacity = \"8MiB\"
eviction = 3

[[secondary]]
type = \"disk\"
path = \"${tmpdir}/kvtier-${pid}/d\"
capacity = \"16MiB\"
sync = true
";
    let (out, stderr) = check(dir.path(), chain);
    assert!(!out.status.success());
    assert_reported(
        &stderr,
        4,
        "eviction",
        "expected a string (\"lru\", \"arc\" or \"s3fifo\"), found an integer 3",
    );
    assert_reported(
        &stderr,
        10,
        "sync",
        "expected a string (\"never\", \"batch\" or \"always\"), found a boolean true",
    );
    assert!(!stderr.contains("unit variant"), "{stderr}");
}
