//! The shared-memory arena across OS processes: one owner per file, and views in other processes
//! whose grants obey the row locks in the mapping. The child side of each test is this same test
//! binary, re-executed with `CHILD_ENV` set (see `spawn_child`).

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;

use tiering_core::arena::{ArenaError, ArenaOptions, ArenaView, ChunkArena, ReclaimedViews};

/// Set in a re-executed child to `<role>:<arena path>`.
const CHILD_ENV: &str = "KVTIER_SHARED_ARENA_CHILD";
/// Prefix of the protocol lines a child prints (the test harness prints its own lines too).
const SAY: &str = "child: ";

const ROWS: usize = 8;
const CHUNK_BYTES: usize = 3000;

fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

fn own(path: &Path) -> Result<Arc<ChunkArena>, ArenaError> {
    let mut opts = ArenaOptions::new(ROWS, CHUNK_BYTES);
    opts.shared_memory = Some(path.to_path_buf());
    ChunkArena::with_options(&opts)
}

fn pattern(row: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ row.wrapping_mul(97)) as u8
}

/// A child process running `test` in `role`, killed and reaped on drop (also when the test fails).
struct ChildProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ChildProcess {
    fn spawn(test: &str, role: &str, path: &Path) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{role}:{}", path.display()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self { child, stdin, lines }
    }

    /// The child's next protocol line.
    fn next(&mut self) -> String {
        for line in self.lines.by_ref() {
            // The harness's "test … " may precede the first line on the same output line.
            if let Some((_, said)) = line.unwrap().split_once(SAY) {
                return said.to_owned();
            }
        }
        panic!("the child exited before saying its next line (its stderr is above)");
    }

    fn expect(&mut self, want: &str) {
        assert_eq!(self.next(), want);
    }

    fn tell(&mut self, what: &str) {
        writeln!(self.stdin, "{what}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// SIGKILL: the child gets no chance to release anything.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    fn wait_success(&mut self) {
        assert!(
            self.child.wait().unwrap().success(),
            "the child failed (its stderr is above)"
        );
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child side: `Some(())` when this process is a child (and has done its part).
fn run_child_role() -> Option<()> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let (role, path) = spec.split_once(':').expect("role:path");
    let path = PathBuf::from(path);
    match role {
        "owner" => match own(&path) {
            Err(e @ ArenaError::AlreadyOwned { .. }) => println!("{SAY}refused: {e}"),
            other => println!("{SAY}unexpected: {other:?}"),
        },
        "view" => view_child(&path),
        _ => panic!("unknown child role {role}"),
    }
    Some(())
}

fn view_child(path: &Path) {
    let view = ArenaView::open(path).unwrap();
    println!("{SAY}attached");
    let busy = |r: Result<(), ArenaError>| match r {
        Err(ArenaError::RowBusy { .. }) => "busy".to_owned(),
        other => format!("not refused: {other:?}"),
    };
    println!("{SAY}write 1 {}", busy(view.write_row(1).map(drop)));
    println!("{SAY}read 1 {}", busy(view.read_row(1).map(drop)));
    let mut row = view.write_row(2).unwrap();
    row.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(2, i));
    drop(row);
    println!("{SAY}wrote 2");
    let mut stdin = std::io::stdin().lines();
    assert_eq!(stdin.next().unwrap().unwrap(), "read 1");
    let row = view.read_row(1).unwrap();
    let ok = row.iter().all(|&b| b == 0xaa);
    drop(row);
    println!("{SAY}read 1 {}", if ok { "ok" } else { "mismatch" });
    // Take grants and die holding them: the parent kills this process.
    let mut held_write = view.write_row(3).unwrap();
    held_write.fill(0x33);
    let held_read = view.read_row(4).unwrap();
    println!("{SAY}holding 3 4");
    let _ = stdin.next();
    drop((held_write, held_read));
}

#[test]
fn second_manager_on_the_same_arena_is_refused() {
    if run_child_role().is_some() {
        return;
    }
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let first = own(&path).unwrap();

    // A second owner in this process…
    let err = own(&path).unwrap_err();
    assert!(
        matches!(&err, ArenaError::AlreadyOwned { path: p } if *p == path),
        "{err:?}"
    );
    assert!(err.to_string().contains(&path.display().to_string()));
    // …and in another process are refused.
    let mut child = ChildProcess::spawn("second_manager_on_the_same_arena_is_refused", "owner", &path);
    let said = child.next();
    assert!(
        said.starts_with("refused: ") && said.contains("already owned"),
        "{said}"
    );
    child.wait_success();

    // The first owner is untouched: its rows, its locks, its file.
    let mut w = first.write_row(5).unwrap();
    w.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(5, i));
    drop(w);
    let r = first.read_row(5).unwrap();
    assert!(r.iter().enumerate().all(|(i, &b)| b == pattern(5, i)));
    drop(r);
    assert_eq!(first.granted_rows(), 0);
    let view = ArenaView::open(&path).unwrap();
    assert!(
        view.read_row(5)
            .unwrap()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(5, i))
    );
    drop(view);

    drop(first);
    assert!(!path.exists(), "the owner removes the file it created");
    let again = own(&path).unwrap();
    assert_eq!(
        again.granted_rows(),
        0,
        "once the owner is gone the path can be owned again"
    );
}

#[test]
fn arena_view_in_another_process_obeys_row_locks() {
    if run_child_role().is_some() {
        return;
    }
    let dir = shm_dir();
    let path = dir.path().join("arena");
    let owner = own(&path).unwrap();
    let mut held = owner.write_row(1).unwrap();
    held.fill(0xaa);

    let mut child = ChildProcess::spawn("arena_view_in_another_process_obeys_row_locks", "view", &path);
    child.expect("attached");
    assert_eq!(owner.attached_views(), 1);
    // The owner's write grant on row 1 refuses both of the child's grants on it…
    child.expect("write 1 busy");
    child.expect("read 1 busy");
    // …while another row is granted, and the child's bytes arrive bit-exact.
    child.expect("wrote 2");
    let row = owner.read_row(2).unwrap();
    assert!(
        row.iter().enumerate().all(|(i, &b)| b == pattern(2, i)),
        "row 2 differs"
    );
    drop(row);

    // Released here, row 1 is readable there, with the owner's bytes.
    drop(held);
    child.tell("read 1");
    child.expect("read 1 ok");

    // The child now holds a write grant on row 3 and a read grant on row 4.
    child.expect("holding 3 4");
    assert!(matches!(owner.write_row(3), Err(ArenaError::RowBusy { .. })));
    assert!(matches!(owner.read_row(3), Err(ArenaError::RowBusy { .. })));
    assert!(matches!(owner.write_row(4), Err(ArenaError::RowBusy { .. })));
    drop(owner.read_row(4).unwrap());
    assert_eq!(
        owner.reclaim_dead_views().unwrap(),
        ReclaimedViews::default(),
        "a live view's grants are never reclaimed"
    );
    assert_eq!(owner.granted_rows(), 2);

    // Killed while holding them: the locks stay (nothing is released behind the owner's back)
    // until the owner reclaims the dead view's slot.
    child.kill();
    assert_eq!(owner.granted_rows(), 2);
    assert!(matches!(owner.write_row(3), Err(ArenaError::RowBusy { .. })));
    assert_eq!(
        owner.reclaim_dead_views().unwrap(),
        ReclaimedViews { views: 1, rows: 2 }
    );
    assert_eq!(owner.granted_rows(), 0);
    assert_eq!(owner.attached_views(), 0);
    let rows = owner.write_rows(&[3, 4]).unwrap();
    assert!(
        rows[0].iter().all(|&b| b == 0x33),
        "the dead view's bytes are still there"
    );
    drop(rows);
    assert_eq!(owner.reclaim_dead_views().unwrap(), ReclaimedViews::default());

    drop(owner);
    assert!(!path.exists(), "nothing is left in /dev/shm");
}
