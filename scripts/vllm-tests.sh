#!/usr/bin/env bash
# Runs the vLLM-in-the-loop suite (crates/kvtier-py/tests/vllm): vLLM 0.33.0's real scheduler and
# OffloadingConnector driving kvtier, and vLLM's own specs on the same workloads. The pinned vLLM
# environment comes from scripts/vllm-env.sh (cached outside the clone); the extension is built
# into it with maturin.
#   scripts/vllm-tests.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/vllm-env.sh")"
(cd "$root/crates/kvtier-py" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet --features fault-injection)
cd "$root/crates/kvtier-py"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# vLLM iterates sets of request ids: a fixed hash seed makes two runs of one workload comparable.
# Its model config is read offline from a directory the tests write.
PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TMPDIR="$scratch" VLLM_LOGGING_LEVEL=WARNING \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$scratch/pytest" tests/vllm "$@"
