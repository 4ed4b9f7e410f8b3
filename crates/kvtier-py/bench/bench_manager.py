"""Times kvtier through the Python binding (FFI included) on the operations of
crates/tier-cpu/benches/cpu_tier.rs, next to vLLM 0.33.0's own CPUOffloadingManager measured in
the same run, and prints the ratios.

vLLM's manager is run from its released source with its imports stubbed (no torch needed), by
crates/tier-cpu/tests/data/recorder/oracle.py: point VLLM_CPU_SRC at the `vllm/v1/kv_offload/cpu`
directory of the unpacked 0.33.0 wheel (`pip download vllm==0.33.0 --no-deps`, unzip). Without
it only kvtier's figures are printed.

    python bench/bench_manager.py [--chunks 100000] [--seconds 2] [--policy lru] [--runs 3]

With --runs N the whole comparison (kvtier, vLLM, loop) is repeated N times, interleaved, and
the median with the min–max of each figure and ratio is printed after the runs.

Each figure is the best of 5 rounds. Both sides run the same loop (16-key batches, a fresh request per load and per store, each
store request announced with on_new_request, finished and its events drained); the clock is read once per 256 calls. A batch
is a slice of a list of keys that already exist, as the connector passes the keys it holds for a request: loads take 16
consecutive keys of a random sequence of resident keys, stores take the next 16 keys of a pool of 4N fresh keys (a key
comes round again only after 4N stores, long after it and its ghost left the cache, so every store evicts 16).
A third run times the loop alone (methods that do nothing) and prints it, with the ratios
recomputed without it: the loop (key lists, request objects, calls) is part of both sides' figures
and bounds the ratio an engine-like caller can see. What the ratios depend on: the CPU and its caches (the tier's index of N chunks vs CPython's
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


def rate(fn, seconds, batch=256, rounds=5):
    """Calls per second of `fn(i)`: the best of `rounds` rounds (a shared machine's other load
    only ever slows a round down), timing batches of calls so the clock is not measured.

    Time is the thread's CPU time (`time.thread_time`), so the time this process spends
    descheduled on a loaded machine counts for neither side; the caches other processes evict
    still do. Both managers do all their work on the calling thread (a CPU-only chain starts no
    other), so nothing is left out."""
    best = 0.0
    count = 0
    clock = time.thread_time
    for _ in range(rounds):
        start = count
        t0 = clock()
        while True:
            for i in range(count, count + batch):
                fn(i)
            count += batch
            elapsed = clock() - t0
            if elapsed >= seconds / rounds:
                break
        best = max(best, (count - start) / elapsed)
    return best


class KvtierSide:
    """kvtier through the binding; every call inside one held step, as an engine holds one per
    scheduler iteration."""

    name = "kvtier (binding)"

    def __init__(self, n, policy):
        self.m = kvtier.TieringManager.from_toml(
            f'[primary]\ntype = "cpu"\ncapacity = {n}\neviction = "{policy}"\n', 64
        )
        self.s = self.m.step()
        self.ctx = kvtier.ReqContext

    def new_request(self, name):
        c = kvtier.ReqContext(name)
        self.s.on_new_request(c)
        return c

    def close(self):
        self.s.release()
        self.m.shutdown()


class _NullStore:
    """Answers every manager call at once (a store evicts 16 keys, as both real sides do)."""

    class _Out:
        evicted_keys = (None,) * 16

    def on_new_request(self, ctx):
        return None

    def lookup(self, key, ctx):
        return None

    def prepare_load(self, keys, ctx):
        return None

    def complete_load(self, keys, ctx):
        return None

    def prepare_store(self, keys, ctx):
        return self._Out

    def complete_store(self, keys, ctx):
        return None

    def on_request_finished(self, ctx):
        return None

    def take_events(self):
        return ()


class LoopSide:
    """The benchmark loop itself, calling methods that do nothing: what every figure pays in
    Python before any manager work (building the key lists, the request object, the calls)."""

    name = "loop only"

    def __init__(self, n, policy):
        self.s = _NullStore()
        self.ctx = kvtier.ReqContext

    def new_request(self, name):
        c = self.ctx(name)
        self.s.on_new_request(c)
        return c

    def close(self):
        pass


class VllmSide:
    """vLLM 0.33.0's CPUOffloadingManager, its released source loaded by the recorder's oracle."""

    name = "vLLM 0.33.0"

    def __init__(self, n, policy):
        sys.path.insert(0, RECORDER)
        import oracle  # noqa: E402

        self.s = oracle.mgr_mod.CPUOffloadingManager(n, cache_policy=policy, enable_events=True)
        self.ctx = oracle.ReqContext

    def new_request(self, name):
        c = self.ctx(name)
        self.s.on_new_request(c)
        return c

    def close(self):
        pass


def bench(side, n, seconds):
    s = side.s
    keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]
    fill = side.new_request("fill")
    for i in range(0, n, 1024):
        b = keys[i : i + 1024]
        s.prepare_store(b, fill)
        s.complete_store(b, fill)
    s.on_request_finished(fill)
    list(s.take_events())
    rnd = random.Random(1)
    res_keys = [keys[rnd.randrange(n)] for _ in range(100000)]
    ctx = side.new_request("bench")
    res = {}
    lookup = s.lookup

    def lookups(i):
        # 256 lookups per call, so the loop around them costs nothing per lookup.
        for k in res_keys[(i * 256) % 99840 : (i * 256) % 99840 + 256]:
            lookup(k, ctx)

    res["lookup_hit"] = rate(lookups, seconds, batch=4) * 256

    def load(i):
        o = (i * 16) % 99984
        b = res_keys[o : o + 16]
        c = side.ctx("load")
        s.prepare_load(b, c)
        s.complete_load(b, c)

    res["load16"] = rate(load, seconds)
    # Fresh keys: random like real block hashes (every word of a hash is random, which both
    # managers' tables rely on), from a seeded generator so the two sides store the same keys.
    fresh = random.Random(2)
    pool = [fresh.randbytes(32) + b"\0\0\0\0" for _ in range(4 * n)]
    rounds = len(pool) // 16
    names = [f"store{j}" for j in range(rounds)]

    def store(i):
        o = (i % rounds) * 16
        b = pool[o : o + 16]
        c = side.new_request(names[i % rounds])
        out = s.prepare_store(b, c)
        assert out is not None and len(out.evicted_keys) == 16
        s.complete_store(b, c)
        s.on_request_finished(c)
        list(s.take_events())

    res["store16_evict"] = rate(store, seconds)
    side.close()
    return res


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    src = os.environ.get("VLLM_CPU_SRC")
    have_vllm = bool(src and os.path.isdir(src))
    # (policy, op) -> lists of kvtier ops/s, vLLM ops/s, ratio, ratio without the loop
    summary = {}
    for run in range(a.runs):
        for policy in a.policy or ["lru", "arc"]:
            k = bench(KvtierSide(a.chunks, policy), a.chunks, a.seconds)
            v = bench(VllmSide(a.chunks, policy), a.chunks, a.seconds) if have_vllm else None
            loop = bench(LoopSide(a.chunks, policy), a.chunks, a.seconds)
            print(f"policy {policy}, {a.chunks} chunks, {sys.version.split()[0]}, run {run + 1}/{a.runs}")
            print(f"  {'op':<15}{'kvtier (binding)':>20}{'vLLM 0.33.0':>16}{'ratio':>9}")
            for op, ops in k.items():
                if v is None:
                    print(f"  {op:<15}{ops:>16,.0f}/s{'-':>16}{'-':>9}")
                else:
                    print(f"  {op:<15}{ops:>16,.0f}/s{v[op]:>14,.0f}/s{ops / v[op]:>8.1f}x")
            # The loop's own time is in both sides' figures; without it the ratio compares the
            # managers alone (binding included on kvtier's side).
            print("  loop alone: " + ", ".join(f"{op} {1e6 / loop[op]:.2f} us" for op in k))
            if v is not None:
                net = []
                for op, ops in k.items():
                    kv, vv = 1 / ops - 1 / loop[op], 1 / v[op] - 1 / loop[op]
                    r = vv / kv if kv > 0 else float("nan")
                    net.append(f"{op} {r:.1f}x")
                    summary.setdefault((policy, op), []).append((ops, v[op], ops / v[op], r))
                print("  ratio without the loop: " + ", ".join(net))
            else:
                print("  (set VLLM_CPU_SRC to compare with vLLM 0.33.0 in the same run)")
            sys.stdout.flush()
    if summary and a.runs > 1:
        print(f"medians of {a.runs} runs, {a.chunks} chunks (min-max)")
        print(f"  {'policy':<7}{'op':<15}{'kvtier/s':>12}{'vLLM/s':>10}{'ratio':>18}{'w/o loop':>18}")
        for (policy, op), rows in summary.items():
            cols = list(zip(*rows))

            def fmt(xs, spec):
                return f"{median(xs):{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"

            print(
                f"  {policy:<7}{op:<15}{median(cols[0]):>12,.0f}{median(cols[1]):>10,.0f}"
                f"{fmt(cols[2], '.1f'):>18}{fmt(cols[3], '.1f'):>18}"
            )


if __name__ == "__main__":
    main()
