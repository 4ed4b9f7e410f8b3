//! `bench fetch-rtt` end to end: two in-process nodes, a busy producer, every control-plane mode.

use std::time::Duration;

use kvtier::bench::fetch_rtt::{SWEEP_STEPS_MS, sweep};
use kvtier::bench::{ControlPlaneMode, FetchRttConfig, Flow, fetch_rtt};

fn small() -> FetchRttConfig {
    FetchRttConfig {
        producer_step: Duration::from_millis(5),
        sched_time: Duration::from_millis(1),
        arrival_mean: Duration::from_millis(3),
        fetches: 4,
        chunks_per_fetch: 2,
        chunk_bytes: 16 * 1024,
        raw_round_trips: 50,
        transfer_samples: 10,
        ..FetchRttConfig::default()
    }
}

/// The hand-off in every mode, with the copy workers as a thread or as two worker processes.
/// Every fetch must land with the bytes the producer's copy workers wrote, or this is an error.
fn handoff_every_mode(workers_process: bool) {
    let cfg = FetchRttConfig {
        // Makes "no producer step began during the fetch" an ordering fact: the producer's
        // model step lasts until the fetches of its started stores landed, instead of 5 ms that
        // a loaded machine could overrun. A fetch that needed a producer step would then wait
        // the fetch timeout.
        hold_offstep_step_until_landed: true,
        explain_slowest: 2,
        workers_process,
        worker_exe: Some(env!("CARGO_BIN_EXE_kvtier").into()),
        ..small()
    };
    let report = fetch_rtt(&cfg).unwrap();
    println!("{report}");
    let modes: Vec<ControlPlaneMode> = report.modes.iter().map(|m| m.mode).collect();
    assert_eq!(modes, ControlPlaneMode::ALL);
    for m in &report.modes {
        assert_eq!(m.fetch_ms.count, 4, "{m:?}");
        assert_eq!(m.producer_steps_during_fetch.len(), 4, "{m:?}");
        assert!(m.producer_step_ms.count > 0, "{m:?}");
        assert!(m.lookup_ms.is_none(), "no probing in the hand-off");
        // The two slowest fetches, split: slowest first, each a measured one whose store was
        // copied (the copy workers' ends are known).
        assert_eq!(m.slowest.len(), 2, "{m:?}");
        assert!(m.slowest[0].rtt_ms >= m.slowest[1].rtt_ms, "{m:?}");
        assert!((m.fetch_ms.max - m.slowest[0].rtt_ms).abs() < 1e-3, "{m:?}");
        for t in &m.slowest {
            assert!((1..=4).contains(&t.request), "{t:?}");
            assert!(t.copy_done_ms.is_some(), "{t:?}");
            // The fetch trace saw it bound on the producer and landed on the consumer, and the
            // segments cut from it add up to the round trip.
            assert!(t.bound_ms.is_some() && t.landed_ms.is_some(), "{t:?}");
            // The consumer handed the fetch to its socket before the producer bound it.
            assert!(
                t.socket_ms.is_some_and(|s| s <= t.bound_ms.unwrap_or(f64::MAX)),
                "{t:?}"
            );
            let sum: f64 = t.segments_ms.iter().sum();
            assert!(t.segments_ms.iter().all(|&s| s >= 0.0), "{t:?}");
            assert!((sum - t.rtt_ms).abs() < 1e-6, "{t:?}");
        }
        let tail = m.tail.as_ref().expect("every hand-off mode summarises its tail");
        assert_eq!((tail.tail, tail.of), (1, 4), "{tail:?}");
        // The stall probe woke through the mode's run, and the verdict's counts are per fetch.
        let machine = m
            .machine
            .as_ref()
            .expect("every hand-off mode runs the stall probe");
        assert!(machine.late_ms.count > 0, "{machine:?}");
        assert_eq!(m.rtt_in_stall.len(), 4, "{m:?}");
        assert!(tail.tail_in_machine_stall <= tail.tail);
        match m.mode {
            // The store completes only at a later producer step's `complete_store`: every
            // fetch landed after at least one producer step began past the one that started it.
            ControlPlaneMode::Step | ControlPlaneMode::Thread => {
                assert!(m.producer_steps_during_fetch.iter().all(|&n| n >= 1), "{m:?}");
                assert_eq!(m.off_step_store_completions, 0, "{m:?}");
            }
            // The copy workers' reports completed the store on the control thread (with worker
            // processes: both ranks over the completion channel), before any later step.
            ControlPlaneMode::ThreadOffStep => {
                assert_eq!(m.producer_steps_during_fetch, [0, 0, 0, 0], "{m:?}");
                assert_eq!(
                    m.off_step_store_completions,
                    5 * 2,
                    "the warm-up's store and the four measured ones, two chunks each"
                );
            }
        }
    }
    assert_eq!(report.raw_control_rtt_us.count, 50);
    assert_eq!(report.transfer_ms.count, 10);
    assert!(report.memcpy_gib_s > 0.0 && report.copy_ms > 0.0);
    let target = report.target.expect("thread+offstep ran");
    assert!(target.step_over_offstep_p50.is_some(), "step ran too");
}

#[test]
fn handoff_every_mode_lands_every_fetch_and_only_offstep_needs_no_producer_step() {
    handoff_every_mode(false);
}

#[test]
fn handoff_with_worker_processes_lands_every_fetch_and_offstep_needs_no_producer_step() {
    handoff_every_mode(true);
}

#[test]
fn a_sweep_runs_offstep_in_the_six_settings_of_its_targets_and_counts_the_runs() {
    let cfg = FetchRttConfig {
        worker_exe: Some(env!("CARGO_BIN_EXE_kvtier").into()),
        ..small()
    };
    let mut seen = Vec::new();
    let report = sweep(&cfg, 1, |run| seen.push((run.step_ms, run.workers_process))).unwrap();
    println!("{report}");
    let settings: Vec<(u64, bool)> = SWEEP_STEPS_MS
        .iter()
        .flat_map(|&s| [(s, false), (s, true)])
        .collect();
    assert_eq!(seen, settings, "each run reported as it ended, in order");
    assert_eq!(report.runs.len(), 6);
    for run in &report.runs {
        assert_eq!(run.fetches, 4, "{run:?}");
        assert!(run.over_p99_limit <= run.fetches && run.over_p99_limit_in_stall <= run.over_p99_limit);
        assert!(run.p99_limit_ms > run.p50_limit_ms, "{run:?}");
    }
    assert_eq!(
        report.p50_met(),
        report.runs.iter().filter(|r| r.p50_met()).count()
    );
    assert!(report.to_string().contains("p99 target in"), "{report}");
}

#[test]
fn worker_processes_copy_only_the_handoff_flow() {
    let cfg = FetchRttConfig {
        flow: Flow::Pull,
        workers_process: true,
        ..small()
    };
    let err = fetch_rtt(&cfg).unwrap_err().to_string();
    assert!(err.contains("workers_process"), "{err}");
}

#[test]
fn a_missing_worker_binary_is_a_clear_error() {
    let cfg = FetchRttConfig {
        workers_process: true,
        worker_exe: Some("/nonexistent/kvtier".into()),
        modes: vec![ControlPlaneMode::ThreadOffStep],
        ..small()
    };
    let err = fetch_rtt(&cfg).unwrap_err().to_string();
    assert!(err.contains("cannot start /nonexistent/kvtier"), "{err}");
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
