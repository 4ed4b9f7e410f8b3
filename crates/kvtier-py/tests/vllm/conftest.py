"""The vLLM-in-the-loop suite: vLLM 0.33.0's real scheduler and OffloadingConnector driven by
:mod:`harness`. Runs in the pinned vLLM environment (scripts/vllm-tests.sh); elsewhere the whole
directory is skipped."""

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm-tests.sh runs this suite in its pinned environment)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
from redis_server import RedisServer, free_port, installed  # noqa: E402

# A hang guard for background work, not a speed requirement.
PATIENCE_S = 60


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return harness.write_model_dir(str(tmp_path_factory.mktemp("model")))


def chain(tmp_path, secondaries="", capacity=16, off_step=True, policy="lru", name="chain"):
    """A kvtier chain file: a CPU tier of ``capacity`` chunks on a shared-memory arena in
    ``tmp_path``, the given ``[[secondary]]`` tables, the control thread on."""
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f"""
[primary]
type = "cpu"
capacity = {capacity}
eviction = "{policy}"
shared_memory = "{tmp_path}/{name}-arena"
{secondaries}
[control_plane]
thread = true
idle_wait = "1ms"
off_step = {"true" if off_step else "false"}
"""
    )
    return str(path)


def disk_tier(path, capacity="4MiB", name="disk"):
    return f"""
[[secondary]]
type = "disk"
name = "{name}"
path = "{path}"
capacity = "{capacity}"
admission = "always"
"""


def redis_tier(port, namespace="fleet"):
    # Short timeouts and back-offs: the fault tests kill servers.
    return f"""
[[secondary]]
type = "redis"
name = "redis"
url = "redis://127.0.0.1:{port}"
namespace = "{namespace}"
admission = "always"
connect_timeout = "200ms"
io_timeout = "500ms"
reconnect_backoff = "100ms"
"""


@pytest.fixture
def redis_server():
    if not installed():
        pytest.skip("redis-server is not installed (scripts/install-test-deps.sh installs it)")
    s = RedisServer()
    yield s
    s.stop()


def kvtier_engine(model_dir, chain_path, shape=None, **kw):
    from kvtier.vllm import KvtierOffloadingSpec

    shape = shape or harness.EngineShape()
    return harness.Engine(
        model_dir, shape, {"kvtier_chain": chain_path, "block_size": shape.block_size}, KvtierOffloadingSpec, **kw
    )


def tier_stats(engine, name):
    """kvtier's counters of the secondary tier ``name``."""
    stats = engine.manager.kvtier_stats()
    for t in stats["secondaries"]:
        if t["name"] == name:
            return t
    raise KeyError(name)


def assert_clean(stats, what=""):
    """Every request finished, no wrong token."""
    assert stats.stuck == [], f"{what}: requests never finished: {stats.stuck[:10]}"
    assert stats.wrong_tokens == 0, f"{what}: {stats.wrong_tokens} wrong tokens of {stats.checked_tokens}"
    assert stats.checked_tokens > 0
