//! End-to-end runs of the engine simulator over small workloads.

use std::time::Duration;

use kvtier::sim::{SimConfig, Workload, WorkloadKind, WorkloadSpec, cpu_chain, run_simulation};
use tier_cpu::PolicyKind;

fn quick_config() -> SimConfig {
    SimConfig {
        device_blocks: 256,
        step_base: Duration::from_micros(20),
        prefill_per_token: Duration::ZERO,
        decode_per_request: Duration::ZERO,
        progress: false,
        ..SimConfig::default()
    }
}

fn small_chat(requests: usize) -> Workload {
    let mut spec = WorkloadSpec::new(WorkloadKind::Chat, requests, 7);
    spec.sessions = 20;
    spec.max_context = 1024;
    Workload::generate(&spec)
}

#[test]
fn small_chat_run_holds_every_identity_and_completes_every_copy() {
    let report = run_simulation(
        &cpu_chain(8 << 20, PolicyKind::Lru),
        &quick_config(),
        &small_chat(120),
    )
    .unwrap();
    println!("{report}");
    assert!(report.identities_hold(), "{report}");
    assert_eq!(report.requests, 120);
    assert!(report.copy_jobs.submitted > 0);
    assert_eq!(report.copy_jobs.completed, report.copy_jobs.submitted);
    assert_eq!(report.copy_jobs.failed, 0);
    assert_eq!(report.copy_jobs.corrupt_chunks, 0);
    assert!(report.source_tokens("cpu") > 0, "{report}");
    assert!(report.tokens_not_recomputed.unwrap() > 0, "{report}");
}
