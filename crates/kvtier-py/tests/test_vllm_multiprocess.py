"""kvtier.vllm driven the way vLLM's offloading connector drives it, across processes: a
scheduler process (this one: spec → manager, steps in connector order) and two worker processes
(ranks 0 and 1, reporters = 2) whose "GPU" KV tensors are numpy arrays. Bytes the workers store
are cascaded to a disk tier, evicted from the CPU tier, promoted back, and loaded bit-exact."""

import multiprocessing
import time
from types import SimpleNamespace

import pytest

import kvtier
from kvtier import LookupResult
from kvtier.vllm import KvtierOffloadingSpec

import vllm_worker

# A hang guard for waits on background work, not a speed requirement.
PATIENCE_S = 60


def chain(tmp_path):
    path = tmp_path / "chain.toml"
    path.write_text(
        f"""
[primary]
type = "cpu"
capacity = 4
eviction = "lru"
shared_memory = "{tmp_path}/arena"

[[secondary]]
type = "disk"
name = "disk"
path = "{tmp_path}/disk"
capacity = "1MiB"
# The test follows every chunk to disk: no reuse gate (a disk tier defaults to after_first_reuse).
admission = "always"

[control_plane]
thread = true
idle_wait = "1ms"
off_step = true
"""
    )
    return str(path)


def keys(prefix, n):
    return [kvtier.make_offload_key(bytes([prefix, i]) * 16, 0) for i in range(n)]


def wait_until(cond, what):
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.005)


class Workers:
    def __init__(self, extra, world_size=2):
        ctx = multiprocessing.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=vllm_worker.main, args=(rank, world_size, extra, child), daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)
        for pipe in self.pipes:
            assert self.recv(pipe) == "ready"

    def recv(self, pipe):
        if not pipe.poll(PATIENCE_S):
            pytest.fail("a worker did not answer")
        msg = pipe.recv()
        if isinstance(msg, str) and msg.startswith("error"):
            pytest.fail(f"worker failed: {msg}")
        return msg

    def all(self, *msg):
        for pipe in self.pipes:
            pipe.send(msg)
        return [self.recv(pipe) for pipe in self.pipes]

    def stop(self):
        for pipe, p in zip(self.pipes, self.procs):
            if p.is_alive():
                try:
                    pipe.send(("exit",))
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def req(name):
    """A stand-in for vLLM's ReqContext (the adapter reads req_id and kv_transfer_params)."""
    return SimpleNamespace(req_id=name, kv_transfer_params=None)


def cascaded(m, n):
    """The disk tier stored `n` chunks and the manager processed the jobs (so their pins on the
    CPU rows are released: until then the rows can be neither evicted nor reused)."""
    st = m.kvtier_stats()
    return st["secondaries"][0]["stores"] >= n and st["jobs_in_flight"] == 0


def store_step(m, workers, r, ks, gpu_blocks):
    """One request in connector order: under the manager lock, new request, lookups,
    on_schedule_end and the store job; the lock is released while the workers copy (and report
    on the channel); then the connector completes the store and finishes the request."""
    with m.lock:
        m.on_new_request(r)
        assert [m.lookup(k, r) for k in ks] == [LookupResult.MISS] * len(ks)
        m.on_schedule_end(SimpleNamespace(new_req_ids=[r.req_id], preempted_req_ids=[]))
        out = m.prepare_store(ks, r)
    assert out.keys_to_store == ks
    assert workers.all("store", gpu_blocks, list(out.store_spec.block_ids)) == [True, True]
    # Both ranks reported on the channel: the control thread completes the store before the
    # connector does (its complete_store below is then absorbed).
    wait_until(
        lambda: all(m.lookup(k, r) is LookupResult.HIT for k in ks),
        "the workers' reports to complete the store",
    )
    with m.lock:
        m.complete_store(out.keys_to_store, r)
        m.on_request_finished(r)
    return out


def test_stored_cascaded_evicted_promoted_and_loaded_bit_exact(tmp_path):
    extra = {"kvtier_chain": chain(tmp_path), "kvtier_channel": str(tmp_path / "done.sock")}
    spec = KvtierOffloadingSpec.from_settings(extra, vllm_worker.block_bytes(), world_size=2)
    assert spec.arena_path == f"{tmp_path}/arena"
    # vLLM's order: the workers register their KV caches before the scheduler (and with it the
    # manager, its arena and its channel) exists; they open those at their first job.
    workers = Workers(extra)
    m = None
    try:
        m = spec.get_manager()
        assert spec.get_manager() is m
        first, second = keys(1, 4), keys(2, 4)
        store_step(m, workers, req("a"), first, [0, 1, 2, 3])
        wait_until(lambda: cascaded(m, 4), "the first chunks to cascade to disk")
        out = store_step(m, workers, req("b"), second, [4, 5, 6, 7])
        assert sorted(out.evicted_keys) == sorted(first), "the CPU tier holds 4 chunks"
        wait_until(lambda: cascaded(m, 8), "the second chunks to cascade to disk")

        # The first chunks are gone from the CPU tier; the disk tier has them: promotion.
        c = req("c")
        with m.lock:
            m.on_new_request(c)
            assert [m.lookup(k, c) for k in first] == [LookupResult.HIT_PENDING] * 4
            m.on_schedule_end(SimpleNamespace(new_req_ids=["c"], preempted_req_ids=[]))
        rows = []

        def promoted():
            # One scheduler step: the lookups and the load that pins the hits share the lock.
            with m.lock:
                if all(m.lookup(k, c) is LookupResult.HIT for k in first):
                    rows.extend(int(r) for r in m.prepare_load(first, c).block_ids)
                m.on_schedule_end()
            return bool(rows)

        wait_until(promoted, "the promotions to land")
        assert workers.all("load", rows, [8, 9, 10, 11]) == [True, True]
        with m.lock:
            # vLLM's cache-hit metrics: these chunks came from the disk tier, the second ones
            # (request b stored them) from the CPU tier.
            assert [m.get_load_source(k, c) for k in first] == ["disk"] * 4
            assert m.get_load_source(second[0], c) == "host"
            m.complete_load(first, c)
            m.on_request_finished(c)

        for rank_blocks in workers.all("blocks", [0, 1, 2, 3, 8, 9, 10, 11]):
            assert rank_blocks[4:] == rank_blocks[:4], "loaded blocks equal the stored ones"
            assert any(any(b) for b in rank_blocks[:4])
        r0, r1 = workers.all("blocks", [0])
        assert r0 != r1, "each rank kept its own slice of the rows"

        st = m.kvtier_stats()
        assert st["manager"]["promoted_keys"] == 4
        assert st["manager"]["off_step_store_completions"] == 8
        assert st["manager"]["duplicate_store_reports"] >= 8
        assert st["primary"]["evictions"] >= 4
        wait_until(lambda: not m.has_pending_work(), "the manager to go idle")

        # A copy that fails on both ranks (blocks the "GPU" does not have): vLLM cannot fail a
        # job, so both ranks finish it and report the failure on the channel; the connector's
        # success report that follows does not bring the chunks back.
        bad, d = keys(3, 2), req("d")
        with m.lock:
            m.on_new_request(d)
            out = m.prepare_store(bad, d)
        assert workers.all("store", [98, 99], list(out.store_spec.block_ids)) == [True, True]
        with m.lock:
            m.complete_store(out.keys_to_store, d)
            m.on_request_finished(d)
            e = req("e")
            m.on_new_request(e)
            assert [m.lookup(k, e) for k in bad] == [LookupResult.MISS] * 2
            m.on_request_finished(e)
        assert m.kvtier_stats()["manager"]["store_report_conflicts"] == 2
    finally:
        workers.stop()
        if m is not None:
            m.shutdown()
