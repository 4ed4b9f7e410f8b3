//! One simulated request over a CPU tier and scripted secondary tiers.

use std::sync::Arc;
use std::time::Duration;

use kvtier::sim::{Chain, Report, RequestSpec, SimConfig, Workload, run_simulation};
use tier_cpu::{CpuTier, PolicyKind};
use tiering_core::{ManagerConfig, SecondaryTier};

/// Tokens per chunk of these runs.
pub const TPC: usize = 16;
/// Bytes per chunk of these runs.
pub const CHUNK: usize = 4096;

/// Runs the engine on one request (`prompt`, then `output`) over a 64-row CPU tier above
/// `tiers`, with 32 device blocks and a 50 µs step; `tune` adjusts the settings.
pub fn run_one_request(
    tiers: Vec<Box<dyn SecondaryTier>>,
    prompt: &[u32],
    output: &[u32],
    tune: impl FnOnce(&mut SimConfig),
) -> Report {
    let primary = CpuTier::new(64, CHUNK, PolicyKind::Lru).unwrap();
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
            prompt: Arc::from(prompt),
            output: Arc::from(output),
        }],
    };
    let mut cfg = SimConfig {
        tokens_per_chunk: TPC,
        chunk_bytes: CHUNK,
        device_blocks: 32,
        step_base: Duration::from_micros(50),
        progress: false,
        ..SimConfig::default()
    };
    tune(&mut cfg);
    run_simulation(&factory, &cfg, &workload).unwrap()
}
