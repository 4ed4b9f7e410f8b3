"""vLLM 0.33.0's own ``TieringOffloadingSpec`` (a CPU primary tier and secondary tiers such as
its ``fs`` tier) runnable on CPU inside :mod:`harness`.

vLLM's tiering keeps the CPU tier in a ``SharedOffloadRegion``: a file in ``/dev/shm`` named
after the engine id, mapped by the scheduler (``rank=None``: the whole region, which the
secondary tiers read and write through ``create_kv_memoryview()``, chunk ``c`` at row ``c``) and
by each worker (its own slot in every row). A row is ``kv_bytes_per_chunk`` bytes (page
aligned); rank ``r``'s slot starts at ``r * cpu_page_size_per_worker`` and holds, back to back,
one ``page × blocks_per_chunk`` section per KV tensor (``create_next_worker_view``, the layout
vLLM's ``CPUOffloadingWorker`` copies into). vLLM's worker needs CUDA, so
:class:`RegionCopyWorker` is :class:`harness.TorchCopyWorker` over exactly those views: the fs
tier cascades the bytes the worker stored, and promotions land where the worker loads from.

The scheduler and the runners of :mod:`harness` build their ``VllmConfig`` separately, so each
gets its own random engine id; the region is named by ``ref_region_id`` from the connector's
extra config instead (:func:`tiering_extra_config` makes a fresh one), which every side shares.
An ``fs`` tier without a ``root_dir`` gets a temporary directory that the manager's shutdown
removes, as it removes the region file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from typing import Any, Optional

import torch

import harness
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class RegionCopyWorker(harness.TorchCopyWorker):
    """:class:`harness.TorchCopyWorker` whose host buffer is this rank's slot of vLLM's
    ``SharedOffloadRegion`` (views made by the region, one per KV tensor, as vLLM's
    ``CPUOffloadingWorker`` makes them). ``shutdown`` releases the region."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int, region: SharedOffloadRegion):
        pages = [t.tensor.shape[1] for t in kv_caches.tensors]
        views = [region.create_next_worker_view(page * blocks_per_chunk) for page in pages]
        # The per-tensor views are adjacent sections of one slot: one strided view covers them,
        # in the order TorchCopyWorker lays the tensors out.
        first = views[0]
        total = sum(v.shape[1] for v in views)
        at = first.storage_offset()
        for v in views:
            assert v.storage_offset() == at and v.stride() == first.stride(), "unexpected region layout"
            at += v.shape[1]
        host = torch.as_strided(region.base_tensor, (num_chunks, total), first.stride(), first.storage_offset())
        super().__init__(kv_caches, blocks_per_chunk, num_chunks, host=host)
        assert self.host.data_ptr() == host.data_ptr() and self.host.stride() == host.stride()
        self.region: Optional[SharedOffloadRegion] = region

    def shutdown(self) -> None:
        region, self.region = self.region, None
        if region is not None:
            self.host = None
            region.cleanup()


class ReferenceTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`RegionCopyWorker` as its worker.

    Extra config keys besides vLLM's (``cpu_bytes_to_use``, ``secondary_tiers``,
    ``tier_poll_interval_s``, ...): ``ref_region_id``, the name of the shared region (the same
    for the scheduler and every rank)."""

    def __init__(self, config: Any):
        super().__init__(config)
        region_id = self.extra_config.get("ref_region_id")
        if region_id:
            self._engine_id = f"kvtier-ref-{region_id}"
        self._tmp_dirs: list = []
        self._ref_worker: Optional[RegionCopyWorker] = None

    def get_manager(self):
        if not self._manager:
            for tier in self.secondary_tier_configs:
                if tier.get("type") == "fs" and not tier.get("root_dir"):
                    d = tempfile.mkdtemp(prefix="kvtier-vllm-fs-")
                    self._tmp_dirs.append(d)
                    tier["root_dir"] = d
            manager = super().get_manager()
            shutdown = manager.shutdown
            dirs = self._tmp_dirs
            region = self._scheduler_mmap

            def shutdown_and_clean() -> None:
                try:
                    shutdown()
                finally:
                    for d in dirs:
                        shutil.rmtree(d, ignore_errors=True)
                    dirs.clear()
                    # The region's files are unlinked by its cleanup, which a failed shutdown
                    # (a buffer still exported) skips: never leave them in /dev/shm.
                    for path, _, _ in getattr(region, "_segments", ()):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)

            manager.shutdown = shutdown_and_clean
        return self._manager

    def get_worker(self, kv_caches: Any):
        if self._ref_worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._ref_worker = RegionCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
            except BaseException:
                region.cleanup()
                raise
        return self._ref_worker


def fs_tier(root_dir: Optional[str] = None, threads: int = 4, **extra) -> dict:
    """vLLM's ``fs`` secondary tier config (``root_dir`` None: a temporary directory the
    manager removes at shutdown)."""
    cfg = {"type": "fs", "n_read_threads": threads, "n_write_threads": threads}
    if root_dir is not None:
        cfg["root_dir"] = str(root_dir)
    cfg.update(extra)
    return cfg


def tiering_extra_config(shape: harness.EngineShape, cpu_chunks: int, tiers: Optional[list] = None,
                         policy: str = "lru", **extra) -> dict:
    """The connector's extra config for :class:`ReferenceTieringSpec`: a CPU tier of
    ``cpu_chunks`` chunks, the given secondary tiers (default: one ``fs`` tier in a temporary
    directory), a fresh shared region name."""
    cfg = {
        "cpu_bytes_to_use": harness.cpu_bytes_for(shape, cpu_chunks),
        "block_size": shape.block_size,
        "eviction_policy": policy,
        "secondary_tiers": list(tiers) if tiers is not None else [fs_tier()],
        "ref_region_id": uuid.uuid4().hex[:16],
    }
    cfg.update(extra)
    return cfg


def tiering_engine(model_dir: str, shape: harness.EngineShape, cpu_chunks: int, tiers: Optional[list] = None,
                   worker_processes: bool = False, **extra) -> harness.Engine:
    """A :class:`harness.Engine` running vLLM's tiering spec (see :func:`tiering_extra_config`)."""
    cfg = tiering_extra_config(shape, cpu_chunks, tiers, **extra)
    return harness.Engine(model_dir, shape, cfg, ReferenceTieringSpec, worker_processes=worker_processes)


def counters(stats_list: list) -> dict:
    """Sums the counters of a list of vLLM ``OffloadingConnectorStats`` (one per step, as
    :class:`harness.Engine` collects them): ``{(metric, labels): total}``."""
    out: dict = {}
    for s in stats_list:
        types, values = s.data.get("types", {}), s.data.get("data", {})
        for name, by_label in values.items():
            if types.get(name) != "counter":
                continue
            for labels, v in by_label.items():
                key = (name, tuple(labels))
                out[key] = out.get(key, 0) + v
    return out


def tier_counter(stats_list: list, metric: str, tier_type: str) -> float:
    """A per-tier counter of vLLM's tiering metrics (``vllm:kv_offload_tiering_*``), summed
    over the run, for the tier whose label ends with ``:<tier_type>``."""
    total = 0
    for (name, labels), v in counters(stats_list).items():
        if name == metric and labels and str(labels[0]).endswith(":" + tier_type):
            total += v
    return total


def fs_tier_of(engine: harness.Engine) -> Any:
    """The manager's first ``fs`` secondary tier."""
    for t in engine.manager.secondary_tiers:
        if t.tier_type == "fs":
            return t
    raise KeyError("fs")


def track_hit_sources(engine: harness.Engine) -> dict:
    """Counts the connector's accepted hit tokens by the tier vLLM attributes them to
    (``get_external_cache_hit_sources``, which vLLM's scheduler calls for its prefix-cache
    stats: ``host``, ``disk``, ``p2p``, ...). Returns the live ``{source name: tokens}`` dict. Not
    part of :attr:`harness.Engine.connector_seconds` (a stats call, not one of the five)."""
    conn = engine.connector
    fn = conn.get_external_cache_hit_sources
    tally: dict = {}

    def get_external_cache_hit_sources(request, num_external_tokens):
        out = fn(request, num_external_tokens)
        for source, n in (out or {}).items():
            name = getattr(source, "value", str(source))
            tally[name] = tally.get(name, 0) + n
        return out

    conn.get_external_cache_hit_sources = get_external_cache_hit_sources
    return tally


