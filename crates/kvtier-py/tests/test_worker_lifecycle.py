"""A kvtier.vllm worker's end of life and its reads of arena rows: shutting down after the
manager has gone is clean and idempotent, and loads into torch tensors raise no warnings."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import kvtier
from kvtier.vllm import KvtierOffloadingSpec
from conftest import keys


def spec(tmp_path, tensors):
    chain = tmp_path / "chain.toml"
    chain.write_text(
        f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n'
        "[control_plane]\nthread = false\noff_step = true\n"
    )
    block = tensors[0][0].numel() * tensors[0].element_size() if hasattr(tensors[0], "numel") else tensors[0][0].nbytes
    return KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, block)


def ids(xs):
    return SimpleNamespace(block_ids=np.array(xs, dtype=np.int64))


def test_a_worker_shut_down_after_its_manager_closes_cleanly_and_twice(tmp_path):
    tensors = [np.arange(8 * 16, dtype=np.float32).reshape(8, 16)]
    sp = spec(tmp_path, tensors)
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    with m.lock:
        m.on_new_request("a")
        out = m.prepare_store(keys(1), "a")
    worker.submit_store(1, ids([2]), out.store_spec)
    assert [r.success for r in worker.get_finished()] == [True]
    assert worker.handler.reporter is not None, "the channel is open"
    # The engine's scheduler side goes first (its channel with it).
    m.shutdown()
    # Before the fix the goodbye on the dead channel raised KvtierError: Broken pipe.
    worker.shutdown()
    worker.shutdown()
    assert worker.handler.reporter is None
    worker.handler.close()


def test_a_reporter_whose_manager_is_gone_fails_only_its_goodbye(tmp_path):
    """What the worker's close absorbs: the binding's reporter raises at its goodbye once the
    manager has gone, and is closed (and quiet) after that."""
    tensors = [np.zeros((4, 16), dtype=np.float32)]
    sp = spec(tmp_path, tensors)
    m = sp.get_manager()
    reporter = kvtier.WorkerReporter(sp.channel_path, 0, m.manager.arena_fingerprint)
    m.shutdown()
    try:
        reporter.close()
    except kvtier.KvtierError as e:
        assert "pipe" in str(e).lower() or "connection" in str(e).lower()
    reporter.close()


def test_loads_into_torch_tensors_raise_no_warnings(tmp_path):
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16), torch.zeros(8, 4, dtype=torch.float16)]
    tensors[1][:] = torch.randn(8, 4).to(torch.float16)
    sp = KvtierOffloadingSpec.from_settings(
        {"kvtier_chain": str(_chain(tmp_path))}, sum(t[0].numel() * t.element_size() for t in tensors)
    )
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with m.lock:
                m.on_new_request("a")
                out = m.prepare_store(keys(1, 2), "a")
            worker.submit_store(1, ids([3, 5]), out.store_spec)
            assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
            with m.lock:
                m.complete_store(keys(1, 2), "a")
                m.on_request_finished("a")
                m.lookup(keys(1)[0], "b")
                rows = list(m.prepare_load(keys(1, 2), "b").block_ids)
            worker.submit_load(2, ids(rows), ids([6, 7]))
            assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
        for t in tensors:
            assert torch.equal(t[6:8], t[[3, 5]])
        with m.lock:
            m.complete_load(keys(1, 2), "b")
    finally:
        worker.shutdown()
        m.shutdown()


def _chain(tmp_path):
    chain = tmp_path / "chain.toml"
    chain.write_text(f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n')
    return chain
