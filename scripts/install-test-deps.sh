#!/usr/bin/env bash
# Installs the system packages kvtier's test suite needs and that cargo cannot fetch:
# `redis-server` and `redis-tools` (redis-cli), used by crates/tier-redis's tests.
# Idempotent: does nothing when redis-server is already on PATH. Debian/Ubuntu (apt-get) only.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
    echo "install-test-deps: redis-server already installed ($(redis-server --version | head -n1))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: redis-server is missing and apt-get is not available;" >&2
    echo "install redis-server and redis-cli (Redis >= 6 or Valkey) by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends redis-server redis-tools

# The Debian package starts a system service on port 6379; the tests start their own servers on
# free ports and do not need it.
echo "install-test-deps: installed $(redis-server --version | head -n1)"
