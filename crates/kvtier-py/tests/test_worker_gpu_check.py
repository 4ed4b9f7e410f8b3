"""scripts/gpu-check.sh cannot run without a GPU; here it must at least parse, and its Python
part must refuse a machine without CUDA with a clear message (exit status 2)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_the_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(ROOT / "scripts" / "gpu-check.sh")], check=True)


def test_the_benchmark_refuses_a_machine_without_cuda_clearly():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here: gpu-check.sh runs the benchmark")
    except ImportError:
        pass
    p = subprocess.run(
        [sys.executable, str(HERE / "gpu" / "bench_copy.py")], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("gpu-check: ")
    assert "torch is not importable" in p.stderr or "no CUDA device" in p.stderr
    assert p.stdout == ""
