//! `bench fetch-rtt` end to end: two in-process nodes, a busy producer, every control-plane mode.

use std::time::Duration;

use kvtier::bench::{ControlPlaneMode, FetchRttConfig, Flow, fetch_rtt};

fn small() -> FetchRttConfig {
    FetchRttConfig {
        producer_step: Duration::from_millis(5),
        fetches: 4,
        chunks_per_fetch: 2,
        chunk_bytes: 16 * 1024,
        raw_round_trips: 50,
        transfer_samples: 10,
        ..FetchRttConfig::default()
    }
}

#[test]
fn handoff_every_mode_lands_every_fetch_and_only_offstep_needs_no_producer_step() {
    let cfg = FetchRttConfig {
        // Makes "no producer step began during the fetch" an ordering fact: the producer's
        // model step outlasts an off-step fetch for sure, instead of 5 ms that a loaded machine
        // could overrun. A fetch that needed a producer step would then wait the fetch timeout.
        hold_offstep_step_until_landed: true,
        ..small()
    };
    // Every fetch must land with the bytes the producer stored, or this is an error.
    let report = fetch_rtt(&cfg).unwrap();
    println!("{report}");
    let modes: Vec<ControlPlaneMode> = report.modes.iter().map(|m| m.mode).collect();
    assert_eq!(modes, ControlPlaneMode::ALL);
    for m in &report.modes {
        assert_eq!(m.fetch_ms.count, 4, "{m:?}");
        assert_eq!(m.producer_steps_during_fetch.len(), 4, "{m:?}");
        assert!(m.producer_step_ms.count > 0, "{m:?}");
        assert!(m.lookup_ms.is_none(), "no probing in the hand-off");
        match m.mode {
            // The store completes only at the producer's next `complete_store`: every fetch
            // saw at least one producer step begin.
            ControlPlaneMode::Step | ControlPlaneMode::Thread => {
                assert!(m.producer_steps_during_fetch.iter().all(|&n| n >= 1), "{m:?}");
                assert_eq!(m.off_step_store_completions, 0, "{m:?}");
            }
            // The copy worker's report completed the store on the control thread.
            ControlPlaneMode::ThreadOffStep => {
                assert_eq!(m.producer_steps_during_fetch, [0, 0, 0, 0], "{m:?}");
                assert_eq!(
                    m.off_step_store_completions, 5,
                    "the warm-up's store and the four measured ones"
                );
            }
        }
    }
    assert_eq!(report.raw_control_rtt_us.count, 50);
    assert_eq!(report.transfer_ms.count, 10);
    assert!(report.target.is_some(), "step and thread+offstep both ran");
}

#[test]
fn pull_flow_runs_the_chosen_modes_in_order() {
    let cfg = FetchRttConfig {
        flow: Flow::Pull,
        modes: vec![ControlPlaneMode::Thread, ControlPlaneMode::Step],
        ..small()
    };
    let report = fetch_rtt(&cfg).unwrap();
    println!("{report}");
    let modes: Vec<ControlPlaneMode> = report.modes.iter().map(|m| m.mode).collect();
    assert_eq!(modes, [ControlPlaneMode::Thread, ControlPlaneMode::Step]);
    for m in &report.modes {
        assert_eq!(m.fetch_ms.count, 4, "{m:?}");
        assert_eq!(m.lookup_ms.map(|l| l.count), Some(4), "{m:?}");
        assert_eq!(m.fetches_waited, 0, "the producer held every chunk already");
    }
    assert!(report.target.is_none(), "thread+offstep did not run");
}

#[test]
fn zero_fetches_or_no_mode_is_a_setting_error() {
    let cfg = FetchRttConfig {
        fetches: 0,
        ..FetchRttConfig::default()
    };
    let err = fetch_rtt(&cfg).unwrap_err().to_string();
    assert!(err.contains("fetches"), "{err}");
    let cfg = FetchRttConfig {
        modes: Vec::new(),
        ..FetchRttConfig::default()
    };
    let err = fetch_rtt(&cfg).unwrap_err().to_string();
    assert!(err.contains("modes"), "{err}");
}

#[test]
fn modes_and_flows_parse_from_their_names() {
    for m in ControlPlaneMode::ALL {
        assert_eq!(m.to_string().parse::<ControlPlaneMode>(), Ok(m));
    }
    assert_eq!("thread+offstep".parse(), Ok(ControlPlaneMode::ThreadOffStep));
    assert!("offstep".parse::<ControlPlaneMode>().is_err());
    assert_eq!("handoff".parse(), Ok(Flow::Handoff));
    assert_eq!("pull".parse(), Ok(Flow::Pull));
    assert!("push".parse::<Flow>().is_err());
}
