"""Runs vLLM 0.33.0's CPUOffloadingManager (real source, stubbed imports) on an op script."""
import sys, types, enum, dataclasses
from dataclasses import dataclass, field

import os
SRC = os.environ.get("VLLM_CPU_SRC", "/tmp/vllm-ref/src/vllm/v1/kv_offload/cpu")

def mod(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m

# typing_extensions.override
mod("typing_extensions", override=lambda f: f)

class LookupResult(enum.Enum):
    MISS = 0; HIT = 1; HIT_PENDING = 2; RETRY = 3
class Medium(enum.Enum):
    CPU = 0
@dataclass
class OffloadingEvent:
    keys: list
    medium: object
    removed: bool
    metadata_only: bool = False
@dataclass
class PrepareStoreOutput:
    keys_to_store: list
    store_spec: object
    evicted_keys: list
@dataclass
class RequestOffloadingContext:
    pass
class ReqContext:
    def __init__(self, req_id):
        self.req_id = req_id
        self._state = {}
        self._pos = {}
    def get_state(self, t):
        return self._state.get(t)
    def set_state(self, v):
        self._state[type(v)] = v
    def set_offload_key_position(self, k, p):
        self._pos[k] = p
    def get_offload_key_position(self, k):
        return self._pos.get(k)
class OffloadingManager: pass
def get_offload_group_idx(key): return int.from_bytes(key[-4:], "big")
for n in ["vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.cpu", "vllm.v1.kv_offload.cpu.policies",
          "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
          "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.offloading",
          "vllm.v1.metrics"]:
    mod(n)
mod("vllm.v1.kv_offload.base", ConfigInfoMapping=dict, LoadStoreSpec=object, LookupResult=LookupResult, Medium=Medium,
    OffloadingEvent=OffloadingEvent, OffloadingManager=OffloadingManager, OffloadKey=bytes,
    PrepareStoreOutput=PrepareStoreOutput, ReqContext=ReqContext, RequestOffloadingContext=RequestOffloadingContext,
    get_offload_group_idx=get_offload_group_idx)
class Spec:
    def __init__(self, ids): self.chunk_ids = list(ids)
mod("vllm.v1.kv_offload.cpu.common", CPULoadStoreSpec=Spec, CPUOffloadingInfo=object, CPUOffloadingMetrics=object)
mod("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics", OffloadingConnectorStats=object)
mod("vllm.v1.metrics.cache_hit_source", CacheHitSource=object)
class L:
    def warning_once(self, *a): pass
    def info(self, *a): pass
mod("vllm.logger", init_logger=lambda n: L())

def load(name, path):
    m = types.ModuleType(name)
    m.__file__ = path
    sys.modules[name] = m
    exec(compile(open(path).read(), path, "exec"), m.__dict__)
    return m
load("vllm.v1.kv_offload.cpu.policies.base", f"{SRC}/policies/base.py")
load("vllm.v1.kv_offload.cpu.policies.lru", f"{SRC}/policies/lru.py")
load("vllm.v1.kv_offload.cpu.policies.arc", f"{SRC}/policies/arc.py")
load("vllm.v1.kv_offload.cpu.policies.factory", f"{SRC}/policies/factory.py")
# dataclass(slots=True) lookups need the module registered before exec: done above.
mgr_mod = load("vllm.v1.kv_offload.cpu.manager", f"{SRC}/manager.py")

def key(n, g=0):
    # Same bytes as kvtier's OffloadKey::from_u64(n).with_group(g).to_bytes().
    M = (1 << 64) - 1
    def sm(x):
        x = (x + 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)
    h = bytearray()
    x = n
    for _ in range(4):
        x = sm(x)
        h += x.to_bytes(8, "little")
    h[24:] = n.to_bytes(8, "big")
    return bytes(h) + g.to_bytes(4, "big")

def name(k):
    return f"{int.from_bytes(k[24:32], 'big')}" + (f"g{get_offload_group_idx(k)}" if get_offload_group_idx(k) else "")

def run(lines, out):
    """Script: one op per line.
    new CAP POLICY | ctx R | pos R K P | lookup R K | load R K.. | cload R K.. | read R K.. | touch R K.. |
    store R K.. | cstore R 0/1 K.. | finish R | events | reset | order"""
    m = None; ctxs = {}
    def ctx(r):
        return ctxs.setdefault(r, ReqContext(r))
    def keys(toks):
        res = []
        for t in toks:
            if "g" in t:
                a, b = t.split("g"); res.append(key(int(a), int(b)))
            else:
                res.append(key(int(t)))
        return res
    for line in lines:
        t = line.split()
        if not t or t[0].startswith("#"): continue
        op = t[0]
        try:
            if op == "new":
                m = mgr_mod.CPUOffloadingManager(int(t[1]), cache_policy=t[2], enable_events=True); ctxs = {}
                out.append("ok")
            elif op == "newctx":
                ctxs[t[1]] = ReqContext(t[1]); out.append("ok")
            elif op == "pos":
                ctx(t[1]).set_offload_key_position(keys([t[2]])[0], int(t[3])); out.append("ok")
            elif op == "lookup":
                out.append(m.lookup(keys([t[2]])[0], ctx(t[1])).name)
            elif op == "load":
                s = m.prepare_load(keys(t[2:]), ctx(t[1])); out.append("chunks " + " ".join(map(str, s.chunk_ids)))
            elif op == "read":
                s = m._prepare_load(keys(t[2:]), ctx(t[1]), record_access=False); out.append("chunks " + " ".join(map(str, s.chunk_ids)))
            elif op == "cload":
                m.complete_load(keys(t[2:]), ctx(t[1])); out.append("ok")
            elif op == "touch":
                m.touch(keys(t[2:]), ctx(t[1])); out.append("ok")
            elif op == "store":
                r = m.prepare_store(keys(t[2:]), ctx(t[1]))
                if r is None: out.append("none")
                else: out.append("keys " + " ".join(map(name, r.keys_to_store)) + " | chunks " + " ".join(map(str, r.store_spec.chunk_ids)) + " | evicted " + " ".join(map(name, r.evicted_keys)))
            elif op == "cstore":
                m.complete_store(keys(t[3:]), ctx(t[1]), success=t[2] == "1"); out.append("ok")
            elif op == "finish":
                m.on_request_finished(ctx(t[1])); out.append("ok")
            elif op == "events":
                evs = list(m.take_events())
                out.append("events " + " ; ".join(("-" if e.removed else "+") + ("m" if e.metadata_only else "") + " " + " ".join(map(name, e.keys)) for e in evs))
            elif op == "reset":
                m.reset_cache(); out.append("ok")
            elif op == "order":
                p = m._policy
                if hasattr(p, "t1"):
                    out.append("t1 " + " ".join(map(name, p.t1)) + " | t2 " + " ".join(map(name, p.t2)) + " | b1 " + " ".join(map(name, p.b1)) + " | b2 " + " ".join(map(name, p.b2)) + f" | p {round(p.target_t1_size * 1e9)}e-9")
                else:
                    ks = sorted(p.chunks, key=lambda k: (p._ranks[k], k))
                    out.append("lru " + " ".join(map(name, ks)))
            else:
                out.append("?" + op)
        except AssertionError as e:
            out.append("assert")

if __name__ == "__main__":
    out = []
    run(open(sys.argv[1]).read().splitlines(), out)
    print("\n".join(out))
