"""The shared Redis tier from Python: two managers (two engines of a fleet) over one real
`redis-server` on a free loopback port. Chunks one engine stores reach the server and the other
engine's lookups promote them back, bit-exact; namespaces keep fleets apart; a server that is
down at start is a clear configuration error, and one that dies later turns lookups into misses
instead of exceptions or hangs.

Skipped (loudly) when redis-server is not installed: scripts/test.sh installs it first."""

import os
import shutil
import time

import pytest

import kvtier
from kvtier import LookupResult
from kvtier.vllm import hit_source_name
from redis_server import RedisServer

CHUNK = 4096
PATIENCE_S = 60

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server / redis-cli are not installed (scripts/install-test-deps.sh installs them)",
)


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.stop()


def chain(port, namespace, capacity=4):
    # Short timeouts and backoffs: the tests kill servers.
    return f"""
[primary]
type = "cpu"
capacity = {capacity}
eviction = "lru"

[[secondary]]
type = "redis"
url = "redis://127.0.0.1:{port}"
namespace = "{namespace}"
layout_fingerprint = "pytest-{CHUNK}"
workers = 2
io_timeout = "500ms"
connect_timeout = "500ms"
reconnect_backoff = "50ms"
reconnect_backoff_max = "200ms"

[control_plane]
thread = true
idle_wait = "1ms"
"""


def payload(k):
    """Bytes of a chunk, different for every key and position."""
    return (k * (CHUNK // len(k) + 1))[:CHUNK]


def key(n):
    return kvtier.make_offload_key(n.to_bytes(4, "big") * 8)


def redis_stores(m):
    return m.stats()["secondaries"][0]["stores"]


def store_all(m, ks):
    """Stores each key (arena row written, then completed) and waits until Redis has it: a
    cascade pins its row until then, so the next store can evict."""
    ctx = kvtier.ReqContext("writer")
    with m.step() as s:
        s.on_new_request(ctx)
    for i, k in enumerate(ks):
        with m.step() as s:
            out = s.prepare_store([k], ctx)
            assert out is not None and out.keys_to_store == [k]
            m.write_row(out.chunk_ids[0], payload(k))
            s.complete_store([k], ctx)
            s.on_schedule_end()
        deadline = time.monotonic() + PATIENCE_S
        while redis_stores(m) < i + 1:
            assert time.monotonic() < deadline, f"key {i} never reached Redis: {m.stats()}"
            time.sleep(0.005)
    with m.step() as s:
        s.on_request_finished(ctx)
        s.on_schedule_end()


def settle(m, k, ctx):
    """Steps until `k`'s lookup is no longer RETRY or HIT_PENDING; returns the verdict."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        with m.step() as s:
            v = s.lookup(k, ctx)
            s.on_schedule_end()
        if v not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            return v
        assert time.monotonic() < deadline, f"the lookup never resolved (last {v})"
        time.sleep(0.005)


def fetch(m, k, ctx):
    """The chunk's bytes when the chain has it (promoted from Redis if need be), else None."""
    if settle(m, k, ctx) is not LookupResult.HIT:
        return None
    with m.step() as s:
        assert s.lookup(k, ctx) is LookupResult.HIT
        row = s.prepare_load([k], ctx)[0]
        data = m.read_row(row)
        s.complete_load([k], ctx)
        s.on_schedule_end()
    return data


def test_chunks_one_engine_stores_are_promoted_bit_exact_by_another(server):
    ks = [key(n) for n in range(6)]
    producer = kvtier.TieringManager.from_toml(chain(server.port, "fleet"), CHUNK)
    consumer = kvtier.TieringManager.from_toml(chain(server.port, "fleet"), CHUNK)
    stranger = kvtier.TieringManager.from_toml(chain(server.port, "other-fleet"), CHUNK)
    try:
        store_all(producer, ks)
        assert redis_stores(producer) == 6
        ctx = kvtier.ReqContext("reader")
        with consumer.step() as s:
            s.on_new_request(ctx)
        # The consumer holds 4 rows: the last 4 keys evict the first 2 again, which are then
        # promoted a second time; every fetch is bit-exact.
        for k in ks + ks[:2]:
            assert fetch(consumer, k, ctx) == payload(k)
        with consumer.step() as s:
            source = s.load_source(ks[0], ctx)
        assert (source.tier, source.tier_type, source.secondary) == ("redis", "redis", 0)
        assert (source.medium, source.locality) == ("STORAGE", "REMOTE")
        # vLLM counts a remote store's hits as external_unspecified.
        assert hit_source_name(source) == "external_unspecified"
        stats = consumer.stats()
        assert stats["manager"]["promoted_keys"] == 8
        assert stats["secondaries"][0]["name"] == "redis"
        # Another namespace never sees the fleet's chunks.
        other = kvtier.ReqContext("stranger")
        with stranger.step() as s:
            s.on_new_request(other)
        assert all(settle(stranger, k, other) is LookupResult.MISS for k in ks)
    finally:
        for m in (producer, consumer, stranger):
            m.shutdown()


def test_a_server_down_at_start_is_a_config_error(server):
    port = server.port
    server.stop()
    with pytest.raises(kvtier.ConfigError, match="127.0.0.1"):
        kvtier.TieringManager.from_toml(chain(port, "down"), CHUNK)


def test_a_server_that_dies_turns_lookups_into_misses(server):
    # Two rows and four keys: the first two are then only in Redis.
    ks = [key(100 + n) for n in range(4)]
    m = kvtier.TieringManager.from_toml(chain(server.port, "dies", capacity=2), CHUNK)
    try:
        store_all(m, ks)
        server.stop()
        ctx = kvtier.ReqContext("after-death")
        with m.step() as s:
            s.on_new_request(ctx)
        # The primary still serves what it holds (asked first: a promotion reserves a row,
        # evicting one).
        assert fetch(m, ks[3], ctx) == payload(ks[3])
        for k in ks[:2]:
            assert fetch(m, k, ctx) is None
        assert m.stats()["secondaries"][0]["extra"]["connection_failures"] >= 1
    finally:
        m.shutdown()
    assert not os.path.exists(server.dir.name)
