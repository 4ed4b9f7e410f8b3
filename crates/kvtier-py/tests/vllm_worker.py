"""A worker process of the multi-process test: one rank's "GPU" KV tensors (numpy arrays) and
kvtier.vllm's OffloadingWorker, driven over a pipe by the scheduler process the way vLLM's
worker-side connector drives it (submit_store / submit_load with block-id specs, get_finished)."""

from types import SimpleNamespace

import numpy as np

from kvtier.vllm import KvtierOffloadingSpec

NUM_BLOCKS = 12
FILLED = 8


def make_tensors(rank):
    """Two "layers" of different dtypes; blocks 0..7 hold rank-specific data, 8..11 zeros."""
    rng = np.random.default_rng(1000 + rank)
    k = np.zeros((NUM_BLOCKS, 4, 8), dtype=np.float32)
    v = np.zeros((NUM_BLOCKS, 16), dtype=np.float16)
    k[:FILLED] = rng.standard_normal((FILLED, 4, 8)).astype(np.float32)
    v[:FILLED] = rng.standard_normal((FILLED, 16)).astype(np.float16)
    return [k, v]


def block_bytes():
    """One rank's bytes of one block over all layers (vLLM's worker_kv_bytes_per_block)."""
    return sum(t[0].nbytes for t in make_tensors(0))


def spec_ids(ids):
    return SimpleNamespace(block_ids=np.array(ids, dtype=np.int32))


def main(rank, world_size, extra_config, conn):
    tensors = make_tensors(rank)
    spec = KvtierOffloadingSpec.from_settings(extra_config, block_bytes(), world_size, rank)
    worker = spec.get_worker(tensors)
    conn.send("ready")
    job = 0
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "store":
                _, gpu_blocks, rows = msg
                job += 1
                worker.submit_store(job, spec_ids(gpu_blocks), spec_ids(rows))
                worker.wait({job})
                conn.send([(r.job_id, r.success) for r in worker.get_finished()] == [(job, True)])
            elif msg[0] == "load":
                _, rows, gpu_blocks = msg
                job += 1
                worker.submit_load(job, spec_ids(rows), spec_ids(gpu_blocks))
                conn.send([(r.job_id, r.success) for r in worker.get_finished()] == [(job, True)])
            elif msg[0] == "blocks":
                _, blocks = msg
                conn.send([b"".join(t[b].tobytes() for t in tensors) for b in blocks])
            elif msg[0] == "exit":
                break
    except Exception as e:  # reported to the scheduler, which fails the test with it
        conn.send(f"error: {e!r}")
        raise
    finally:
        worker.shutdown()
