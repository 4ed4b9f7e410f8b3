"""Copy benchmark of scripts/gpu-check.sh (needs one NVIDIA GPU and the pinned vLLM env).

Three backends copy the same KV blocks between device memory and pinned host memory, in one
run: kvtier's worker (kvtier.vllm over an arena in a temporary directory), vLLM 0.33's own
CPU-offloading worker (``CPUOffloadingWorker``), and a raw torch copy (contiguous blocks, one
``copy_(non_blocking=True)`` per tensor: the ceiling). For 16, 64 and 256 blocks per job it
reports GB/s per direction, and the step-time impact: a fixed-size matmul loop on the model's
stream stands in for the forward, with a store and a load job of each backend submitted at
every step's start and polled at its end (vLLM's connector does the same), against the loop
alone.

Verdicts (one line each; exit status 1 when one fails, 2 when CUDA is missing):
  store throughput  kvtier ≥ 0.9 × vLLM's handler, at every job size
  load throughput   kvtier ≥ 0.9 × vLLM's handler, at every job size
  step time         the forward loop slowed by ≤ 5 % while kvtier copies run beside it
                    (vLLM's handler measured the same way, printed beside it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

THROUGHPUT_RATIO = 0.9
SLOWDOWN_MAX = 0.05


def fail(msg: str, code: int = 2) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr)
    sys.exit(code)


def need_cuda():
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        fail(f"torch is not importable ({e}); run this in the pinned vLLM environment (scripts/vllm-env.sh)")
    if not torch.cuda.is_available():
        fail(
            f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() == False; "
            "this benchmark needs one NVIDIA GPU"
        )
    return torch


def spec_ids(ids, gpu=False):
    ns = SimpleNamespace(block_ids=np.asarray(ids, dtype=np.int64))
    if gpu:
        ns.group_sizes, ns.block_indices = [len(ids)], [0]
    return ns


class Kvtier:
    name = "kvtier"

    def __init__(self, torch, tensors, page, rows, tmp):
        from kvtier.vllm import KvtierOffloadingSpec, KvtierOffloadingWorker

        chain = os.path.join(tmp, "chain.toml")
        with open(chain, "w") as f:
            f.write(
                f'[primary]\ntype = "cpu"\ncapacity = {rows}\nshared_memory = "{tmp}/arena"\n'
                "[control_plane]\nthread = false\noff_step = true\n"
            )
        self.spec = KvtierOffloadingSpec.from_settings({"kvtier_chain": chain}, page * len(tensors))
        self.manager = self.spec.get_manager()
        # The worker's data path: no row-key table, so no reports (the manager is not driven).
        self.worker = KvtierOffloadingWorker(self.spec.get_transfer_handler(tensors), None)
        self.worker.handler.open()
        if not self.worker.handler.pinned:
            print("gpu-check: warning: kvtier could not pin its arena (see the log above)", file=sys.stderr)

    def store(self, job, blocks, rows):
        self.worker.submit_store(job, spec_ids(blocks, True), spec_ids(rows))

    def load(self, job, rows, blocks):
        self.worker.submit_load(job, spec_ids(rows), spec_ids(blocks, True))

    def finished(self):
        return [r.job_id for r in self.worker.get_finished()]

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


class Vllm:
    name = "vLLM"

    def __init__(self, torch, tensors, page, rows, tmp):
        from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
        )
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-not-found]
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker  # type: ignore[import-not-found]

        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(len(tensors))]],
        )
        self.worker = CPUOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=rows)
        self.gpu, self.cpu = GPULoadStoreSpec, CPULoadStoreSpec

    def store(self, job, blocks, rows):
        assert self.worker.submit_store(job, self.gpu(list(blocks), [len(blocks)], [0]), self.cpu(list(rows)))

    def load(self, job, rows, blocks):
        assert self.worker.submit_load(job, self.cpu(list(rows)), self.gpu(list(blocks), [len(blocks)], [0]))

    def finished(self):
        return [r.job_id for r in self.worker.get_finished()]

    def close(self):
        self.worker.shutdown()


class RawTorch:
    """One pinned host tensor per KV tensor; a job copies n consecutive blocks of each with one
    ``copy_(non_blocking=True)`` on a stream of its direction that first waits for the model's."""

    name = "torch"

    def __init__(self, torch, tensors, page, rows, tmp):
        self.torch = torch
        self.tensors = tensors
        self.host = [torch.empty((rows, page), dtype=torch.int8, pin_memory=True) for _ in tensors]
        self.streams = {True: torch.cuda.Stream(), False: torch.cuda.Stream()}
        self.events = {}

    def _job(self, job, store, n):
        torch = self.torch
        stream = self.streams[store]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t, h in zip(self.tensors, self.host):
                if store:
                    h[:n].copy_(t[:n], non_blocking=True)
                else:
                    t[:n].copy_(h[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        self.events[job] = ev

    def store(self, job, blocks, rows):
        self._job(job, True, len(blocks))

    def load(self, job, rows, blocks):
        self._job(job, False, len(blocks))

    def finished(self):
        done = [j for j, ev in self.events.items() if ev.query()]
        for j in done:
            del self.events[j]
        return done

    def close(self):
        self.torch.cuda.synchronize()


def drain(backend, jobs, timeout_s=120.0):
    pending = set(jobs)
    deadline = time.monotonic() + timeout_s
    while pending:
        pending -= set(backend.finished())
        if time.monotonic() > deadline:
            fail(f"{backend.name}: jobs {sorted(pending)[:5]} never finished", 1)


def throughput(torch, backend, n, reps, block_bytes, rng, num_blocks, job0):
    """(store GB/s, load GB/s) of ``reps`` jobs of ``n`` blocks each."""
    out = []
    for store in (True, False):
        torch.cuda.synchronize()
        jobs = []
        t0 = time.perf_counter()
        for i in range(reps):
            blocks = rng.choice(num_blocks, n, replace=False)
            rows = np.arange(n)
            job = job0 + len(jobs) + (0 if store else reps)
            jobs.append(job)
            if store:
                backend.store(job, blocks, rows)
            else:
                backend.load(job, rows, blocks)
        drain(backend, jobs)
        seconds = time.perf_counter() - t0
        out.append(reps * n * block_bytes / seconds / 1e9)
    return out


def step_times(torch, backend, steps, n, rng, num_blocks, job0, mats, k):
    """Per-step wall times of the forward stand-in; with ``backend``, a store and a load job of
    ``n`` blocks are submitted at each step's start and polled at its end."""
    a, b = mats
    times, jobs = [], []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if backend is not None:
            js, jl = job0 + 2 * s, job0 + 2 * s + 1
            backend.store(js, rng.choice(num_blocks, n, replace=False), np.arange(n))
            backend.load(jl, np.arange(n, 2 * n), rng.choice(num_blocks, n, replace=False))
            jobs += [js, jl]
        for _ in range(k):
            c = a @ b
        done = torch.cuda.Event()
        done.record()
        if backend is not None:
            backend.finished()  # vLLM's get_finished at the step's end: must not block
        done.synchronize()
        times.append(time.perf_counter() - t0)
        del c
    if backend is not None:
        drain(backend, jobs)
    return times[max(2, steps // 6) :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=32, help="KV tensors (layers)")
    ap.add_argument("--page-kib", type=int, default=32, help="bytes of one block of one tensor, KiB")
    ap.add_argument("--sizes", default="16,64,256", help="blocks per job")
    ap.add_argument("--reps", type=int, default=8, help="jobs per size and direction")
    ap.add_argument("--steps", type=int, default=40, help="steps of the forward loop per backend")
    ap.add_argument("--step-blocks", type=int, default=64, help="blocks per job during the forward loop")
    ap.add_argument("--matmul", type=int, default=4096, help="matrix size of the forward stand-in")
    ap.add_argument("--matmuls", type=int, default=8, help="matmuls per step")
    ap.add_argument("--tmp", default=None, help="directory for the arena (default: a new temporary one)")
    args = ap.parse_args()
    torch = need_cuda()

    sizes = [int(x) for x in args.sizes.split(",")]
    page = args.page_kib * 1024
    rows = max(max(sizes), 2 * args.step_blocks)
    num_blocks = 2 * rows + 64
    block_bytes = page * args.tensors
    own_tmp = args.tmp is None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = tempfile.mkdtemp(prefix="kvtier-gpu-check-", dir=shm) if own_tmp else args.tmp
    rng = np.random.default_rng(0)
    print(
        f"gpu-check: {torch.cuda.get_device_name()} | {args.tensors} KV tensors x {args.page_kib} KiB pages "
        f"({block_bytes / 2**20:.1f} MiB per block), {num_blocks} device blocks, {rows} host rows"
    )
    backends = []
    try:
        tensors = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, device="cuda") for _ in range(args.tensors)]
        for cls in (Kvtier, Vllm, RawTorch):
            sub = os.path.join(tmp, cls.name)
            os.makedirs(sub, exist_ok=True)
            backends.append(cls(torch, tensors, page, rows, sub))

        job = 1
        gbps = {}
        print(f"\n{'blocks/job':>10} {'backend':>8} {'store GB/s':>11} {'load GB/s':>10}")
        for n in sizes:
            for be in backends:
                throughput(torch, be, n, 2, block_bytes, rng, num_blocks, job)  # warm-up
                job += 4
                gbps[(be.name, n)] = throughput(torch, be, n, args.reps, block_bytes, rng, num_blocks, job)
                job += 2 * args.reps
                st, ld = gbps[(be.name, n)]
                print(f"{n:>10} {be.name:>8} {st:>11.2f} {ld:>10.2f}")

        m = args.matmul
        mats = (torch.randn(m, m, device="cuda", dtype=torch.float16), torch.randn(m, m, device="cuda", dtype=torch.float16))
        base = step_times(torch, None, args.steps, 0, rng, num_blocks, 0, mats, args.matmuls)
        base_ms = statistics.median(base) * 1e3
        slow = {}
        print(f"\nforward stand-in: {args.matmuls} x {m}^2 fp16 matmuls, {base_ms:.2f} ms per step alone")
        for be in backends:
            t = step_times(torch, be, args.steps, args.step_blocks, rng, num_blocks, job, mats, args.matmuls)
            job += 2 * args.steps
            ms = statistics.median(t) * 1e3
            slow[be.name] = ms / base_ms - 1
            print(f"{be.name:>8}: {ms:.2f} ms per step with a store and a load of {args.step_blocks} blocks ({slow[be.name] * 100:+.1f} %)")

        verdicts = []
        for d, name in ((0, "store"), (1, "load")):
            ratios = {n: gbps[("kvtier", n)][d] / gbps[("vLLM", n)][d] for n in sizes}
            worst = min(ratios, key=ratios.get)
            ok = ratios[worst] >= THROUGHPUT_RATIO
            detail = ", ".join(f"{n}: {r:.2f}" for n, r in ratios.items())
            verdicts.append(ok)
            print(
                f"VERDICT {'PASS' if ok else 'FAIL'} {name} throughput: kvtier/vLLM >= {THROUGHPUT_RATIO} at every "
                f"job size (blocks/job: ratio {detail})"
            )
        ok = slow["kvtier"] <= SLOWDOWN_MAX
        verdicts.append(ok)
        print(
            f"VERDICT {'PASS' if ok else 'FAIL'} step time: forward slowed by {slow['kvtier'] * 100:+.1f} % with kvtier "
            f"copies beside it (<= {SLOWDOWN_MAX * 100:.0f} %; vLLM's handler: {slow['vLLM'] * 100:+.1f} %, "
            f"raw torch: {slow['torch'] * 100:+.1f} %)"
        )
    finally:
        for be in backends:
            try:
                be.close()
            except Exception as e:  # noqa: BLE001
                print(f"gpu-check: closing {be.name}: {e}", file=sys.stderr)
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()
