//! `kvtier` leaves no scratch behind: a run interrupted by SIGINT or SIGTERM removes its
//! `${tmpdir}/kvtier-${pid}` directory itself; one killed with SIGKILL has it reclaimed by the
//! next start. Each test gives the binary a private `TMPDIR`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CHAIN: &str = r#"
[primary]
type = "cpu"
capacity = "8MiB"

[[secondary]]
type = "disk"
name = "disk"
path = "${tmpdir}/kvtier-${pid}/disk"
capacity = "64MiB"
"#;

fn kvtier(tmp: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.env("TMPDIR", tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

fn scratch_entries(tmp: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("kvtier-"))
        })
        .collect()
}

/// Kills the child on drop, so a failing test leaves no process behind.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a long `kvtier run` over a disk chain and waits until its slab directory exists.
fn start_run(tmp: &Path, chain: &Path) -> Reap {
    let child = kvtier(tmp)
        .args(["run", "--no-baseline", "--requests", "500000", "--config"])
        .arg(chain)
        .spawn()
        .unwrap();
    let dir = tmp.join(format!("kvtier-{}", child.id())).join("disk");
    let child = Reap(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
        assert!(
            Instant::now() < deadline,
            "the run never created {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let tmp = root.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let chain = root.path().join("chain.toml");
    std::fs::write(&chain, CHAIN).unwrap();
    (root, tmp, chain)
}

fn interrupted_run_removes_its_scratch(signal: libc::c_int, code: i32) {
    let (_root, tmp, chain) = setup();
    let mut run = start_run(&tmp, &chain);
    let pid = libc::pid_t::try_from(run.0.id()).unwrap();
    // SAFETY: plain kill(2) of our own child, which `run` has not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let status = run.0.wait().unwrap();
    assert_eq!(status.code(), Some(code), "{status:?}");
    assert_eq!(scratch_entries(&tmp), Vec::<PathBuf>::new());
}

#[test]
fn a_run_interrupted_by_sigint_removes_its_scratch() {
    interrupted_run_removes_its_scratch(libc::SIGINT, 130);
}

#[test]
fn a_run_terminated_by_sigterm_removes_its_scratch() {
    interrupted_run_removes_its_scratch(libc::SIGTERM, 143);
}

#[test]
fn scratch_of_a_run_killed_with_sigkill_is_reclaimed_by_the_next_start() {
    let (_root, tmp, chain) = setup();
    let mut run = start_run(&tmp, &chain);
    run.0.kill().unwrap();
    run.0.wait().unwrap();
    assert_eq!(scratch_entries(&tmp).len(), 1, "SIGKILL cannot clean up");
    let out = kvtier(&tmp).arg("tiers").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(scratch_entries(&tmp), Vec::<PathBuf>::new());
}

#[test]
fn check_build_and_a_failed_run_leave_no_scratch() {
    let (_root, tmp, chain) = setup();
    let out = kvtier(&tmp)
        .args(["check", "--build"])
        .arg(&chain)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(scratch_entries(&tmp), Vec::<PathBuf>::new());
    // A run that fails after the disk tier was built (a device pool too large) cleans up too.
    let out = kvtier(&tmp)
        .args([
            "run",
            "--requests",
            "10",
            "--no-baseline",
            "--device-blocks",
            "4294967296",
            "--config",
        ])
        .arg(&chain)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(scratch_entries(&tmp), Vec::<PathBuf>::new());
}
