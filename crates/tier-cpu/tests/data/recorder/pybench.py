"""Times vLLM 0.33.0's CPUOffloadingManager (real source) on the same operations as the Rust bench."""
import sys, time, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle

def bench(n, policy, seconds=2.0):
    m = oracle.mgr_mod.CPUOffloadingManager(n, cache_policy=policy, enable_events=True)
    keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]
    for i in range(0, n, 1024):
        ctx = oracle.ReqContext("fill")
        b = keys[i:i + 1024]
        m.prepare_store(b, ctx); m.complete_store(b, ctx)
    list(m.take_events())
    absent = [os.urandom(32) + b"\0\0\0\0" for _ in range(10000)]
    res = {}
    def run(name, fn):
        count = 0; t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn(count); count += 1
        res[name] = count / (time.perf_counter() - t0)
    ctx = oracle.ReqContext("bench")
    import random
    rnd = random.Random(1)
    res_keys = [keys[rnd.randrange(n)] for _ in range(100000)]
    run("lookup_hit", lambda i: m.lookup(res_keys[i % 100000], ctx))
    run("lookup_miss", lambda i: m.lookup(absent[i % 10000], ctx))
    def touch(i):
        b = [res_keys[(i * 16 + j) % 100000] for j in range(16)]
        m.touch(b, ctx)
    run("touch16", touch)
    def load(i):
        b = [res_keys[(i * 16 + j) % 100000] for j in range(16)]
        c = oracle.ReqContext("load")
        m.prepare_load(b, c); m.complete_load(b, c)
    run("load16", load)
    ctr = [0]
    def store(i):
        b = []
        for _ in range(16):
            ctr[0] += 1
            b.append(ctr[0].to_bytes(32, "big") + b"\0\0\0\0")
        c = oracle.ReqContext("store")
        out = m.prepare_store(b, c)
        assert out is not None and len(out.evicted_keys) == 16
        m.complete_store(b, c)
        list(m.take_events())
    run("store16_evict", store)
    return res


def bench_cpu(n, policy, iters_scale=1.0):
    """The same operations as `bench`, timed in thread CPU time (time.thread_time_ns), which a
    shared machine's preemption does not inflate: ns per op, the best of 5 rounds."""
    m = oracle.mgr_mod.CPUOffloadingManager(n, cache_policy=policy, enable_events=True)
    keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]
    for i in range(0, n, 1024):
        ctx = oracle.ReqContext("fill")
        b = keys[i:i + 1024]
        m.prepare_store(b, ctx); m.complete_store(b, ctx)
    list(m.take_events())
    import random
    rnd = random.Random(1)
    res_keys = [keys[rnd.randrange(n)] for _ in range(100000)]
    ctx = oracle.ReqContext("bench")

    def best(fn, iters):
        iters = max(1, int(iters * iters_scale))
        out, i = float("inf"), 0
        for _ in range(5):
            t0 = time.thread_time_ns()
            for _ in range(iters):
                fn(i); i += 1
            out = min(out, (time.thread_time_ns() - t0) / iters)
        return out

    res = {}
    res["lookup_hit"] = best(lambda i: m.lookup(res_keys[i % 100000], ctx), 20000)

    def touch(i):
        m.touch([res_keys[(i * 16 + j) % 100000] for j in range(16)], ctx)
    res["touch16"] = best(touch, 2000)

    def load(i):
        b = [res_keys[(i * 16 + j) % 100000] for j in range(16)]
        c = oracle.ReqContext("load")
        m.prepare_load(b, c); m.complete_load(b, c)
    res["load16"] = best(load, 1000)
    ctr = [0]

    def store(i):
        b = []
        for _ in range(16):
            ctr[0] += 1
            b.append(ctr[0].to_bytes(32, "big") + b"\0\0\0\0")
        c = oracle.ReqContext("store")
        out = m.prepare_store(b, c)
        assert out is not None and len(out.evicted_keys) == 16
        m.complete_store(b, c)
        list(m.take_events())
    res["store16_evict"] = best(store, 500)
    return res

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    for policy in sys.argv[2:] or ["lru", "arc"]:
        r = bench(n, policy)
        print(policy, n, " ".join(f"{k}={v:,.0f}/s" for k, v in r.items()))
