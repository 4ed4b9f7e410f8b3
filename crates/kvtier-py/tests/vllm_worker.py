"""A worker process of the multi-process test: one rank's "GPU" KV tensors (numpy arrays) and
its kvtier.vllm transfer handler, driven over a pipe by the scheduler process."""

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


def rank_chunk_bytes():
    return sum(t[0].nbytes for t in make_tensors(0))


def main(rank, world_size, extra_config, conn):
    tensors = make_tensors(rank)
    spec = KvtierOffloadingSpec(
        extra_config=extra_config, rank_chunk_bytes=rank_chunk_bytes(), world_size=world_size
    )
    handler = spec.get_transfer_handler(tensors, rank)
    conn.send("ready")
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "store":
                _, gpu_blocks, rows, keys = msg
                conn.send(handler.store(gpu_blocks, rows, keys))
            elif msg[0] == "load":
                _, rows, gpu_blocks = msg
                handler.load(rows, gpu_blocks)
                conn.send(True)
            elif msg[0] == "blocks":
                _, blocks = msg
                conn.send([b"".join(t[b].tobytes() for t in tensors) for b in blocks])
            elif msg[0] == "exit":
                break
    except Exception as e:  # reported to the scheduler, which fails the test with it
        conn.send(f"error: {e!r}")
        raise
    finally:
        handler.close()
