"""kvtier.vllm in one process: the spec's configuration errors, the manager lock, and how vLLM's
request contexts (positions, transfer parameters, tier filter) reach kvtier."""

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvtier
from kvtier.vllm import KvtierOffloadingSpec, KvtierOffloadingWorker
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


def test_the_arena_path_is_read_with_the_managers_parser(tmp_path, monkeypatch):
    chain = tmp_path / "chain.toml"
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    chain.write_text('[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "${tmpdir}/arena"\n')
    assert kvtier.chain_arena_path(chain) == f"{tmp_path}/arena"
    assert KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, 64).arena_path == f"{tmp_path}/arena"
    chain.write_text('[primary]\ntype = "cpu"\ncapacity = 4\n')
    assert kvtier.chain_arena_path(str(chain)) is None
    # ${pid} differs in every process: workers could never open the scheduler's arena.
    chain.write_text('[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "/dev/shm/kv-${pid}"\n')
    with pytest.raises(kvtier.ConfigError, match=r"\$\{pid\}"):
        KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, 64)
    chain.write_text('[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = 7\n')
    with pytest.raises(kvtier.ConfigError, match="path string"):
        kvtier.chain_arena_path(chain)
    chain.write_text("[primary]\ncapacity = 4\n")
    with pytest.raises(kvtier.ConfigError, match="type"):
        kvtier.chain_arena_path(chain)
    with pytest.raises(kvtier.ConfigError):
        kvtier.chain_arena_path(tmp_path / "missing.toml")


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


def worker_spec(tmp_path, off_step=True, world_size=1, **settings):
    """A spec over a chain with a shared arena, off-step completions and no control thread
    (reports are applied when the scheduler side calls in), and "GPU" tensors; `settings` go to
    `from_settings` (rank, replicated_layout)."""
    chain = tmp_path / "chain.toml"
    chain.write_text(
        f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n'
        f"[control_plane]\nthread = false\noff_step = {'true' if off_step else 'false'}\n"
    )
    tensors = [np.arange(8 * 16, dtype=np.float32).reshape(8, 16)]
    extra = {"kvtier_chain": str(chain)}
    return KvtierOffloadingSpec.from_settings(extra, tensors[0][0].nbytes, world_size, **settings), tensors


def ids(xs):
    return SimpleNamespace(block_ids=np.array(xs, dtype=np.int64))


def results(worker):
    return [(r.job_id, r.success) for r in worker.get_finished()]


def test_without_vllm_get_stats_is_none_and_kvtier_stats_has_the_counters(tmp_path):
    m = spec(tmp_path).get_manager()
    try:
        # vLLM's connector calls get_stats every step and expects OffloadingConnectorStats or
        # None: without vLLM there is no such type (tests/vllm/test_vllm_stats.py covers the
        # payload under vLLM). kvtier's counters have their own name; config_info describes
        # the chain either way.
        assert m.get_stats() is None
        assert [t["tier"] for t in m.config_info()] == ["0:primary"]
        assert m.kvtier_stats()["jobs_in_flight"] == 0
        with m.lock:
            assert m.get_stats() is None and "manager" in m.kvtier_stats()
    finally:
        m.shutdown()


def test_the_lock_is_held_per_thread_and_other_threads_wait_for_it(tmp_path):
    m = spec(tmp_path).get_manager()
    k = keys(1)
    order = []
    try:
        with m.lock:
            m.on_new_request("a")
            m.prepare_store(k, "a")

            def other():
                # Neither the lock nor a call without it uses the holder's step: both wait.
                with m.lock:
                    order.append("other locked")
                    assert m.lookup(k[0], "a") is kvtier.LookupResult.HIT
                order.append(m.lookup(k[0], "a"))

            t = threading.Thread(target=other)
            t.start()
            time.sleep(0.1)
            m.complete_store(k, "a")
            order.append("holder done")
        t.join(timeout=30)
        assert not t.is_alive()
        assert order == ["holder done", "other locked", kvtier.LookupResult.HIT]
        # The other thread's exit released its own step, not this thread's (none held now).
        assert m._step is None
    finally:
        m.shutdown()


def test_a_worker_built_before_the_manager_opens_the_arena_at_its_first_job(tmp_path):
    sp, tensors = worker_spec(tmp_path)
    # vLLM's order: the workers register their KV caches before the scheduler exists.
    worker = sp.get_worker(tensors)
    m = sp.get_manager()
    try:
        k = keys(1, 2)
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(k, "a")
        assert worker.submit_store(1, ids([3, 5]), out.store_spec) is True
        assert results(worker) == [(1, True)]
        with m.lock:
            m.complete_store(k, "a")
            m.on_request_finished("a")
            assert [m.lookup(x, "b") for x in k] == [kvtier.LookupResult.HIT] * 2
            rows = list(m.prepare_load(k, "b").block_ids)
        assert worker.submit_load(2, ids(rows), ids([6, 7])) is True
        assert results(worker) == [(2, True)]
        assert (tensors[0][6:8] == tensors[0][[3, 5]]).all()
        with m.lock:
            m.complete_load(k, "b")
    finally:
        worker.shutdown()
        m.shutdown()


def test_a_worker_with_no_manager_fails_its_store_after_waiting(tmp_path, caplog):
    sp, tensors = worker_spec(tmp_path)
    handler = sp.get_transfer_handler(tensors)
    handler.open_timeout_s = 0.2
    worker = KvtierOffloadingWorker(handler, f"{sp.arena_path}.keys")
    # No manager ever creates the arena: the failure cannot be reported, so the job's result
    # says so (vLLM stops on it rather than trust the rows).
    assert worker.submit_store(1, ids([0]), ids([0])) is True
    assert results(worker) == [(1, False)]
    assert "could not be reported" in caplog.text
    with pytest.raises(kvtier.KvtierError, match="no live kvtier manager"):
        handler.open()


def test_a_failed_store_copy_is_reported_so_the_engines_success_report_cannot_keep_it(tmp_path, caplog):
    sp, tensors = worker_spec(tmp_path)
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    try:
        k = keys(1, 2)
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(k, "a")
        # Block 99 does not exist: the copy fails. vLLM cannot fail a job, so the job finishes;
        # the failure went to the manager on the channel.
        assert worker.submit_store(1, ids([0, 99]), out.store_spec) is True
        assert results(worker) == [(1, True)]
        assert "reported as failed" in caplog.text
        with m.lock:
            m.complete_store(k, "a")  # vLLM's connector: success, always
            m.on_request_finished("a")
            assert [m.lookup(x, "b") for x in k] == [kvtier.LookupResult.MISS] * 2
        counters = m.kvtier_stats()["manager"]
        assert counters["store_report_conflicts"] == 2
        assert counters["off_step_store_completions"] == 2
    finally:
        worker.shutdown()
        m.shutdown()


def test_a_failed_load_copy_raises_instead_of_finishing(tmp_path):
    sp, tensors = worker_spec(tmp_path)
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    try:
        k = keys(1)
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(k, "a")
        worker.submit_store(1, ids([0]), out.store_spec)
        with m.lock:
            m.complete_store(k, "a")
            m.on_request_finished("a")
            m.lookup(k[0], "b")
            rows = list(m.prepare_load(k, "b").block_ids)
        with pytest.raises(kvtier.KvtierError, match="cannot fail a load"):
            worker.submit_load(2, ids(rows), ids([99]))
        assert results(worker) == [(1, True)]
        with m.lock:
            m.complete_load(k, "b")
    finally:
        worker.shutdown()
        m.shutdown()


FAKE_VLLM_BASE = '''
class OffloadingManager:
    pass


class OffloadingWorker:
    pass


class OffloadingSpec:
    def __init__(self, config):
        # The fields vLLM 0.33.0's OffloadingSpec.__init__ reads.
        self.config = config
        self.extra_config = config.extra_config
        self.enable_events = config.enable_kv_cache_events
        self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.blocks_per_chunk = config.cache.blocks_per_chunk
'''

FAKE_VLLM_CONFIG = '''
from types import SimpleNamespace

ALGO = "sha256"


def get_current_vllm_config_or_none():
    return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=ALGO))
'''

UNDER_FAKE_VLLM = '''
import sys
import kvtier
import vllm.config
from vllm.v1.kv_offload import base
from kvtier.vllm import KvtierOffloadingSpec

assert issubclass(KvtierOffloadingSpec, base.OffloadingSpec)
spec = KvtierOffloadingSpec.from_settings({"kvtier_chain": sys.argv[1], "kvtier_arena": "a"}, 64)
assert spec.blocks_per_chunk == 1 and spec.tokens_per_block == ()
vllm.config.ALGO = "xxhash"
try:
    KvtierOffloadingSpec.from_settings({"kvtier_chain": sys.argv[1], "kvtier_arena": "a"}, 64)
except kvtier.ConfigError as e:
    assert "sha256" in str(e), e
else:
    raise AssertionError("xxhash block hashes were accepted")
print("ok")
'''


def test_under_vllm_the_spec_derives_from_vllms_and_refuses_16_byte_hashes(tmp_path):
    """With a vLLM importable (a stand-in package with the fields vLLM's base classes read),
    the adapter's classes derive from vLLM's, from_settings builds a config vLLM's spec accepts,
    and xxhash prefix-caching hashes are refused when the spec is made."""
    pkg = tmp_path / "fake" / "vllm"
    (pkg / "v1" / "kv_offload").mkdir(parents=True)
    for d in (pkg, pkg / "v1", pkg / "v1" / "kv_offload"):
        (d / "__init__.py").write_text("")
    (pkg / "v1" / "kv_offload" / "base.py").write_text(FAKE_VLLM_BASE)
    (pkg / "config.py").write_text(FAKE_VLLM_CONFIG)
    chain = tmp_path / "chain.toml"
    chain.write_text('[primary]\ntype = "cpu"\ncapacity = 4\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    run = subprocess.run(
        [sys.executable, "-c", UNDER_FAKE_VLLM, str(chain)], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_reset_cache_under_the_lock_keeps_the_lock_held(tmp_path):
    m = spec(tmp_path).get_manager()
    k = keys(1)
    try:
        with m.lock:
            m.on_new_request("a")
            m.prepare_store(k, "a")
            m.complete_store(k, "a")
            # vLLM's connector resets holding the lock, and goes on calling under it.
            m.reset_cache()
            assert m._step is not None
            assert m.lookup(k[0], "a") is kvtier.LookupResult.MISS
            m.on_reset_flushed()
        assert m._step is None
    finally:
        m.shutdown()


def test_transfers_follow_vllms_gpu_specs_with_partial_chunks_and_several_groups(tmp_path):
    """Two KV-cache groups (tensors 0 and 1, and tensor 2) and two blocks per chunk: a chunk of
    a group fills only its tensors' sections of the row, and a load that starts mid-chunk (vLLM's
    block_indices) copies the right blocks of the right chunks."""
    pages = (16, 8, 32)
    rng = np.random.default_rng(7)
    tensors = [rng.integers(0, 255, (12, p), dtype=np.uint8) for p in pages]
    chain = tmp_path / "chain.toml"
    chain.write_text(f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n')
    sp = KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, sum(pages), blocks_per_chunk=2)
    m = sp.get_manager()
    handler = sp.get_transfer_handler([t.copy() for t in tensors], group_tensors=[[0, 1], [2]])
    try:
        # The plan: group 0 from logical block 1 (half a chunk, then a whole one), group 1 whole.
        assert handler.chunks([1, 2, 3, 5, 6], [10, 11, 12], [3, 2], [1, 4]) == [
            (10, 0, [(1, 1)]),
            (11, 0, [(0, 2), (1, 3)]),
            (12, 1, [(0, 5), (1, 6)]),
        ]
        with pytest.raises(kvtier.KvtierError, match="need 2 chunks"):
            handler.chunks([1, 2, 3], [10], [3], [1])
        with pytest.raises(kvtier.KvtierError, match="cover"):
            handler.chunks([1, 2], [10, 11], [2], [0])

        handler.copy_out([0, 1, 2, 3, 4, 5], [0, 1, 2], [4, 2], [0, 0])
        # Row 2 is group 1's: tensor 2's section starts after two pages of tensors 0 and 1.
        row2 = m.manager.read_row(2)
        assert row2[48 + 32 : 48 + 64] == tensors[2][5].tobytes()
        assert row2[:48] == bytes(48), "group 1 leaves the other tensors' sections alone"

        # A load from the middle of group 0's first chunk, through vLLM's worker API.
        worker = KvtierOffloadingWorker(handler, None)
        gpu = SimpleNamespace(block_ids=np.array([9, 10, 11]), group_sizes=[3], block_indices=[1])
        assert worker.submit_load(1, ids([0, 1]), gpu) is True
        for t, original in zip(handler.tensors[:2], tensors[:2]):
            assert (t[9:12] == original[1:4]).all()
        assert (handler.tensors[2][9:12] == tensors[2][9:12]).all(), "group 0 does not touch tensor 2"
        handler.load([2], [8], [0, 1], [0, 1])
        assert (handler.tensors[2][8] == tensors[2][5]).all()
    finally:
        handler.close()
        m.shutdown()


def test_a_reset_keeps_rows_with_queued_copies_until_vllm_reports_them_flushed(tmp_path):
    """vLLM submits a step's store copies at the next step, so a copy prepared before a reset
    runs after it. Its row is not handed to a new key until on_reset_flushed, so the late copy
    neither lands under the new key nor reports it stored."""
    sp, tensors = worker_spec(tmp_path)
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    try:
        ka, kb = keys(1), keys(2, 3, 4)
        with m.lock:
            m.on_new_request("a")
            job_a = m.prepare_store(ka, "a")
            (row_a,) = list(job_a.store_spec.block_ids)
            m.reset_cache()
            m.on_new_request("b")
            rows_b = list(m.prepare_store(kb, "b").store_spec.block_ids)
        assert row_a not in rows_b, "the row of the queued copy is fenced"
        with m.lock:
            assert m.prepare_store(keys(5), "b") is None, "the fenced row is not free either"
        # The late copy of A: it reports A's key (unknown since the reset), not one of B's.
        worker.submit_store(1, ids([0]), job_a.store_spec)
        assert results(worker) == [(1, True)]
        with m.lock:
            assert [m.lookup(k, "b") for k in kb] == [kvtier.LookupResult.HIT_PENDING] * 3
            m.on_reset_flushed()
            out = m.prepare_store(keys(5), "b")
        assert list(out.store_spec.block_ids) == [row_a]
    finally:
        worker.shutdown()
        m.shutdown()


def test_completions_after_a_request_finished_leave_no_context_behind(tmp_path):
    """vLLM's connector finishes a request and completes its last store a step later."""
    m = spec(tmp_path).get_manager()
    r = SimpleNamespace(req_id="r", kv_transfer_params=None)
    k = keys(1)
    try:
        with m.lock:
            m.on_new_request(r)
            m.prepare_store(k, r)
            m.on_request_finished(r)
        assert m._contexts == {}
        with m.lock:
            m.complete_store(k, r)
            assert m.lookup(k[0], "other") is kvtier.LookupResult.HIT
        assert m._contexts == {"other": m._contexts["other"]}
    finally:
        m.shutdown()


def test_data_parallel_engines_need_a_chain_each(tmp_path):
    def config(chain, dp_index):
        return SimpleNamespace(
            extra_config={"kvtier_chain": chain, "kvtier_channel": f"{tmp_path}/done-{{dp_index}}.sock"},
            parallel=SimpleNamespace(world_size=1, rank=0, data_parallel_size=2, data_parallel_index=dp_index),
            cache=SimpleNamespace(blocks_per_chunk=1, tokens_per_hash=1),
            worker_kv_bytes_per_block=64,
        )

    for i in (0, 1):
        (tmp_path / f"chain-{i}.toml").write_text(
            f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena-{i}"\n'
        )
    with pytest.raises(kvtier.ConfigError, match="dp_index"):
        KvtierOffloadingSpec(config(str(tmp_path / "chain-0.toml"), 0))
    specs = [KvtierOffloadingSpec(config(f"{tmp_path}/chain-{{dp_index}}.toml", i)) for i in (0, 1)]
    assert [s.arena_path for s in specs] == [f"{tmp_path}/arena-0", f"{tmp_path}/arena-1"]
    assert [s.channel_path for s in specs] == [f"{tmp_path}/done-0.sock", f"{tmp_path}/done-1.sock"]
    managers = [s.get_manager() for s in specs]
    for m in managers:
        m.shutdown()


class _FakeCudaTensor:
    """What the handler reads of a CUDA tensor before copying: its blocks' sizes, its device."""

    is_cuda = True

    def __init__(self, blocks, page):
        self.page = page

    def __getitem__(self, i):
        return np.zeros(self.page, dtype=np.uint8)


class _FakeCudart:
    def __init__(self, rc):
        self.rc, self.calls = rc, []

    def cudaHostRegister(self, address, length, flags):
        self.calls.append(("register", address, length, flags))
        return self.rc

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


@pytest.mark.parametrize("rc", [0, 1])
def test_a_cuda_rank_pins_the_rows_for_dma_and_unpins_them_at_close(tmp_path, caplog, rc):
    chain = tmp_path / "chain.toml"
    chain.write_text(f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n')
    sp = KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, 64)
    m = sp.get_manager()
    cudart = _FakeCudart(rc)
    handler = sp.get_transfer_handler([_FakeCudaTensor(8, 64)])
    handler._cudart = lambda: cudart
    try:
        view = handler.open()
        address, length = view.row_region
        assert address != 0 and length == view.num_chunks * m.manager.row_stride
        assert cudart.calls == [("register", address, length, 0)]
        if rc:
            assert "could not pin" in caplog.text
        handler.close()
        assert cudart.calls[1:] == ([("unregister", address)] if rc == 0 else [])
    finally:
        handler.close()
        m.shutdown()


def test_a_replicated_layout_keeps_one_copy_written_by_rank_0_and_loaded_by_every_rank(tmp_path):
    """vLLM's replicated layout (every rank's KV byte-identical, stores submitted to rank 0
    only): a row holds one rank's slice, rank 0 alone reports (the manager waits for one
    report, not world_size), and rank 1 loads the same bytes into its own tensors."""
    sp, tensors = worker_spec(tmp_path, world_size=2, rank=0, replicated_layout=True)
    block = tensors[0][0].nbytes
    assert sp.replicated_layout and sp.copies == 1 and sp.chunk_bytes == block
    rank1, rank1_tensors = worker_spec(tmp_path, world_size=2, rank=1, replicated_layout=True)
    rank1_tensors[0][:] = 0
    m = sp.get_manager()
    writer = sp.get_worker(tensors)
    reader = rank1.get_worker(rank1_tensors)
    try:
        assert m.manager.chunk_bytes == block
        assert reader.handler.channel_path is None, "rank 1 never reports"
        assert (reader.handler.rank, reader.handler.slot) == (1, 0)
        k = keys(1, 2)
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(k, "a")
        assert writer.submit_store(1, ids([3, 5]), out.store_spec) is True
        assert results(writer) == [(1, True)]
        with m.lock:
            # Rank 0's report alone completed the store (before the connector's own report).
            assert [m.lookup(x, "b") for x in k] == [kvtier.LookupResult.HIT] * 2
            m.complete_store(k, "a")
            m.on_request_finished("a")
            rows = list(m.prepare_load(k, "b").block_ids)
        assert reader.submit_load(2, ids(rows), ids([6, 7])) is True
        assert results(reader) == [(2, True)]
        assert (rank1_tensors[0][6:8] == tensors[0][[3, 5]]).all()
        assert m.kvtier_stats()["manager"]["off_step_store_completions"] == 2
        with m.lock:
            m.complete_load(k, "b")
    finally:
        reader.shutdown()
        writer.shutdown()
        m.shutdown()
