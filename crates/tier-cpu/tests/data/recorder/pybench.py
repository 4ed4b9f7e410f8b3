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
    def run(name, fn, prepare=None):
        if prepare is None:
            count = 0; t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn(count); count += 1
            res[name] = count / (time.perf_counter() - t0)
            return
        # `prepare(k)` makes the inputs of the next k calls: slices of 500 calls are timed,
        # not the making of their inputs.
        count, spent = 0, 0.0
        while spent < seconds:
            prepare(500)
            t0 = time.perf_counter()
            for _ in range(500):
                fn(count); count += 1
            spent += time.perf_counter() - t0
        res[name] = count / spent
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
    fresh = FreshKeys()
    def store(i):
        b = fresh.take()
        c = oracle.ReqContext("store")
        out = m.prepare_store(b, c)
        assert out is not None and len(out.evicted_keys) == 16
        m.complete_store(b, c)
        list(m.take_events())
    run("store16_evict", store, fresh.make)
    return res


class FreshKeys:
    """Batches of 16 keys never offered before, made ahead of the loop that is timed (an engine
    hands over keys it has already hashed), as the Rust benches make theirs."""

    def __init__(self):
        self.counter = 0
        self.ready = []

    def make(self, batches):
        """Makes the next `batches` batches; `take` hands them out in order."""
        made = []
        for _ in range(batches):
            b = []
            for _ in range(16):
                self.counter += 1
                b.append(self.counter.to_bytes(32, "big") + b"\0\0\0\0")
            made.append(b)
        made.reverse()
        self.ready = made

    def take(self):
        return self.ready.pop()


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

    def best(fn, iters, prepare=None):
        iters = max(1, int(iters * iters_scale))
        out, i = float("inf"), 0
        for _ in range(5):
            if prepare is not None:
                prepare(iters)  # the round's inputs, made before its clock starts
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
    fresh = FreshKeys()

    def store(i):
        b = fresh.take()
        c = oracle.ReqContext("store")
        out = m.prepare_store(b, c)
        assert out is not None and len(out.evicted_keys) == 16
        m.complete_store(b, c)
        list(m.take_events())
    res["store16_evict"] = best(store, 500, fresh.make)
    return res

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    for policy in sys.argv[2:] or ["lru", "arc"]:
        r = bench(n, policy)
        print(policy, n, " ".join(f"{k}={v:,.0f}/s" for k, v in r.items()))
