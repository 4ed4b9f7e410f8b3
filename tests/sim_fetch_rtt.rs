//! `bench fetch-rtt` end to end: two in-process nodes, a busy producer, both control-plane modes.

use std::time::Duration;

use kvtier::bench::{ControlPlaneMode, FetchRttConfig, fetch_rtt};

#[test]
fn both_modes_pull_every_chunk_and_report_their_round_trips() {
    let cfg = FetchRttConfig {
        producer_step: Duration::from_millis(10),
        fetches: 4,
        chunks_per_fetch: 2,
        chunk_bytes: 16 * 1024,
        raw_round_trips: 50,
        ..FetchRttConfig::default()
    };
    let report = fetch_rtt(&cfg).unwrap();
    println!("{report}");
    let modes: Vec<ControlPlaneMode> = report.modes.iter().map(|m| m.mode).collect();
    assert_eq!(modes, [ControlPlaneMode::Thread, ControlPlaneMode::Step]);
    for m in &report.modes {
        assert_eq!(m.fetch_ms.count, 4, "{m:?}");
        assert_eq!(m.lookup_ms.count, 4, "{m:?}");
        assert!(m.producer_step_ms.count > 0, "{m:?}");
    }
    assert_eq!(report.raw_control_rtt_us.count, 50);
    assert!(report.raw_control_rtt_us.p50 > 0.0);
}

#[test]
fn zero_fetches_is_a_setting_error() {
    let cfg = FetchRttConfig {
        fetches: 0,
        ..FetchRttConfig::default()
    };
    let err = fetch_rtt(&cfg).unwrap_err().to_string();
    assert!(err.contains("fetches"), "{err}");
}
