#!/usr/bin/env bash
# Runs every test of the workspace: the Rust crates, the Redis-backed tests (redis-server is
# installed from Debian's packages when missing) and the Python binding's pytest suite (run by
# crates/kvtier-py/tests/pytest_suite.rs in a project-local venv it creates). Works with rustup's
# stock cargo: cargo-nextest is used when installed, `cargo test` otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-test-deps.sh

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --all-features --no-fail-fast
else
  cargo test --workspace --all-features --no-fail-fast
fi
