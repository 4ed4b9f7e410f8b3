//! `kvtier peer` across two OS processes on loopback: a producer serves chunks, a consumer pulls
//! and verifies them; each consumer failure (unreachable, refused handshake, producer killed
//! mid-transfer, chunk not held) ends with its own exit code and one clear line.

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

/// A chain whose p2p tier takes its secret from `KVTIER_PEER_TEST_SECRET`.
fn secret_chain(dir: &std::path::Path, name: &str, bind: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n\n[[secondary]]\ntype = \"p2p\"\nbind = \"{bind}\"\nhash_seed = \"peer-cli\"\nlayout_fingerprint = \"peer-cli\"\nsecret_env = \"KVTIER_PEER_TEST_SECRET\"\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Starts a producer of `chunks` chunks on `port` and waits for its "serving" line; `extra`
/// are further arguments. Returns the guard and the rest of its stdout.
fn start_producer(
    config: &std::path::Path,
    chunks: &str,
    extra: &[&str],
    secret: &str,
) -> (Producer, BufReader<std::process::ChildStdout>) {
    let mut child = kvtier()
        .args(["peer", "--config"])
        .arg(config)
        .args(["--chunks", chunks, "--chunk-bytes", "16384", "--serve-secs", "60"])
        .args(extra)
        .env("KVTIER_PEER_TEST_SECRET", secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let producer = Producer(child);
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.contains("serving"), "producer said: {line}");
    (producer, stdout)
}

fn consumer(config: &std::path::Path, from: &str, chunks: &str, secret: &str) -> Command {
    consumer_of(config, from, chunks, "16384", secret)
}

fn consumer_of(
    config: &std::path::Path,
    from: &str,
    chunks: &str,
    chunk_bytes: &str,
    secret: &str,
) -> Command {
    let mut c = kvtier();
    c.args(["peer", "--config"])
        .arg(config)
        .args([
            "--chunks",
            chunks,
            "--chunk-bytes",
            chunk_bytes,
            "--timeout-secs",
            "20",
        ])
        .args(["--pull-from", from])
        .env("KVTIER_PEER_TEST_SECRET", secret);
    c
}

/// The exit code and stderr of a finished consumer, asserting it printed one clear line and
/// no panic.
fn failed(out: &std::process::Output) -> (i32, String) {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    let last = err.lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("kvtier: "), "{err}");
    (out.status.code().expect("exited, not killed"), last)
}

#[test]
fn an_unreachable_producer_exits_with_code_10() {
    let dir = tempfile::tempdir().unwrap();
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let out = consumer(&cons, &format!("127.0.0.1:{}", free_port()), "4", "")
        .output()
        .unwrap();
    let (code, line) = failed(&out);
    assert_eq!(code, 10, "{line}");
    assert!(line.contains("unreachable"), "{line}");
    let out = consumer(&cons, "no-such-host.invalid:7100", "4", "")
        .output()
        .unwrap();
    let (code, line) = failed(&out);
    assert_eq!(code, 10, "{line}");
    assert!(line.contains("does not resolve"), "{line}");
}

#[test]
fn a_refused_handshake_exits_with_code_11_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let prod = secret_chain(dir.path(), "prod.toml", &format!("127.0.0.1:{port}"));
    let cons = secret_chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let (producer, _out) = start_producer(&prod, "4", &[], "the-producers-secret");
    let out = consumer(&cons, &format!("127.0.0.1:{port}"), "4", "another-secret")
        .output()
        .unwrap();
    let (code, line) = failed(&out);
    assert_eq!(code, 11, "{line}");
    assert!(line.contains("refused"), "{line}");
    // Another chunk size is refused too, and the reason names it.
    let mut other_size = consumer_of(
        &cons,
        &format!("127.0.0.1:{port}"),
        "4",
        "8192",
        "the-producers-secret",
    );
    let (code, line) = failed(&other_size.output().unwrap());
    assert_eq!(code, 11, "{line}");
    assert!(line.contains("chunk size"), "{line}");
    drop(producer);
}

#[test]
fn a_producer_killed_mid_transfer_exits_with_code_12() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let prod = chain(dir.path(), "prod.toml", &format!("127.0.0.1:{port}"));
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let (mut producer, mut prod_out) = start_producer(&prod, "16", &["--hold-after-chunks", "4"], "");
    let pull = consumer(&cons, &format!("127.0.0.1:{port}"), "16", "")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pull = Producer(pull);
    let mut line = String::new();
    prod_out.read_line(&mut line).unwrap();
    assert!(line.contains("holding mid-transfer"), "producer said: {line}");
    producer.0.kill().unwrap();
    producer.0.wait().unwrap();
    let mut pull = pull;
    let status = pull.0.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(pull.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(12), "{err}");
    assert!(err.contains("died mid-transfer"), "{err}");
}

#[test]
fn a_wrong_seed_exits_with_code_14_and_a_localhost_name_works() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let prod = chain(dir.path(), "prod.toml", &format!("127.0.0.1:{port}"));
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    let (producer, _out) = start_producer(&prod, "8", &[], "");
    let ok = consumer(&cons, &format!("localhost:{port}"), "8", "")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(out.contains("pulled 8 chunks from localhost"), "{out}");

    let mut wrong_seed = consumer(&cons, &format!("localhost:{port}"), "8", "");
    wrong_seed.args(["--seed", "2"]);
    let (code, line) = failed(&wrong_seed.output().unwrap());
    assert_eq!(code, 14, "{line}");
    assert!(
        line.contains("does not hold chunk") && line.contains("--seed"),
        "{line}"
    );

    let (code, line) = failed(
        &consumer(&cons, &format!("localhost:{port}"), "12", "")
            .output()
            .unwrap(),
    );
    assert_eq!(code, 14, "{line}");
    assert!(line.contains("fewer --chunks"), "{line}");
    drop(producer);
}

#[test]
fn peer_help_documents_the_exit_codes() {
    let out = kvtier().args(["peer", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for code in ["10", "11", "12", "13", "14", "15"] {
        assert!(help.contains(&format!("  {code}  ")), "{help}");
    }
}

#[test]
fn a_pull_that_outlives_its_timeout_exits_with_code_13() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let prod = chain(dir.path(), "prod.toml", &format!("127.0.0.1:{port}"));
    let cons = chain(dir.path(), "cons.toml", "127.0.0.1:0");
    // The producer stalls after 2 chunks and stays alive: the consumer's own deadline ends it.
    let (producer, _out) = start_producer(&prod, "8", &["--hold-after-chunks", "2"], "");
    let mut pull = kvtier();
    pull.args(["peer", "--config"])
        .arg(&cons)
        .args(["--chunks", "8", "--chunk-bytes", "16384", "--timeout-secs", "2"])
        .args(["--pull-from", &format!("127.0.0.1:{port}")]);
    let (code, line) = failed(&pull.output().unwrap());
    assert_eq!(code, 13, "{line}");
    assert!(line.contains("deadline"), "{line}");
    drop(producer);
}
