"""The worker side of :mod:`kvtier.vllm`: copies between a rank's KV tensors and its slice of
the arena rows, and vLLM's ``OffloadingWorker`` over them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _kvtier as _k
from ._vllm_types import RowKeys, _vllm

_WorkerBase = _vllm("OffloadingWorker")
_log = logging.getLogger("kvtier.vllm")


class KvtierTransferHandler:
    """One worker rank's copies between its KV tensors and the arena rows.

    ``kv_tensors`` are the rank's KV caches, each indexed by GPU block id on its first axis (a
    torch tensor on any device, or a numpy array). A chunk is ``blocks_per_chunk`` consecutive
    blocks; its bytes for this rank are, tensor after tensor, the blocks' bytes, written at
    offset ``rank * rank_stride`` of the row.

    The arena and the completion channel are opened on first use (or by :meth:`open`), not
    here: vLLM builds its workers before its scheduler, whose manager creates both. Opening
    waits up to ``open_timeout_s`` for a live manager's arena and channel.
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
        open_timeout_s: float = 60.0,
    ):
        self.arena_path = str(arena_path)
        self.tensors = list(kv_tensors)
        self.rank = rank
        self.world_size = world_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = [self._nbytes(t[0]) for t in self.tensors]
        self.rank_chunk_bytes = sum(self.block_bytes) * blocks_per_chunk
        # Where each rank's slice starts in a row (vLLM's per-worker page, maybe padded).
        self.rank_stride = rank_stride or self.rank_chunk_bytes
        if self.rank_chunk_bytes > self.rank_stride:
            raise _k.KvtierError(
                f"a rank's chunk of {self.rank_chunk_bytes} bytes does not fit its slice of "
                f"{self.rank_stride} bytes"
            )
        self.channel_path = channel_path
        self.fingerprint = fingerprint
        self.grant_timeout_s = grant_timeout_s
        self.open_timeout_s = open_timeout_s
        self._view: Optional[_k.ArenaView] = None
        self.reporter: Optional[_k.WorkerReporter] = None

    @property
    def view(self) -> _k.ArenaView:
        """The rank's view of the arena (opened on first use)."""
        return self.open()

    def open(self) -> _k.ArenaView:
        """Opens the arena view and the completion channel if not yet open. Waits up to
        ``open_timeout_s`` for the manager to create them (a missing file, an arena left by an
        earlier run that no live manager owns, a socket nobody listens on); then raises the
        last error."""
        if self._view is not None:
            return self._view
        deadline = time.monotonic() + self.open_timeout_s
        while True:
            try:
                view = _k.ArenaView(self.arena_path)
                reporter = None
                if self.channel_path is not None:
                    fp = view.fingerprint if self.fingerprint is None else self.fingerprint
                    reporter = _k.WorkerReporter(self.channel_path, self.rank, fp)
                break
            except (_k.KvtierError, OSError) as e:
                if time.monotonic() > deadline:
                    raise _k.KvtierError(
                        f"rank {self.rank}: no live kvtier manager serves the arena at "
                        f"{self.arena_path} (and channel {self.channel_path}) after "
                        f"{self.open_timeout_s:g} s: {e}"
                    ) from e
                time.sleep(0.05)
        if self.rank_stride * self.world_size > view.chunk_bytes:
            if reporter is not None:
                reporter.close()
            raise _k.KvtierError(
                f"a chunk of {self.world_size} ranks × {self.rank_chunk_bytes} bytes (slices of "
                f"{self.rank_stride}) does not fit the arena's rows of {view.chunk_bytes} bytes"
            )
        self._view, self.reporter = view, reporter
        return view

    @staticmethod
    def _nbytes(t: Any) -> int:
        n = getattr(t, "nbytes", None)
        if n is None:  # torch
            n = t.numel() * t.element_size()
        return int(n)

    def _row(self, chunk_id: int, write: bool) -> _k.Row:
        # Ranks copy into slices of the same row, and a row grant is whole-row: wait for the
        # other rank's grant (held only for one copy) instead of failing.
        view = self.open()
        deadline = time.monotonic() + self.grant_timeout_s
        while True:
            try:
                return view.row(chunk_id, write)
            except _k.KvtierError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.0002)

    def _blocks(self, gpu_block_ids: Sequence[int], i: int) -> list:
        return list(gpu_block_ids[i * self.blocks_per_chunk : (i + 1) * self.blocks_per_chunk])

    def copy_out(self, gpu_block_ids: Sequence[int], chunk_ids: Sequence[int]) -> None:
        """Copies the chunks' blocks into this rank's slice of their rows."""
        import numpy as np

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

    def report(self, keys: Sequence[bytes], success: bool) -> bool:
        """Reports finished (or failed) stores of ``keys`` on the channel; ``False`` when no
        channel is open (nothing reported)."""
        self.open()
        if self.reporter is None:
            return False
        self.reporter.report(list(keys), success)
        return True

    def store(self, gpu_block_ids: Sequence[int], chunk_ids: Sequence[int], keys: Sequence[bytes] = ()) -> bool:
        """Copies the chunks' blocks into their rows and reports ``keys`` when a channel is
        open: as stored, or — when the copy raises — as failed before the error propagates."""
        try:
            self.copy_out(gpu_block_ids, chunk_ids)
        except Exception:
            if len(keys):
                self.report(keys, False)
            raise
        if len(keys):
            self.report(keys, True)
        return True

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

    vLLM 0.33.0 cannot fail a job (its connector asserts every result's success). A store
    whose copy fails is therefore reported as failed on the completion channel — the manager
    applies that report before the engine's, and drops the chunks — and finished towards vLLM.
    Only when the failure cannot reach the manager is the job's result a failure. A load that
    fails raises: the GPU blocks would otherwise hold wrong KV.
    """

    def __init__(self, handler: KvtierTransferHandler, row_keys: "RowKeys | str | None"):
        self.handler = handler
        self._row_keys = row_keys
        self._finished: list = []
        self._result_cls = _vllm("TransferResult")
        if self._result_cls is object:
            self._result_cls = _TransferResult

    @property
    def row_keys(self) -> Optional[RowKeys]:
        """The row-key table (opened on first use, once the manager has created it)."""
        if isinstance(self._row_keys, str):
            view = self.handler.open()
            self._row_keys = RowKeys(self._row_keys, view.num_chunks, create=False)
        return self._row_keys

    def _done(self, job_id: int, ok: bool, nbytes: int, t0: float) -> None:
        self._finished.append(self._result_cls(job_id, ok, nbytes, time.perf_counter() - t0))

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        t0 = time.perf_counter()
        rows = [int(r) for r in dst_spec.block_ids]
        blocks = [int(b) for b in src_spec.block_ids]
        keys: list = []
        error: Optional[Exception] = None
        try:
            row_keys = self.row_keys
            if row_keys is not None:
                keys = row_keys.keys_of(rows)
            self.handler.copy_out(blocks, rows)
        except Exception as e:  # reported below; vLLM cannot take an exception here either
            error = e
        try:
            reported = bool(keys) and self.handler.report(keys, error is None)
        except Exception as e:
            _log.error("kvtier: rank %d could not report store job %d: %s", self.handler.rank, job_id, e)
            reported = False
        if error is None:
            ok = True
        elif reported:
            _log.error(
                "kvtier: rank %d: store job %d failed (%s); reported as failed on the completion "
                "channel, so the manager drops those chunks",
                self.handler.rank,
                job_id,
                error,
            )
            ok = True
        else:
            _log.error(
                "kvtier: rank %d: store job %d failed (%s) and the failure could not be reported",
                self.handler.rank,
                job_id,
                error,
            )
            ok = False
        self._done(job_id, ok, len(rows) * self.handler.rank_chunk_bytes, t0)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        t0 = time.perf_counter()
        rows = [int(r) for r in src_spec.block_ids]
        try:
            self.handler.load(rows, [int(b) for b in dst_spec.block_ids])
        except Exception as e:
            raise _k.KvtierError(
                f"rank {self.handler.rank}: load job {job_id} from arena rows {rows} failed: {e} "
                "(vLLM cannot fail a load; its blocks would hold wrong KV)"
            ) from e
        self._done(job_id, True, len(rows) * self.handler.rank_chunk_bytes, t0)
        return True

    def get_finished(self) -> list:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set) -> None:
        """Copies finish at submission; nothing to wait for."""

    def shutdown(self) -> None:
        self.handler.close()
