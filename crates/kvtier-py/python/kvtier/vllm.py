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

Nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from . import _kvtier as _k

__all__ = [
    "ChunkSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierTransferHandler",
    "StoreOutput",
]

# Calls that start a scheduler step's lookup phase: the lock is held from the first of them
# until on_schedule_end, so a HIT stays resident until its prepare_load.
_OPENING = frozenset({"lookup", "prepare_load", "on_new_request"})


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


class KvtierOffloadingManager:
    """vLLM's ``OffloadingManager`` over a kvtier manager.

    vLLM's connector does not delimit its scheduler steps, so this class does: the step lock is
    taken by the first lookup/load/new-request call and held until ``on_schedule_end``; calls
    after it (the connector's stores and finished requests, and the completions reported after
    the model ran) each run in a short step of their own, so the lock is never held while the
    model executes and the control thread serves peers meanwhile.
    """

    def __init__(self, manager: _k.TieringManager):
        self.manager = manager
        self._step: Optional[_k.Step] = None
        self._contexts: dict = {}
        self._lock = threading.Lock()

    # -- step bookkeeping -------------------------------------------------------------------
    def _call(self, name: str, *args):
        if self._step is not None:
            return getattr(self._step, name)(*args)
        if name in _OPENING:
            self._step = self.manager.step()
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
            entry = (req_context, _k.ReqContext(req_id, params if isinstance(params, dict) else None))
            self._contexts[req_id] = entry
        return entry[1]

    def end_step(self) -> None:
        """Releases the step lock if held (``on_schedule_end`` does this)."""
        if self._step is not None:
            step, self._step = self._step, None
            step.release()

    # -- vLLM's OffloadingManager -----------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any) -> _k.LookupResult:
        return self._call("lookup", key, self._ctx(req_context))

    def prepare_load(self, keys: Sequence[bytes], req_context: Any) -> ChunkSpec:
        return ChunkSpec(self._call("prepare_load", keys, self._ctx(req_context)))

    def touch(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        ctx = self._ctx(req_context if req_context is not None else "__touch__")
        self._call("touch", keys, ctx)

    def complete_load(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        self._call("complete_load", keys, self._ctx(req_context))

    def prepare_store(self, keys: Sequence[bytes], req_context: Any) -> Optional[StoreOutput]:
        out = self._call("prepare_store", keys, self._ctx(req_context))
        if out is None:
            return None
        return StoreOutput(out.keys_to_store, ChunkSpec(out.chunk_ids), out.evicted)

    def complete_store(self, keys: Sequence[bytes], req_context: Any, success: bool = True) -> None:
        self._call("complete_store", keys, self._ctx(req_context), success)

    def on_new_request(self, req_context: Any) -> _k.OffloadPolicy:
        return self._call("on_new_request", self._ctx(req_context))

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
        try:
            self._call("on_schedule_end", end)
        finally:
            self.end_step()

    def take_events(self) -> list:
        if self._step is not None:
            return self._step.take_events()
        return self.manager.take_events()

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
    ):
        self.view = _k.ArenaView(arena_path)
        self.tensors = list(kv_tensors)
        self.rank = rank
        self.world_size = world_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = [self._nbytes(t[0]) for t in self.tensors]
        self.rank_chunk_bytes = sum(self.block_bytes) * blocks_per_chunk
        if self.rank_chunk_bytes * world_size > self.view.chunk_bytes:
            raise _k.KvtierError(
                f"a chunk of {world_size} ranks × {self.rank_chunk_bytes} bytes does not fit the "
                f"arena's rows of {self.view.chunk_bytes} bytes"
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
                    off = self.rank * self.rank_chunk_bytes
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
                off = self.rank * self.rank_chunk_bytes
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


class KvtierOffloadingSpec:
    """The offloading spec vLLM loads (``spec_name = "KvtierOffloadingSpec"``).

    Extra-config keys (``kv_connector_extra_config``): ``kvtier_chain`` (chain file, required),
    ``kvtier_channel`` (completion socket; default ``<arena>.sock``), ``kvtier_arena`` (the
    arena file, default the chain's ``[primary] shared_memory``), ``block_size`` or
    ``blocks_per_chunk``.
    """

    def __init__(self, vllm_config: Any = None, kv_cache_config: Any = None, *, extra_config=None,
                 rank_chunk_bytes: Optional[int] = None, world_size: Optional[int] = None):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        if extra_config is None:
            extra_config = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.extra_config = dict(extra_config)
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
        self.world_size = world_size or _world_size(vllm_config)
        self.blocks_per_chunk = int(self.extra_config.get("blocks_per_chunk", 1))
        gpu_block = _gpu_block_size(vllm_config)
        if "block_size" in self.extra_config and gpu_block:
            self.blocks_per_chunk = int(self.extra_config["block_size"]) // gpu_block
        self.rank_chunk_bytes = rank_chunk_bytes or _rank_chunk_bytes(kv_cache_config, self.blocks_per_chunk)
        self._manager: Optional[KvtierOffloadingManager] = None

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one arena row: every rank's slice of one chunk."""
        return self.rank_chunk_bytes * self.world_size

    def get_manager(self) -> KvtierOffloadingManager:
        """The scheduler-side manager (built once), with its completion channel open."""
        if self._manager is None:
            m = _k.TieringManager.from_config(self.chain_path, self.chunk_bytes, reporters=self.world_size)
            try:
                if os.path.exists(self.channel_path):
                    os.unlink(self.channel_path)
                m.open_completion_channel(self.channel_path)
            except BaseException:
                m.shutdown()
                raise
            self._manager = KvtierOffloadingManager(m)
        return self._manager

    def get_transfer_handler(self, kv_tensors: Sequence[Any], rank: int = 0) -> KvtierTransferHandler:
        """A worker rank's handler over its KV tensors."""
        return KvtierTransferHandler(
            self.arena_path,
            kv_tensors,
            rank=rank,
            world_size=self.world_size,
            blocks_per_chunk=self.blocks_per_chunk,
            channel_path=self.channel_path,
        )


def _world_size(vllm_config: Any) -> int:
    try:
        return int(vllm_config.parallel_config.world_size)
    except AttributeError:
        return 1


def _gpu_block_size(vllm_config: Any) -> Optional[int]:
    try:
        return int(vllm_config.cache_config.block_size)
    except AttributeError:
        return None


def _rank_chunk_bytes(kv_cache_config: Any, blocks_per_chunk: int) -> int:
    """One rank's bytes of one chunk: every layer's page of one block, times blocks per chunk."""
    if kv_cache_config is None:
        raise _k.ConfigError("rank_chunk_bytes is needed when no kv_cache_config is given")
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += int(spec.page_size_bytes) * len(group.layer_names)
    return total * blocks_per_chunk
