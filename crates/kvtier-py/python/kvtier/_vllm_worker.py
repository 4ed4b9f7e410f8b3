"""The worker side of :mod:`kvtier.vllm`: copies between a rank's KV tensors and its slice of
the arena rows, and vLLM's ``OffloadingWorker`` over them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _kvtier as _k
from ._vllm_types import RowKeys, _vllm

_WorkerBase = _vllm("OffloadingWorker")


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
