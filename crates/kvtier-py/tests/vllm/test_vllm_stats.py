"""vLLM's offloading metrics from kvtier (issue 32 §3), through vLLM 0.33's own code.

A kvtier chain (a CPU tier of 2 chunks over a disk tier) runs a store, a second store that
evicts the first chunks to disk, and a request that promotes them back and loads them, with
kvtier's worker doing the copies. After every step the payload goes where vLLM sends it:

- vLLM's ``OffloadingConnectorScheduler.update_connector_output`` turns the worker's transfer
  results into load/store bytes and times, and ``OffloadingConnectorScheduler.get_stats`` merges
  the manager's ``get_stats()`` into them and adds its ``config_info()`` once;
- vLLM's ``KVConnectorLogging`` aggregates the payloads of the interval and ``reduce``s them
  into the "KV Transfer metrics" log line;
- vLLM's ``OffloadPromMetrics`` (the ``OffloadingConnector``'s Prometheus logger, built from
  the spec vLLM loads by ``spec_module_path``) records them, refusing any metric or info label
  the spec did not declare.

Those vLLM methods are called unbound on a stand-in holding only the attributes they read, so
no model, engine or GPU is needed.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import prometheus_client  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    KV_OFFLOAD_CONFIG_INFO,
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    ReqContext,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

import kvtier  # noqa: E402
from kvtier import _vllm_stats as vs  # noqa: E402
from kvtier.vllm import KvtierOffloadingManager, KvtierOffloadingSpec  # noqa: E402

PATIENCE_S = 60  # a hang guard for background work, not a speed requirement
BLOCK_FLOATS = 1024  # 4 KiB per "GPU" block (one block per chunk)


def chain(tmp_path):
    path = tmp_path / "chain.toml"
    path.write_text(
        f"""
[primary]
type = "cpu"
capacity = 2
shared_memory = "{tmp_path}/arena"

[[secondary]]
type = "disk"
name = "disk"
path = "{tmp_path}/disk"
capacity = "1MiB"
admission = "always"

[control_plane]
thread = true
idle_wait = "1ms"
off_step = true
"""
    )
    return str(path)


def extra_config(tmp_path):
    return {
        "spec_module_path": "kvtier.vllm",
        "spec_name": "KvtierOffloadingSpec",
        "kvtier_chain": chain(tmp_path),
    }


@pytest.fixture
def wired(monkeypatch):
    """kvtier.vllm's manager and spec with get_stats / config_info / build_metric_definitions /
    config_info_keys from kvtier._vllm_stats: as kvtier.vllm defines them once wired, else
    patched in here the way kvtier.vllm is to wire them. Yields whether they were patched."""
    patched = False
    if KvtierOffloadingManager.config_info is OffloadingManager.config_info:

        def get_stats(self):
            state = self.__dict__.setdefault("_test_vllm_stats_state", vs.VllmStatsState())
            return vs.stats_for_vllm(state, self)

        def config_info(self):
            return vs.config_info_for_vllm(self)

        monkeypatch.setattr(KvtierOffloadingManager, "get_stats", get_stats)
        monkeypatch.setattr(KvtierOffloadingManager, "config_info", config_info)
        patched = True
    if KvtierOffloadingSpec.build_metric_definitions.__func__ is OffloadingSpec.build_metric_definitions.__func__:
        monkeypatch.setattr(
            KvtierOffloadingSpec,
            "build_metric_definitions",
            classmethod(lambda cls, extra: vs.metric_definitions_for_vllm(extra)),
        )
        monkeypatch.setattr(
            KvtierOffloadingSpec,
            "config_info_keys",
            classmethod(lambda cls, extra: vs.config_info_keys_for_vllm(extra)),
        )
        patched = True
    yield patched


class Prometheus:
    """vLLM's OffloadPromMetrics over a registry of its own (vLLM's loggers use the global one,
    where a second test's metrics would clash)."""

    def __init__(self, kv_transfer_config):
        self.registry = prometheus_client.CollectorRegistry()
        reg = self.registry

        class Counter(prometheus_client.Counter):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)

        class Gauge(prometheus_client.Gauge):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)

        class Histogram(prometheus_client.Histogram):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)

        self.metrics = OffloadPromMetrics(
            SimpleNamespace(kv_transfer_config=kv_transfer_config),
            {
                prometheus_client.Counter: Counter,
                prometheus_client.Gauge: Gauge,
                prometheus_client.Histogram: Histogram,
            },
            ["model_name", "engine"],
            {0: ["kvtier-test", "0"]},
        )

    def value(self, name, **labels):
        return self.registry.get_sample_value(name, {"model_name": "kvtier-test", "engine": "0", **labels})

    def samples(self, name):
        return [s for m in self.registry.collect() for s in m.samples if s.name == name]


class Connector:
    """The scheduler side of vLLM's OffloadingConnector, as far as its stats go: vLLM's own
    update_connector_output and get_stats, run on the attributes they read."""

    update_connector_output = OffloadingConnectorScheduler.update_connector_output
    _update_connector_output = OffloadingConnectorScheduler._update_connector_output
    get_stats = OffloadingConnectorScheduler.get_stats

    def __init__(self, manager):
        self.manager = manager
        self._connector_stats = OffloadingConnectorStats()
        self._info_sent = False
        self._stale_job_threshold = 0
        self._manager_locked = lambda: manager.lock

    def worker_output(self, results, loads):
        """Worker transfer results as vLLM's worker side hands them over (the sizes and times
        of finished jobs; no completed jobs, which this stand-in does not track)."""
        meta = OffloadingWorkerMetadata()
        for r in results:
            assert r.success
            (meta.transfer_stats.load if r.job_id in loads else meta.transfer_stats.store).record(
                r.transfer_size, r.transfer_time
            )
        self.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def wait_until(cond, what):
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.005)


def ids(xs):
    return SimpleNamespace(block_ids=np.array(xs, dtype=np.int64))


def keys(prefix, n):
    return [kvtier.make_offload_key(bytes([prefix, i]) * 16, 0) for i in range(n)]


def test_kvtier_stats_reach_vllms_log_line_and_prometheus(tmp_path, wired):
    extra = extra_config(tmp_path)
    tensors = [np.arange(8 * BLOCK_FLOATS, dtype=np.float32).reshape(8, BLOCK_FLOATS)]
    spec = KvtierOffloadingSpec.from_settings(extra, tensors[0][0].nbytes)
    worker = spec.get_worker(tensors)
    m = spec.get_manager()
    ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    prom = Prometheus(ktc)
    logging = KVConnectorLogging(ktc)
    conn = Connector(m)
    payloads = []

    def publish():
        """The end of a scheduler step: vLLM's scheduler takes the connector's stats and the
        frontend's loggers observe them."""
        stats = conn.get_stats()
        if stats is not None:
            assert isinstance(stats, OffloadingConnectorStats)
            # Each logger gets its own copy, as each gets one off the engine's IPC.
            payloads.append(copy.deepcopy(stats.data))
            logging.observe(copy.deepcopy(stats.data))
            prom.metrics.observe(copy.deepcopy(stats.data), 0)

    def cascaded(n):
        st = m.kvtier_stats()
        return st["secondaries"][0]["stores"] >= n and st["jobs_in_flight"] == 0

    job = iter(range(1, 100))
    loads = set()

    def store(name, ks, blocks):
        r = ReqContext(req_id=name)
        with m.lock:
            m.on_new_request(r)
            assert [m.lookup(k, r) for k in ks] == [LookupResult.MISS] * len(ks)
            out = m.prepare_store(ks, r)
        assert out.keys_to_store == ks
        assert worker.submit_store(next(job), ids(blocks), out.store_spec)
        conn.worker_output(worker.get_finished(), loads)
        wait_until(lambda: all(m.lookup(k, r) is LookupResult.HIT for k in ks), "the store to complete")
        with m.lock:
            m.complete_store(ks, r)
            m.on_request_finished(r)
        publish()
        return out

    try:
        first, second = keys(1, 2), keys(2, 2)
        store("a", first, [0, 1])
        wait_until(lambda: cascaded(2), "the first chunks to cascade to disk")
        out = store("b", second, [2, 3])
        assert sorted(out.evicted_keys) == sorted(first)
        wait_until(lambda: cascaded(4), "the second chunks to cascade to disk")
        publish()

        # The first chunks come back from disk (promotion) and are loaded.
        c = ReqContext(req_id="c")
        with m.lock:
            m.on_new_request(c)
            assert [m.lookup(k, c) for k in first] == [LookupResult.HIT_PENDING] * 2
        rows = []

        def promoted():
            with m.lock:
                if all(m.lookup(k, c) is LookupResult.HIT for k in first):
                    rows.extend(int(x) for x in m.prepare_load(first, c).block_ids)
            return bool(rows)

        wait_until(promoted, "the promotions to land")
        load_job = next(job)
        loads.add(load_job)
        assert worker.submit_load(load_job, ids(rows), ids([4, 5]))
        conn.worker_output(worker.get_finished(), loads)
        assert (tensors[0][4:6] == tensors[0][0:2]).all()
        with m.lock:
            m.complete_load(first, c)
            m.on_request_finished(c)
        publish()
        wait_until(lambda: not m.has_pending_work(), "the manager to go idle")
        publish()

        # The log line: vLLM's aggregate + reduce over the interval's payloads.
        totals = logging.transfer_stats_accumulator.reduce()
        lines = []
        logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1 and "vllm:kv_offload_tiering_chunk_hits:('1:disk',)=" in lines[0]

        chunk = m.manager.chunk_bytes
        # GPU<->CPU bytes, from kvtier's worker through vLLM's connector.
        assert totals["vllm:kv_offload_store_bytes"] == 4 * chunk
        assert totals["vllm:kv_offload_load_bytes"] == 2 * chunk
        assert totals["vllm:kv_offload_store_time"] > 0 and totals["vllm:kv_offload_load_time"] > 0
        # Lookups and hits per tier, from the manager's get_stats.
        q = "vllm:kv_offload_tiering_chunk_queries"
        h = "vllm:kv_offload_tiering_chunk_hits"
        assert totals[f"{q}:('0:primary',)"] >= 6
        assert totals[f"{h}:('0:primary',)"] >= 2
        assert totals[f"{q}:('1:disk',)"] >= 2
        assert totals[f"{h}:('1:disk',)"] >= 2
        # Tier traffic: cascades written to disk, promotions read back.
        assert totals["vllm:kv_offload_tiering_write_bytes:('1:disk',)"] == 4 * chunk
        assert totals["vllm:kv_offload_tiering_read_bytes:('1:disk',)"] == 2 * chunk
        # kvtier's own counters ride along.
        assert totals["vllm:kv_offload_kvtier_manager:('promoted_keys',)"] == 2
        assert totals["vllm:kv_offload_kvtier_manager:('cascade_jobs',)"] >= 2
        assert totals["vllm:kv_offload_kvtier_tier:('0:primary', 'evictions')"] >= 2
        # Counters are deltas: the payloads add up to kvtier's cumulative counts.
        st = m.kvtier_stats()
        assert totals[f"{q}:('1:disk',)"] == st["secondaries"][0]["hits"] + st["secondaries"][0]["misses"]
        assert totals["vllm:kv_offload_kvtier_manager:('promotion_jobs',)"] == st["manager"]["promotion_jobs"]

        # Prometheus: the same numbers under the series vLLM's dashboards read.
        assert prom.value("vllm:kv_offload_store_bytes_total") == 4 * chunk
        assert prom.value("vllm:kv_offload_load_bytes_total") == 2 * chunk
        assert prom.value(f"{q}_total", tier="0:primary") >= 6
        assert prom.value(f"{h}_total", tier="1:disk") >= 2
        assert prom.value("vllm:kv_offload_tiering_read_bytes_total", tier="1:disk") == 2 * chunk
        assert prom.value("vllm:kv_offload_tiering_write_bytes_total", tier="1:disk") == 4 * chunk
        assert prom.value("vllm:kv_offload_kvtier_manager_total", counter="promoted_keys") == 2
        assert prom.value("vllm:kv_offload_kvtier_tier_figure", tier="0:primary", figure="capacity_chunks") == 2
        assert prom.value("vllm:kv_offload_cpu_cache_usage_perc") is not None

        # config_info: sent once, one series per tier, every declared label filled and nothing
        # undeclared (else vLLM's logger drops labels and warns).
        infos = [d["info"] for d in payloads if d.get("info") is not None]
        assert len(infos) == 1
        (info,) = infos
        declared = KvtierOffloadingSpec.config_info_keys(extra)
        assert {k for series in info for k in series} == set(declared)
        assert [s["tier"] for s in info] == ["0:primary", "1:disk"]
        assert [(s["medium"], s["locality"]) for s in info] == [("CPU", "LOCAL"), ("STORAGE", "LOCAL")]
        assert info[0]["cpu_num_chunks"] == 2 and info[0]["capacity_bytes"] == 2 * chunk
        assert info[1]["tier_type"] == "disk" and info[1]["capacity_chunks"] == st["secondaries"][0]["capacity_chunks"]
        samples = prom.samples(KV_OFFLOAD_CONFIG_INFO)
        assert sorted(s.labels["tier"] for s in samples) == ["0:primary", "1:disk"]
        assert all(s.value == 1 for s in samples)
        disk = next(s for s in samples if s.labels["tier"] == "1:disk")
        assert disk.labels["medium"] == "STORAGE" and disk.labels["tier_name"] == "disk"
    finally:
        worker.shutdown()
        m.shutdown()


def test_stats_are_deltas_and_unchanged_state_gives_none(tmp_path):
    """stats_for_vllm on plain stats dicts: each call carries the increase since the previous
    one; with nothing new it returns None (vLLM then sends only its own numbers)."""
    m = kvtier.TieringManager.from_toml('[primary]\ntype = "cpu"\ncapacity = 4\n[control_plane]\nthread = false\n', 64)
    try:
        state = vs.VllmStatsState(report_transfers=True, chunk_bytes=64)
        k = keys(3, 2)
        with m.step() as s:
            ctx = kvtier.ReqContext("a")
            s.on_new_request(ctx)
            assert [s.lookup(x, ctx) for x in k] == [kvtier.LookupResult.MISS] * 2
            out = s.prepare_store(k, ctx)
            s.complete_store(out.keys_to_store, ctx)
            first = vs.stats_for_vllm(state, s.stats())
            assert [s.lookup(x, ctx) for x in k] == [kvtier.LookupResult.HIT] * 2
            s.prepare_load(k, ctx)
            s.complete_load(k, ctx)
            second = vs.stats_for_vllm(state, s.stats())
            third = vs.stats_for_vllm(state, s.stats())
        r1, r2 = first.reduce(), second.reduce()
        q = "vllm:kv_offload_tiering_chunk_queries:('0:primary',)"
        assert r1[q] == 2 and r2[q] == 2
        assert "vllm:kv_offload_tiering_chunk_hits:('0:primary',)" not in r1
        assert r2["vllm:kv_offload_tiering_chunk_hits:('0:primary',)"] == 2
        # report_transfers: GPU<->CPU bytes from kvtier's own counters.
        assert r1["vllm:kv_offload_store_bytes"] == 2 * 64 and "vllm:kv_offload_load_bytes" not in r1
        assert r2["vllm:kv_offload_load_bytes"] == 2 * 64
        assert third is None and state.last_delta == {"counters": {}, "gauges": {}}
        # Every name emitted is declared for vLLM's Prometheus logger (or by its connector).
        declared = set(vs.metric_definitions_for_vllm())
        connector = {"vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes"}
        assert set(first.data["types"]) | set(second.data["types"]) <= declared | connector
    finally:
        m.shutdown()


def test_config_info_from_a_chain_file_matches_the_built_chain(tmp_path):
    path = chain(tmp_path)
    m = kvtier.TieringManager.from_config(path, 4096)
    try:
        built = vs.config_info_for_vllm(m)
    finally:
        m.shutdown()
    from_file = vs.config_info_for_vllm(path, chunk_bytes=4096)
    keys_ = ("tier", "tier_name", "tier_type", "medium", "locality", "chunk_bytes")
    assert [{k: s[k] for k in keys_} for s in from_file] == [{k: s[k] for k in keys_} for s in built]
    assert from_file[0]["capacity_chunks"] == built[0]["capacity_chunks"] == 2
