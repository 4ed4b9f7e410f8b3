"""kvtier as vLLM's KV-offloading implementation.

vLLM's ``OffloadingConnector`` loads an offloading spec by module path::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_module_path": "kvtier.vllm",
        "spec_name": "KvtierOffloadingSpec", "kvtier_chain": "/etc/kvtier/chain.toml",
        "block_size": 64}}'

Scheduler side, :meth:`KvtierOffloadingSpec.get_manager` returns a
:class:`KvtierOffloadingManager`: vLLM's ``OffloadingManager`` methods over a kvtier manager built
from the chain file (whose ``[primary]`` must set ``shared_memory``). vLLM's CPU block ids *are*
the arena's row ids, so load and store specs carry arena rows unchanged.

Worker side, :meth:`KvtierOffloadingSpec.get_transfer_handler` returns a
:class:`KvtierTransferHandler` per rank: it opens the arena, copies between the rank's KV tensors
(torch, imported lazily; numpy arrays work too) and its slice of each arena row, and reports
finished stores on the manager's completion channel, so the manager cascades them while the
model runs. A row holds every rank's slice, rank-major.

Under vLLM the classes derive from vLLM's ``OffloadingSpec`` / ``OffloadingManager`` /
``OffloadingWorker`` (its factory checks the spec's base class); without vLLM installed they are
plain classes with the same methods, so the adapter is testable without torch. torch is imported
only by a worker copying torch tensors.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

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

    def event(self, e: Any) -> Any:
        b = self.base
        return b.OffloadingEvent(
            keys=list(e.keys),
            medium=b.Medium(e.medium) if e.medium else b.Medium.CPU,
            removed=e.removed,
            locality=b.Locality(e.locality) if e.locality else None,
            ownership=e.ownership,
            metadata_only=e.metadata_only,
        )


_VLLM: Optional[_VllmTypes] = None


def _vllm_types() -> _VllmTypes:
    global _VLLM
    if _VLLM is None:
        _VLLM = _VllmTypes()
    return _VLLM


_ManagerBase = _vllm("OffloadingManager")
_SpecBase = _vllm("OffloadingSpec")
_WorkerBase = _vllm("OffloadingWorker")

__all__ = [
    "ChunkSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "KvtierTransferHandler",
    "RowKeys",
    "StoreOutput",
]

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


class _StepLock:
    """vLLM's ``OffloadingManager.lock``: entering takes a kvtier step (the GIL is released
    while waiting), leaving releases it; not reentrant."""

    def __init__(self, owner: "KvtierOffloadingManager"):
        self.owner = owner

    def __enter__(self):
        if self.owner._step is not None:
            raise _k.StepError("the manager lock is not reentrant")
        self.owner._step = self.owner.manager.step()
        return self.owner

    def __exit__(self, *exc):
        self.owner.end_step()
        return False


class KvtierOffloadingManager(_ManagerBase):
    """vLLM's ``OffloadingManager`` over a kvtier manager.

    vLLM 0.33.0's connector holds ``manager.lock`` around every sequence of calls that relies on
    an earlier answer (a lookup HIT, then the prepare_load that pins it); here the lock is a
    kvtier step, so the control thread runs only while no caller holds it (the model's
    execution). A call made without the lock runs in a step of its own.
    """

    def __init__(self, manager: _k.TieringManager, row_keys: Optional[RowKeys] = None):
        self.manager = manager
        self.row_keys = row_keys
        self._step: Optional[_k.Step] = None
        self._contexts: dict = {}
        self._types = _vllm_types()

    @property
    def lock(self) -> _StepLock:
        return _StepLock(self)

    def _call(self, name: str, *args):
        if self._step is not None:
            return getattr(self._step, name)(*args)
        with self.manager.step() as s:
            return getattr(s, name)(*args)

    def _ctx(self, req_context: Any) -> _k.ReqContext:
        """The kvtier context of a vLLM ``ReqContext`` (or a request id), one per request."""
        if isinstance(req_context, _k.ReqContext):
            return req_context
        req_id = req_context if isinstance(req_context, str) else req_context.req_id
        entry = self._contexts.get(req_id)
        if entry is None or (entry[0] is not req_context and not isinstance(req_context, str)):
            params = getattr(req_context, "kv_transfer_params", None)
            try:
                ctx = _k.ReqContext(
                    req_id,
                    params if isinstance(params, dict) else None,
                    _tier_filter(getattr(req_context, "load_tier_filter", None)),
                )
            except (TypeError, ValueError):  # parameters that are not JSON: drop them
                ctx = _k.ReqContext(req_id)
            entry = (req_context, ctx)
            self._contexts[req_id] = entry
        return entry[1]

    def _ctx_with_positions(self, req_context: Any, keys: Sequence[bytes]) -> _k.ReqContext:
        """The kvtier context, with the end-token positions vLLM's scheduler recorded for `keys`
        copied over (the LRU policy orders a request's keys by them)."""
        ctx = self._ctx(req_context)
        get = getattr(req_context, "get_offload_key_position", None)
        if get is not None and not isinstance(req_context, _k.ReqContext):
            for key in keys:
                pos = get(key)
                if pos is not None:
                    ctx.set_offload_key_position(key, pos)
        return ctx

    def end_step(self) -> None:
        """Releases the step if one is held."""
        if self._step is not None:
            step, self._step = self._step, None
            step.release()

    # -- vLLM's OffloadingManager -----------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any) -> Any:
        r = self._call("lookup", key, self._ctx(req_context))
        v = self._types
        return v.lookup[r] if v.base is not None else r

    def _spec(self, ids: list) -> Any:
        v = self._types
        return v.spec(ids) if v.base is not None else ChunkSpec(ids)

    def prepare_load(self, keys: Sequence[bytes], req_context: Any) -> Any:
        return self._spec(self._call("prepare_load", keys, self._ctx_with_positions(req_context, keys)))

    def touch(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        ctx = self._ctx_with_positions(req_context if req_context is not None else "__touch__", keys)
        self._call("touch", keys, ctx)

    def complete_load(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        self._call("complete_load", keys, self._ctx(req_context))

    def prepare_store(self, keys: Sequence[bytes], req_context: Any) -> Optional[StoreOutput]:
        out = self._call("prepare_store", keys, self._ctx_with_positions(req_context, keys))
        if out is None:
            return None
        if self.row_keys is not None:
            self.row_keys.record(out.keys_to_store, out.chunk_ids)
        v = self._types
        if v.base is not None:
            return v.base.PrepareStoreOutput(
                keys_to_store=out.keys_to_store, store_spec=v.spec(out.chunk_ids), evicted_keys=out.evicted
            )
        return StoreOutput(out.keys_to_store, ChunkSpec(out.chunk_ids), out.evicted)

    def complete_store(self, keys: Sequence[bytes], req_context: Any, success: bool = True) -> None:
        self._call("complete_store", keys, self._ctx(req_context), success)

    def on_new_request(self, req_context: Any) -> Any:
        policy = self._call("on_new_request", self._ctx(req_context))
        v = self._types
        if v.base is not None:
            return v.base.RequestOffloadingContext(policy=v.policy[policy])
        return policy

    def on_request_finished(self, req_context: Any) -> None:
        ctx = self._ctx(req_context)
        self._call("on_request_finished", ctx)
        self._contexts.pop(ctx.req_id, None)

    def on_schedule_end(self, ctx: Any = None) -> None:
        end = None
        if ctx is not None:
            end = _k.ScheduleEndContext(
                list(getattr(ctx, "new_req_ids", ()) or ()),
                list(getattr(ctx, "preempted_req_ids", ()) or ()),
            )
        self._call("on_schedule_end", end)

    def take_events(self) -> list:
        events = self._step.take_events() if self._step is not None else self.manager.take_events()
        v = self._types
        return [v.event(e) for e in events] if v.base is not None else events

    def has_pending_work(self) -> bool:
        if self._step is not None:
            return self._step.has_pending_work()
        return self.manager.has_pending_work()

    def get_stats(self) -> dict:
        if self._step is not None:
            return self._step.stats()
        return self.manager.stats()

    def reset_cache(self) -> None:
        self.end_step()
        self.manager.reset_cache()

    def shutdown(self) -> None:
        self.end_step()
        self.manager.shutdown()


def _tier_filter(f: Any) -> Optional[list]:
    """vLLM's ``TierFilter`` as kvtier's list of matchers; ``None`` (every tier) for ``ALL``."""
    matchers = getattr(f, "matchers", None)
    if f is None or matchers is None or getattr(type(f), "ALL", None) is f:
        return None

    def name(v: Any) -> Optional[str]:
        return None if v is None else str(getattr(v, "value", v))

    return [{"medium": name(m.medium), "locality": name(m.locality)} for m in matchers]


def _chain_arena_path(chain_path: str) -> Optional[str]:
    """The ``[primary] shared_memory`` of a chain file (Python ≥ 3.11, or with tomli)."""
    try:
        import tomllib  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    with open(chain_path, "rb") as f:
        chain = tomllib.load(f)
    path = chain.get("primary", {}).get("shared_memory")
    if path is None:
        return None
    return path.replace("${tmpdir}", os.environ.get("TMPDIR", "/tmp"))


class KvtierTransferHandler:
    """One worker rank's copies between its KV tensors and the arena rows.

    ``kv_tensors`` are the rank's KV caches, each indexed by GPU block id on its first axis (a
    torch tensor on any device, or a numpy array). A chunk is ``blocks_per_chunk`` consecutive
    blocks; its bytes for this rank are, tensor after tensor, the blocks' bytes, written at
    offset ``rank * rank_chunk_bytes`` of the row.
    """

    def __init__(
        self,
        arena_path: str,
        kv_tensors: Sequence[Any],
        rank: int = 0,
        world_size: int = 1,
        blocks_per_chunk: int = 1,
        channel_path: Optional[str] = None,
        fingerprint: Optional[int] = None,
        grant_timeout_s: float = 10.0,
        rank_stride: Optional[int] = None,
    ):
        self.view = _k.ArenaView(arena_path)
        self.tensors = list(kv_tensors)
        self.rank = rank
        self.world_size = world_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = [self._nbytes(t[0]) for t in self.tensors]
        self.rank_chunk_bytes = sum(self.block_bytes) * blocks_per_chunk
        # Where each rank's slice starts in a row (vLLM's per-worker page, maybe padded).
        self.rank_stride = rank_stride or self.rank_chunk_bytes
        if self.rank_chunk_bytes > self.rank_stride or self.rank_stride * world_size > self.view.chunk_bytes:
            raise _k.KvtierError(
                f"a chunk of {world_size} ranks × {self.rank_chunk_bytes} bytes (slices of "
                f"{self.rank_stride}) does not fit the arena's rows of {self.view.chunk_bytes} bytes"
            )
        self.grant_timeout_s = grant_timeout_s
        self.reporter = None
        if channel_path is not None:
            fp = self.view.fingerprint if fingerprint is None else fingerprint
            self.reporter = _k.WorkerReporter(channel_path, rank, fp)

    @staticmethod
    def _nbytes(t: Any) -> int:
        n = getattr(t, "nbytes", None)
        if n is None:  # torch
            n = t.numel() * t.element_size()
        return int(n)

    def _row(self, chunk_id: int, write: bool) -> _k.Row:
        # Ranks copy into slices of the same row, and a row grant is whole-row: wait for the
        # other rank's grant (held only for one copy) instead of failing.
        deadline = time.monotonic() + self.grant_timeout_s
        while True:
            try:
                return self.view.row(chunk_id, write)
            except _k.KvtierError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.0002)

    def _blocks(self, gpu_block_ids: Sequence[int], i: int) -> list:
        return list(gpu_block_ids[i * self.blocks_per_chunk : (i + 1) * self.blocks_per_chunk])

    def store(self, gpu_block_ids: Sequence[int], chunk_ids: Sequence[int], keys: Sequence[bytes] = ()) -> bool:
        """Copies the chunks' blocks into their rows; reports ``keys`` when a channel is open."""
        import numpy as np

        ok = True
        try:
            for i, row_id in enumerate(chunk_ids):
                blocks = self._blocks(gpu_block_ids, i)
                with self._row(int(row_id), True) as row:
                    dst = row.array()
                    off = self.rank * self.rank_stride
                    for t, nb in zip(self.tensors, self.block_bytes):
                        for b in blocks:
                            _copy_block_out(t, int(b), dst[off : off + nb], np)
                            off += nb
                    del dst
        except Exception:
            ok = False
            raise
        finally:
            if self.reporter is not None and len(keys):
                self.reporter.report(list(keys), ok)
        return ok

    def load(self, chunk_ids: Sequence[int], gpu_block_ids: Sequence[int]) -> bool:
        """Copies the rows' slices of this rank into the chunks' blocks."""
        import numpy as np

        for i, row_id in enumerate(chunk_ids):
            blocks = self._blocks(gpu_block_ids, i)
            with self._row(int(row_id), False) as row:
                src = row.array()
                off = self.rank * self.rank_stride
                for t, nb in zip(self.tensors, self.block_bytes):
                    for b in blocks:
                        _copy_block_in(t, int(b), src[off : off + nb], np)
                        off += nb
                del src
        return True

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None


def _is_numpy(t: Any, np: Any) -> bool:
    return isinstance(t, np.ndarray)


def _copy_block_out(t: Any, block: int, dst: Any, np: Any) -> None:
    if _is_numpy(t, np):
        dst[:] = np.ascontiguousarray(t[block]).reshape(-1).view(np.uint8)
        return
    import torch  # noqa: F401  (lazily: workers without torch use numpy tensors)

    src = t[block].contiguous().view(-1).view(torch.uint8)
    torch.from_numpy(dst).copy_(src, non_blocking=False)


def _copy_block_in(t: Any, block: int, src: Any, np: Any) -> None:
    if _is_numpy(t, np):
        flat = t[block].reshape(-1).view(np.uint8)
        flat[:] = src
        return
    import torch

    dst = t[block].view(-1).view(torch.uint8)
    dst.copy_(torch.from_numpy(np.array(src, copy=False)), non_blocking=False)


@dataclass
class _TransferResult:
    """vLLM's ``TransferResult`` when vLLM is not importable."""

    job_id: int
    success: bool
    transfer_size: Optional[int] = None
    transfer_time: Optional[float] = None


class KvtierOffloadingWorker(_WorkerBase):
    """vLLM's ``OffloadingWorker`` of one rank: GPU↔arena copies, done at submission (the
    copies are host-side memcpy-speed for numpy and synchronous ``copy_`` for torch), with the
    finished stores reported by key on the completion channel.

    Handles one KV-cache group per job with chunk-aligned block runs (``blocks_per_chunk``
    GPU blocks per chunk, ``block_indices`` 0).
    """

    def __init__(self, handler: KvtierTransferHandler, row_keys: Optional[RowKeys]):
        self.handler = handler
        self.row_keys = row_keys
        self._finished: list = []
        self._result_cls = _vllm("TransferResult")
        if self._result_cls is object:
            self._result_cls = _TransferResult

    def _done(self, job_id: int, ok: bool, nbytes: int, t0: float) -> None:
        self._finished.append(self._result_cls(job_id, ok, nbytes, time.perf_counter() - t0))

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        t0 = time.perf_counter()
        rows = [int(r) for r in dst_spec.block_ids]
        keys = self.row_keys.keys_of(rows) if self.row_keys is not None else ()
        try:
            ok = self.handler.store([int(b) for b in src_spec.block_ids], rows, keys)
        except Exception:
            ok = False
        self._done(job_id, ok, len(rows) * self.handler.rank_chunk_bytes, t0)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        t0 = time.perf_counter()
        rows = [int(r) for r in src_spec.block_ids]
        try:
            ok = self.handler.load(rows, [int(b) for b in dst_spec.block_ids])
        except Exception:
            ok = False
        self._done(job_id, ok, len(rows) * self.handler.rank_chunk_bytes, t0)
        return True

    def get_finished(self) -> list:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set) -> None:
        """Copies finish at submission; nothing to wait for."""

    def shutdown(self) -> None:
        self.handler.close()


class KvtierOffloadingSpec(_SpecBase):
    """The offloading spec vLLM loads (``spec_name = "KvtierOffloadingSpec"``).

    Extra-config keys (``kv_connector_extra_config``): ``kvtier_chain`` (chain file, required),
    ``kvtier_channel`` (completion socket; default ``<arena>.sock``), ``kvtier_arena`` (the
    arena file; default the chain's ``[primary] shared_memory``).

    From vLLM's ``OffloadingConfig`` it reads ``extra_config``, ``parallel.world_size`` and
    ``parallel.rank``, ``worker_kv_bytes_per_block`` and ``cache.blocks_per_chunk``. A row holds
    every rank's slice of a chunk, rank-major, as vLLM's CPU spec lays its region out.
    """

    def __init__(self, config: Any):
        if _SpecBase is not object:
            super().__init__(config)
        self.config = config
        self.extra_config = dict(config.extra_config or {})
        chain = self.extra_config.get("kvtier_chain")
        if not chain:
            raise _k.ConfigError("kv_connector_extra_config needs kvtier_chain (a chain file path)")
        self.chain_path = str(chain)
        self.arena_path = self.extra_config.get("kvtier_arena") or _chain_arena_path(self.chain_path)
        if not self.arena_path:
            raise _k.ConfigError(
                f"{self.chain_path}: [primary] needs shared_memory (the arena workers open), "
                "or set kvtier_arena"
            )
        self.channel_path = self.extra_config.get("kvtier_channel") or f"{self.arena_path}.sock"
        self.world_size = int(config.parallel.world_size)
        self.rank = int(getattr(config.parallel, "rank", 0))
        self.blocks_per_chunk = int(config.cache.blocks_per_chunk)
        self.rank_chunk_bytes = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
        if self.rank_chunk_bytes <= 0:
            raise _k.ConfigError("worker_kv_bytes_per_block must be positive")
        self._manager: Optional[KvtierOffloadingManager] = None
        self._worker: Optional[KvtierOffloadingWorker] = None

    @classmethod
    def from_settings(
        cls,
        extra_config: dict,
        worker_kv_bytes_per_block: int,
        world_size: int = 1,
        rank: int = 0,
        blocks_per_chunk: int = 1,
    ) -> "KvtierOffloadingSpec":
        """A spec without vLLM's config object (engines other than vLLM, and tests)."""
        from types import SimpleNamespace

        return cls(
            SimpleNamespace(
                extra_config=extra_config,
                parallel=SimpleNamespace(world_size=world_size, rank=rank),
                cache=SimpleNamespace(blocks_per_chunk=blocks_per_chunk),
                worker_kv_bytes_per_block=worker_kv_bytes_per_block,
            )
        )

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one arena row's data: every rank's slice of one chunk."""
        return self.rank_chunk_bytes * self.world_size

    def get_manager(self) -> KvtierOffloadingManager:
        """The scheduler-side manager (built once), with its completion channel open."""
        if self._manager is None:
            m = _k.TieringManager.from_config(self.chain_path, self.chunk_bytes, reporters=self.world_size)
            try:
                if os.path.exists(self.channel_path):
                    os.unlink(self.channel_path)
                m.open_completion_channel(self.channel_path)
                row_keys = RowKeys(f"{self.arena_path}.keys", m.num_chunks, create=True)
            except BaseException:
                m.shutdown()
                raise
            self._manager = KvtierOffloadingManager(m, row_keys)
        return self._manager

    def get_transfer_handler(self, kv_tensors: Sequence[Any], rank: Optional[int] = None) -> KvtierTransferHandler:
        """The copy engine of one rank over its KV tensors (each indexed by block id)."""
        return KvtierTransferHandler(
            self.arena_path,
            kv_tensors,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            blocks_per_chunk=self.blocks_per_chunk,
            channel_path=self.channel_path,
            rank_stride=self.rank_chunk_bytes,
        )

    def get_worker(self, kv_caches: Any, rank: Optional[int] = None) -> KvtierOffloadingWorker:
        """vLLM's worker for this rank; ``kv_caches`` is vLLM's ``CanonicalKVCaches`` (or a list
        of tensors indexed by block id)."""
        if self._worker is None:
            tensors = getattr(kv_caches, "tensors", kv_caches)
            tensors = [getattr(t, "tensor", t) for t in tensors]
            handler = self.get_transfer_handler(tensors, rank)
            view = handler.view
            row_keys = RowKeys(f"{self.arena_path}.keys", view.num_chunks, create=False)
            self._worker = KvtierOffloadingWorker(handler, row_keys)
        return self._worker
