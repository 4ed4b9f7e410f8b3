"""The worker side of :mod:`kvtier.vllm`: copies between a rank's KV tensors and its slice of
the arena rows, and vLLM's ``OffloadingWorker`` over them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _kvtier as _k
from ._copy_engine import Completion, CopyJob, host_array, make_engine
from ._vllm_types import RowKeys, _vllm

_WorkerBase = _vllm("OffloadingWorker")
_log = logging.getLogger("kvtier.vllm")


class KvtierTransferHandler:
    """One worker rank's copies between its KV tensors and the arena rows.

    ``kv_tensors`` are the rank's KV caches, each indexed by GPU block id on its first axis (a
    torch tensor on any device, or a numpy array). A chunk is ``blocks_per_chunk`` consecutive
    blocks of one KV-cache group. This rank's slice of a row starts at ``slot * rank_stride``
    (``slot`` is the rank unless given) and holds one section per tensor, in tensor order, of
    ``blocks_per_chunk`` pages each: a chunk's block ``j`` of tensor ``t`` is at ``section[t] +
    j * page[t]``. A chunk of group ``g`` fills the sections of the tensors ``group_tensors[g]``
    names (default: one group over every tensor), as vLLM sizes a row for every tensor's page.

    Transfers follow vLLM's GPU specs: per group, ``group_sizes[g]`` GPU blocks whose first is
    logical block ``block_indices[g]`` of the request, so the first and last chunk of a group may
    be partial (only their blocks are copied).

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
        group_tensors: Optional[Sequence[Sequence[int]]] = None,
        slot: Optional[int] = None,
    ):
        self.arena_path = str(arena_path)
        self.tensors = list(kv_tensors)
        self.rank = rank
        # Which of the row's ``world_size`` slices this rank copies: its rank, or 0 for every
        # rank when the ranks' KV is identical and a row holds one copy (replicated layout).
        self.slot = rank if slot is None else slot
        self.world_size = world_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = [self._nbytes(t[0]) for t in self.tensors]
        self.num_blocks = [_num_blocks(t) for t in self.tensors]
        self.rank_chunk_bytes = sum(self.block_bytes) * blocks_per_chunk
        # Where each tensor's section starts in this rank's slice of a row.
        self.sections = [sum(self.block_bytes[:i]) * blocks_per_chunk for i in range(len(self.tensors))]
        if group_tensors is None:
            group_tensors = [range(len(self.tensors))]
        self.group_tensors = [[int(i) for i in g] for g in group_tensors]
        if any(not 0 <= i < len(self.tensors) for g in self.group_tensors for i in g):
            raise _k.KvtierError(f"group_tensors {self.group_tensors} name tensors beyond the {len(self.tensors)} given")
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
        # (cudart, address) of a CUDA host registration of the rows, undone at close.
        self._pinned: Optional[tuple] = None

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

        def attempt() -> tuple:
            view = _k.ArenaView(self.arena_path)
            reporter = None
            if self.channel_path is not None:
                fp = view.fingerprint if self.fingerprint is None else self.fingerprint
                reporter = _k.WorkerReporter(self.channel_path, self.rank, fp)
            return view, reporter

        try:
            view, reporter = _retrying(attempt, self.open_timeout_s, 0.05)
        except (_k.KvtierError, OSError) as e:
            raise _k.KvtierError(
                f"rank {self.rank}: no live kvtier manager serves the arena at "
                f"{self.arena_path} (and channel {self.channel_path}) after "
                f"{self.open_timeout_s:g} s: {e}"
            ) from e
        if self.rank_stride * self.world_size > view.chunk_bytes:
            if reporter is not None:
                reporter.close()
            raise _k.KvtierError(
                f"a chunk of {self.world_size} ranks × {self.rank_chunk_bytes} bytes (slices of "
                f"{self.rank_stride}) does not fit the arena's rows of {view.chunk_bytes} bytes"
            )
        self._view, self.reporter = view, reporter
        self._pin_for_dma(view)
        return view

    @staticmethod
    def _cudart() -> Any:
        import torch

        return torch.cuda.cudart()

    def _pin_for_dma(self, view: _k.ArenaView) -> None:
        """Registers the rows with CUDA (page-locked, so device copies are DMA, not staged
        through a bounce buffer) when this rank's tensors are on a CUDA device. A refusal is
        logged and the copies run unpinned."""
        if not any(getattr(t, "is_cuda", False) for t in self.tensors):
            return
        cudart = self._cudart()
        address, length = view.row_region
        t0 = time.perf_counter()
        rc = cudart.cudaHostRegister(address, length, 0)
        took = time.perf_counter() - t0
        if int(rc) != 0:
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:  # the failed call leaves its error for the next CUDA call
                try:
                    clear()
                except Exception:
                    pass
            _log.warning(
                "kvtier: rank %d could not pin the arena's %.1f MiB for DMA (CUDA error %s, after "
                "%.3f s); copies run through pageable memory: staged by the driver, slower, and "
                "device-to-host copies block the engine until they finish",
                self.rank,
                length / 2**20,
                rc,
                took,
            )
            return
        _log.info("kvtier: rank %d pinned the arena's %.1f MiB for DMA in %.3f s", self.rank, length / 2**20, took)
        self._pinned = (cudart, address)

    @property
    def pinned(self) -> bool:
        """Whether the rows are registered with CUDA (page-locked for DMA)."""
        return self._pinned is not None

    @property
    def row_stride(self) -> int:
        """Bytes from one row to the next in the arena's row region."""
        view = self.open()
        return view.row_region[1] // view.num_chunks

    def region_array(self, view: Optional[_k.ArenaView] = None) -> Any:
        """A writable numpy ``uint8`` array over the whole row region, for copy engines that
        address rows by offset (``row * row_stride``); they touch a row only under its grant."""
        view = view or self.open()
        address, length = view.row_region
        return host_array(address, length, view)

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
        return _retrying(lambda: view.row(chunk_id, write), self.grant_timeout_s, 0.0002)

    def chunks(
        self,
        gpu_block_ids: Sequence[int],
        chunk_ids: Sequence[int],
        group_sizes: Optional[Sequence[int]] = None,
        block_indices: Optional[Sequence[int]] = None,
    ) -> list:
        """The copies of one transfer, chunk by chunk: ``(row, group, [(j, gpu_block), ...])``
        with ``j`` the block's position in the chunk. ``chunk_ids`` hold each group's chunks in
        group order, as vLLM's CPU spec does; without ``group_sizes`` every block is in group
        0, starting at a chunk boundary."""
        bpc = self.blocks_per_chunk
        if group_sizes is None:
            group_sizes, block_indices = [len(gpu_block_ids)], [0]
        if block_indices is None or len(block_indices) != len(group_sizes):
            raise _k.KvtierError("a transfer needs one block index per group size")
        if len(group_sizes) > len(self.group_tensors):
            raise _k.KvtierError(
                f"a transfer of {len(group_sizes)} KV-cache groups; the worker knows {len(self.group_tensors)}"
            )
        out, g_off, c_off = [], 0, 0
        for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
            n = int(n)
            if n == 0:
                continue
            skip = int(first) % bpc
            count = -(-(n + skip) // bpc)
            rows = chunk_ids[c_off : c_off + count]
            blocks = gpu_block_ids[g_off : g_off + n]
            if len(rows) != count or len(blocks) != n:
                raise _k.KvtierError(
                    f"group {g}: {n} blocks from logical block {first} need {count} chunks and "
                    f"{n} GPU blocks; the transfer has {len(rows)} and {len(blocks)} left"
                )
            for c, row in enumerate(rows):
                lo, hi = max(0, c * bpc - skip), min(n, (c + 1) * bpc - skip)
                out.append((int(row), g, [((skip + i) % bpc, int(blocks[i])) for i in range(lo, hi)]))
            g_off, c_off = g_off + n, c_off + count
        if g_off != len(gpu_block_ids) or c_off != len(chunk_ids):
            raise _k.KvtierError(
                f"the transfer names {len(gpu_block_ids)} GPU blocks and {len(chunk_ids)} chunks; "
                f"its groups cover {g_off} and {c_off}"
            )
        return out

    def _places(self, group: int, placed: list):
        """(tensor index, GPU blocks, byte offset in the row, bytes) of a chunk's copies, one per
        tensor of its group: the chunk's positions ``j`` are consecutive, so its pages of one
        tensor are one span of the row, copied with one gather (or scatter) of its GPU blocks
        rather than a copy per block (each a synchronous device transfer under torch)."""
        base = self.slot * self.rank_stride
        first = placed[0][0]
        blocks = [block for _, block in placed]
        for t in self.group_tensors[group]:
            nb = self.block_bytes[t]
            yield t, blocks, base + self.sections[t] + first * nb, nb * len(blocks)

    def plan(
        self,
        gpu_block_ids: Sequence[int],
        chunk_ids: Sequence[int],
        group_sizes: Optional[Sequence[int]] = None,
        block_indices: Optional[Sequence[int]] = None,
    ) -> list:
        """A transfer's copies, chunk by chunk: ``(row, [(tensor index, GPU blocks, offset in
        the row, bytes), ...])``. Every GPU block and row is checked to exist (asynchronous
        engines copy by address)."""
        out = []
        num_rows = self.open().num_chunks
        for row, group, placed in self.chunks(gpu_block_ids, chunk_ids, group_sizes, block_indices):
            if not 0 <= row < num_rows:
                raise _k.KvtierError(f"arena row {row} does not exist (the arena has {num_rows})")
            parts = list(self._places(group, placed))
            for t, blocks, _, _ in parts:
                n = self.num_blocks[t]
                bad = [] if n is None else [b for b in blocks if not 0 <= b < n]
                if bad:
                    raise _k.KvtierError(f"GPU blocks {bad} do not exist in KV tensor {t} of {n} blocks")
            out.append((row, parts))
        return out

    def copy_plan(self, plan: list, write: bool) -> None:
        """Runs a plan's copies now, row grant by row grant: into the rows (``write``: a store)
        or out of them (a load)."""
        import numpy as np

        for row_id, parts in plan:
            with self._row(row_id, write) as row:
                data = row.array()
                for t, blocks, off, n in parts:
                    if write:
                        _gather_out(self.tensors[t], blocks, data[off : off + n], np)
                    else:
                        _scatter_in(self.tensors[t], blocks, data[off : off + n], np)
                del data

    def copy_out(
        self,
        gpu_block_ids: Sequence[int],
        chunk_ids: Sequence[int],
        group_sizes: Optional[Sequence[int]] = None,
        block_indices: Optional[Sequence[int]] = None,
    ) -> None:
        """Copies GPU blocks into this rank's slice of their chunks' rows (see :meth:`chunks`)."""
        self.copy_plan(self.plan(gpu_block_ids, chunk_ids, group_sizes, block_indices), True)

    def report(self, keys: Sequence[bytes], success: bool) -> bool:
        """Reports finished (or failed) stores of ``keys`` on the channel; ``False`` when no
        channel is open (nothing reported)."""
        self.open()
        if self.reporter is None:
            return False
        self.reporter.report(list(keys), success)
        return True

    def store(
        self,
        gpu_block_ids: Sequence[int],
        chunk_ids: Sequence[int],
        keys: Sequence[bytes] = (),
        group_sizes: Optional[Sequence[int]] = None,
        block_indices: Optional[Sequence[int]] = None,
    ) -> bool:
        """Copies the chunks' blocks into their rows and reports ``keys`` when a channel is
        open: as stored, or — when the copy raises — as failed before the error propagates."""
        try:
            self.copy_out(gpu_block_ids, chunk_ids, group_sizes, block_indices)
        except Exception:
            if len(keys):
                self.report(keys, False)
            raise
        if len(keys):
            self.report(keys, True)
        return True

    def load(
        self,
        chunk_ids: Sequence[int],
        gpu_block_ids: Sequence[int],
        group_sizes: Optional[Sequence[int]] = None,
        block_indices: Optional[Sequence[int]] = None,
    ) -> bool:
        """Copies this rank's slice of the chunks' rows into their GPU blocks (see
        :meth:`chunks`)."""
        self.copy_plan(self.plan(gpu_block_ids, chunk_ids, group_sizes, block_indices), False)
        return True

    def close(self, keep_pinned: bool = False) -> None:
        """Unpins the rows and says goodbye on the channel. Idempotent, and quiet when the
        manager has already gone (its channel then refuses the goodbye). ``keep_pinned`` leaves
        the rows registered (copies given up at shutdown may still be running on the device)."""
        if self._pinned is not None and not keep_pinned:
            # Before the view (and its mapping) goes.
            cudart, address = self._pinned
            self._pinned = None
            try:
                cudart.cudaHostUnregister(address)
            except Exception as e:
                _log.warning("kvtier: rank %d could not unpin the arena: %s", self.rank, e)
        reporter, self.reporter = self.reporter, None
        if reporter is not None:
            try:
                reporter.close()
            except (_k.KvtierError, OSError) as e:
                # The manager shut down first: nobody is left to say goodbye to.
                _log.debug("kvtier: rank %d: completion channel already gone at close: %s", self.rank, e)


def _retrying(attempt: Any, timeout_s: float, pause_s: float) -> Any:
    """``attempt()``'s result, tried again every ``pause_s`` while it raises a kvtier or OS
    error, for up to ``timeout_s``; then the last error propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return attempt()
        except (_k.KvtierError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(pause_s)


def _num_blocks(t: Any) -> Optional[int]:
    """Blocks of a KV tensor (its first axis), ``None`` when it does not say."""
    shape = getattr(t, "shape", None)
    if shape is not None and len(shape):
        return int(shape[0])
    try:
        return len(t)
    except TypeError:
        return None


def _is_numpy(t: Any, np: Any) -> bool:
    return isinstance(t, np.ndarray)


def _gather_out(t: Any, blocks: list, dst: Any, np: Any) -> None:
    """Copies blocks ``blocks`` of tensor ``t``, in order, into the byte span ``dst``."""
    if _is_numpy(t, np):
        dst[:] = np.ascontiguousarray(t[blocks]).reshape(-1).view(np.uint8)
        return
    import torch  # noqa: F401  (lazily: workers without torch use numpy tensors)

    idx = torch.as_tensor(blocks, dtype=torch.long, device=t.device)
    src = t.index_select(0, idx).contiguous().view(-1).view(torch.uint8)
    torch.from_numpy(dst).copy_(src, non_blocking=False)


def _scatter_in(t: Any, blocks: list, src: Any, np: Any) -> None:
    """Copies the byte span ``src`` into blocks ``blocks`` of tensor ``t``, in order."""
    if _is_numpy(t, np):
        t[blocks] = src.view(t.dtype).reshape((len(blocks),) + t.shape[1:])
        return
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.long, device=t.device)
    data = torch.from_numpy(_readable(src, np)).to(t.device)
    t.index_copy_(0, idx, data.view(t.dtype).view((len(blocks),) + tuple(t.shape[1:])))


def _readable(a: Any, np: Any) -> Any:
    """``a`` itself when writable; else a writable alias of its bytes (kept alive with it) that
    ``torch.from_numpy`` takes without warning about read-only memory. Only ever read."""
    if a.flags.writeable:
        return a
    return np.asarray(_Alias(a))


class _Alias:
    """A numpy array interface over the same bytes as the (read-only, contiguous) array ``a``."""

    def __init__(self, a: Any):
        self.a = a
        self.__array_interface__ = {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (a.__array_interface__["data"][0], False),
            "version": 3,
        }


def _groups(gpu_spec: Any) -> tuple:
    """A GPU spec's ``(group_sizes, block_indices)``; ``(None, None)`` for a spec without them
    (one group, chunk-aligned)."""
    sizes = getattr(gpu_spec, "group_sizes", None)
    if sizes is None:
        return None, None
    return list(sizes), list(getattr(gpu_spec, "block_indices", None) or [0] * len(sizes))


@dataclass
class _TransferResult:
    """vLLM's ``TransferResult`` when vLLM is not importable."""

    job_id: int
    success: bool
    transfer_size: Optional[int] = None
    transfer_time: Optional[float] = None


class KvtierOffloadingWorker(_WorkerBase):
    """vLLM's ``OffloadingWorker`` of one rank: device↔arena copies through a copy engine
    (:mod:`kvtier._copy_engine`), with the finished stores reported by key on the completion
    channel.

    On CUDA the copies run on the engine's own streams (a store stream, a load stream and one
    for expedited loads) and a job is handed to vLLM — and a store reported on the channel —
    only once its event fired, polled without blocking at every ``submit_*``, ``wait`` and
    ``get_finished``. Elsewhere (numpy arrays, CPU tensors) the copies run inside ``submit_*``
    and are reported there. ``engine`` injects another engine (the tests' fake device).

    Jobs follow vLLM's GPU specs: several KV-cache groups per job, each starting at any
    logical block (partial first and last chunks), see :meth:`KvtierTransferHandler.chunks`.

    vLLM 0.33.0 cannot fail a job (its connector asserts every result's success). A store
    whose copy fails is therefore reported as failed on the completion channel — the manager
    applies that report before the engine's, and drops the chunks — and finished towards vLLM.
    Only when the failure cannot reach the manager is the job's result a failure. A load that
    fails raises (from the call that finds it: ``submit_load`` on the CPU, ``get_finished`` or
    ``wait`` on CUDA): the GPU blocks would otherwise hold wrong KV.
    """

    #: How long ``shutdown`` waits for copies still running before giving them up.
    shutdown_timeout_s = 60.0

    def __init__(self, handler: KvtierTransferHandler, row_keys: "RowKeys | str | None", engine: Any = None):
        self.handler = handler
        self._row_keys = row_keys
        self._engine = engine
        self._finished: list = []
        # Failed loads not yet raised (vLLM cannot take a failed load).
        self._load_failures: list = []
        self._closed = False
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

    @property
    def engine(self) -> Any:
        """The copy engine (built at the first job: a CUDA engine opens the arena). ``engine``
        given to the constructor as a factory (a callable taking the handler) is called then."""
        if self._engine is None:
            self._engine = make_engine(self.handler)
        elif not hasattr(self._engine, "submit"):
            self._engine = self._engine(self.handler)
        return self._engine

    def _nbytes(self, rows: list) -> int:
        return len(rows) * self.handler.rank_chunk_bytes

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        rows = [int(r) for r in dst_spec.block_ids]
        blocks = [int(b) for b in src_spec.block_ids]
        job = CopyJob(job_id, True, [], nbytes=self._nbytes(rows))
        try:
            row_keys = self.row_keys
            if row_keys is not None:
                job.keys = row_keys.keys_of(rows)
            job.plan = self.handler.plan(blocks, rows, *_groups(src_spec))
            engine = self.engine
        except Exception as e:  # reported below; vLLM cannot take an exception here either
            self._complete(Completion(job, False, e))
            return True
        engine.submit(job)
        # A failed load found here raises from the next load, wait or get_finished instead.
        self._collect(raise_load_failures=False)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        rows = [int(r) for r in src_spec.block_ids]
        job = CopyJob(job_id, False, [], nbytes=self._nbytes(rows), expedited=bool(expedited))
        try:
            job.plan = self.handler.plan([int(b) for b in dst_spec.block_ids], rows, *_groups(dst_spec))
            engine = self.engine
        except Exception as e:
            self._complete(Completion(job, False, e))
            self._raise_load_failures()
            return True
        engine.submit(job)
        self._collect()
        return True

    def _collect(self, raise_load_failures: bool = True) -> None:
        """Hands the engine's completions on: stores reported on the channel, results queued
        for ``get_finished``; a failed load raises once every completion was handled."""
        for c in self.engine.poll() if hasattr(self._engine, "submit") else ():
            self._complete(c)
        if raise_load_failures:
            self._raise_load_failures()

    def _complete(self, c: Completion) -> None:
        job = c.job
        if not job.store:
            if c.ok:
                self._finished.append(self._result_cls(job.job_id, True, job.nbytes, c.seconds))
            else:
                self._load_failures.append(c)
            return
        try:
            reported = bool(job.keys) and self.handler.report(job.keys, c.ok)
        except Exception as e:
            _log.error("kvtier: rank %d could not report store job %d: %s", self.handler.rank, job.job_id, e)
            reported = False
        if c.ok:
            ok = True
        elif reported:
            _log.error(
                "kvtier: rank %d: store job %d failed (%s); reported as failed on the completion "
                "channel, so the manager drops those chunks",
                self.handler.rank,
                job.job_id,
                c.error,
            )
            ok = True
        else:
            _log.error(
                "kvtier: rank %d: store job %d failed (%s) and the failure could not be reported",
                self.handler.rank,
                job.job_id,
                c.error,
            )
            ok = False
        self._finished.append(self._result_cls(job.job_id, ok, job.nbytes, c.seconds))

    def _raise_load_failures(self) -> None:
        failures = self._load_failures
        if not failures:
            return
        first, rest = failures[0], failures[1:]
        failures.clear()
        for c in rest:
            _log.error("kvtier: rank %d: load job %d failed: %s", self.handler.rank, c.job.job_id, c.error)
        rows = [row for row, _ in first.job.plan]
        raise _k.KvtierError(
            f"rank {self.handler.rank}: load job {first.job.job_id} from arena rows {rows} failed: "
            f"{first.error} (vLLM cannot fail a load; its blocks would hold wrong KV)"
        ) from first.error

    def get_finished(self) -> list:
        """vLLM's results of the jobs whose copies are done (polled, never waited for)."""
        self._collect()
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set) -> None:
        """Blocks until the copies of ``job_ids`` are done (vLLM waits so for the expedited
        loads its next forward reads, and for stores of preempted requests' blocks); their
        results come from ``get_finished`` as usual."""
        if self._engine is not None and hasattr(self._engine, "submit"):
            self._engine.wait(set(job_ids))
        self._collect()

    def shutdown(self) -> None:
        """Waits (up to ``shutdown_timeout_s``) for the copies in flight and reports them —
        given-up stores as failed —, then closes the handler. Idempotent, and clean after the
        manager has gone."""
        if self._closed:
            return
        self._closed = True
        abandoned = False
        if hasattr(self._engine, "submit"):
            for c in self._engine.shutdown(self.shutdown_timeout_s):
                self._complete(c)
            abandoned = bool(getattr(self._engine, "abandoned", False))
            for c in self._load_failures:
                _log.error("kvtier: rank %d: load job %d failed at shutdown: %s", self.handler.rank, c.job.job_id, c.error)
            self._load_failures.clear()
        self.handler.close(keep_pinned=abandoned)
