//! The same pull across two OS processes: this test binary re-runs itself as the producer.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use common::*;
use tiering_core::{LookupResult, ManagerConfig};

const CHILD_ENV: &str = "KVTIER_P2P_TEST_CHILD";
const N: u64 = 6;

/// The producer process. Runs only when the parent test starts it (the variable is set).
#[test]
#[ignore = "the producer half of the multi-process tests; started by them"]
fn child_producer() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    init_tracing();
    let mut o = opts();
    o.deadlines.drain_ms = 200;
    let mut a = Node::new(o, ManagerConfig::default());
    a.store("child", &keys(0, N));
    if mode == "hold" {
        a.p2p.faults().hold_after_chunks(2);
    }
    println!("READY {}", a.p2p.local_id());
    std::io::stdout().flush().unwrap();
    // Serve (from the control thread) until the parent closes our stdin or kills us.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    a.mgr.shutdown().unwrap();
}

/// Kills the child if a test fails before reaping it.
struct ChildGuard {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_producer(mode: &str) -> (ChildGuard, String, u16) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_producer",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().unwrap();
    let mut guard = ChildGuard { child, stdin };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            // libtest may have printed `test child_producer ... ` on the same line.
            if let Some(at) = line.find("READY ") {
                let _ = tx.send(line[at + 6..].trim().to_owned());
            }
        }
    });
    let id = match rx.recv_timeout(PATIENCE) {
        Ok(id) => id,
        Err(e) => {
            let _ = guard.child.kill();
            panic!("the producer process did not start: {e}");
        }
    };
    let (host, port) = id.rsplit_once(':').unwrap();
    (guard, host.to_owned(), port.parse().unwrap())
}

#[test]
fn two_processes_pull_over_loopback() {
    init_tracing();
    let (mut child, host, port) = spawn_producer("serve");
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, N);
    let ctx = b.pull_ctx_to("mp", &host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    let trace = b.pull_until_settled(&ctx, &ks);
    for t in &trace {
        assert_eq!(
            t,
            &[LookupResult::Retry, LookupResult::HitPending, LookupResult::Hit]
        );
    }
    for (k, got) in ks.iter().zip(b.read_hits(&ctx, &ks)) {
        assert_eq!(got, pattern(k));
    }
    b.finish(&ctx);
    b.wait_clean();
    drop(child.stdin.take());
    let status = child.child.wait().unwrap();
    assert!(status.success(), "the producer process failed: {status}");
}

#[test]
fn producer_process_killed_mid_transfer() {
    init_tracing();
    let (mut child, host, port) = spawn_producer("hold");
    let mut b = Node::new(opts(), ManagerConfig::default());
    let ks = keys(0, N);
    let ctx = b.pull_ctx_to("mp-kill", &host, port);
    b.mgr.on_new_request(&ctx).unwrap();
    let hb = b.p2p.clone();
    let consumer = std::thread::spawn(move || {
        let trace = b.pull_until_settled(&ctx, &ks);
        (b, ctx, ks, trace)
    });
    wait_for("two chunks from the producer process", || {
        hb.chunks_received() == 2
    });
    child.child.kill().unwrap();
    let _ = child.child.wait();
    let (mut b, ctx, ks, trace) = consumer.join().unwrap();
    for t in &trace[..2] {
        assert_eq!(t.last(), Some(&LookupResult::Hit), "{trace:?}");
    }
    for t in &trace[2..] {
        assert_eq!(t.last(), Some(&LookupResult::Miss), "{trace:?}");
    }
    assert_eq!(b.read_hits(&ctx, &ks[..2])[1], pattern(&ks[1]));
    b.finish(&ctx);
    b.wait_clean();
}
