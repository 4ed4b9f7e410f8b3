"""kvtier.vllm's copy engines (kvtier._copy_engine) without a GPU: the stream engine runs on a
fake device layer whose streams run when the test says, so the ordering and completion rules
of the CUDA path are checked here: a job is reported only after its event, loads are done
before the step that reads them, failed copies are reported as failed, shutdown waits for (or
gives up) copies in flight, and thousands of interleaved jobs complete exactly once.

Also: the address arithmetic of the pointer mover (what vLLM's swap_blocks_batch gets on a GPU)
round-trips bit-exact through a real arena, emulated with memmove."""

import ctypes
import logging
import random
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

import kvtier
from kvtier._copy_engine import (
    CopyJob,
    NumpyMover,
    PointerMover,
    StreamCopyEngine,
    SyncCopyEngine,
    make_engine,
)
from kvtier.vllm import KvtierOffloadingSpec, KvtierOffloadingWorker
from conftest import keys

HIT, HIT_PENDING, MISS = "HIT", "HIT_PENDING", "MISS"


def _name(result):
    """A lookup's answer by name (kvtier's enum, or vLLM's when vLLM is importable)."""
    return getattr(result, "name", None) or str(result).rsplit(".", 1)[-1]


# -- the fake device layer ---------------------------------------------------------------------
class FakeEvent:
    def __init__(self):
        self.done = False
        self.error = None
        self.t = None


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.ops = deque()
        self.error = None

    def __repr__(self):
        return f"FakeStream({self.name}, {[k for k, _ in self.ops]})"


class FakeDevice:
    """Streams are queues of operations (wait for an event, run a function, record an event)
    that run only when the test calls :meth:`run` (or a host ``synchronize`` needs them: the
    "device" then runs whatever it can). A function that raises fails the next event recorded
    on its stream (then the stream goes on), as a failed copy would."""

    def __init__(self):
        self.lock = threading.RLock()
        self.model = FakeStream("model")
        self.streams = [self.model]
        self.clock = 0

    # the device layer
    def new_stream(self):
        s = FakeStream(f"copy{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self):
        return self.model

    def new_event(self, timing=False):
        return FakeEvent()

    def record(self, event, stream):
        with self.lock:
            event.done, event.error = False, None
            stream.ops.append(("record", event))

    def wait(self, stream, event):
        with self.lock:
            stream.ops.append(("wait", event))

    def launch(self, stream, fn):
        with self.lock:
            stream.ops.append(("run", fn))

    def query(self, event):
        with self.lock:
            if event.error is not None:
                raise event.error
            return event.done

    def synchronize(self, event):
        with self.lock:
            while not event.done and event.error is None:
                if not self.run():
                    raise RuntimeError("fake device: the event can never fire")
            if event.error is not None:
                raise event.error

    def elapsed_s(self, start, end):
        return (end.t - start.t) * 1e-3

    # the test's controls
    def _one(self, s):
        if not s.ops:
            return False
        kind, x = s.ops[0]
        if kind == "wait" and not (x.done or x.error is not None):
            return False
        if kind == "run":
            try:
                x()
            except Exception as e:
                s.error = e
        elif kind == "record":
            self.clock += 1
            x.t = self.clock
            if s.error is not None:
                x.error, s.error = s.error, None
            else:
                x.done = True
        s.ops.popleft()
        return True

    def run(self, *streams, ops=None):
        """Runs operations of ``streams`` (default: all) until none can run, or ``ops`` of
        them ran; returns how many ran."""
        with self.lock:
            streams = streams or tuple(self.streams)
            n = 0
            progress = True
            while progress and (ops is None or n < ops):
                progress = False
                for s in streams:
                    if (ops is None or n < ops) and self._one(s):
                        n += 1
                        progress = True
            return n

    def queued(self, stream):
        return [k for k, _ in stream.ops]


# -- helpers ---------------------------------------------------------------------------------
def ids(xs, **gpu):
    return SimpleNamespace(block_ids=np.array(xs, dtype=np.int64), **gpu)


def results(worker):
    return [(r.job_id, r.success) for r in worker.get_finished()]


def make_spec(tmp_path, capacity=8, world_size=1, rank=0, pages=(64,), blocks=16, bpc=1, seed=0):
    """A spec over a chain with a shared arena and off-step completions applied when the
    scheduler side calls in; numpy "GPU" tensors of random bytes, one page per block each."""
    chain = tmp_path / "chain.toml"
    chain.write_text(
        f'[primary]\ntype = "cpu"\ncapacity = {capacity}\nshared_memory = "{tmp_path}/arena"\n'
        "[control_plane]\nthread = false\noff_step = true\n"
    )
    rng = np.random.default_rng(seed + rank)
    tensors = [rng.integers(0, 255, (blocks, p), dtype=np.uint8) for p in pages]
    sp = KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, sum(pages), world_size, rank, bpc)
    return sp, tensors


class Rig:
    """A manager, one rank's worker on the fake device, and the scheduler-side calls."""

    def __init__(self, tmp_path, mover=None, **kw):
        self.sp, self.tensors = make_spec(tmp_path, **kw)
        self.m = self.sp.get_manager()
        self.dev = FakeDevice()
        handler = self.sp.get_transfer_handler(self.tensors)
        factory = (lambda h: make_engine(h, device=self.dev)) if mover is None else (lambda h: mover(h, self.dev))
        self.worker = KvtierOffloadingWorker(handler, f"{self.sp.arena_path}.keys", engine=factory)
        self.worker.shutdown_timeout_s = 1.0
        self.handler = handler

    def row(self, row, n=64):
        """The first ``n`` bytes of a row, read past its grants (a write grant is held while the
        row's copy is in flight)."""
        stride = self.handler.row_stride
        return self.handler.region_array()[row * stride : row * stride + n].tobytes()

    @property
    def store_stream(self):
        return self.worker.engine.streams["store"]

    @property
    def load_stream(self):
        return self.worker.engine.streams["load"]

    def prepare_store(self, ns, req="a"):
        with self.m.lock:
            self.m.on_new_request(req)
            return self.m.prepare_store(keys(*ns), req)

    def lookups(self, ns, req="b"):
        with self.m.lock:
            return [_name(self.m.lookup(k, req)) for k in keys(*ns)]

    def stored(self, ns, req="a"):
        """The connector's complete_store, after the worker finished the job."""
        with self.m.lock:
            self.m.complete_store(keys(*ns), req)
            self.m.on_request_finished(req)

    def prepare_load(self, ns, req="b"):
        with self.m.lock:
            assert [_name(self.m.lookup(k, req)) for k in keys(*ns)] == [HIT] * len(ns)
            return list(self.m.prepare_load(keys(*ns), req).block_ids)

    def close(self):
        self.worker.shutdown()
        self.m.shutdown()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


# -- ordering and completion -------------------------------------------------------------------
def test_a_store_is_reported_only_after_its_event(rig):
    out = rig.prepare_store([1, 2])
    rows = list(out.store_spec.block_ids)
    assert rig.worker.submit_store(1, ids([3, 5]), out.store_spec) is True
    assert isinstance(rig.worker.engine, StreamCopyEngine)
    # Queued, not run: nothing finished, nothing reported, the rows untouched.
    assert results(rig.worker) == []
    assert rig.lookups([1, 2]) == [HIT_PENDING] * 2
    assert rig.row(rows[0]) == bytes(64)
    with pytest.raises(kvtier.KvtierError, match="busy"):
        rig.m.manager.read_row(rows[0])  # the write grant is held while the copy is in flight
    # The copy runs, but its end event is not recorded yet: still nothing.
    stream = rig.store_stream
    rig.dev.run(rig.dev.model)
    while rig.dev.queued(stream)[:1] != ["record"] or len(stream.ops) > 1:
        rig.dev.run(stream, ops=1)
    assert rig.row(rows[0]) == rig.tensors[0][3].tobytes()
    assert results(rig.worker) == []
    assert rig.lookups([1, 2]) == [HIT_PENDING] * 2
    rig.dev.run(stream)
    # The event fired: get_finished reports on the channel and hands the job to vLLM.
    assert results(rig.worker) == [(1, True)]
    assert rig.lookups([1, 2]) == [HIT] * 2, "the worker's report completed the store"
    assert rig.m.kvtier_stats()["manager"]["off_step_store_completions"] == 2
    rig.stored([1, 2])


def test_a_store_waits_for_the_forward_queued_before_it_and_the_model_never_waits(rig):
    # A forward queued on the model's stream writes block 3; the store of block 3 is submitted
    # after it (vLLM submits a step's stores at the next step).
    new = np.full(64, 7, dtype=np.uint8)
    rig.dev.launch(rig.dev.model, lambda: rig.tensors[0].__setitem__(3, new))
    out = rig.prepare_store([1])
    rig.worker.submit_store(1, ids([3]), out.store_spec)
    # The store stream cannot start before the forward.
    assert rig.dev.run(rig.store_stream) == 0
    assert "wait" not in rig.dev.queued(rig.dev.model), "the model's stream never waits on a store"
    rig.dev.run(rig.dev.model)
    rig.dev.run(rig.store_stream)
    assert results(rig.worker) == [(1, True)]
    assert rig.m.manager.read_row(int(out.store_spec.block_ids[0]))[:64] == new.tobytes()
    # More forwards queue behind nothing: the model's stream only records events for copies.
    rig.dev.launch(rig.dev.model, lambda: None)
    assert rig.dev.run(rig.dev.model) == 1
    rig.stored([1])


def _store_and_finish(rig, ns, blocks, job=1):
    out = rig.prepare_store(ns)
    rig.worker.submit_store(job, ids(blocks), out.store_spec)
    rig.dev.run()
    assert results(rig.worker) == [(job, True)]
    rig.stored(ns)


def test_loads_are_done_before_the_step_that_reads_them(rig):
    _store_and_finish(rig, [1, 2], [3, 5])
    t = rig.tensors[0]
    expected = t[[3, 5]].copy()
    rows = rig.prepare_load([1, 2])
    # Writes queued on the model's stream before the load (vLLM zeroes new blocks) land first.
    rig.dev.launch(rig.dev.model, lambda: t.__setitem__(slice(8, 10), 0))
    # An ordinary load: its request resumes when get_finished reports it, not before.
    rig.worker.submit_load(7, ids(rows), ids([8, 9]))
    assert results(rig.worker) == []
    assert rig.dev.run(rig.load_stream) == 0, "the load waits for the model's earlier writes"
    rig.dev.run(rig.dev.model)
    rig.dev.run(rig.load_stream, ops=2)  # the wait and the start event: the copy not yet run
    assert results(rig.worker) == []
    rig.dev.run(rig.load_stream)
    assert results(rig.worker) == [(7, True)]
    assert (t[8:10] == expected).all()
    with rig.m.lock:
        rig.m.complete_load(keys(1, 2), "b")

    # An expedited load (its request runs in this very step): vLLM waits for it before the
    # forward; after wait() the blocks hold the data whatever the device does next.
    rows = rig.prepare_load([1, 2], req="c")
    t[10:12] = 0
    rig.worker.submit_load(8, ids(rows), ids([10, 11]), expedited=True)
    assert rig.worker.engine.streams["expedited"].ops, "expedited loads have a stream of their own"
    seen = []
    rig.worker.wait({8})
    rig.dev.launch(rig.dev.model, lambda: seen.append(t[10:12].copy()))  # the forward
    rig.dev.run(rig.dev.model)
    assert (seen[0] == expected).all()
    assert results(rig.worker) == [(8, True)]
    with rig.m.lock:
        rig.m.complete_load(keys(1, 2), "c")


class FailingMover:
    """A mover whose copies of the jobs named fail on the device."""

    def __init__(self, inner, fail):
        self.inner, self.fail = inner, set(fail)

    def run(self, job, keep):
        if job.job_id in self.fail:
            raise RuntimeError(f"device error in job {job.job_id}")
        self.inner.run(job, keep)


def _failing(fail):
    def build(handler, dev):
        mover = NumpyMover(handler.tensors, handler.region_array(), handler.row_stride)
        return StreamCopyEngine(handler, dev, FailingMover(mover, fail))

    return build


def test_a_failed_copy_is_reported_as_failed(tmp_path, caplog):
    rig = Rig(tmp_path, mover=_failing({1, 3}))
    try:
        out = rig.prepare_store([1, 2])
        rig.worker.submit_store(1, ids([3, 5]), out.store_spec)
        rig.dev.run()
        # vLLM cannot fail a job: it finishes; the manager heard of the failure first.
        assert results(rig.worker) == [(1, True)]
        assert "reported as failed" in caplog.text
        rig.stored([1, 2])
        assert rig.lookups([1, 2]) == [MISS] * 2
        assert rig.m.kvtier_stats()["manager"]["store_report_conflicts"] == 2

        # A GPU block that does not exist fails at submission, before any copy is queued.
        out = rig.prepare_store([4])
        rig.worker.submit_store(2, ids([99]), out.store_spec)
        assert rig.dev.queued(rig.store_stream) == []
        assert results(rig.worker) == [(2, True)]
        rig.stored([4])
        assert rig.lookups([4]) == [MISS]

        # A load that fails on the device raises where it is found (its blocks hold wrong KV).
        _store_and_finish(rig, [5], [1], job=4)
        rows = rig.prepare_load([5])
        rig.worker.submit_load(3, ids(rows), ids([9]))
        rig.dev.run()
        with pytest.raises(kvtier.KvtierError, match="load job 3 .* cannot fail a load"):
            rig.worker.get_finished()
        assert results(rig.worker) == []
    finally:
        rig.close()


def test_shutdown_waits_for_copies_in_flight(rig):
    out = rig.prepare_store([1])
    rig.worker.submit_store(1, ids([2]), out.store_spec)
    timer = threading.Timer(0.1, rig.dev.run)
    timer.start()
    t0 = time.monotonic()
    rig.worker.shutdown()
    timer.join()
    assert time.monotonic() - t0 >= 0.09
    assert results(rig.worker) == [(1, True)]
    assert rig.lookups([1]) == [HIT], "reported before the handler closed"
    rig.worker.shutdown()  # idempotent


def test_shutdown_gives_up_copies_that_never_finish(rig, caplog):
    out = rig.prepare_store([1])
    rig.worker.submit_store(1, ids([2]), out.store_spec)
    rig.worker.shutdown_timeout_s = 0.05
    rig.worker.shutdown()
    engine = rig.worker.engine
    assert engine.abandoned and engine.in_flight() == 0
    assert "still running after" in caplog.text
    # The store is reported failed, and its row stays granted (the copy may still write it).
    assert results(rig.worker) == [(1, True)]
    assert "reported as failed" in caplog.text
    row = int(out.store_spec.block_ids[0])
    with pytest.raises(kvtier.KvtierError):
        rig.handler.view.row(row, True)
    rig.stored([1])
    assert rig.lookups([1]) == [MISS]


def test_the_cpu_engine_copies_at_submission(tmp_path):
    sp, tensors = make_spec(tmp_path)
    m = sp.get_manager()
    worker = sp.get_worker(tensors)
    try:
        with m.lock:
            m.on_new_request("a")
            out = m.prepare_store(keys(1), "a")
        worker.submit_store(1, ids([4]), out.store_spec)
        assert isinstance(worker.engine, SyncCopyEngine)
        with m.lock:
            # Reported at submission, as before the copy engines.
            assert _name(m.lookup(keys(1)[0], "b")) == HIT
        assert results(worker) == [(1, True)]
    finally:
        worker.shutdown()
        m.shutdown()


# -- exactly once ------------------------------------------------------------------------------
class Grant:
    def __init__(self, owner, row):
        self.owner, self.chunk_id = owner, row
        owner.held[row] = owner.held.get(row, 0) + 1

    def release(self):
        self.owner.held[self.chunk_id] -= 1


class StubHandler:
    """The parts of KvtierTransferHandler the stream engine and the worker use, with grant and
    report bookkeeping."""

    rank, world_size, rank_chunk_bytes, tensors = 0, 1, 8, []

    def __init__(self):
        self.held = {}
        self.reports = []

    def plan(self, blocks, rows, *groups):
        return [(r, [(0, [b], 0, 8)]) for r, b in zip(rows, blocks)]

    def _row(self, row, write):
        return Grant(self, row)

    def report(self, ks, success):
        self.reports.append((list(ks), success))
        return True

    def close(self, keep_pinned=False):
        pass


class CountingMover:
    def __init__(self, fail):
        self.runs = {}
        self.fail = fail

    def run(self, job, keep):
        self.runs[job.job_id] = self.runs.get(job.job_id, 0) + 1
        if job.job_id in self.fail:
            raise RuntimeError("boom")


def test_thousands_of_interleaved_jobs_complete_exactly_once():
    rng = random.Random(33)
    dev = FakeDevice()
    handler = StubHandler()
    fail = {j for j in range(1, 4001) if rng.random() < 0.05}
    mover = CountingMover(fail)
    worker = KvtierOffloadingWorker(handler, None, engine=StreamCopyEngine(handler, dev, mover))
    # Keys per store job; the worker reads them from the row-key table, stubbed here.
    job_keys = {}
    worker._row_keys = SimpleNamespace(keys_of=lambda rows: [b"k%d-%d" % (next_job[0], r) for r in rows])
    next_job = [0]
    seen = []
    loads = set()
    for job in range(1, 4001):
        next_job[0] = job
        n = rng.randint(1, 4)
        rows, blocks = rng.sample(range(1000), n), rng.sample(range(1000), n)
        kind = rng.random()
        if kind < 0.5:
            job_keys[job] = [b"k%d-%d" % (job, r) for r in rows]
            worker.submit_store(job, ids(blocks), ids(rows))
        else:
            loads.add(job)
            try:
                worker.submit_load(job, ids(rows), ids(blocks), expedited=kind > 0.9)
            except kvtier.KvtierError:  # a failed load found at this poll
                pass
        action = rng.random()
        try:
            if action < 0.3:
                dev.run(rng.choice(dev.streams), ops=rng.randint(0, 12))
            elif action < 0.5:
                seen += worker.get_finished()
            elif action < 0.52 and job > 10:
                worker.wait({rng.randint(job - 10, job)})
        except kvtier.KvtierError as e:
            assert "cannot fail a load" in str(e)
    while worker.engine.in_flight():
        dev.run()
        try:
            seen += worker.get_finished()
        except kvtier.KvtierError:
            pass
    seen += worker.get_finished()
    done = [r.job_id for r in seen]
    failed_loads = loads & fail
    assert sorted(done) == sorted(set(range(1, 4001)) - failed_loads), "every job exactly once"
    assert all(r.success for r in seen), "failed stores reach the manager, so vLLM sees success"
    reported = {}
    for ks, ok in handler.reports:
        for k in ks:
            assert k not in reported, f"key {k!r} reported twice"
            reported[k] = ok
    expected = {k: j not in fail for j, ks in job_keys.items() for k in ks}
    assert reported == expected, "every stored key reported once, failed ones as failed"
    assert set(mover.runs.values()) == {1}
    assert all(v == 0 for v in handler.held.values()), "every grant released"
    worker.shutdown()
    worker.shutdown()


# -- addresses: what vLLM's swap_blocks_batch gets on a GPU -----------------------------------
class HostTensor:
    """What the pointer mover reads of a torch tensor, over a numpy array."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape
        self.is_cuda = False

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return SimpleNamespace(numel=lambda: self.a[i].size, nbytes=self.a[i].nbytes)

    def data_ptr(self):
        return self.a.ctypes.data

    def stride(self, dim):
        return self.a.strides[dim] // self.a.itemsize

    def element_size(self):
        return self.a.itemsize


def memmove_swap(src, dst, sizes, is_src_access_order_any=False):
    for s, d, n in zip(src, dst, sizes):
        ctypes.memmove(int(d), int(s), int(n))


def _pointer_engine(handler, dev):
    view = handler.open()
    mover = PointerMover(handler.tensors, view.row_region[0], handler.row_stride, memmove_swap, as_args=lambda a: a)
    return StreamCopyEngine(handler, dev, mover)


@pytest.mark.parametrize("mover", ["numpy", "pointer", "torch"])
def test_round_trips_are_bit_exact_over_groups_and_partial_chunks(tmp_path, mover):
    """Two KV-cache groups (tensors 0 and 1, and tensor 2), two blocks per chunk, a load from
    the middle of a chunk: the engine's copies land where the synchronous ones do. ``torch``:
    the torch mover (CUDA's fallback when vLLM's op is missing) over CPU tensors."""
    pages = (16, 8, 32)
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 255, (12, p), dtype=np.uint8) for p in pages]
    original = [a.copy() for a in arrays]
    if mover == "torch":
        torch = pytest.importorskip("torch")
        # Different dtypes: the mover copies bytes through uint8 views.
        arrays = [torch.from_numpy(a).view(dt) for a, dt in zip(arrays, (torch.float16, torch.uint8, torch.int32))]
    chain = tmp_path / "chain.toml"
    chain.write_text(f'[primary]\ntype = "cpu"\ncapacity = 4\nshared_memory = "{tmp_path}/arena"\n')
    sp = KvtierOffloadingSpec.from_settings({"kvtier_chain": str(chain)}, sum(pages), blocks_per_chunk=2)
    m = sp.get_manager()
    dev = FakeDevice()
    tensors = [HostTensor(a) for a in arrays] if mover == "pointer" else arrays
    handler = sp.get_transfer_handler(tensors, group_tensors=[[0, 1], [2]])
    build = _pointer_engine if mover == "pointer" else (lambda h, d: make_engine(h, device=d))
    worker = KvtierOffloadingWorker(handler, None, engine=lambda h: build(h, dev))
    reference = sp.get_transfer_handler([a.copy() for a in original], group_tensors=[[0, 1], [2]])
    assert isinstance(worker.engine, StreamCopyEngine)
    try:
        gpu = ids([0, 1, 2, 3, 4, 5], group_sizes=[4, 2], block_indices=[0, 0])
        worker.submit_store(1, gpu, ids([0, 1, 2]))
        dev.run()
        assert results(worker) == [(1, True)]
        stored = [m.manager.read_row(r) for r in range(3)]
        # The synchronous handler writes the same bytes.
        for r in range(3):
            with handler.view.row(r, True) as row:
                row.array()[:] = 0
        reference.copy_out([0, 1, 2, 3, 4, 5], [0, 1, 2], [4, 2], [0, 0])
        assert [m.manager.read_row(r) for r in range(3)] == stored
        # Loads: from the middle of group 0's first chunk, and group 1's chunk.
        worker.submit_load(2, ids([0, 1]), ids([9, 10, 11], group_sizes=[3], block_indices=[1]))
        worker.submit_load(3, ids([2]), ids([8], group_sizes=[0, 1], block_indices=[0, 1]))
        dev.run()
        assert sorted(results(worker)) == [(2, True), (3, True)]
        now = [np.asarray(a.view(torch.uint8)) if mover == "torch" else a for a in arrays]
        for a, o in zip(now[:2], original[:2]):
            assert (a[9:12] == o[1:4]).all()
        assert (now[2][8] == original[2][5]).all()
        assert (now[2][9:12] == original[2][9:12]).all(), "group 0 does not touch tensor 2"
    finally:
        worker.shutdown()
        reference.close()
        m.shutdown()


def test_pointer_descriptors_coalesce_consecutive_blocks(tmp_path):
    a = np.zeros((16, 8), dtype=np.float32)  # 32-byte pages
    t = HostTensor(a)
    mover = PointerMover([t], 1 << 20, 4096, memmove_swap, as_args=lambda x: x)
    base = a.ctypes.data
    job = CopyJob(1, True, [(2, [(0, [4, 5, 6], 0, 96)]), (3, [(0, [9, 3], 32, 64)])])
    dev, host, sizes = mover.descriptors(job)
    assert dev == [base + 4 * 32, base + 9 * 32, base + 3 * 32]
    assert host == [(1 << 20) + 2 * 4096, (1 << 20) + 3 * 4096 + 32, (1 << 20) + 3 * 4096 + 64]
    assert sizes == [96, 32, 32]


def test_the_row_region_addresses_the_rows_grants_give(rig):
    view = rig.handler.open()
    address, length = view.row_region
    assert length == rig.handler.row_stride * view.num_chunks
    for r in (0, 3):
        with view.row(r, False) as row:
            data = row.array()
            assert data.__array_interface__["data"][0] == address + r * rig.handler.row_stride
            del data


def test_multi_rank_stores_hold_write_grants_only_to_submit(tmp_path):
    """Ranks write slices of the same rows: a write grant held across an asynchronous copy would
    stall the other rank's submission, so it is released once the copy is queued; loads keep
    their (shared) read grants until done."""
    r0 = Rig(tmp_path, world_size=2, rank=0)
    sp1, t1 = make_spec(tmp_path, world_size=2, rank=1)
    dev1 = FakeDevice()
    w1 = KvtierOffloadingWorker(
        sp1.get_transfer_handler(t1), f"{sp1.arena_path}.keys", engine=lambda h: make_engine(h, device=dev1)
    )
    try:
        out = r0.prepare_store([1])
        r0.worker.submit_store(1, ids([2]), out.store_spec)
        assert not r0.worker.engine.hold_write_grants
        w1.handler.grant_timeout_s = 0.5
        w1.submit_store(1, ids([2]), out.store_spec)  # not stalled by rank 0's queued copy
        assert results(w1) == []
        r0.dev.run()
        dev1.run()
        assert results(r0.worker) == [(1, True)] and results(w1) == [(1, True)]
        assert r0.lookups([1]) == [HIT], "both ranks reported"
        row = r0.m.manager.read_row(int(out.store_spec.block_ids[0]))
        assert row[:64] == r0.tensors[0][2].tobytes() and row[64:128] == t1[0][2].tobytes()
        r0.stored([1])
        rows = r0.prepare_load([1])
        r0.worker.submit_load(2, ids(rows), ids([7]))
        with pytest.raises(kvtier.KvtierError):
            r0.handler.view.row(rows[0], True)  # the read grant is held while the load runs
        r0.dev.run()
        assert results(r0.worker) == [(2, True)]
        with r0.handler.view.row(rows[0], True):
            pass
    finally:
        w1.shutdown()
        r0.close()


def test_cpu_tensors_get_the_sync_engine(tmp_path):
    sp, tensors = make_spec(tmp_path)
    assert isinstance(make_engine(sp.get_transfer_handler(tensors)), SyncCopyEngine)
