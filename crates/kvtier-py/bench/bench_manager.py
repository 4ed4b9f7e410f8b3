"""Times kvtier through the Python binding (FFI included) on the operations of
crates/tier-cpu/benches/cpu_tier.rs, next to vLLM 0.33.0's own CPUOffloadingManager measured in
the same run, and prints the ratios.

vLLM's manager is run from its released source with its imports stubbed (no torch needed), by
crates/tier-cpu/tests/data/recorder/oracle.py: point VLLM_CPU_SRC at the `vllm/v1/kv_offload/cpu`
directory of the unpacked 0.33.0 wheel (`pip download vllm==0.33.0 --no-deps`, unzip). Without
it only kvtier's figures are printed.

    python bench/bench_manager.py [--chunks 100000] [--seconds 2] [--policy lru]

What the ratios depend on: the CPU and its caches (the tier's index of N chunks vs CPython's
dict), the Python version (call overhead is part of both sides), and N.
"""

import argparse
import os
import random
import sys
import time

import kvtier

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDER = os.path.join(HERE, "..", "..", "tier-cpu", "tests", "data", "recorder")


def rate(fn, seconds):
    count = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(count)
        count += 1
    return count / (time.perf_counter() - t0)


def bench_kvtier(n, policy, seconds):
    m = kvtier.TieringManager.from_toml(
        f'[primary]\ntype = "cpu"\ncapacity = {n}\neviction = "{policy}"\n', 64
    )
    keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]
    fill = kvtier.ReqContext("fill")
    with m.step() as s:
        s.on_new_request(fill)
        for i in range(0, n, 1024):
            b = keys[i : i + 1024]
            s.prepare_store(b, fill)
            s.complete_store(b, fill)
        s.on_request_finished(fill)
        s.take_events()
    rnd = random.Random(1)
    res_keys = [keys[rnd.randrange(n)] for _ in range(100000)]
    ctx = kvtier.ReqContext("bench")
    res = {}
    # One step held across each measurement, as the engine holds one per scheduler iteration.
    with m.step() as s:
        s.on_new_request(ctx)
        lookup = s.lookup
        res["lookup_hit"] = rate(lambda i: lookup(res_keys[i % 100000], ctx), seconds)

        def load(i):
            b = [res_keys[(i * 16 + j) % 100000] for j in range(16)]
            c = kvtier.ReqContext("load")
            s.prepare_load(b, c)
            s.complete_load(b, c)

        res["load16"] = rate(load, seconds)
        ctr = [0]

        def store(i):
            b = []
            for _ in range(16):
                ctr[0] += 1
                b.append(ctr[0].to_bytes(32, "big") + b"\0\0\0\0")
            c = kvtier.ReqContext(f"store{i}")
            s.on_new_request(c)
            out = s.prepare_store(b, c)
            assert out is not None and len(out.evicted) == 16
            s.complete_store(b, c)
            s.on_request_finished(c)
            s.take_events()

        res["store16_evict"] = rate(store, seconds)
    m.shutdown()
    return res


def bench_vllm(n, policy, seconds):
    src = os.environ.get("VLLM_CPU_SRC")
    if not src or not os.path.isdir(src):
        return None
    sys.path.insert(0, RECORDER)
    import pybench  # noqa: E402  (imports oracle, which loads the vLLM source)

    r = pybench.bench(n, policy, seconds)
    return {k: r[k] for k in ("lookup_hit", "load16", "store16_evict")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--policy", action="append")
    a = ap.parse_args()
    for policy in a.policy or ["lru", "arc"]:
        k = bench_kvtier(a.chunks, policy, a.seconds)
        v = bench_vllm(a.chunks, policy, a.seconds)
        print(f"policy {policy}, {a.chunks} chunks, {sys.version.split()[0]}")
        print(f"  {'op':<15}{'kvtier (binding)':>20}{'vLLM 0.33.0':>16}{'ratio':>9}")
        for op, ops in k.items():
            if v is None:
                print(f"  {op:<15}{ops:>16,.0f}/s{'-':>16}{'-':>9}")
            else:
                print(f"  {op:<15}{ops:>16,.0f}/s{v[op]:>14,.0f}/s{ops / v[op]:>8.1f}x")
        if v is None:
            print("  (set VLLM_CPU_SRC to compare with vLLM 0.33.0 in the same run)")


if __name__ == "__main__":
    main()
