//! `kvtier run --metrics-addr` serves Prometheus text over HTTP: scraped from outside the
//! process, the endpoint shows lookups, transfer bytes and duration histograms with real values.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The child, killed and reaped on drop (also when the test fails).
struct Run(Child);

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    // HTTP/1.0: the body comes whole, not chunked, and the connection closes after it.
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200").then(|| body.to_owned())
}

/// The value of the first sample line that starts with `prefix`.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn metrics_endpoint_is_scraped_over_http_during_a_run() {
    let port = free_port();
    let scratch = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "run",
            "--requests",
            "300",
            "--no-baseline",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--metrics-hold",
            "60",
        ])
        .env("TMPDIR", scratch.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _run = Run(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    let text = loop {
        assert!(
            Instant::now() < deadline,
            "the endpoint never showed the run's figures"
        );
        if let Some(t) = scrape(port)
            && sample(&t, "kvtier_lookups_total{").is_some()
            && t.lines().any(|l| {
                l.starts_with("kvtier_lookups_total{") && l.contains("result=\"hit\"") && !l.ends_with(" 0")
            })
            && sample(&t, "kvtier_transfer_bytes_total{").is_some_and(|v| v > 0.0)
            && t.contains("kvtier_job_duration_seconds_bucket")
        {
            break t;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        text.contains("kvtier_lock_hold_seconds_bucket"),
        "lock histograms are exported"
    );
    assert!(
        text.contains("kvtier_tier_resident_chunks{"),
        "tier gauges are exported"
    );
    assert!(text.contains("kvtier_control_sweeps_total"));
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        assert!(line.starts_with("kvtier_"), "every metric is prefixed: {line}");
    }
}
