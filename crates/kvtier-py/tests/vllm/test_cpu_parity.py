"""kvtier with a CPU-only chain against vLLM 0.33.0's own ``CPUOffloadingSpec``, both driven by
vLLM's real scheduler and connector on the same workload: the manager sees the same calls and
gives the same answers (lookups, rows handed out for loads and stores, evictions), call for call,
and every token is right on both sides."""

import pytest

import harness
from conftest import assert_clean, chain, kvtier_engine

MANAGER_CALLS = (
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
)


def _norm(v):
    """A comparable form of a manager argument or answer."""
    if isinstance(v, (bytes, str, int, float, bool)) or v is None:
        return v
    if hasattr(v, "req_id") and hasattr(v, "kv_transfer_params"):
        return ("req", v.req_id)
    if hasattr(v, "keys_to_store"):
        return ("store", [bytes(k) for k in v.keys_to_store], list(v.store_spec.block_ids), sorted(map(bytes, v.evicted_keys)))
    if hasattr(v, "block_ids"):
        return ("rows", list(v.block_ids))
    if hasattr(v, "policy"):
        return ("policy", v.policy.name)
    if hasattr(v, "name") and hasattr(v, "value"):
        return v.name
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_norm(x) for x in v]
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    return type(v).__name__


def record(manager):
    """Wraps the manager's calls so each is logged with its arguments and answer."""
    log = []
    for name in MANAGER_CALLS:
        fn = getattr(manager, name)

        def call(*a, _fn=fn, _name=name, **kw):
            r = _fn(*a, **kw)
            log.append((_name, _norm(list(a) + sorted(kw.items())), _norm(r)))
            return r

        setattr(manager, name, call)
    return log


@pytest.mark.parametrize(("workload", "policy"), [("chat", "lru"), ("waves", "lru"), ("waves", "arc")])
def test_cpu_only_chain_matches_vllm_cpu_spec_call_for_call(model_dir, tmp_path, workload, policy):
    # A device cache smaller than the workload's prefixes, a CPU tier twice its size but still
    # smaller than the workload: prefixes come back from the CPU tier, and the CPU tier evicts.
    shape = harness.EngineShape(num_gpu_blocks=24)
    capacity = 48
    if workload == "chat":
        work = harness.shared_prefix_workload(7, 64, shape.block_size)
    else:
        work = harness.waves_workload(3, prefixes=14, waves=8, per_wave=6, block_size=shape.block_size)

    ref = harness.Engine(
        model_dir,
        shape,
        {
            "cpu_bytes_to_use": harness.cpu_bytes_for(shape, capacity),
            "block_size": shape.block_size,
            "eviction_policy": policy,
        },
        harness.ReferenceCPUSpec,
    )
    ref_log = record(ref.manager)
    ref_stats = harness.drive(ref, work)
    ref.shutdown()

    # off_step = false: vLLM's CPU manager completes stores only when the scheduler reports them.
    ours = kvtier_engine(model_dir, chain(tmp_path, capacity=capacity, off_step=False, policy=policy), shape)
    our_log = record(ours.manager)
    our_stats = harness.drive(ours, work)
    ours.shutdown()

    assert_clean(ref_stats, "vLLM CPUOffloadingSpec")
    assert_clean(our_stats, "kvtier")
    loads = [c for c in ref_log if c[0] == "prepare_load"]
    evictions = [c for c in ref_log if c[0] == "prepare_store" and c[2] and c[2][3]]
    assert loads, "the workload never loaded from the CPU tier"
    assert evictions, "the workload never evicted from the CPU tier"
    for i, (a, b) in enumerate(zip(ref_log, our_log)):
        assert a == b, f"call {i} differs:\n vLLM:   {a}\n kvtier: {b}\n before: {ref_log[max(0, i - 3):i]}"
    assert len(our_log) == len(ref_log)
    assert our_stats.connector_tokens == ref_stats.connector_tokens > 0
