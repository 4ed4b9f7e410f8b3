"""kvtier.vllm in one process: the spec's configuration errors, the manager lock, and how vLLM's
request contexts (positions, transfer parameters, tier filter) reach kvtier."""

from types import SimpleNamespace

import pytest

import kvtier
from kvtier.vllm import KvtierOffloadingSpec
from conftest import keys


def spec(tmp_path, shared=True):
    chain = tmp_path / "chain.toml"
    arena = f'shared_memory = "{tmp_path}/arena"\n' if shared else ""
    chain.write_text(f'[primary]\ntype = "cpu"\ncapacity = 4\n{arena}')
    return KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, 64, world_size=2)


def test_configuration_errors_name_the_problem(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="kvtier_chain"):
        KvtierOffloadingSpec.from_settings({}, 64)
    with pytest.raises(kvtier.ConfigError, match="shared_memory"):
        spec(tmp_path, shared=False)
    with pytest.raises(kvtier.ConfigError, match="worker_kv_bytes_per_block"):
        KvtierOffloadingSpec.from_settings({"kvtier_chain": "x", "kvtier_arena": "y"}, 0)


def test_vllm_contexts_map_to_one_kvtier_context_with_positions_and_filter(tmp_path):
    sp = spec(tmp_path)
    assert sp.chunk_bytes == 128 and sp.channel_path == f"{tmp_path}/arena.sock"
    m = sp.get_manager()
    try:
        positions = {}
        matcher = SimpleNamespace(medium=SimpleNamespace(value="STORAGE"), locality=None)
        vctx = SimpleNamespace(
            req_id="r",
            kv_transfer_params={"x": 1},
            load_tier_filter=SimpleNamespace(matchers=(matcher,)),
            get_offload_key_position=positions.get,
        )
        k = keys(1, 2)
        positions[k[0]] = 64
        with m.lock:
            m.on_new_request(vctx)
            out = m.prepare_store(k, vctx)
            assert list(out.store_spec.block_ids) == [0, 1]
            m.on_schedule_end(None)
        ctx = m._ctx(vctx)
        assert ctx is m._ctx(vctx) and ctx.req_id == "r"
        assert ctx.get_offload_key_position(k[0]) == 64
        assert ctx.get_offload_key_position(k[1]) is None
        # The row-key table tells workers which key each row is being written for.
        assert m.row_keys.keys_of([0, 1]) == k
        with m.lock:
            with pytest.raises(kvtier.StepError, match="not reentrant"):
                m.lock.__enter__()
            m.complete_store(k, vctx)
        # Without the lock, a call runs in a step of its own.
        assert m.lookup(k[0], vctx) is kvtier.LookupResult.HIT
        assert m.has_pending_work() is False
    finally:
        m.shutdown()
