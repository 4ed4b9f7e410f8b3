"""kvtier's secondary tiers under vLLM's scheduler: chunks evicted from the device and from the
CPU tier come back from disk or Redis (lookups that answer HIT_PENDING/RETRY, deferred
requests, promotions while vLLM schedules), with the off-step completions on and off, one and
two ranks, ranks in worker processes. Every request finishes, no token is wrong, and each
secondary tier serves hits."""

import pytest

import harness
from conftest import assert_clean, chain, disk_tier, kvtier_engine, redis_tier, tier_stats

# A device cache and a CPU tier both smaller than the workload's prefixes: revisits reach the
# secondary tier.
SHAPE = dict(num_gpu_blocks=24)
CPU_CHUNKS = 12


def workload(shape):
    return harness.waves_workload(11, prefixes=12, waves=8, per_wave=6, block_size=shape.block_size)


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
@pytest.mark.parametrize(("ranks", "processes"), [(1, False), (2, False), (2, True)], ids=["1rank", "2ranks", "2procs"])
def test_cpu_disk_chain_serves_revisits_from_disk(model_dir, tmp_path, off_step, ranks, processes):
    shape = harness.EngineShape(world_size=ranks, **SHAPE)
    path = chain(tmp_path, disk_tier(tmp_path / "disk"), capacity=CPU_CHUNKS, off_step=off_step)
    engine = kvtier_engine(model_dir, path, shape, worker_processes=processes)
    try:
        stats = harness.drive(engine, workload(shape))
        disk = tier_stats(engine, "disk")
        manager = engine.manager.kvtier_stats()["manager"]
    finally:
        engine.shutdown()
    assert_clean(stats, "cpu+disk")
    assert disk["hits"] > 0 and manager["promoted_keys"] > 0, (disk, manager)
    assert stats.connector_tokens > 0
    # Worker reports are consumed (off-step) or set aside (on-step), never mismatched.
    assert manager["unmatched_worker_reports"] == 0, manager


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
@pytest.mark.parametrize("ranks", [1, 2], ids=["1rank", "2ranks"])
def test_cpu_redis_chain_serves_revisits_from_redis(model_dir, tmp_path, redis_server, off_step, ranks):
    shape = harness.EngineShape(world_size=ranks, **SHAPE)
    path = chain(tmp_path, redis_tier(redis_server.port), capacity=CPU_CHUNKS, off_step=off_step)
    engine = kvtier_engine(model_dir, path, shape)
    try:
        stats = harness.drive(engine, workload(shape))
        redis = tier_stats(engine, "redis")
    finally:
        engine.shutdown()
    assert_clean(stats, "cpu+redis")
    assert redis["hits"] > 0, redis


def test_two_vllm_schedulers_share_one_redis(model_dir, tmp_path, redis_server):
    """A fleet: the second engine's requests find the prefixes the first engine computed, in
    the Redis server they share, and load them bit-exact (the second engine never computed
    them)."""
    shape = harness.EngineShape(**SHAPE)
    work = workload(shape)
    first = kvtier_engine(model_dir, chain(tmp_path, redis_tier(redis_server.port), capacity=CPU_CHUNKS, name="a"), shape)
    try:
        assert_clean(harness.drive(first, work), "first engine")
    finally:
        first.shutdown()
    second = kvtier_engine(model_dir, chain(tmp_path, redis_tier(redis_server.port), capacity=CPU_CHUNKS, name="b"), shape)
    try:
        stats = harness.drive(second, work)
        redis = tier_stats(second, "redis")
    finally:
        second.shutdown()
    assert_clean(stats, "second engine")
    assert redis["hits"] > 0 and stats.connector_tokens > 0, redis


def test_connector_reset_mid_run(model_dir, tmp_path):
    """vLLM's prefix-cache reset between waves (its connector resets kvtier's CPU tier, fencing
    rows with copies in flight): the run goes on, every token right, and prefixes stored after
    the reset are served again."""
    shape = harness.EngineShape(**SHAPE)
    path = chain(tmp_path, disk_tier(tmp_path / "disk"), capacity=CPU_CHUNKS)
    engine = kvtier_engine(model_dir, path, shape)
    resets = []

    def reset_at(eng, step):
        if step in (40, 80) and eng.reset_cache():
            resets.append(step)

    try:
        stats = harness.drive(engine, workload(shape), on_step=reset_at)
    finally:
        engine.shutdown()
    assert_clean(stats, "reset")
    assert resets, "vLLM refused every reset"
    assert stats.connector_tokens > 0
