"""The benchmark script still runs against the binding: a short run, kvtier and the loop only
(without VLLM_CPU_SRC), so a change to the binding's API that breaks the bench shows here rather
than on the next measurement. The figures themselves are not checked (no timing in tests)."""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "bench_manager.py")


def test_bench_runs_every_operation_for_both_policies():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_SRC"}
    out = subprocess.run(
        [sys.executable, BENCH, "--chunks", "1024", "--seconds", "0.05"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for policy in ("lru", "arc"):
        assert f"policy {policy}, 1024 chunks" in out.stdout
    # Each operation printed a rate for kvtier, for both policies; the store loop asserts inside
    # the script that every store evicted 16 keys.
    for op in ("lookup_hit", "load16", "store16_evict"):
        lines = [line for line in out.stdout.splitlines() if line.strip().startswith(op)]
        assert len(lines) == 2, out.stdout
        assert all("/s" in line for line in lines)
    assert out.stdout.count("loop alone:") == 2
