//! Per-run scratch space that cannot outlive the run.
//!
//! The shipped chains keep their disk slabs in `${tmpdir}/kvtier-${pid}` (see
//! `docs/ARCHITECTURE.md`, "Plugins and chains"). A [`ScratchGuard`] owns that directory for
//! the lifetime of a command:
//!
//! - at start it reclaims the scratch directories of processes that are gone (a `kill -9`, a
//!   power loss): a `kvtier-<pid>` directory is removed only when `<pid>` is not alive
//!   (`kill(pid, 0)` fails with `ESRCH`) *and* no file in it is still locked (the disk tier
//!   holds an exclusive `flock` on its slab while it is open, which covers pid reuse);
//! - it removes this process's directory when dropped (a normal return or an error);
//! - on `SIGINT` and `SIGTERM` a watcher thread removes the directory and exits with
//!   `128 + signal`, as a shell expects. Open slab files are unlinked; the kernel frees their
//!   blocks when the process exits a moment later.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Prefix of every per-process scratch directory under the temporary directory.
const PREFIX: &str = "kvtier-";

/// This process's scratch directory: what `${tmpdir}/kvtier-${pid}` expands to in a chain file.
#[must_use]
pub fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("{PREFIX}{}", std::process::id()))
}

/// Owns this process's scratch directory; see the module documentation.
#[derive(Debug)]
pub struct ScratchGuard {
    dir: PathBuf,
}

impl ScratchGuard {
    /// Reclaims stale scratch of dead processes, then guards this process's directory (removed
    /// on drop, `SIGINT` and `SIGTERM`).
    #[must_use]
    pub fn install() -> Self {
        let tmp = std::env::temp_dir();
        for dir in reclaim_stale(&tmp) {
            tracing::info!(dir = %dir.display(), "removed the scratch directory of a process that is gone");
        }
        let dir = scratch_dir();
        install_signal_cleanup(dir.clone());
        Self { dir }
    }

    /// The guarded directory (it may not exist yet; a chain creates it on demand).
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ScratchGuard {
    fn drop(&mut self) {
        remove(&self.dir);
    }
}

fn remove(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!(
            "kvtier: cannot remove the scratch directory {}: {e}",
            dir.display()
        ),
    }
}

/// A watcher thread that removes `dir` and exits on `SIGINT` or `SIGTERM`. When the handler
/// cannot be installed the default action (terminate) stays, and the next start reclaims.
fn install_signal_cleanup(dir: PathBuf) {
    let mut signals = match Signals::new([SIGINT, SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot install the SIGINT/SIGTERM handler; scratch of an interrupted run is reclaimed at the next start");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("kvtier-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                remove(&dir);
                std::process::exit(128 + sig);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the signal watcher thread");
    }
}

/// Whether process `pid` exists (a process we may not signal still exists).
fn alive(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 performs only the existence and permission checks; nothing is delivered.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether any regular file under `dir` is locked by someone (the disk tier's slab lock).
fn any_locked(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => any_locked(&path),
            Ok(t) if t.is_file() => File::open(&path).is_ok_and(|f| {
                // SAFETY: `flock` only reads the descriptor number, which `f` keeps open.
                let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
                // Our probe lock goes with `f` when it closes.
                rc != 0
            }),
            _ => false,
        }
    })
}

/// Removes every `kvtier-<pid>` directory under `tmp` whose process is gone and whose files
/// nobody holds locked; returns the directories removed.
pub fn reclaim_stale(tmp: &Path) -> Vec<PathBuf> {
    let own = std::process::id();
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(pid_t) = libc::pid_t::try_from(pid) else {
            continue;
        };
        if pid == own || !entry.file_type().is_ok_and(|t| t.is_dir()) || alive(pid_t) {
            continue;
        }
        let path = entry.path();
        if any_locked(&path) {
            continue;
        }
        if std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that is not running: a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn stale_scratch_of_a_dead_process_is_reclaimed_and_live_or_locked_scratch_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let dead = tmp.path().join(format!("{PREFIX}{}", dead_pid()));
        std::fs::create_dir_all(dead.join("disk")).unwrap();
        std::fs::write(dead.join("disk/slab"), b"x").unwrap();
        let live = tmp.path().join(format!("{PREFIX}{}", std::process::id()));
        std::fs::create_dir_all(&live).unwrap();
        // A dead pid whose slab is still locked (pid reuse, or a lock held elsewhere) is kept.
        let locked = tmp.path().join(format!("{PREFIX}{}", dead_pid()));
        std::fs::create_dir_all(&locked).unwrap();
        let slab = File::create(locked.join("slab")).unwrap();
        // SAFETY: `slab` is open for the call.
        let rc = unsafe { libc::flock(slab.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(rc, 0);
        let other = tmp.path().join("kvtier-notapid");
        std::fs::create_dir_all(&other).unwrap();

        let removed = reclaim_stale(tmp.path());
        assert_eq!(removed, vec![dead.clone()]);
        assert!(!dead.exists());
        assert!(live.exists());
        assert!(locked.exists());
        assert!(other.exists());
        drop(slab);
        assert_eq!(reclaim_stale(tmp.path()), vec![locked.clone()]);
    }
}
