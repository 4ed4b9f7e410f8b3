"""Run by scripts/python-tests.sh in a fresh virtual environment holding only the built wheel
(no pytest, no numpy, nothing from the repository on the path): the package imports from its
install location and a manager built from a TOML string stores, looks up, loads and shuts down.
Exits non-zero with the reason on any difference."""

import os
import sys

import kvtier
import kvtier.vllm  # the adapter imports without torch (torch is imported lazily)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    where = os.path.dirname(os.path.abspath(kvtier.__file__))
    if where.startswith(os.path.dirname(os.path.dirname(here))):
        sys.exit(f"kvtier was imported from the source tree ({where}), not from the installed wheel")
    m = kvtier.TieringManager.from_toml('[primary]\ntype = "cpu"\ncapacity = 4\neviction = "lru"\n', 64)
    keys = [kvtier.make_offload_key(bytes([i]) * 32) for i in range(3)]
    ctx = kvtier.ReqContext("smoke")
    with m.step() as s:
        s.on_new_request(ctx)
        out = s.prepare_store(keys, ctx)
        if out is None or list(out.keys_to_store) != keys or len(out.chunk_ids) != 3:
            sys.exit(f"prepare_store answered {out!r}")
        s.complete_store(out.keys_to_store, ctx)
        verdicts = [s.lookup(k, ctx) for k in keys]
        if verdicts != [kvtier.LookupResult.HIT] * 3:
            sys.exit(f"lookups answered {verdicts}")
        rows = s.prepare_load(keys, ctx)
        if sorted(rows) != sorted(out.chunk_ids):
            sys.exit(f"prepare_load answered rows {rows}, stored {out.chunk_ids}")
        s.complete_load(keys, ctx)
        s.on_request_finished(ctx)
    m.shutdown()
    print(f"kvtier wheel OK from {where}")


if __name__ == "__main__":
    main()
