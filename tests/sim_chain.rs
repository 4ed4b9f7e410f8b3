//! The simulator over chains built from chain files: a CPU tier that overflows into a disk tier,
//! and the tier benchmark over the same kind of chain.

use std::time::Duration;

use kvtier::bench::{TierBenchConfig, bench_tiers};
use kvtier::sim::{
    BuiltTiers, SimConfig, Workload, WorkloadKind, WorkloadSpec, config_chain, run_simulation,
};
use tier_cpu::{CpuTier, CpuTierOptions};
use tiering_config::ChainConfig;
use tiering_core::options::parse_options;
use tiering_core::{
    PrimaryTier, TierError,
    registry::{PrimaryContext, Registry, TierRegistration},
};

// The disk tier registers itself; naming the crate keeps its registration linked.
use tier_disk as _;

fn cpu_factory(options: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
    let opts: CpuTierOptions = parse_options(options)?;
    Ok(Box::new(CpuTier::from_options(&opts, ctx.chunk_bytes)?))
}

static CPU: TierRegistration = TierRegistration::primary("cpu", "kvtier-tests", cpu_factory);

/// The global registry, with a `cpu` primary type whether or not tier-cpu registers one.
fn registry() -> &'static Registry {
    let global = Registry::global().unwrap();
    let regs = global.iter().filter(|r| r.name != "cpu").chain([&CPU]);
    Box::leak(Box::new(Registry::from_registrations(regs).unwrap()))
}

fn chain_file(dir: &std::path::Path, cpu: &str, disk: &str) -> ChainConfig {
    chain_file_with(dir, cpu, disk, false)
}

fn chain_file_with(dir: &std::path::Path, cpu: &str, disk: &str, off_step: bool) -> ChainConfig {
    let text = format!(
        "[primary]\ntype = \"cpu\"\ncapacity = \"{cpu}\"\n\n\
         [[secondary]]\ntype = \"disk\"\nname = \"disk\"\npath = \"{}\"\ncapacity = \"{disk}\"\n\n\
         [control_plane]\nthread = true\noff_step = {off_step}\n",
        dir.display()
    );
    ChainConfig::parse("test-chain.toml", &text).unwrap()
}

fn quick_config() -> SimConfig {
    SimConfig {
        device_blocks: 256,
        step_base: Duration::from_micros(20),
        prefill_per_token: Duration::from_nanos(100),
        decode_per_request: Duration::ZERO,
        progress: false,
        ..SimConfig::default()
    }
}

#[test]
fn a_cpu_tier_that_overflows_serves_prefixes_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    // 64 chunks of 16 KiB in the CPU tier: far below the workload's working set.
    let config = chain_file(dir.path(), "1MiB", "64MiB");
    let mut spec = WorkloadSpec::new(WorkloadKind::Chat, 150, 3);
    spec.sessions = 30;
    spec.max_context = 1024;
    let report = run_simulation(
        &config_chain(config, registry()),
        &quick_config(),
        &Workload::generate(&spec),
    )
    .unwrap();
    println!("{report}");
    assert!(report.identities_hold(), "{report}");
    assert_eq!(report.chain, ["cpu", "disk"]);
    assert!(report.source_tokens("disk") > 0, "no disk hits:\n{report}");
    assert!(report.manager.promoted_keys > 0);
    assert!(report.manager.cascade_jobs > 0);
    assert_eq!(report.copy_jobs.completed, report.copy_jobs.submitted);
}

#[test]
fn off_step_completions_keep_every_identity() {
    // The copy worker reports finished stores straight to the manager and the engine reports
    // them again at its next step: each store must still complete (and cascade) exactly once.
    let dir = tempfile::tempdir().unwrap();
    let config = chain_file_with(dir.path(), "1MiB", "64MiB", true);
    let mut spec = WorkloadSpec::new(WorkloadKind::Chat, 150, 3);
    spec.sessions = 30;
    spec.max_context = 1024;
    let report = run_simulation(
        &config_chain(config, registry()),
        &quick_config(),
        &Workload::generate(&spec),
    )
    .unwrap();
    assert!(report.identities_hold(), "{report}");
    assert!(report.source_tokens("disk") > 0, "no disk hits:\n{report}");
    assert_eq!(report.copy_jobs.completed, report.copy_jobs.submitted);
    assert!(report.manager.cascade_jobs > 0);
    let m = &report.manager;
    assert!(
        m.off_step_store_completions > 0,
        "the worker's reports were used: {m:?}"
    );
    assert!(
        m.duplicate_store_reports > 0,
        "the second report of each store was absorbed: {m:?}"
    );
}

#[test]
fn a_zero_capacity_tier_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = chain_file(dir.path(), "0B", "64MiB");
    let spec = WorkloadSpec::new(WorkloadKind::Chat, 5, 3);
    let err = run_simulation(
        &config_chain(config, registry()),
        &quick_config(),
        &Workload::generate(&spec),
    )
    .expect_err("a zero-capacity primary must be refused");
    let text = err.to_string();
    assert!(text.contains("test-chain.toml"), "{text}");
    assert!(text.contains("capacity"), "{text}");
}

#[test]
fn bench_tiers_measures_cpu_and_disk_next_to_their_references() {
    let dir = tempfile::tempdir().unwrap();
    let config = chain_file(dir.path(), "8MiB", "64MiB");
    let cfg = TierBenchConfig {
        chunk_bytes: 64 * 1024,
        batch_chunks: 8,
        total_bytes: 2 << 20,
        scratch_dir: dir.path().to_owned(),
        ..TierBenchConfig::default()
    };
    let tiers = BuiltTiers::from_config(&config, registry(), cfg.chunk_bytes).unwrap();
    let report = bench_tiers(tiers, &cfg).unwrap();
    println!("{report}");
    let ops: Vec<(&str, &str)> = report.rows.iter().map(|r| (r.tier.as_str(), r.op)).collect();
    assert_eq!(
        ops,
        [
            ("cpu", "store"),
            ("cpu", "load"),
            ("disk", "store"),
            ("disk", "load")
        ]
    );
    for r in &report.rows {
        assert_eq!(r.bytes, 2 << 20, "{r:?}");
        assert!(r.gib_per_s > 0.0 && r.reference_gib_per_s > 0.0, "{r:?}");
    }
    // The scratch file of the reference is removed.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("kvtier-bench-raw"))
        .collect();
    assert!(leftovers.is_empty());
}
