"""Records vLLM 0.33.0's store_threshold filter on random offer sequences.

Runs the wheel's own CPUOffloadingManager (through tier-cpu's recorder/oracle.py, which loads
the manager with its imports stubbed) with store_threshold=N and a small tracker. Each op
`offer K..` is a prepare_store of distinct keys into a large tier; the keys vLLM lets through
(`keys_to_store`) are printed after `=`, and their store is then completed with failure so no
key ever becomes resident: the output is exactly the threshold filter's verdict.

Usage: VLLM_CPU_SRC=.../site-packages/vllm/v1/kv_offload/cpu python3 record.py DEST COUNT
"""
import os, random, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../../../tier-cpu/tests/data/recorder"))
import oracle  # noqa: E402


def record(seed, threshold, tracker, ops, keyspace):
    rng = random.Random(seed)
    m = oracle.mgr_mod.CPUOffloadingManager(
        4096, cache_policy="lru", store_threshold=threshold, max_tracker_size=tracker
    )
    ctx = oracle.ReqContext("r")
    lines = [f"new {threshold} {tracker}"]
    for _ in range(ops):
        n = rng.randint(1, min(5, keyspace))
        keys = rng.sample(range(keyspace), n)
        out = m.prepare_store([oracle.key(k) for k in keys], ctx)
        stored = out.keys_to_store
        m.complete_store(stored, ctx, success=False)
        lines.append("offer " + " ".join(map(str, keys)) + " = " + " ".join(map(oracle.name, stored)))
    return lines


def main():
    dest, count = sys.argv[1], int(sys.argv[2])
    os.makedirs(dest, exist_ok=True)
    params = [(2, 4, 12), (2, 8, 20), (3, 5, 10), (2, 64, 30)]
    for i in range(count):
        threshold, tracker, keyspace = params[i % len(params)]
        lines = record(1000 + i, threshold, tracker, 80, keyspace)
        with open(os.path.join(dest, f"t{threshold}_tracker{tracker}_{i:02}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
