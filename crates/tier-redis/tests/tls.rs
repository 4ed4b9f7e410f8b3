//! TLS (`rediss://`), with the `tls` feature: a `redis-server` listening only on a TLS port with
//! a self-signed certificate made by `openssl`; chunks round-trip through it.

#![cfg(feature = "tls")]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{PATIENCE, Rig, content, free_port, keys, options, redis_installed};
use tiering_core::JobOutcome;

struct TlsServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Option<TlsServer> {
    if !redis_installed() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("server.crt"), dir.path().join("server.key"));
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("\n!!!!!!!! SKIPPED: openssl cannot make a test certificate !!!!!!!!\n");
        return None;
    }
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args(["--save", "", "--appendonly", "no", "--tls-auth-clients", "no"])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--tls-ca-cert-file")
        .arg(&cert)
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the TLS server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(TlsServer {
        child,
        port,
        _dir: dir,
    })
}

#[test]
fn chunks_round_trip_over_tls() {
    let Some(server) = start() else {
        return;
    };
    // A self-signed certificate: `#insecure` skips verification (a private CA would be
    // configured on the host's trust store instead).
    let url = format!("rediss://127.0.0.1:{}/#insecure", server.port);
    let mut rig = Rig::new(&options(&url, "tls"), 4096, 4);
    let ks = keys(0..4);
    assert_eq!(rig.store(&ks).outcome, JobOutcome::Ok);
    let (r, rows) = rig.load(&ks);
    assert_eq!(r.outcome, JobOutcome::Ok);
    for (k, row) in ks.iter().zip(rows) {
        assert!(row == content(k, 4096));
    }
    // Plain redis:// to a TLS-only port fails at start, clearly.
    let plain = format!("redis://127.0.0.1:{}", server.port);
    assert!(tier_redis::RedisTier::connect(&options(&plain, "tls"), 4096).is_err());
}
