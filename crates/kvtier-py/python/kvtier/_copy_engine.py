"""How a kvtier worker's copies between a rank's KV tensors and the arena rows run.

Two engines behind one interface (``submit`` / ``poll`` / ``wait`` / ``shutdown``):

- :class:`SyncCopyEngine` copies inside ``submit`` (numpy arrays, torch tensors on the CPU): the
  job is finished when ``submit`` returns, and the next ``poll`` hands its completion out.
- :class:`StreamCopyEngine` copies on device streams of its own and never blocks the caller: a
  store stream, a load stream and a stream for vLLM's expedited loads, created once. Every job
  first waits (on the device) for an event recorded on the model's current stream at
  submission, so a store never reads KV a forward is still writing and a load never races the
  writes (e.g. zeroing) queued before it on its blocks. The model's stream never waits on a
  copy here: a load is ordered before the forward that reads it by the worker — an ordinary
  load is reported to vLLM only once its event fired (the request resumes at a later step), an
  expedited one is waited for in ``wait`` before the forward is queued. A job's copies are one
  batched call (vLLM's ``swap_blocks_batch`` over page descriptors when importable, else one
  gather/scatter per tensor on the device and one asynchronous copy per row span). Completion is
  an event per job, polled without blocking in ``poll``; only then does the worker report the
  job, so a store is never reported before its bytes are in the arena.

The device is reached only through a *device layer* (streams, events, the current stream,
record / wait / query / synchronize, and ``launch`` to queue work on a stream):
:class:`TorchCudaDevice` for CUDA, and a fake in the tests whose streams run when the test says.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

_log = logging.getLogger("kvtier.vllm")

STORE, LOAD, EXPEDITED = "store", "load", "expedited"


@dataclass
class CopyJob:
    """One vLLM transfer job of one rank.

    ``plan`` holds the job's copies chunk by chunk: ``(row, [(tensor, gpu_blocks, offset,
    nbytes), ...])`` where the blocks of tensor ``tensor`` go to (or come from) the ``nbytes``
    starting at ``offset`` in the row, one page per block, in order. ``keys`` are the chunks'
    keys a store reports."""

    job_id: int
    store: bool
    plan: list
    keys: list = field(default_factory=list)
    nbytes: int = 0
    expedited: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def kind(self) -> str:
        return STORE if self.store else (EXPEDITED if self.expedited else LOAD)


@dataclass
class Completion:
    """A job whose copies are over: ``ok``, or failed with ``error``."""

    job: CopyJob
    ok: bool
    error: Optional[BaseException] = None
    seconds: float = 0.0


class SyncCopyEngine:
    """Copies at submission through the handler's row grants (numpy, or torch ``index_select``
    / ``index_copy_``): nothing is ever in flight after ``submit`` returns."""

    def __init__(self, handler: Any):
        self.handler = handler
        self._done: list = []
        self.abandoned = False

    def submit(self, job: CopyJob) -> None:
        try:
            self.handler.copy_plan(job.plan, job.store)
        except Exception as e:  # the job fails; the worker reports it
            self._done.append(Completion(job, False, e, time.perf_counter() - job.submitted))
            return
        self._done.append(Completion(job, True, None, time.perf_counter() - job.submitted))

    def poll(self) -> list:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: Any) -> None:
        """Jobs finish at submission: nothing to wait for."""

    def in_flight(self) -> int:
        return 0

    def shutdown(self, timeout_s: float = 0.0) -> list:
        return self.poll()


@dataclass
class _Flight:
    job: CopyJob
    stream: Any
    ready: Any = None
    start: Any = None
    end: Any = None
    grants: list = field(default_factory=list)
    keep: list = field(default_factory=list)
    error: Optional[BaseException] = None


class StreamCopyEngine:
    """Copies on the engine's own streams of ``device`` (see the module docs), with ``mover``
    issuing a job's copies on the stream it is launched on.

    Row grants: a load holds read grants on its rows until its copies are done (ranks share
    them). A store holds its write grants as long when this rank is the rows' only writer
    (``hold_write_grants``); when several ranks write slices of the same rows, a write grant
    held across an asynchronous copy would stall the other ranks' submissions (and, with the
    ranks in lockstep, the engine), so it is taken and released around the submission: the
    manager's protocol (a row being written is neither read nor handed out until every rank
    reported it) keeps the row to this copy while it runs.
    """

    def __init__(self, handler: Any, device: Any, mover: Any, hold_write_grants: Optional[bool] = None):
        self.handler = handler
        self.device = device
        self.mover = mover
        if hold_write_grants is None:
            hold_write_grants = int(getattr(handler, "world_size", 1)) == 1
        self.hold_write_grants = hold_write_grants
        self.streams = {kind: device.new_stream() for kind in (STORE, LOAD, EXPEDITED)}
        self._flights: dict = {}
        self._done: list = []
        self._events: list = []
        # Set when shutdown gave up on copies still running: their memory must stay as it is
        # (their grants and buffers are kept here).
        self.abandoned = False
        self._abandoned: list = []

    def _event(self) -> Any:
        return self._events.pop() if self._events else self.device.new_event(timing=True)

    def submit(self, job: CopyJob) -> None:
        """Queues the job's copies; never blocks on the device. A job whose copies cannot be
        queued finishes as failed (``poll`` hands it out)."""
        flight = _Flight(job, self.streams[job.kind])
        dev = self.device
        try:
            for row, _ in job.plan:
                flight.grants.append(self.handler._row(row, job.store))
            flight.ready = self._event()
            dev.record(flight.ready, dev.current_stream())
            dev.wait(flight.stream, flight.ready)
            flight.start = self._event()
            dev.record(flight.start, flight.stream)
        except Exception as e:
            self._release(flight)
            self._done.append(Completion(job, False, e, time.perf_counter() - job.submitted))
            return
        try:
            dev.launch(flight.stream, lambda: self.mover.run(job, flight.keep))
        except Exception as e:  # copies queued before the error still run: wait for them
            flight.error = e
        try:
            flight.end = self._event()
            dev.record(flight.end, flight.stream)
        except Exception as e:
            flight.error = flight.error or e
            flight.end = None
        if job.store and not self.hold_write_grants:
            self._release(flight)
        if flight.end is None:  # nothing to wait for on a device that cannot record
            self._finish(flight, False)
        else:
            self._flights[job.job_id] = flight

    def _release(self, flight: _Flight) -> None:
        grants, flight.grants = flight.grants, []
        for g in grants:
            try:
                g.release()
            except Exception as e:  # never an array of ours: log, the grant stays with it
                _log.error("kvtier: could not release arena row %s: %s", getattr(g, "chunk_id", "?"), e)

    def _finish(self, flight: _Flight, done_ok: bool) -> None:
        job = flight.job
        self._flights.pop(job.job_id, None)
        self._release(flight)
        ok = done_ok and flight.error is None
        seconds = time.perf_counter() - job.submitted
        if ok:
            try:
                seconds = self.device.elapsed_s(flight.start, flight.end)
            except Exception:
                pass
            self._events.extend(e for e in (flight.ready, flight.start, flight.end) if e is not None)
        flight.keep = []
        self._done.append(Completion(job, ok, flight.error, seconds))

    def poll(self) -> list:
        """Completions since the last call: every job whose end event fired (or whose event
        reports a device error), without blocking."""
        for flight in list(self._flights.values()):
            try:
                fired = self.device.query(flight.end)
            except Exception as e:
                flight.error = flight.error or e
                fired = True
            if fired:
                self._finish(flight, True)
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: Any) -> None:
        """Blocks until the copies of ``job_ids`` (those in flight) are done on the device."""
        for job_id in job_ids:
            flight = self._flights.get(job_id)
            if flight is None:
                continue
            try:
                self.device.synchronize(flight.end)
            except Exception as e:
                flight.error = flight.error or e

    def in_flight(self) -> int:
        return len(self._flights)

    def shutdown(self, timeout_s: float = 60.0) -> list:
        """Waits up to ``timeout_s`` for the copies in flight, then gives the rest up: they
        finish as failed (the worker reports such stores as failed) and the engine is marked
        ``abandoned`` (their memory may still be written: the handler then leaves the arena
        registered). Returns every completion not yet handed out."""
        deadline = time.monotonic() + timeout_s
        out = self.poll()
        while self._flights and time.monotonic() < deadline:
            time.sleep(0.0005)
            out += self.poll()
        if self._flights:
            self.abandoned = True
            _log.error(
                "kvtier: rank %s: %d copy job(s) still running after %.3g s at shutdown; given up "
                "as failed",
                getattr(self.handler, "rank", "?"),
                len(self._flights),
                timeout_s,
            )
            for flight in list(self._flights.values()):
                flight.error = flight.error or TimeoutError(f"copy job {flight.job.job_id} abandoned at shutdown")
                # Grants (and buffers) of abandoned copies are kept: their rows may still be
                # written, their descriptors read.
                self._abandoned.append((flight.grants, flight.keep))
                flight.grants, flight.keep = [], []
                self._finish(flight, False)
            out += self.poll()
        self._events.clear()
        return out


class TorchCudaDevice:
    """The device layer over ``torch.cuda`` for one device."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def new_event(self, timing: bool = False) -> Any:
        return self.torch.cuda.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def launch(self, stream: Any, fn: Callable[[], Any]) -> Any:
        with self.torch.cuda.stream(stream):
            return fn()


class _Memory:
    """numpy's array interface over ``length`` bytes at ``address`` (writable), keeping
    ``owner`` (what keeps the memory mapped) alive as long as any array of it."""

    def __init__(self, address: int, length: int, owner: Any, readonly: bool = False):
        self.owner = owner
        self.__array_interface__ = {
            "shape": (int(length),),
            "typestr": "|u1",
            "data": (int(address), bool(readonly)),
            "version": 3,
        }


def host_array(address: int, length: int, owner: Any) -> Any:
    """A writable numpy ``uint8`` array over host memory the caller keeps mapped (``owner``)."""
    import numpy as np

    return np.asarray(_Memory(address, length, owner))


def _blocks_of(plan: list, tensor: int) -> list:
    return [(row, b, off, n) for row, parts in plan for t, b, off, n in parts if t == tensor]


class NumpyMover:
    """Copies between numpy KV arrays and the arena's row region (a numpy ``uint8`` array),
    one fancy-indexed gather or scatter per tensor and chunk. Used with device layers that run
    host code as the "device" (the tests' fake)."""

    def __init__(self, tensors: Sequence[Any], region: Any, row_stride: int):
        self.tensors, self.region, self.row_stride = list(tensors), region, row_stride

    def run(self, job: CopyJob, keep: list) -> None:
        import numpy as np

        for row, parts in job.plan:
            base = row * self.row_stride
            for t, blocks, off, n in parts:
                tensor = self.tensors[t]
                span = self.region[base + off : base + off + n]
                if job.store:
                    span[:] = np.ascontiguousarray(tensor[blocks]).reshape(-1).view(np.uint8)
                else:
                    tensor[blocks] = span.view(tensor.dtype).reshape((len(blocks),) + tensor.shape[1:])


class TorchMover:
    """torch copies, queued on the current stream: per tensor of a job, one gather
    (``index_select``, store) or scatter (``index_copy_``, load) of its blocks on the device
    through a staging tensor, and one ``copy_(non_blocking=True)`` per row span between the
    staging tensor and the (pinned) rows. The staging tensors stay alive with the job."""

    def __init__(self, tensors: Sequence[Any], region: Any, row_stride: int):
        import torch

        self.torch = torch
        self.tensors, self.row_stride = list(tensors), row_stride
        self.region = torch.from_numpy(region)

    def run(self, job: CopyJob, keep: list) -> None:
        torch = self.torch
        used = sorted({t for _, parts in job.plan for t, *_ in parts})
        for t in used:
            tensor = self.tensors[t]
            spans = _blocks_of(job.plan, t)
            blocks = [b for _, bs, _, _ in spans for b in bs]
            idx = torch.tensor(blocks, dtype=torch.long).to(tensor.device, non_blocking=True)
            keep.append(idx)
            if job.store:
                staged = tensor.index_select(0, idx)
            else:
                staged = torch.empty((len(blocks),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            keep.append(staged)
            flat = staged.view(-1).view(torch.uint8)
            k = 0
            for row, bs, off, n in spans:
                host = self.region[row * self.row_stride + off : row * self.row_stride + off + n]
                dev = flat[k : k + n]
                if job.store:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
                k += n
            if not job.store:
                tensor.index_copy_(0, idx, staged)


class PointerMover:
    """One call of vLLM's ``swap_blocks_batch`` per job: a descriptor (source address,
    destination address, bytes) per run of consecutive blocks of one tensor that are also
    consecutive pages of one row span — a chunk's pages of one tensor coalesce into one copy
    when its GPU blocks are consecutive. ``swap(src, dst, sizes, is_src_access_order_any)``
    takes int64 CPU tensors (``as_args`` makes them of the descriptor arrays: pinned torch
    tensors by default); they stay alive with the job."""

    def __init__(
        self,
        tensors: Sequence[Any],
        region_address: int,
        row_stride: int,
        swap: Callable,
        load_swap: Optional[Callable] = None,
        as_args: Optional[Callable] = None,
    ):
        self.tensors = list(tensors)
        self.as_args = as_args or _pinned_int64
        self.base = [int(t.data_ptr()) for t in self.tensors]
        self.stride = [int(t.stride(0)) * int(t.element_size()) for t in self.tensors]
        self.page = [int(t[0].numel()) * int(t.element_size()) for t in self.tensors]
        self.region_address, self.row_stride = int(region_address), int(row_stride)
        self.swap, self.load_swap = swap, load_swap or swap

    def descriptors(self, job: CopyJob) -> tuple:
        """``(device addresses, host addresses, sizes)`` of the job's copies, coalesced."""
        dev: list = []
        host: list = []
        sizes: list = []
        for row, parts in job.plan:
            row_base = self.region_address + row * self.row_stride
            for t, blocks, off, _ in parts:
                page, stride, base = self.page[t], self.stride[t], self.base[t]
                h = row_base + off
                for b in blocks:
                    d = base + b * stride
                    if sizes and dev[-1] + sizes[-1] == d and host[-1] + sizes[-1] == h:
                        sizes[-1] += page
                    else:
                        dev.append(d)
                        host.append(h)
                        sizes.append(page)
                    h += page
        return dev, host, sizes

    def run(self, job: CopyJob, keep: list) -> None:
        import numpy as np

        dev, host, sizes = self.descriptors(job)
        if not sizes:
            return
        src, dst = (dev, host) if job.store else (host, dev)
        args = [self.as_args(np.array(x, dtype=np.int64)) for x in (src, dst, sizes)]
        keep.extend(args)
        if job.store:
            # Stores read the live KV cache: stream order (the default) keeps their reads behind
            # the wait on the model's event.
            self.swap(*args, is_src_access_order_any=False)
        else:
            # Loads read rows no device stream writes: the driver may prefetch them.
            self.load_swap(*args, is_src_access_order_any=True)


def _pinned_int64(a: Any) -> Any:
    """A pinned torch int64 CPU tensor of ``a`` (vLLM's descriptor buffers are pinned: its
    Triton path copies them to the device asynchronously)."""
    import torch

    t = torch.from_numpy(a)
    return t.pin_memory() if torch.cuda.is_available() else t


def vllm_swap_blocks() -> Optional[Callable]:
    """vLLM's batched copy op (``vllm._custom_ops.swap_blocks_batch``) when it is importable and
    its kernel is present (vLLM built for CUDA), else ``None``."""
    try:
        import torch
        from vllm import _custom_ops as ops  # type: ignore[import-not-found]

        if not hasattr(torch.ops, "_C_cache_ops") or not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
            return None
        return ops.swap_blocks_batch
    except Exception:
        return None


def _vllm_triton_load_swap(tensors: Sequence[Any], pinned: bool) -> Optional[Callable]:
    """vLLM's Triton ``swap_blocks_batch`` for loads, where vLLM's own worker picks it: the rows
    pinned (the kernel reads host memory directly), every page under its size threshold and a
    multiple of 8 bytes; else ``None`` (the copy engine's op serves loads too)."""
    if not pinned:
        return None
    try:
        import functools

        from vllm.triton_utils import HAS_TRITON  # type: ignore[import-not-found]
        from vllm.v1.kv_offload.cpu import swap_blocks_triton as st  # type: ignore[import-not-found]

        pages = [int(t[0].numel()) * int(t.element_size()) for t in tensors]
        if not HAS_TRITON or not pages or max(pages) >= st.THRESHOLD_BYTES or any(p % 8 for p in pages):
            return None
        chunk = 1
        while chunk < max(pages):
            chunk *= 2
        return functools.partial(st.swap_blocks_batch, bytes_per_chunk=min(chunk, 8192))
    except Exception:
        return None


def _pages_contiguous(t: Any) -> bool:
    try:
        return bool(t[0].is_contiguous())
    except Exception:
        return False


def make_engine(handler: Any, device: Any = None, mover: Any = None) -> Any:
    """The engine for ``handler``'s tensors: a :class:`StreamCopyEngine` on CUDA (or on the
    ``device`` layer given), else a :class:`SyncCopyEngine`."""
    tensors = handler.tensors
    cuda = [t for t in tensors if getattr(t, "is_cuda", False) and hasattr(t, "data_ptr")]
    if device is None:
        if not cuda:
            return SyncCopyEngine(handler)
        device = TorchCudaDevice(cuda[0].device)
    view = handler.open()
    if mover is None:
        region = handler.region_array(view)
        if not cuda:  # a device layer that runs host code (the tests' fake)
            torch_tensors = any(type(t).__module__.startswith("torch") for t in tensors)
            mover = (TorchMover if torch_tensors else NumpyMover)(tensors, region, handler.row_stride)
        else:
            swap = vllm_swap_blocks()
            if swap is not None and all(_pages_contiguous(t) for t in tensors):
                load_swap = _vllm_triton_load_swap(tensors, pinned=handler.pinned)
                mover = PointerMover(tensors, view.row_region[0], handler.row_stride, swap, load_swap)
            else:
                mover = TorchMover(tensors, region, handler.row_stride)
    return StreamCopyEngine(handler, device, mover)
