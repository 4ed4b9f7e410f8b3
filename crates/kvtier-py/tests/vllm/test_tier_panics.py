"""A tier that panics under vLLM's real scheduler: a cpu + faulty + disk chain, where the faulty
tier (the extension's ``fault-injection`` feature, which scripts/vllm-tests.sh builds with) panics
mid-run in one of its calls. The panic is caught at kvtier's tier-call boundary: the tier is
quarantined, vLLM never sees an exception and keeps scheduling, every request finishes with every
token right, and the disk tier behind the quarantined one keeps serving hits."""

import pytest

import harness
from conftest import assert_clean, chain, disk_tier, kvtier_engine, tier_stats

# A device cache and a CPU tier both smaller than the workload's prefixes: revisits reach the
# secondary tiers.
SHAPE = dict(num_gpu_blocks=24)
CPU_CHUNKS = 12


def faulty_tier(panic_in, panic_after):
    return f"""
[[secondary]]
type = "faulty"
name = "faulty"
panic_in = "{panic_in}"
panic_after = {panic_after}
admission = "always"
"""


def workload(shape):
    return harness.waves_workload(11, prefixes=12, waves=10, per_wave=6, block_size=shape.block_size)


class Trace:
    """Per step: tiers quarantined so far, the disk tier's and the faulty tier's hits."""

    def __init__(self):
        self.rows = []

    def record(self, engine, step):
        stats = engine.manager.kvtier_stats()
        by_name = {t["name"]: t for t in stats["secondaries"]}
        self.rows.append((step, stats["manager"]["tiers_quarantined"], by_name["disk"]["hits"], by_name["faulty"]["hits"]))

    def quarantine_step(self):
        return next((s for s, q, _, _ in self.rows if q > 0), None)

    def disk_hits_at(self, step):
        return max((d for s, _, d, _ in self.rows if s <= step), default=0)


# The call that panics, and how many calls of it succeed first: chosen so the panic lands well
# inside the run (the test checks that it did).
PANICS = [
    ("lookup", 60),
    ("on_request_finished", 15),
    ("submit_store", 8),
]


@pytest.mark.parametrize("off_step", [True, False], ids=["off_step", "on_step"])
@pytest.mark.parametrize(("panic_in", "panic_after"), PANICS, ids=[p for p, _ in PANICS])
def test_a_panicking_tier_is_quarantined_and_vllm_keeps_scheduling(model_dir, tmp_path, panic_in, panic_after, off_step):
    shape = harness.EngineShape(**SHAPE)
    secondaries = faulty_tier(panic_in, panic_after) + disk_tier(tmp_path / "disk")
    engine = kvtier_engine(model_dir, chain(tmp_path, secondaries, capacity=CPU_CHUNKS, off_step=off_step), shape)
    trace = Trace()
    try:
        stats = harness.drive(engine, workload(shape), on_step=trace.record)
        trace.record(engine, stats.steps)
        manager = engine.manager.kvtier_stats()["manager"]
        faulty = tier_stats(engine, "faulty")
        disk = tier_stats(engine, "disk")
    finally:
        engine.shutdown()
    # vLLM never saw the panic: every request finished, every token right.
    assert_clean(stats, f"panic in {panic_in}")
    assert manager["tiers_quarantined"] >= 1, manager
    assert manager["tier_panics"] >= 1, manager
    assert faulty["extra"].get("quarantined") == 1, faulty
    # Mid-run: steps ran before and after it.
    q = trace.quarantine_step()
    assert q is not None and 0 < q < stats.steps - 20, (q, stats.steps)
    # The disk tier behind the quarantined one keeps serving.
    assert disk["hits"] > trace.disk_hits_at(q), (q, trace.rows[-5:], disk)
