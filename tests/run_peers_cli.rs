//! `kvtier run` with a p2p tier whose configured peer is down at start: a refused port and a
//! black-holed address behave alike — a warning naming file, line and peer, and the run
//! proceeds — and `--require-peers` turns both into an error before anything is built.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output};
use std::time::Duration;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// The peer's session gives up after a short handshake deadline: until then the tier has
/// pending work, which the run's drain waits for.
fn chain(dir: &std::path::Path, peer: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("peers.toml");
    let text = format!(
        "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n\n[[secondary]]\ntype = \"p2p\"\nbind = \"127.0.0.1:0\"\npeers = [\"{peer}\"]\nhash_seed = \"run-peers\"\nlayout_fingerprint = \"run-peers\"\ninsecure = true\n\n[secondary.deadlines]\nhandshake_ms = 300\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// An address whose port was free a moment ago: connections are refused at once.
fn refused() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// A listener whose accept queue is full, so the kernel drops further SYNs: a connection to
/// it neither succeeds nor is refused (a black hole), for as long as the guard lives.
struct BlackHole {
    _listener: TcpListener,
    _queued: Vec<TcpStream>,
    addr: SocketAddr,
}

fn black_hole() -> BlackHole {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    // Never accepted: each connection takes a queue slot until one times out.
    for _ in 0..10_000 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(s) => queued.push(s),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
                return BlackHole {
                    _listener: listener,
                    _queued: queued,
                    addr,
                };
            }
        }
    }
    panic!("the accept queue never filled");
}

fn run(config: &std::path::Path, extra: &[&str]) -> Output {
    kvtier()
        .args(["run", "--config"])
        .arg(config)
        .args([
            "--requests",
            "20",
            "--device-blocks",
            "256",
            "--step-us",
            "10",
            "--prefill-ns-per-token",
            "0",
            "--no-baseline",
        ])
        .args(extra)
        .output()
        .unwrap()
}

fn assert_warned_and_ran(out: &Output, peer: SocketAddr) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{err}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let warning = err
        .lines()
        .find(|l| l.starts_with("kvtier: warning:"))
        .unwrap_or_else(|| panic!("no warning: {err}"));
    assert!(
        warning.contains("peers.toml:8")
            && warning.contains(&peer.to_string())
            && warning.contains("proceeds"),
        "{warning}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("requests"));
}

fn assert_refused_to_start(out: &Output, peer: SocketAddr) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("peers.toml:8") && err.contains(&peer.to_string()) && err.contains("unreachable"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "the run started: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_refused_peer_warns_and_the_run_proceeds_unless_required() {
    let dir = tempfile::tempdir().unwrap();
    let peer = refused();
    let config = chain(dir.path(), peer);
    assert_warned_and_ran(&run(&config, &[]), peer);
    assert_refused_to_start(&run(&config, &["--require-peers"]), peer);
}

#[test]
fn a_black_holed_peer_behaves_like_a_refused_one() {
    let dir = tempfile::tempdir().unwrap();
    let hole = black_hole();
    let config = chain(dir.path(), hole.addr);
    assert_warned_and_ran(&run(&config, &[]), hole.addr);
    assert_refused_to_start(&run(&config, &["--require-peers"]), hole.addr);
}
