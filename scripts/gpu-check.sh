#!/usr/bin/env bash
# The GPU check of kvtier's vLLM workers (docs/GPU.md), for a machine with one NVIDIA GPU and the
# pinned vLLM environment (scripts/vllm-env.sh; built beforehand: this script uses no network).
#   (a) the `cuda`-marked worker tests on real CUDA tensors: bit-exact round trips for several
#       KV layouts (several groups, partial chunks, two ranks on one device), both copy paths;
#   (b) the copy benchmark, one run: kvtier's worker vs vLLM 0.33's CPU-offloading worker vs a
#       raw torch copy, 16/64/256 blocks per job, GB/s per direction and the step-time impact
#       on a matmul loop standing in for the forward; one VERDICT line per target:
#         store and load throughput of kvtier >= 0.9 x vLLM's handler at every job size,
#         the forward loop slowed by <= 5 % while kvtier's copies run beside it.
# kvtier is built (release) into a temporary directory put first on PYTHONPATH, so the cached
# vLLM environment is left as it was; every temporary file goes on exit.
#   scripts/gpu-check.sh [bench_copy.py options, e.g. --tensors 64 --page-kib 16]
# Exit status: 0 all passed, 1 a test or a verdict failed, 2 no usable GPU / environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CARGO_NET_OFFLINE=true PIP_NO_INDEX=1

if ! venv="$("$root/scripts/vllm-env.sh")" || [ ! -x "$venv/bin/python" ]; then
    echo "gpu-check: the pinned vLLM environment is missing and could not be built offline" >&2
    exit 2
fi
python="$venv/bin/python"
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA device visible to torch in $venv (this check needs one NVIDIA GPU)" >&2
    exit 2
fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-check.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

echo "gpu-check: building kvtier (release) for $("$python" -V)"
(cd "$root/crates/kvtier-py" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" build --release --quiet --interpreter "$python" --out "$scratch/wheels")
"$python" -m pip install --quiet --no-index --no-deps --target "$scratch/site" "$scratch"/wheels/kvtier-*.whl
export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"

status=0
echo "gpu-check: (a) cuda worker tests"
(cd "$root/crates/kvtier-py" && "$python" -m pytest -q -p no:cacheprovider -rs \
    --basetemp "$scratch/pytest" -m cuda tests/gpu) || status=1

echo "gpu-check: (b) copy benchmark"
mkdir -p "$scratch/bench"
"$python" "$root/crates/kvtier-py/tests/gpu/bench_copy.py" --tmp "$scratch/bench" "$@" || status=$?
exit "$status"
