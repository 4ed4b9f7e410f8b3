"""Generates random valid op scripts, runs them through the vLLM 0.33.0 oracle, writes fixtures."""
import random, sys
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle

def gen(seed, policy, n_ops=120, finished_stores=False, engine_ops=False):
    rnd = random.Random(seed)
    cap = rnd.choice([3, 4, 5, 8])
    universe = rnd.choice([8, 12, 20])
    groups = rnd.choice([1, 1, 2])
    lines = [f"new {cap} {policy}"]
    m = None
    out = []
    oracle.run(lines, out)
    # Track state through the oracle's own manager object by re-running incrementally.
    script = list(lines)
    mgr_holder = {}
    # Re-implement incremental run: keep manager by running ops one at a time.
    ctxs = {}
    m = oracle.mgr_mod.CPUOffloadingManager(cap, cache_policy=policy, enable_events=True)
    reqs = ["a", "b", "c"]
    pending = {r: [] for r in reqs}   # keys each request stored and not completed
    pinned = {r: [] for r in reqs}    # keys loaded by request and not completed
    finished = set()
    posmap = {r: {} for r in reqs}
    def K(tok):
        if "g" in tok:
            a, b = tok.split("g"); return oracle.key(int(a), int(b))
        return oracle.key(int(tok))
    def tok():
        n = rnd.randint(1, universe)
        g = rnd.randint(0, groups - 1)
        return f"{n}g{g}" if g else f"{n}"
    def C(r):
        if r not in ctxs: ctxs[r] = oracle.ReqContext(r)
        return ctxs[r]
    ops = []
    for _ in range(n_ops):
        live = [r for r in reqs if r not in finished]
        if not live:
            # new generation of requests
            for r in reqs:
                ctxs[r] = oracle.ReqContext(r); pending[r] = []; pinned[r] = []; posmap[r] = {}
            finished.clear()
            ops.append("newctx a"); ops.append("newctx b"); ops.append("newctx c")
            live = list(reqs)
        if finished_stores and finished and rnd.random() < 0.15:
            # A finished request stores keys it observed before finishing (vLLM keeps its
            # rank), completing the store at once since finished requests take no more steps.
            r = rnd.choice(sorted(finished))
            st = C(r).get_state(oracle.mgr_mod._RequestCacheAccess)
            seen = sorted(oracle.name(k) for k in st.seen_keys) if st is not None else []
            if seen:
                ks = rnd.sample(seen, rnd.randint(1, min(3, len(seen))))
                res = m.prepare_store([K(t) for t in ks], C(r))
                ops.append(f"store {r} " + " ".join(ks))
                if res is not None and res.keys_to_store:
                    done = [oracle.name(k) for k in res.keys_to_store]
                    ok = 1 if rnd.random() < 0.85 else 0
                    m.complete_store([K(t) for t in done], C(r), success=bool(ok))
                    ops.append(f"cstore {r} {ok} " + " ".join(done))
                continue
        r = rnd.choice(live)
        x = rnd.random()
        if x < 0.30:
            ks = []
            for _ in range(rnd.randint(1, 4)):
                t = tok()
                if t not in ks: ks.append(t)
            # sometimes give positions first
            if rnd.random() < 0.5:
                for t in ks:
                    if t not in posmap[r]:
                        p = rnd.randint(0, 50)
                        posmap[r][t] = p
                        C(r).set_offload_key_position(K(t), p)
                        ops.append(f"pos {r} {t} {p}")
            res = m.prepare_store([K(t) for t in ks], C(r))
            ops.append(f"store {r} " + " ".join(ks))
            if res is not None:
                pending[r] += [oracle.name(k) for k in res.keys_to_store]
        elif x < 0.50 and pending[r]:
            rnd.shuffle(pending[r])
            n = rnd.randint(1, len(pending[r]))
            ks, pending[r] = pending[r][:n], pending[r][n:]
            ok = 1 if rnd.random() < 0.85 else 0
            m.complete_store([K(t) for t in ks], C(r), success=bool(ok))
            ops.append(f"cstore {r} {ok} " + " ".join(ks))
        elif x < 0.65:
            ready = [t for t in dict.fromkeys(tok() for _ in range(4)) if m.lookup(K(t), C(r)) == oracle.LookupResult.HIT]
            if ready:
                ks = rnd.sample(ready, rnd.randint(1, len(ready)))
                # An engine cannot pin for a read (vLLM's public manager API has no such call):
                # engine-op scripts draw the same numbers and always load.
                rd = rnd.random() < 0.25 and not engine_ops
                m._prepare_load([K(t) for t in ks], C(r), record_access=not rd)
                ops.append(("read " if rd else "load ") + f"{r} " + " ".join(ks))
                pinned[r] += ks
        elif x < 0.78 and pinned[r]:
            rnd.shuffle(pinned[r])
            n = rnd.randint(1, len(pinned[r]))
            ks, pinned[r] = pinned[r][:n], pinned[r][n:]
            m.complete_load([K(t) for t in ks], C(r))
            ops.append(f"cload {r} " + " ".join(ks))
        elif x < 0.84:
            ks = [tok() for _ in range(rnd.randint(1, 3))]
            m.touch([K(t) for t in ks], C(r))
            ops.append(f"touch {r} " + " ".join(ks))
        elif x < 0.92 and not pending[r] and not pinned[r]:
            m.on_request_finished(C(r)); finished.add(r)
            ops.append(f"finish {r}")
        elif x < 0.96:
            ops.append(f"lookup {r} {tok()}")
        elif x < 0.995:
            ops.append("order")
        else:
            # reset only when nothing is in flight
            if not any(pending.values()) and not any(pinned.values()):
                m.reset_cache(); ops.append("reset")
        if rnd.random() < 0.2:
            list(m.take_events()); ops.append("events")
    ops.append("order"); ops.append("events")
    script = [f"new {cap} {policy}"] + ops
    out = []
    oracle.run(script, out)
    return script, out

if __name__ == "__main__":
    # gen.py DEST COUNT [SEED_OFFSET] [OPS] [--finished-stores] [--engine-ops]
    late = "--finished-stores" in sys.argv
    engine = "--engine-ops" in sys.argv
    args = [a for a in sys.argv if a not in ("--finished-stores", "--engine-ops")]
    dest = args[1]
    count = int(args[2])
    offset = int(args[3]) if len(args) > 3 else 0
    n_ops = int(args[4]) if len(args) > 4 else 120
    prefix = ("late_" if late else "") + ("engine_" if engine else "")
    for policy in ["lru", "arc"]:
        for seed in range(count):
            script, out = gen(seed * 7919 + (1 if policy == "arc" else 0) + offset, policy, n_ops, late, engine)
            assert "assert" not in out, (policy, seed)
            with open(f"{dest}/{policy}_{prefix}{seed:03}.txt", "w") as f:
                for s, o in zip(script, out):
                    f.write(f"{s}\n= {o}\n")
