//! `kvtier redis invalidate` and `kvtier bench tiers` with a Redis tier, against a real
//! `redis-server` started on a free loopback port (killed on drop). Skipped loudly when
//! redis-server is not installed (`scripts/install-test-deps.sh` installs it).

mod common;

use common::{kvtier, text};

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tier_redis::{RedisTier, RedisTierOptions};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobOutcome, ReqContext, SecondaryTier, TransferJob,
    arena::{ChunkArena, RowGrant},
};

struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Option<Self> {
        if Command::new("redis-server").arg("--version").output().is_err() {
            eprintln!(
                "\n!!!!!!!! SKIPPED: redis-server is not installed; run scripts/install-test-deps.sh !!!!!!!!\n"
            );
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let s = Self {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(s)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stores `n` chunks of 4 KiB under `namespace`.
fn store(url: &str, namespace: &str, n: u32) {
    let mut opts = RedisTierOptions::new(url);
    opts.namespace = namespace.into();
    let arena = ChunkArena::new(n as usize, 4096).unwrap();
    let mut tier = RedisTier::connect(&opts, 4096).unwrap();
    let waker = ControlWaker::new();
    tier.set_waker(waker.clone());
    let rows: Vec<u32> = (0..n).collect();
    tier.submit_store(TransferJob {
        id: JobId(1),
        kind: JobKind::Store,
        keys: (0..u64::from(n))
            .map(tiering_core::OffloadKey::from_u64)
            .collect(),
        chunk_ids: rows.clone(),
        req: ReqContext::local("t"),
        rows: RowGrant::Read(arena.read_rows(&rows).unwrap()),
    });
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.is_empty() {
        assert!(Instant::now() < deadline);
        waker.wait(Duration::from_millis(20));
        tier.poll_finished(&mut out);
    }
    assert_eq!(out[0].outcome, JobOutcome::Ok);
}

#[test]
fn invalidate_deletes_a_namespace_by_url_and_by_chain() {
    let Some(server) = Server::start() else {
        return;
    };
    store(&server.url(), "cli-a", 9);
    store(&server.url(), "cli-b", 4);
    let out = kvtier(&[
        "redis",
        "invalidate",
        "--url",
        &server.url(),
        "--namespace",
        "cli-a",
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("deleted 9 keys of namespace `cli-a`"), "{t}");

    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain.toml");
    std::fs::write(
        &chain,
        format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"1MiB\"\n\n[[secondary]]\ntype = \"redis\"\nurl = \"{}\"\nnamespace = \"cli-b\"\n",
            server.url()
        ),
    )
    .unwrap();
    let out = kvtier(&["redis", "invalidate", "--config", chain.to_str().unwrap()]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("deleted 4 keys of namespace `cli-b`"), "{t}");

    // Errors: no namespace with --url, a bad namespace, a chain without redis.
    let out = kvtier(&["redis", "invalidate", "--url", &server.url()]);
    assert!(
        !out.status.success() && text(&out).contains("--namespace"),
        "{}",
        text(&out)
    );
    let out = kvtier(&["redis", "invalidate", "--url", &server.url(), "--namespace", "a*"]);
    assert!(
        !out.status.success() && text(&out).contains("`namespace`"),
        "{}",
        text(&out)
    );
    let out = kvtier(&["redis", "invalidate", "--config", "config/cpu-only.toml"]);
    assert!(
        !out.status.success() && text(&out).contains("no `type = \"redis\"` tier"),
        "{}",
        text(&out)
    );
}

#[test]
fn bench_tiers_measures_redis_against_a_raw_pipeline() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("chain.toml");
    std::fs::write(
        &chain,
        format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"8MiB\"\n\n[[secondary]]\ntype = \"redis\"\nurl = \"{}\"\nnamespace = \"bench\"\n",
            server.url()
        ),
    )
    .unwrap();
    let json = dir.path().join("bench.json");
    let out = kvtier(&[
        "bench",
        "tiers",
        "--config",
        chain.to_str().unwrap(),
        "--chunk-bytes",
        "65536",
        "--batch-chunks",
        "8",
        "--mib",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("redis-rs raw pipelined SET") && t.contains("redis-rs raw pipelined GET"),
        "{t}"
    );
    assert!(t.contains("lookup p50"), "{t}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let redis_rows: Vec<_> = rows.iter().filter(|r| r["tier"] == "redis").collect();
    assert_eq!(redis_rows.len(), 2, "{t}");
    for r in redis_rows {
        assert!(r["gib_per_s"].as_f64().unwrap() > 0.0 && r["reference_gib_per_s"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(
        report["lookups"][0]["samples"],
        2 * 1024 * 1024 / 65536 + 8,
        "{t}"
    );
    // The benchmark's chunks and the reference's values are not cache: none are left.
    let mut conn = redis::Client::open(server.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let left: u64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    assert_eq!(left, 0, "the benchmark left {left} keys on the server");
}

#[test]
fn run_with_two_nodes_serves_one_node_from_what_the_other_stored() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("nodes.toml");
    std::fs::write(
        &chain,
        format!(
            "[primary]\ntype = \"cpu\"\ncapacity = \"32MiB\"\n\n[[secondary]]\ntype = \"redis\"\nurl = \"{}\"\nnamespace = \"nodes-test\"\nlayout_fingerprint = \"nodes-test\"\n",
            server.url()
        ),
    )
    .unwrap();
    let json = dir.path().join("nodes.json");
    let out = kvtier(&[
        "run",
        "--config",
        chain.to_str().unwrap(),
        "--nodes",
        "2",
        "--workload",
        "shared-prefix",
        "--requests",
        "120",
        "--device-blocks",
        "512",
        "--step-us",
        "10",
        "--prefill-ns-per-token",
        "0",
        "--no-baseline",
        "--json",
        json.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("cross-node") && t.contains("total"), "{t}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    let requests: u64 = nodes
        .iter()
        .map(|n| n["report"]["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(requests, 120);
    let cross: u64 = nodes
        .iter()
        .map(|n| n["cross_node_tokens"].as_u64().unwrap())
        .sum();
    assert!(cross > 0, "no cross-node hits:\n{t}");
    // A fresh server holds nothing from an earlier run.
    assert!(nodes.iter().all(|n| n["foreign_tokens"] == 0), "{t}");
    // Cross-node tokens are a part of what the shared tier served each node.
    for n in nodes {
        let redis = n["report"]["sources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["source"] == "redis")
            .unwrap()["tokens"]
            .as_u64()
            .unwrap();
        assert!(n["cross_node_tokens"].as_u64().unwrap() <= redis, "{t}");
    }
}

#[test]
fn run_with_nodes_needs_a_shared_tier() {
    let dir = tempfile::tempdir().unwrap();
    let chain = dir.path().join("cpu.toml");
    std::fs::write(&chain, "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n").unwrap();
    let out = kvtier(&["run", "--config", chain.to_str().unwrap(), "--nodes", "2"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("needs a tier the nodes share"),
        "{}",
        text(&out)
    );
}
