//! `kvtier run` and `kvtier bench` as commands: arguments, JSON output, and bad input turned
//! into errors that name what is wrong.

use std::io::Write;

use clap::Parser;
use kvtier::bench::BenchCommand;
use kvtier::sim::RunArgs;

// The disk tier registers itself; naming the crate keeps its registration linked.
use tier_disk as _;

#[derive(Parser)]
struct Run {
    #[command(flatten)]
    args: RunArgs,
}

#[derive(Parser)]
struct Bench {
    #[command(subcommand)]
    cmd: BenchCommand,
}

const CPU_ONLY: &str = "[primary]\ntype = \"cpu\"\ncapacity = \"16MiB\"\n";

fn run(args: &[&str]) -> anyhow::Result<()> {
    let mut argv = vec!["run"];
    argv.extend_from_slice(args);
    let parsed = Run::try_parse_from(argv)?;
    kvtier::sim::run_command(&parsed.args, "inline-default.toml", CPU_ONLY)
}

const QUICK: [&str; 8] = [
    "--requests",
    "40",
    "--device-blocks",
    "256",
    "--step-us",
    "10",
    "--prefill-ns-per-token",
    "0",
];

#[test]
fn run_writes_a_json_report_with_the_identities() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let mut args = QUICK.to_vec();
    let path = json.to_string_lossy().into_owned();
    args.extend(["--workload", "shared-prefix", "--json", &path]);
    run(&args).unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["requests"], 40);
    assert_eq!(v["chain"][0], "cpu");
    let ids = v["identities"].as_array().unwrap();
    assert!(!ids.is_empty());
    assert!(ids.iter().all(|i| i["holds"] == true), "{ids:?}");
    assert!(v["baseline"]["computed_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn a_trace_replays_and_an_invalid_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.jsonl");
    let mut f = std::fs::File::create(&good).unwrap();
    for i in 0..6 {
        writeln!(
            f,
            "{{\"arrival\": {}, \"session\": \"s\", \"tokens\": 40, \"output\": 4}}",
            f64::from(i) * 0.01
        )
        .unwrap();
    }
    drop(f);
    let good_path = good.to_string_lossy().into_owned();
    let mut args = QUICK.to_vec();
    args.extend(["--trace", &good_path]);
    run(&args).unwrap();

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"arrival\": 0.0, \"tokens\": 40}\n{\"arrival\": 0.1, \"tokens\": \"many\"}\n",
    )
    .unwrap();
    let bad_path = bad.to_string_lossy().into_owned();
    let mut args = QUICK.to_vec();
    args.extend(["--trace", &bad_path]);
    let err = format!("{:#}", run(&args).unwrap_err());
    assert!(err.contains(&format!("{bad_path}:2:")), "{err}");
}

#[test]
fn unreadable_config_and_bad_settings_are_errors() {
    let err = format!("{:#}", run(&["--config", "/nonexistent/chain.toml"]).unwrap_err());
    assert!(err.contains("/nonexistent/chain.toml"), "{err}");
    let err = format!("{:#}", run(&["--device-blocks", "0"]).unwrap_err());
    assert!(err.contains("device_blocks"), "{err}");
    // A request longer than the whole device pool can never run.
    let err = format!(
        "{:#}",
        run(&["--requests", "5", "--device-blocks", "4"]).unwrap_err()
    );
    assert!(err.contains("device blocks"), "{err}");
    assert!(Run::try_parse_from(["run", "--workload", "bogus"]).is_err());
}

#[test]
fn bench_fetch_rtt_parses_a_single_mode_and_rejects_unknown_ones() {
    let b =
        Bench::try_parse_from(["bench", "fetch-rtt", "--control-plane", "step", "--fetches", "2"]).unwrap();
    assert!(matches!(b.cmd, BenchCommand::FetchRtt { fetches: 2, .. }));
    assert!(Bench::try_parse_from(["bench", "fetch-rtt", "--control-plane", "sometimes"]).is_err());
    let b = Bench::try_parse_from(["bench", "fetch-rtt", "--step-ms=-1"]).unwrap();
    let err = kvtier::bench::run_command(&b.cmd, "x", CPU_ONLY)
        .unwrap_err()
        .to_string();
    assert!(err.contains("step-ms"), "{err}");
}

#[test]
fn out_of_range_arguments_are_refused_before_anything_runs() {
    let err = Run::try_parse_from(["run", "--requests", "100000000"])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("more than the limit of 1000000"), "{err}");
    assert!(Run::try_parse_from(["run", "--requests", "1000000"]).is_ok());
    for args in [
        ["bench", "tiers", "--mib", "0"],
        ["bench", "tiers", "--chunk-bytes", "0"],
        ["bench", "tiers", "--batch-chunks", "0"],
    ] {
        assert!(Bench::try_parse_from(args).is_err(), "{args:?}");
    }
}

#[test]
fn an_unwritable_json_path_fails_before_the_run_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir/report.json");
    let err = run(&["--requests", "5", "--json", missing.to_str().unwrap()]).unwrap_err();
    assert!(format!("{err:#}").contains("cannot write there"), "{err:#}");
    // A run that fails after the check removes the empty file the check created.
    let json = dir.path().join("report.json");
    let err = run(&[
        "--requests",
        "5",
        "--device-blocks",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(err.is_err());
    assert!(!json.exists());
}
