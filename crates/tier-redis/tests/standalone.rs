//! The Redis tier against a real standalone `redis-server`: through a `TieringManager` (CPU
//! primary) and on its own with hand-made jobs.

mod common;

use std::time::{Duration, Instant};

use common::{Node, PATIENCE, RedisServer, Rig, content, key, keys, options, redis_installed};
use redis::Commands;
use tier_redis::{RedisTier, RedisTierError, format::HEADER_LEN, invalidate_namespace};
use tiering_core::{JobOutcome, LookupResult, SecondaryTier};

const CHUNK: usize = 16 * 1024;

#[test]
fn a_chunk_evicted_from_the_cpu_tier_is_promoted_back_bit_exact() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let mut node = Node::new(&options(&server.url(), "promote"), 4, CHUNK);
    let all = keys(0..8);
    node.store(&all);
    let stats = node.redis_stats();
    assert_eq!(stats.stores, 8, "every chunk cascaded to redis");
    assert_eq!(stats.failures, 0);
    for k in &all[..4] {
        assert!(
            !node.in_primary(k),
            "{k} should have been evicted from the CPU tier"
        );
    }
    // The first four come back from redis, byte for byte.
    for k in &all[..4] {
        let got = node.fetch(k).expect("a redis hit");
        assert!(got == content(k, CHUNK), "{k} came back with other bytes");
    }
    let stats = node.redis_stats();
    assert_eq!(stats.loads, 4);
    assert_eq!(stats.bytes_read, 4 * CHUNK as u64);
    assert!(stats.hits >= 4);
    // A key nobody stored is a miss (after a Retry while the server is asked).
    assert_eq!(node.lookup(&key(99)), LookupResult::Miss);
    node.shutdown();
}

#[test]
fn a_corrupted_value_fails_its_key_and_is_never_served() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let mut rig = Rig::new(&options(&server.url(), "corrupt"), CHUNK, 4);
    let ks = keys(1..5);
    assert_eq!(rig.store(&ks).outcome, JobOutcome::Ok);
    let mut c = server.client();
    // Key 1: one payload byte flipped with SETRANGE. Key 2: truncated. Key 3: deleted.
    let name1 = rig.tier.key_name(&ks[0]);
    let at = HEADER_LEN + 100;
    let old: Vec<u8> = c.getrange(&name1, at as isize, at as isize).unwrap();
    let _: i64 = c.setrange(&name1, at as isize, &[old[0] ^ 0x5a][..]).unwrap();
    let name2 = rig.tier.key_name(&ks[1]);
    let _: () = c.set(&name2, &b"KVTRDS01short"[..]).unwrap();
    let _: i64 = c.del(rig.tier.key_name(&ks[2])).unwrap();

    let (r, rows) = rig.load(&ks);
    assert_eq!(
        r.outcome,
        JobOutcome::Partial(vec![ks[3]]),
        "only the intact key loads"
    );
    assert!(rows[3] == content(&ks[3], CHUNK));
    for (i, row) in rows[..3].iter().enumerate() {
        assert!(row.iter().all(|&b| b == 0), "row {i} of a failed key was written");
    }
    assert_eq!(rig.stat("bad_values"), 2.0);
    assert_eq!(rig.stat("missing_values"), 1.0);
    // The bad values were deleted, and the failed keys are now misses.
    let exists: bool = c.exists(&name1).unwrap();
    assert!(!exists, "the corrupt value was left on the server");
    for k in &ks[..3] {
        assert_eq!(rig.lookup(k), LookupResult::Miss);
    }
    assert_eq!(rig.lookup(&ks[3]), LookupResult::Hit);
}

#[test]
fn a_job_larger_than_one_write_keeps_every_reply_with_its_key() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    // 48 chunks of 16 KiB: the values go out in several writes (the tier sends its encoded
    // pipeline every 256 KiB) and come back as 48 replies read one by one.
    let mut rig = Rig::new(&options(&server.url(), "streamed"), CHUNK, 48);
    let ks = keys(100..148);
    assert_eq!(rig.store(&ks).outcome, JobOutcome::Ok);
    // One key in the middle disappears: its neighbours' replies must stay with their keys.
    let mut c = server.client();
    let _: i64 = c.del(rig.tier.key_name(&ks[20])).unwrap();
    let (r, rows) = rig.load(&ks);
    let mut expected = ks.clone();
    expected.remove(20);
    assert_eq!(r.outcome, JobOutcome::Partial(expected));
    for (i, (k, row)) in ks.iter().zip(&rows).enumerate() {
        if i == 20 {
            assert!(row.iter().all(|&b| b == 0), "the missing key's row was written");
        } else {
            assert!(
                *row == content(k, CHUNK),
                "{k} (reply {i}) came back with other bytes"
            );
        }
    }
    assert_eq!(rig.stat("missing_values"), 1.0);
    // The connection is still in step: the next round trip answers its own commands.
    let (r, rows) = rig.load(&ks[..4]);
    assert_eq!(r.outcome, JobOutcome::Ok);
    assert!(rows[3] == content(&ks[3], CHUNK));
    assert_eq!(rig.stat("connection_failures"), 0.0);
    assert_eq!(rig.stat("server_errors"), 0.0);
}

#[test]
fn a_corrupted_value_is_not_promoted_through_the_manager() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let opts = options(&server.url(), "corrupt-mgr");
    let mut node = Node::new(&opts, 2, CHUNK);
    let ks = keys(0..4);
    node.store(&ks);
    let name = RedisTier::connect(&opts, CHUNK).unwrap().key_name(&ks[0]);
    let mut c = server.client();
    let _: i64 = c
        .setrange(&name, (HEADER_LEN + 7) as isize, b"corrupted!")
        .unwrap();
    assert_eq!(node.fetch(&ks[0]), None, "a corrupt chunk must not be served");
    let stats = node.manager_stats();
    assert_eq!(stats.manager.failed_promotion_keys, 1);
    assert_eq!(stats.secondaries[0].extra["bad_values"], 1.0);
    // Its neighbour is intact.
    assert_eq!(node.fetch(&ks[1]), Some(content(&ks[1], CHUNK)));
    node.shutdown();
}

#[test]
fn namespaces_and_layouts_are_isolated() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let base = options(&server.url(), "iso-a");
    let mut a = Rig::new(&base, CHUNK, 2);
    let ks = keys(10..12);
    assert_eq!(a.store(&ks).outcome, JobOutcome::Ok);
    assert_eq!(a.lookup(&ks[0]), LookupResult::Hit);

    let mut other_ns = base.clone();
    other_ns.namespace = "iso-b".into();
    let mut other_fp = base.clone();
    other_fp.layout_fingerprint = "fp8".into();
    for opts in [&other_ns, &other_fp] {
        let mut rig = Rig::new(opts, CHUNK, 2);
        assert_eq!(rig.lookup(&ks[0]), LookupResult::Miss);
        assert_eq!(rig.load(&ks).0.outcome, JobOutcome::Failed);
    }
    let mut other_chunk = Rig::new(&base, CHUNK / 2, 2);
    assert_eq!(other_chunk.lookup(&ks[0]), LookupResult::Miss);

    // A value of layout A planted under layout B's key is refused by its header.
    let b = Rig::new(&other_fp, CHUNK, 2);
    let mut c = server.client();
    let value: Vec<u8> = c.get(a.tier.key_name(&ks[0])).unwrap();
    let _: () = c.set(b.tier.key_name(&ks[0]), value).unwrap();
    drop(b);
    let mut b = Rig::new(&other_fp, CHUNK, 2);
    assert_eq!(
        b.lookup(&ks[0]),
        LookupResult::Hit,
        "the key exists under B's name"
    );
    let (r, rows) = b.load(&ks[..1]);
    assert_eq!(
        r.outcome,
        JobOutcome::Failed,
        "another layout's value is not served"
    );
    assert!(rows[0].iter().all(|&x| x == 0));
    assert_eq!(b.stat("bad_values"), 1.0);
}

#[test]
fn invalidate_deletes_only_the_namespace() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let a_opts = options(&server.url(), "inv-a");
    let b_opts = options(&server.url(), "inv-b");
    let mut a = Rig::new(&a_opts, 1024, 64);
    let mut b = Rig::new(&b_opts, 1024, 64);
    assert_eq!(a.store(&keys(0..50)).outcome, JobOutcome::Ok);
    assert_eq!(b.store(&keys(0..7)).outcome, JobOutcome::Ok);
    // Another layout of namespace a goes too.
    let mut a2 = a_opts.clone();
    a2.layout_fingerprint = "x".into();
    assert_eq!(Rig::new(&a2, 1024, 4).store(&keys(0..3)).outcome, JobOutcome::Ok);

    assert_eq!(invalidate_namespace(&a_opts, "inv-a").unwrap(), 53);
    assert_eq!(invalidate_namespace(&a_opts, "inv-a").unwrap(), 0, "idempotent");
    a.tier.forget_presence();
    assert_eq!(a.lookup(&key(0)), LookupResult::Miss);
    assert_eq!(a.load(&keys(0..2)).0.outcome, JobOutcome::Failed);
    let (r, rows) = b.load(&keys(0..7));
    assert_eq!(r.outcome, JobOutcome::Ok, "the other namespace is untouched");
    assert!(rows[6] == content(&key(6), 1024));
    assert!(matches!(
        invalidate_namespace(&a_opts, "bad*ns"),
        Err(RedisTierError::InvalidOptions(_))
    ));
}

#[test]
fn auth_failure_is_a_clear_error_at_start() {
    if !redis_installed() {
        return;
    }
    // `password_env` needs a variable this process already has (setting one would race the
    // other test threads): the server's password is the value of PATH.
    let Ok(password) = std::env::var("PATH") else {
        panic!("PATH is not set");
    };
    let server = RedisServer::with_password(&password);
    let mut opts = options(&server.url(), "auth");
    let err = RedisTier::connect(&opts, CHUNK).unwrap_err();
    assert!(matches!(err, RedisTierError::Auth { .. }), "{err}");
    assert!(err.to_string().contains("authenticate"), "{err}");

    // A wrong password (the value of another variable).
    opts.password_env = Some("CARGO_PKG_NAME".into());
    if std::env::var("CARGO_PKG_NAME").is_ok() {
        let err = RedisTier::connect(&opts, CHUNK).unwrap_err();
        assert!(matches!(err, RedisTierError::Auth { .. }), "{err}");
        assert!(
            !err.to_string().contains(&password),
            "the password must not be printed: {err}"
        );
    }

    opts.password_env = Some("KVTIER_TEST_REDIS_UNSET_PW".into());
    let err = RedisTier::connect(&opts, CHUNK).unwrap_err();
    assert!(matches!(err, RedisTierError::MissingPassword { .. }), "{err}");
    assert!(err.to_string().contains("KVTIER_TEST_REDIS_UNSET_PW"), "{err}");

    opts.password_env = Some("PATH".into());
    let mut rig = Rig::new(&opts, CHUNK, 2);
    assert_eq!(rig.store(&keys(0..2)).outcome, JobOutcome::Ok);
    assert_eq!(rig.load(&keys(0..2)).0.outcome, JobOutcome::Ok);
}

#[test]
fn an_unreachable_server_is_an_error_at_start() {
    if !redis_installed() {
        return;
    }
    let mut server = RedisServer::start();
    let url = server.url();
    server.kill();
    let err = RedisTier::connect(&options(&url, "down"), CHUNK).unwrap_err();
    assert!(matches!(err, RedisTierError::Server { .. }), "{err}");
    assert!(err.to_string().contains("127.0.0.1"), "{err}");
}

#[test]
fn a_killed_server_degrades_to_misses_without_stalling_and_recovers_on_restart() {
    if !redis_installed() {
        return;
    }
    let mut server = RedisServer::start();
    let mut node = Node::new(&options(&server.url(), "killed"), 4, CHUNK);
    node.store(&keys(0..8));
    assert_eq!(node.redis_stats().stores, 8);

    server.kill();
    // Evicted chunks are now misses: the lookup resolves (Retry, then Miss), nothing hangs.
    for k in keys(0..4) {
        assert_eq!(node.fetch(&k), None, "{k} cannot come from a dead server");
    }
    // Stores keep working in the primary; their cascades fail and are counted.
    node.store(&keys(100..104));
    let stats = node.redis_stats();
    assert!(stats.failures >= 4, "failed cascades are counted: {stats:?}");
    assert!(stats.extra["connection_failures"] >= 1.0);

    // Back on the same port (empty): new chunks are stored and promoted again.
    server.restart();
    let deadline = Instant::now() + PATIENCE;
    let mut n = 200;
    let stored_before = node.redis_stats().stores;
    loop {
        node.store(&[key(n)]);
        if node.redis_stats().stores > stored_before {
            break;
        }
        assert!(Instant::now() < deadline, "the tier never reconnected");
        std::thread::sleep(Duration::from_millis(50));
        n += 1;
    }
    // More chunks through the reconnected tier, then push them out of the CPU tier and bring
    // each back: every worker serves some of these, including any that held a connection from
    // before the restart (it must not fail work on it).
    let revived: Vec<_> = (n..n + 4).map(key).collect();
    node.store(&revived[1..]);
    node.store(&keys(1000..1004));
    for k in &revived {
        assert!(!node.in_primary(k));
        assert_eq!(
            node.fetch(k),
            Some(content(k, CHUNK)),
            "{k} was stored after the restart"
        );
    }
    node.shutdown();
}

#[test]
fn a_hung_server_fails_jobs_within_the_timeout_and_drain_returns() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let mut rig = Rig::new(&options(&server.url(), "hung"), CHUNK, 8);
    assert_eq!(rig.store(&keys(0..2)).outcome, JobOutcome::Ok);
    let pid = server.pid();
    // SIGSTOP: the server keeps its sockets open and answers nothing.
    assert!(
        std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let job_a = {
        let (r, _) = rig.load(&keys(0..2));
        r
    };
    assert_eq!(job_a.outcome, JobOutcome::Failed);
    // Lookups stay non-blocking and are misses: the timed-out load counts the server as
    // unreachable, so nothing is asked or answered from the cache until it answers again.
    let started = Instant::now();
    assert_eq!(
        rig.tier.lookup(&key(50), &tiering_core::ReqContext::local("t")),
        LookupResult::Miss
    );
    assert!(started.elapsed() < Duration::from_secs(1), "lookup blocked");
    assert_eq!(rig.lookup(&key(50)), LookupResult::Miss);
    rig.tier.drain_jobs();
    assert!(
        std::process::Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    // After it resumes, the tier serves again.
    let deadline = Instant::now() + PATIENCE;
    loop {
        if rig.store(&keys(10..12)).outcome == JobOutcome::Ok {
            break;
        }
        assert!(Instant::now() < deadline, "never recovered");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(rig.load(&keys(10..12)).0.outcome, JobOutcome::Ok);
}

#[test]
fn the_server_memory_and_evictions_are_reported() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"], None);
    let mut opts = options(&server.url(), "evict");
    opts.info_interval = tiering_core::options::HumanDuration(Duration::from_millis(20));
    let mut rig = Rig::new(&opts, CHUNK, 32);
    // 10 × 32 × 16 KiB = 5 MiB into a 2 MiB server.
    for _ in 0..10 {
        let _ = rig.store(&keys(0..32));
    }
    for round in 1..10u64 {
        let _ = rig.store(&keys(round * 100..round * 100 + 32));
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        rig.tier.on_schedule_end();
        let s = rig.tier.stats();
        if s.evictions > 0 && s.extra["server_used_memory_bytes"] > 0.0 {
            assert_eq!(s.extra["server_maxmemory_bytes"], (2 << 20) as f64);
            assert!(s.capacity_chunks > 0);
            break;
        }
        assert!(Instant::now() < deadline, "no evictions reported: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The evicted chunks of the first round are misses (or fail to load), never wrong bytes.
    rig.tier.forget_presence();
    let (r, rows) = rig.load(&keys(0..32));
    let ok: Vec<_> = match r.outcome {
        JobOutcome::Ok => keys(0..32),
        JobOutcome::Partial(ok) => ok,
        JobOutcome::Failed => Vec::new(),
    };
    assert!(ok.len() < 32, "some of the first chunks were evicted");
    for (i, k) in keys(0..32).iter().enumerate() {
        if ok.contains(k) {
            assert!(rows[i] == content(k, CHUNK));
        }
    }
}

#[test]
fn a_full_queue_refuses_jobs_at_once_and_every_job_is_reported() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let mut opts = options(&server.url(), "queue");
    opts.workers = 1;
    opts.max_queued_jobs = 1;
    let mut rig = Rig::new(&opts, CHUNK, 8);
    let pid = server.pid().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    // The one worker blocks on the stopped server; one job waits; the rest are refused.
    for i in 0..4u32 {
        rig.submit_store_at(&[key(u64::from(i))], i);
    }
    let results = rig.wait(4);
    assert!(
        std::process::Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert!(
        results.iter().all(|r| r.outcome == JobOutcome::Failed),
        "{results:?}"
    );
    let rejected = rig.stat("rejected_jobs");
    assert!((2.0..=3.0).contains(&rejected), "rejected {rejected}");
    assert_eq!(rig.tier.stats().failures, 4);
}
