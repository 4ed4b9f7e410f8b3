//! `kvtier soak` on a few seconds: the fault injector injects every kind of fault against two
//! nodes (this process and a `kvtier soak-node` child), the checks run and nothing is left
//! behind; and a wrong byte served on purpose is reported as a violation.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvtier::soak::checks::TtftBound;
use kvtier::soak::{FaultKind, SoakConfig, run_soak};

fn redis_installed() -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "\n!!!!!!!! SKIPPED: redis-server is not installed; run scripts/install-test-deps.sh \
             to run the soak test !!!!!!!!\n"
        );
    }
    ok
}

/// A soak of `secs` seconds on the test binary, seed 3, 60 requests a round.
fn short_soak(secs: u64, faults: bool, inject_wrong_bytes: bool) -> SoakConfig {
    SoakConfig {
        duration: Duration::from_secs(secs),
        seed: 3,
        requests: 60,
        fault_gap: None,
        ttft: TtftBound {
            factor: 3.0,
            slack_ms: 25.0,
        },
        faults,
        inject_wrong_bytes,
        exe: PathBuf::from(env!("CARGO_BIN_EXE_kvtier")),
    }
}

#[test]
fn a_short_soak_injects_every_fault_and_serves_no_wrong_byte() {
    if !redis_installed() {
        return;
    }
    let r = run_soak(&short_soak(14, true, false)).expect("the soak runs");
    println!("{r}");
    for row in &r.faults {
        let no_tmpfs = row.kind == FaultKind::DiskFill && row.note.contains("skipped");
        assert!(
            row.injected >= 1 || no_tmpfs,
            "{} was not injected:\n{r}",
            row.kind
        );
    }
    assert!(r.completed > 0 && r.peer_requests > 0, "{r}");
    assert_eq!(r.wrong_bytes, [0, 0], "{r}");
    assert_eq!(r.audit_wrong_bytes, [0, 0], "{r}");
    assert!(r.leftovers.is_empty(), "{r}");
    assert!(r.proc[0].fds > 0 && r.proc[2].rss_kib > 0, "{r}");
    assert!(r.ttft_reference.1 > 0.0 && r.ttft_soak.1 > 0.0, "{r}");
}

/// The checks catch a wrong byte served: a byte flipped in every idle arena row (resident chunks
/// no tier checksum covers) between two rounds, the second running the first's workload again,
/// so it loads chunks from those rows.
#[test]
fn the_checks_catch_wrong_bytes_served() {
    if !redis_installed() {
        return;
    }
    let r = run_soak(&short_soak(6, false, true)).expect("the soak runs");
    println!("{r}");
    assert!(r.arena_rows_corrupted > 0, "{r}");
    assert!(r.wrong_bytes[0] > 0, "{r}");
    assert!(
        r.violations.iter().any(|v| v.contains("wrong bytes")),
        "{:?}",
        r.violations
    );
    assert!(r.leftovers.is_empty(), "{r}");
}
