#!/usr/bin/env bash
# Runs every test of the workspace: the Rust crates with the Redis-backed tests (redis-server is
# installed from Debian's packages when missing), the Python binding's pytest suite (in a
# project-local venv, scripts/python-tests.sh) and the vLLM-in-the-loop suite (vLLM 0.33.0's real
# scheduler and connector, in a pinned environment cached outside the clone,
# scripts/vllm-tests.sh). Works with rustup's stock cargo: cargo-nextest is used when installed,
# `cargo test` otherwise. `cargo test` alone runs only the Rust tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-test-deps.sh

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --all-features --no-fail-fast
  # The chain builder of an engine that links its tiers statically (no tier-library loader).
  cargo nextest run -p tiering-config --no-default-features
else
  cargo test --workspace --all-features --no-fail-fast
  cargo test -p tiering-config --no-default-features
fi
scripts/python-tests.sh
scripts/vllm-tests.sh
