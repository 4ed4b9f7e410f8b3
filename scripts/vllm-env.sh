#!/usr/bin/env bash
# Prints the path of a virtual environment holding the pinned vLLM (and the torch it brings),
# creating it first when missing. The environment lives in a cache directory outside the clone
# (KVTIER_VLLM_CACHE, default ~/.cache/kvtier), keyed by a hash of the pinned requirements and the
# Python version, so a clean clone reuses it and a change of pins builds a new one beside it.
# vLLM's wheel brings torch with its CUDA libraries (several GB, downloaded once per key);
# everything kvtier's tests run with it runs on CPU.
#   scripts/vllm-env.sh            -> prints the venv path on stdout (progress on stderr)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
reqs="$root/crates/kvtier-py/tests/vllm/requirements.txt"
cache="${KVTIER_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier}"
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( (cat "$reqs"; echo "python $pyver") | sha256sum | cut -c1-16)"
venv="$cache/vllm-env-$key"
if [ -f "$venv/.complete" ]; then
    echo "$venv"
    exit 0
fi
mkdir -p "$cache"
# A half-built environment (an interrupted install) is rebuilt from scratch; a lock keeps two
# runs from building the same key at once.
exec 9>"$cache/vllm-env-$key.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv"
    echo "vllm-env: building $venv (pinned in $reqs; downloads several GB once)" >&2
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    # uv resolves and installs the multi-GB set several times faster than pip; bytecode is
    # compiled once here (the test runs set PYTHONDONTWRITEBYTECODE, and an uncompiled vLLM takes
    # ~30 s to import instead of ~14 s).
    "$venv/bin/python" -m pip install --quiet uv >&2
    VIRTUAL_ENV="$venv" "$venv/bin/uv" pip install --python "$venv/bin/python" \
        --no-cache --compile-bytecode -r "$reqs" >&2
    touch "$venv/.complete"
fi
echo "$venv"
