"""vLLM's types when vLLM is importable, kvtier's stand-ins otherwise, and the row-key table
shared by the scheduler and worker sides of :mod:`kvtier.vllm`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import _kvtier as _k


def _vllm(name: str) -> Any:
    """A class of vLLM's kv_offload base module, or ``object`` when vLLM is not importable."""
    try:
        from vllm.v1.kv_offload import base  # type: ignore[import-not-found]
    except Exception:  # vLLM (or torch) absent: plain classes
        return object
    return getattr(base, name, object)


class _VllmTypes:
    """vLLM's result types, used for the manager's answers when vLLM is importable (its
    connector compares against them); ``None`` otherwise, and the kvtier types are returned."""

    def __init__(self):
        try:
            from vllm.v1.kv_offload import base  # type: ignore[import-not-found]
            from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-not-found]
        except Exception:
            self.base = None
            return
        self.base = base
        self.spec = CPULoadStoreSpec
        self.lookup = {
            _k.LookupResult.HIT: base.LookupResult.HIT,
            _k.LookupResult.HIT_PENDING: base.LookupResult.HIT_PENDING,
            _k.LookupResult.MISS: base.LookupResult.MISS,
            _k.LookupResult.RETRY: base.LookupResult.RETRY,
        }
        self.policy = {
            _k.OffloadPolicy.CHUNK_LEVEL: base.OffloadPolicy.CHUNK_LEVEL,
            _k.OffloadPolicy.REQUEST_LEVEL: base.OffloadPolicy.REQUEST_LEVEL,
        }
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]
        except Exception:  # a vLLM without cache-hit sources: the names are returned
            CacheHitSource = None  # noqa: N806
        self.hit_source = CacheHitSource

    def event(self, e: Any) -> Any:
        b = self.base
        return b.OffloadingEvent(
            keys=list(e.keys),
            medium=b.Medium(e.medium) if e.medium else b.Medium.CPU,
            removed=e.removed,
            locality=b.Locality(e.locality) if e.locality else None,
            ownership=e.ownership,
            metadata_only=e.metadata_only,
            removal_expected=e.removal_expected,
        )


_VLLM: Optional[_VllmTypes] = None


def _vllm_types() -> _VllmTypes:
    global _VLLM
    if _VLLM is None:
        _VLLM = _VllmTypes()
    return _VLLM


KEY_BYTES = _k.KEY_BYTES


@dataclass(frozen=True)
class ChunkSpec:
    """Where chunks live in the CPU tier: arena rows (vLLM's ``CPULoadStoreSpec.block_ids``)."""

    block_ids: list
    medium: str = "CPU"


@dataclass(frozen=True)
class StoreOutput:
    """vLLM's ``PrepareStoreOutput``: keys to write, their rows, keys evicted."""

    keys_to_store: list
    store_spec: ChunkSpec
    evicted_keys: list = field(default_factory=list)


class RowKeys:
    """The key each arena row is being written for, in a small shared file next to the arena
    (``<arena>.keys``, 36 bytes per row): the scheduler side records it at ``prepare_store``;
    workers, whose store jobs carry only rows, read it to report finished stores by key."""

    def __init__(self, path: str, num_chunks: int, create: bool):
        import numpy as np

        self.path = path
        mode = "w+" if create else "r"
        self.table = np.memmap(path, dtype=np.uint8, mode=mode, shape=(num_chunks, KEY_BYTES))

    def record(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        import numpy as np

        for key, row in zip(keys, rows):
            self.table[int(row)] = np.frombuffer(key, dtype=np.uint8)

    def keys_of(self, rows: Sequence[int]) -> list:
        return [bytes(self.table[int(r)]) for r in rows]
