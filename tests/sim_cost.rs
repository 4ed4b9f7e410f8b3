//! The simulated engine over a stalled secondary tier with a recompute cost: the request stops
//! waiting for the promotion at its deadline and recomputes; the promotion still lands once the
//! tier recovers, and the run ends with nothing pinned or leaked.

use std::time::Duration;

mod common;

use common::sim::{CHUNK, TPC, run_one_request};
use kvtier::sim::{SimConfig, chunk_keys, fill_chunk};
use tiering_core::SecondaryTier;
use tiering_core::testing::{Completion, ScriptedTier};

#[test]
fn a_stalled_promotion_is_abandoned_and_the_request_recomputes() {
    let prompt: Vec<u32> = (0..(6 * TPC + 3) as u32).map(|t| t * 5 + 1).collect();
    let output: Vec<u32> = vec![9, 8, 7];
    let mut all = prompt.clone();
    all.extend_from_slice(&output);
    let keys = chunk_keys(&all, TPC, 0);

    let (tier, handle) = ScriptedTier::new("stalled");
    for k in &keys[..4] {
        let mut bytes = vec![0u8; CHUNK];
        fill_chunk(k, &mut bytes);
        handle.insert(*k, bytes);
    }
    handle.set_completion(Completion::Manual);
    let releaser = {
        let handle = handle.clone();
        std::thread::spawn(move || {
            // The promotion stays stuck until the engine has given up on it and recomputed:
            // a cascade of a freshly computed chunk is the proof.
            let gave_up = handle.wait_until(Duration::from_secs(30), |v| v.count("submit_store") > 0);
            handle.set_completion(Completion::Immediate);
            handle.complete_all();
            gave_up
        })
    };

    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(tier)];
    let report = run_one_request(tiers, &prompt, &output, |c| {
        c.recompute_cost = true;
        // The engine itself stops waiting once waiting costs more than the recompute it can
        // expect to save (6 chunks × 16 tokens here, × the even odds it credits a first
        // wait); at 40 µs per token that is ≈ 1.9 ms, later than the manager's deadline (1 ms
        // floor for the first chunk), so the manager's abandonment is what this test sees.
        c.prefill_per_token = Duration::from_micros(40);
    });
    assert!(releaser.join().unwrap(), "the engine never recomputed: {report}");
    println!("{report}");

    let d = &report.decisions[0];
    assert_eq!(d.name, "stalled");
    assert_eq!(d.started, 4, "{report}");
    assert!(d.abandoned_by_deadline >= 1, "{report}");
    assert_eq!(d.promoted, 4, "the promotion landed after the stall: {report}");
    assert_eq!(
        report.source_tokens("stalled"),
        0,
        "nothing was loaded from the stalled tier"
    );
    assert_eq!(report.source_tokens("computed"), prompt.len() as u64, "{report}");
    assert_eq!(report.copy_jobs.corrupt_chunks, 0);
    let scripted = |name: &str| name.contains("stalled");
    for id in report.identities.iter().filter(|i| !scripted(&i.name)) {
        assert!(id.holds, "{id:?}");
    }
    assert!(report.to_string().contains("promotions versus recompute"));
}

#[test]
fn model_profiles_derive_the_prefill_cost_and_turn_the_cost_model_on() {
    let p = kvtier::sim::profile::ModelProfile::named("llama-3.1-70b").unwrap();
    let cfg = SimConfig::default().with_model(p);
    assert!(cfg.recompute_cost);
    let per_kib = p.secs_per_kv_byte() * 1024.0;
    let sim = cfg.prefill_per_token.as_secs_f64();
    let kib_per_token = cfg.chunk_bytes as f64 / cfg.tokens_per_chunk as f64 / 1024.0;
    assert!((sim - per_kib * kib_per_token).abs() < 1e-9, "{sim}");
    let r = cfg.manager_recompute_cost().unwrap();
    assert_eq!(r.tokens_per_chunk() as usize, cfg.tokens_per_chunk);
    assert_eq!(r.per_token(), cfg.prefill_per_token);
}

mod cli {
    use clap::Parser;
    use kvtier::sim::RunArgs;

    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        args: RunArgs,
    }

    const CPU_ONLY: &str = "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n";

    fn run(args: &[&str]) -> anyhow::Result<()> {
        let mut argv = vec!["run"];
        argv.extend_from_slice(args);
        let parsed = Run::try_parse_from(argv)?;
        kvtier::sim::run_command(&parsed.args, "inline-default.toml", CPU_ONLY)
    }

    #[test]
    fn model_writes_the_profile_and_the_recompute_cost_into_the_report() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("report.json");
        let path = json.to_string_lossy().into_owned();
        run(&[
            "--requests",
            "30",
            "--device-blocks",
            "256",
            "--step-us",
            "10",
            "--model",
            "llama-3.1-70b",
            "--json",
            &path,
        ])
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(v["config"]["model"]["name"], "llama-3.1-70b");
        assert_eq!(v["config"]["recompute_cost"], true);
        // 892 ns per simulated token of 1 KiB (see the profile's derivation).
        let per_token_us = v["config"]["prefill_per_token"].as_f64().unwrap();
        assert!((per_token_us - 0.892).abs() < 0.001, "{per_token_us}");
    }

    #[test]
    fn an_unknown_model_or_a_model_with_an_explicit_prefill_cost_is_refused() {
        let e = run(&["--model", "gpt-9"]).unwrap_err().to_string();
        assert!(e.contains("gpt-9") && e.contains("llama-3.1-8b"), "{e}");
        let e = run(&["--model", "llama-3.1-8b", "--prefill-ns-per-token", "5"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--prefill-ns-per-token"), "{e}");
    }
}
