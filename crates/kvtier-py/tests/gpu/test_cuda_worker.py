"""kvtier.vllm's worker on real CUDA tensors (scripts/gpu-check.sh runs these on a GPU machine):
bit-exact round trips device → arena → device for several KV layouts (one group; several
groups with partial chunks; two ranks on one device sharing rows), through both movers (vLLM's
swap_blocks_batch op where vLLM is built for CUDA, and the torch fallback), and the stream
ordering against the model's stream."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import keys
from kvtier._copy_engine import PointerMover, StreamCopyEngine, TorchCudaDevice, TorchMover, make_engine, vllm_swap_blocks
from kvtier.vllm import KvtierOffloadingSpec, KvtierOffloadingWorker

pytestmark = pytest.mark.cuda

PATIENCE_S = 30


def _torch():
    import torch

    return torch


def gpu_ids(blocks, group_sizes=None, block_indices=None):
    ns = SimpleNamespace(block_ids=np.array(blocks, dtype=np.int64))
    if group_sizes is not None:
        ns.group_sizes, ns.block_indices = list(group_sizes), list(block_indices)
    return ns


def rows_spec(rows):
    return SimpleNamespace(block_ids=np.array(rows, dtype=np.int64))


def kv_tensors(rank, pages, blocks=64):
    """vLLM-like KV tensors on cuda:0, one page per block, of mixed dtypes and random bits."""
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    out = []
    for i, page in enumerate(pages):
        if i % 2 == 0:
            t = torch.randn((blocks, page // 2), generator=g, device="cuda").to(torch.bfloat16)
        else:
            t = torch.randint(-128, 127, (blocks, page), generator=g, device="cuda", dtype=torch.int8)
        out.append(t)
    return out


def same(a, b):
    torch = _torch()
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def engine_factory(kind):
    def build(handler):
        view = handler.open()
        if kind == "torch":
            mover = TorchMover(handler.tensors, handler.region_array(view), handler.row_stride)
        else:
            swap = vllm_swap_blocks()
            if swap is None:
                pytest.skip("vLLM's swap_blocks_batch op is not available (vLLM not built for CUDA)")
            mover = PointerMover(handler.tensors, view.row_region[0], handler.row_stride, swap)
        return make_engine(handler, mover=mover)

    return build


MOVERS = ["vllm-op", "torch"]


class Ranks:
    def __init__(self, tmp_path, pages, mover, world_size=1, bpc=1, groups=None, capacity=32):
        chain = tmp_path / "chain.toml"
        chain.write_text(
            f'[primary]\ntype = "cpu"\ncapacity = {capacity}\nshared_memory = "{tmp_path}/arena"\n'
            "[control_plane]\nthread = false\noff_step = true\n"
        )
        page_bytes = sum(pages)
        self.specs = [
            KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, page_bytes, world_size, r, bpc)
            for r in range(world_size)
        ]
        self.m = self.specs[0].get_manager()
        self.tensors = [kv_tensors(r, pages) for r in range(world_size)]
        self.workers = []
        for sp, ts in zip(self.specs, self.tensors):
            h = sp.get_transfer_handler(ts, group_tensors=groups)
            self.workers.append(KvtierOffloadingWorker(h, f"{sp.arena_path}.keys", engine=engine_factory(mover)))

    def finish(self, job):
        deadline = time.monotonic() + PATIENCE_S
        pending = set(range(len(self.workers)))
        while pending:
            for r in list(pending):
                got = [(x.job_id, x.success) for x in self.workers[r].get_finished()]
                if got:
                    assert got == [(job, True)]
                    pending.discard(r)
            assert time.monotonic() < deadline, "a copy never finished"

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.m.shutdown()


def _round_trip(r, n_keys, src, dst, store_gpu, load_gpu):
    m = r.m
    ks = keys(*range(1, n_keys + 1))
    with m.lock:
        m.on_new_request("a")
        out = m.prepare_store(ks, "a")
    rows = list(out.store_spec.block_ids)
    for w in r.workers:
        w.submit_store(1, store_gpu, rows_spec(rows))
    assert isinstance(r.workers[0].engine, StreamCopyEngine)
    assert isinstance(r.workers[0].engine.device, TorchCudaDevice)
    r.finish(1)
    with m.lock:
        m.complete_store(ks, "a")
        m.on_request_finished("a")
        for k in ks:
            m.lookup(k, "b")
        rows = list(m.prepare_load(ks, "b").block_ids)
    for ts in r.tensors:
        for t in ts:
            t[dst] = 0
    for w in r.workers:
        w.submit_load(2, rows_spec(rows), load_gpu)
    r.finish(2)
    with m.lock:
        m.complete_load(ks, "b")


@pytest.mark.parametrize("mover", MOVERS)
def test_one_group_round_trips_bit_exact(tmp_path, mover):
    torch = _torch()
    r = Ranks(tmp_path, (4096, 2048, 4096), mover)
    try:
        src = [3, 9, 10, 11, 20, 7]
        dst = [40, 41, 42, 50, 51, 60]
        before = [t[src].clone() for t in r.tensors[0]]
        _round_trip(r, 6, src, dst, gpu_ids(src), gpu_ids(dst))
        torch.cuda.synchronize()
        for t, b in zip(r.tensors[0], before):
            assert same(t[dst], b)
    finally:
        r.close()


@pytest.mark.parametrize("mover", MOVERS)
def test_groups_and_partial_chunks_round_trip_bit_exact(tmp_path, mover):
    """Group 0 (tensors 0, 1) from logical block 2, group 1 (tensor 2) from logical block 1;
    four blocks per chunk, so first and last chunks of each group are partial."""
    torch = _torch()
    r = Ranks(tmp_path, (1024, 512, 2048), mover, bpc=4, groups=[[0, 1], [2]])
    try:
        g0, g1 = [5, 6, 7, 8, 9, 12], [30, 31, 33]
        # Group 0: 6 blocks from logical 2 → chunks of 2, 4 blocks: 2 chunks; group 1: 3 blocks
        # from logical 1 → one chunk.
        spec = gpu_ids(g0 + g1, [6, 3], [2, 1])
        d0, d1 = [44, 45, 46, 47, 48, 49], [55, 56, 57]
        before = [r.tensors[0][0][g0].clone(), r.tensors[0][1][g0].clone(), r.tensors[0][2][g1].clone()]
        untouched = r.tensors[0][2][d0].clone()
        _round_trip(r, 3, d0 + d1, d0 + d1, spec, gpu_ids(d0 + d1, [6, 3], [2, 1]))
        torch.cuda.synchronize()
        t = r.tensors[0]
        assert same(t[0][d0], before[0]) and same(t[1][d0], before[1]) and same(t[2][d1], before[2])
        assert same(t[2][d0], torch.zeros_like(untouched))
    finally:
        r.close()


@pytest.mark.parametrize("mover", MOVERS)
def test_two_ranks_on_one_device_share_rows_bit_exact(tmp_path, mover):
    torch = _torch()
    r = Ranks(tmp_path, (2048, 2048), mover, world_size=2)
    try:
        src, dst = [1, 2, 3, 4], [60, 61, 62, 63]
        before = [[t[src].clone() for t in ts] for ts in r.tensors]
        _round_trip(r, 4, src, dst, gpu_ids(src), gpu_ids(dst))
        torch.cuda.synchronize()
        for ts, bs in zip(r.tensors, before):
            for t, b in zip(ts, bs):
                assert same(t[dst], b)
        assert not same(r.tensors[0][0][dst], r.tensors[1][0][dst]), "each rank loads its own slice"
    finally:
        r.close()


def test_a_store_reads_what_the_model_stream_wrote_before_it_and_an_expedited_load_is_waited(tmp_path):
    """Work queued on the model's stream before a submission is ordered before the copy; after
    vLLM's wait() for an expedited load, the next kernel on the model's stream reads the data."""
    torch = _torch()
    r = Ranks(tmp_path, (1 << 20,), "vllm-op" if vllm_swap_blocks() is not None else "torch")
    try:
        t = r.tensors[0][0]
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):  # keep the model's stream busy so a copy that did not wait would win
            big = big @ big / 64
        t[5].fill_(7)
        m = r.m
        ks = keys(1)
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(ks, "a")
        w = r.workers[0]
        w.submit_store(1, gpu_ids([5]), out.store_spec)
        r.finish(1)
        row = int(out.store_spec.block_ids[0])
        stride = w.handler.row_stride
        stored = w.handler.region_array()[row * stride : row * stride + t[5].numel() * t.element_size()]
        assert (np.frombuffer(stored.tobytes(), dtype=np.int16) == torch.full((1,), 7, dtype=t.dtype).view(torch.int16).item()).all()
        with m.lock:
            m.complete_store(ks, "a")
            m.on_request_finished("a")
            m.lookup(ks[0], "b")
            rows = list(m.prepare_load(ks, "b").block_ids)
        t[9].zero_()
        w.submit_load(2, rows_spec(rows), gpu_ids([9]), expedited=True)
        w.wait({2})
        seen = t[9].clone()  # queued on the model's stream after the wait
        torch.cuda.current_stream().synchronize()
        assert same(seen, t[5])
        assert [(x.job_id, x.success) for x in w.get_finished()] == [(2, True)]
        with m.lock:
            m.complete_load(ks, "b")
    finally:
        r.close()


def test_the_arena_is_pinned_once(tmp_path):
    r = Ranks(tmp_path, (4096,), "torch")
    try:
        h = r.workers[0].handler
        h.open()
        assert h.pinned, "cudaHostRegister of the arena failed on this machine"
        region = h.region_array()
        assert _torch().from_numpy(region).is_pinned()
    finally:
        r.close()
