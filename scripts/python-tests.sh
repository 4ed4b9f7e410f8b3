#!/usr/bin/env bash
# Builds the kvtier Python extension into a project-local virtual environment (.venv at the
# repository root, created with maturin, pytest and numpy from PyPI when missing) and runs the
# Python tests. Needs only python3 (>= 3.9) and cargo.
#   scripts/python-tests.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVTIER_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import maturin, pytest, numpy" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet maturin pytest numpy
fi
# `maturin develop` installs the extension into the venv: a debug build (with debug assertions),
# which reuses much of the workspace's test build; a release build of the whole dependency tree
# cost CI minutes. The Python benchmarks build their own release wheel (bench/bench_manager.py).
(cd "$root/crates/kvtier-py" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet)
cd "$root/crates/kvtier-py"
# pytest's temporary directories go under one of ours, removed on exit (its default,
# /tmp/pytest-of-$USER, outlives the run).
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# tests/vllm needs the pinned vLLM environment: scripts/vllm-tests.sh runs it.
"$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest" --ignore=tests/vllm tests "$@"
# What a user installs: the wheel, built and installed into a fresh virtual environment that
# holds nothing else (no index: the package has no dependencies), then driven once from outside
# the source tree.
(cd "$root/crates/kvtier-py" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" build --quiet --out "$scratch/wheels")
"$python" -m venv "$scratch/clean-venv"
"$scratch/clean-venv/bin/python" -m pip install --quiet --no-index "$scratch"/wheels/kvtier-*.whl
(cd "$scratch" && "$scratch/clean-venv/bin/python" -I "$root/crates/kvtier-py/tests/wheel_smoke.py")
