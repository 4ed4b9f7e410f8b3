"""vLLM's per-request tier filters (``kv_transfer_params["kv_load_tiers"]``, parsed by vLLM's
connector into ``ReqContext.load_tier_filter``) honoured by kvtier's lookups: a filter that
excludes STORAGE yields no disk or Redis hits in the workload that otherwise hits them; one that
admits the tier's medium and locality leaves them."""

import pytest

import harness
from conftest import assert_clean, chain, disk_tier, kvtier_engine, redis_tier, tier_stats

SHAPE = dict(num_gpu_blocks=24)


def run(model_dir, tmp_path, secondary, name, params):
    shape = harness.EngineShape(**SHAPE)
    engine = kvtier_engine(model_dir, chain(tmp_path, secondary, capacity=12, name=name), shape)
    try:
        work = harness.waves_workload(11, prefixes=12, waves=8, per_wave=6, block_size=shape.block_size)
        stats = harness.drive(engine, work, kv_transfer_params=params)
        tier = tier_stats(engine, secondary_name(secondary))
    finally:
        engine.shutdown()
    assert_clean(stats, f"{name} {params}")
    return stats, tier


def secondary_name(toml):
    return "disk" if 'type = "disk"' in toml else "redis"


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_filter_without_storage_keeps_requests_off_storage_tiers(model_dir, tmp_path, request, tier):
    if tier == "disk":
        secondary = disk_tier(tmp_path / "disk")
        admits = {"medium": "storage", "locality": "local"}
    else:
        secondary = redis_tier(request.getfixturevalue("redis_server").port)
        admits = {"medium": "STORAGE", "locality": "REMOTE"}
    _, unfiltered = run(model_dir, tmp_path, secondary, "all", None)
    assert unfiltered["hits"] > 0, unfiltered
    cpu_only, excluded = run(model_dir, tmp_path, secondary, "cpu", {"kv_load_tiers": [{"medium": "CPU"}]})
    assert excluded["hits"] == 0, excluded
    nothing, none = run(model_dir, tmp_path, secondary, "none", {"kv_load_tiers": []})
    assert none["hits"] == 0, none
    _, admitted = run(model_dir, tmp_path, secondary, "admit", {"kv_load_tiers": [admits]})
    assert admitted["hits"] > 0, admitted
