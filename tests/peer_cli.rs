//! `kvtier peer` across two OS processes on loopback: a producer serves chunks, a consumer pulls
//! and verifies them; a wrong seed and a dead address fail with clear errors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

struct Producer(Child);

impl Drop for Producer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn chain(dir: &std::path::Path, name: &str, bind: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n\n[[secondary]]\ntype = \"p2p\"\nbind = \"{bind}\"\nhash_seed = \"peer-cli\"\nlayout_fingerprint = \"peer-cli\"\ninsecure = true\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

#[test]
fn a_consumer_process_pulls_and_verifies_what_a_producer_process_serves() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let prod = chain(dir.path(), "prod.toml", &format!("127.0.0.1:{port}"));
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let mut child = kvtier()
        .args(["peer", "--config"])
        .arg(&prod)
        .args(["--chunks", "8", "--chunk-bytes", "16384", "--serve-secs", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let producer = Producer(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert!(line.contains("serving 8 chunks"), "producer said: {line}");

    let pull = |seed: &str| {
        kvtier()
            .args(["peer", "--config"])
            .arg(&cons)
            .args([
                "--chunks",
                "8",
                "--chunk-bytes",
                "16384",
                "--seed",
                seed,
                "--timeout-secs",
                "20",
            ])
            .args(["--pull-from", &format!("127.0.0.1:{port}")])
            .output()
            .unwrap()
    };
    let ok = pull("1");
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        out.contains("pulled 8 chunks") && out.contains("every byte verified"),
        "{out}"
    );

    let wrong = pull("2");
    assert!(!wrong.status.success());
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(err.contains("does not hold chunk"), "{err}");
    drop(producer);
}

#[test]
fn pulling_from_a_dead_address_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let out = kvtier()
        .args(["peer", "--config"])
        .arg(&cons)
        .args(["--pull-from", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unreachable"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_chain_without_a_p2p_tier_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cpu.toml");
    std::fs::write(&path, "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n").unwrap();
    let out = kvtier().args(["peer", "--config"]).arg(&path).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no p2p tier"));
}
