"""The producer of the p2p tests: a vLLM engine (scheduler, connector, runner) over a kvtier
chain with a p2p tier, in a process of its own. It runs its workload, says "stored", then idles
with no step held (its control thread serves peers) until told "done" or killed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def p2p_tier(port, name="p2p"):
    return f"""
[[secondary]]
type = "p2p"
name = "{name}"
bind = "127.0.0.1:{port}"
hash_seed = "kvtier-vllm-test"
layout_fingerprint = "kvtier-vllm-test"
insecure = true
"""


def main(conn, model_dir, chain_path, workload, shape_kw):
    import harness
    from kvtier.vllm import KvtierOffloadingSpec

    shape = harness.EngineShape(**shape_kw)
    engine = harness.Engine(
        model_dir, shape, {"kvtier_chain": chain_path, "block_size": shape.block_size}, KvtierOffloadingSpec
    )
    try:
        stats = harness.drive(engine, workload)
        conn.send(("stored", stats.wrong_tokens, len(stats.stuck)))
        conn.recv()  # "done": until then the manager's control thread serves the peer
    finally:
        engine.shutdown()
    conn.send("bye")
