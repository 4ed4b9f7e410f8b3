#!/usr/bin/env bash
# Same-run comparison of tier-cpu with vLLM 0.33.0's CPUOffloadingManager (see compare.py).
# Installs the released wheel (no dependencies: only its pure-Python CPU manager is used) into a
# venv outside the repository on first use: VLLM_VENV, default /tmp/vllm033-venv.
#
#   crates/tier-cpu/tests/data/recorder/compare.sh [--rounds 5] [--sizes 10000,100000] \
#       [--policies lru,arc] [--seconds 1.0] [--clock wall|cpu]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VLLM_VENV:-/tmp/vllm033-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --no-deps vllm==0.33.0
fi
exec "$venv/bin/python" "$here/compare.py" "$@"
