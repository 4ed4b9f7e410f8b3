//! `kvtier run`'s text report has a health section that shows disk corruption found at open and
//! the promotions it failed, without `RUST_LOG` or `--json`.

use std::io::{Seek, SeekFrom, Write};
use std::process::Command;

fn run(chain: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["run", "--requests", "100", "--no-baseline", "--config"])
        .arg(chain)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn health_line<'a>(report: &'a str, tier: &str) -> &'a str {
    let section = report.split("\nhealth\n").nth(1).expect("a health section");
    section
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{tier}:")))
        .unwrap_or_else(|| panic!("no {tier} line in:\n{section}"))
}

/// The number before `label` in a health line.
fn count(line: &str, label: &str) -> u64 {
    let before = line.split(label).next().unwrap();
    before
        .rsplit([' ', ','])
        .find(|w| !w.is_empty())
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn the_health_section_lists_injected_disk_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain.toml");
    // A relative path: the slab lives next to the chain file and survives the run. Every chunk
    // goes to disk (no reuse gate), so the damage below hits slots the second run reads.
    std::fs::write(
        &chain,
        "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n[[secondary]]\ntype = \"disk\"\npath = \"slabs\"\ncapacity = \"32MiB\"\nadmission = \"always\"\n",
    )
    .unwrap();
    let clean = run(&chain);
    let disk = health_line(&clean, "disk");
    assert_eq!(count(disk, "corrupt slots"), 0, "{disk}");
    assert_eq!(count(disk, "failed jobs"), 0, "{disk}");

    // Damage the slab's payload in many places (past the superblock).
    let slab = std::fs::read_dir(dir.path().join("slabs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let len = std::fs::metadata(&slab).unwrap().len();
    let mut f = std::fs::OpenOptions::new().write(true).open(&slab).unwrap();
    let mut off = 8192 + 100;
    while off < len {
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(&[0xff; 64]).unwrap();
        off += 64 * 1024;
    }
    drop(f);

    let damaged = run(&chain);
    let disk = health_line(&damaged, "disk");
    assert!(count(disk, "slots recovered at open") > 0, "{disk}");
    assert!(
        count(disk, "corrupt slots") + count(disk, "slots discarded at open") > 0,
        "{disk}"
    );
    let manager = health_line(&damaged, "manager");
    assert_eq!(count(manager, "tiers quarantined"), 0, "{manager}");
}
