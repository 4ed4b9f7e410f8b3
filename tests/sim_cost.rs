//! The simulated engine over a stalled secondary tier with a recompute cost: the request stops
//! waiting for the promotion at its deadline and recomputes; the promotion still lands once the
//! tier recovers, and the run ends with nothing pinned or leaked.

use std::sync::Arc;
use std::time::Duration;

use kvtier::sim::{Chain, RequestSpec, SimConfig, Workload, chunk_keys, fill_chunk, run_simulation};
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::testing::{Completion, ScriptedTier};
use tiering_core::{ManagerConfig, SecondaryTier};

const TPC: usize = 16;
const CHUNK: usize = 4096;

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

    let primary = CpuTier::new(64, CHUNK, PolicyKind::Lru).unwrap();
    let tiers: Vec<Box<dyn SecondaryTier>> = vec![Box::new(tier)];
    let chain = std::sync::Mutex::new(Some(Chain::new(
        Box::new(primary),
        tiers,
        ManagerConfig::default(),
    )));
    let factory = move |_: usize| {
        chain
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| "the chain was already used".into())
    };
    let workload = Workload {
        label: "one request".into(),
        requests: vec![RequestSpec {
            name: "r0".into(),
            arrival: 0.0,
            prompt: Arc::from(prompt.as_slice()),
            output: Arc::from(output.as_slice()),
        }],
    };
    let cfg = SimConfig {
        tokens_per_chunk: TPC,
        chunk_bytes: CHUNK,
        device_blocks: 32,
        step_base: Duration::from_micros(50),
        progress: false,
        recompute_cost: true,
        ..SimConfig::default()
    };
    let report = run_simulation(&factory, &cfg, &workload).unwrap();
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
