"""Faults under vLLM's scheduler: a Redis server killed mid-run and the disk tier's directory
removed mid-run. Every request finishes (none stuck), no token is wrong, and a tier whose
promotions fail turns into misses within 50 scheduler steps of its first failed promotion, in
both off_step modes, without retrying the failed promotions every step."""

import shutil

import pytest

import harness
from conftest import assert_clean, chain, disk_tier, kvtier_engine, redis_tier, tier_stats

SHAPE = dict(num_gpu_blocks=24)
KILL_STEP = 40
# Steps within which a failing tier's lookups must have become misses.
MISS_WITHIN_STEPS = 50


class TierTrace:
    """Per step: the tier's cumulative hits and the manager's failed promotion keys."""

    def __init__(self, name):
        self.name = name
        self.rows = []

    def record(self, engine, step):
        stats = engine.manager.kvtier_stats()
        tier = next(t for t in stats["secondaries"] if t["name"] == self.name)
        self.rows.append((step, tier["hits"], stats["manager"]["failed_promotion_keys"]))

    def first_failure_step(self):
        return next((s for s, _, failed in self.rows if failed > 0), None)

    def last_hit_step(self):
        last = None
        for (_, h0, _), (s, h1, _) in zip(self.rows, self.rows[1:]):
            if h1 > h0:
                last = s
        return last

    def failing_steps(self):
        """Steps in which new promotion failures were seen."""
        return sum(1 for (_, _, f0), (_, _, f1) in zip(self.rows, self.rows[1:]) if f1 > f0)


def workload(shape):
    return harness.waves_workload(11, prefixes=12, waves=10, per_wave=6, block_size=shape.block_size)


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
def test_killed_redis_turns_into_misses_and_loses_no_request(model_dir, tmp_path, redis_server, off_step):
    shape = harness.EngineShape(**SHAPE)
    engine = kvtier_engine(model_dir, chain(tmp_path, redis_tier(redis_server.port), capacity=12, off_step=off_step), shape)
    trace = TierTrace("redis")

    def on_step(eng, step):
        if step == KILL_STEP:
            redis_server.stop()
        trace.record(eng, step)

    try:
        stats = harness.drive(engine, workload(shape), on_step=on_step)
        trace.record(engine, stats.steps)
    finally:
        engine.shutdown()
    assert_clean(stats, "redis killed")
    hits_before = [h for s, h, _ in trace.rows if s <= KILL_STEP]
    assert hits_before[-1] > 0, "no Redis hit before the kill: the fault was never exercised"
    first = trace.first_failure_step()
    assert first is not None, "no promotion from the dead server failed: the fault was never exercised"
    last_hit = trace.last_hit_step()
    assert last_hit is None or last_hit <= first + MISS_WITHIN_STEPS, trace.rows
    # Failed promotions are remembered (back-off), not started again every step.
    assert trace.failing_steps() <= 5, trace.rows
    # After the kill, no Redis hit survives past the bound either way (the tier knows the
    # server is gone once a round trip fails).
    late = [h for s, h, _ in trace.rows if s > KILL_STEP + MISS_WITHIN_STEPS]
    assert not late or late[-1] == late[0], trace.rows


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
def test_disk_directory_removed_mid_run(model_dir, tmp_path, off_step):
    """The disk tier keeps its slab files open: removing the directory loses nothing already
    stored; the run finishes with every token right."""
    shape = harness.EngineShape(**SHAPE)
    disk_dir = tmp_path / "disk"
    engine = kvtier_engine(model_dir, chain(tmp_path, disk_tier(disk_dir), capacity=12, off_step=off_step), shape)

    def on_step(eng, step):
        if step == KILL_STEP:
            shutil.rmtree(disk_dir)

    try:
        stats = harness.drive(engine, workload(shape), on_step=on_step)
        disk = tier_stats(engine, "disk")
    finally:
        engine.shutdown()
    assert_clean(stats, "disk directory removed")
    assert disk["hits"] > 0
    assert not disk_dir.exists()
