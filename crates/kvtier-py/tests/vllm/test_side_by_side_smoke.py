"""bench/vllm_side_by_side.py runs: tiny sizes, one run, all three specs, both workloads. Checks
that it prints its table and its verdict lines and leaves no files behind, not what the
verdicts say."""

import os
import shutil
import subprocess
import sys
import tempfile

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "vllm_side_by_side.py")


def test_side_by_side_bench_prints_table_and_verdicts():
    # A short directory (not pytest's tmp_path): kvtier binds a Unix socket under it.
    scratch = tempfile.mkdtemp(prefix="sbs-")
    try:
        run_and_check(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_and_check(scratch):
    env = dict(os.environ, TMPDIR=scratch)
    out = subprocess.run(
        # --debug-build: the smoke test checks the output, not the figures (no release build).
        [sys.executable, BENCH, "--debug-build", "--runs", "1", "--seeds", "1", "--requests", "16", "--gpu-blocks", "24",
         "--cpu-chunks", "12", "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--max-steps", "800"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    for title in ("kvtier cpu+disk", "vLLM CPUOffloading", "vLLM Tiering cpu+fs"):
        assert title in text, text
    for workload in ("waves", "chat"):
        assert f"== workload {workload}:" in text, text
    for row in ("connector µs/step", "get_num_new_matched_tokens", "connector tokens", "from disk/fs",
                "waited steps (sum)", "RETRY answers", "GPU<-CPU load KiB", "CPU<-disk promote KiB",
                "wrong tokens", "stuck at bound"):
        assert row in text, text
    verdicts = [line for line in text.splitlines() if line.startswith("VERDICT ")]
    # Per workload: 1/3 of the CPU spec, 1/3 of the tiering spec, waiting steps vs tiering.
    assert len(verdicts) == 6, verdicts
    assert all(("MET" in v) for v in verdicts), verdicts
    assert "What the ratios depend on" in text
    # The bench works in a directory of its own under TMPDIR and removes it.
    assert os.listdir(scratch) == [], os.listdir(scratch)
