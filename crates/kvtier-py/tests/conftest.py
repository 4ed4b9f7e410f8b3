"""Shared helpers: keys named by small integers (as the Rust tests name them) and managers over
a CPU-only chain."""

import pytest

import kvtier

MASK = (1 << 64) - 1


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def key(n, group=0):
    """The key Rust's `OffloadKey::from_u64(n).with_group(group)` names, packed as vLLM does."""
    parts = []
    x = n
    for _ in range(3):
        x = _splitmix64(x)
        parts.append(x.to_bytes(8, "little"))
    parts.append(n.to_bytes(8, "big"))
    return kvtier.make_offload_key(b"".join(parts), group)


def keys(*ns):
    return [key(n) for n in ns]


def num(k):
    """The integer a key was made from (group ignored)."""
    return int.from_bytes(k[24:32], "big")


def nums(ks):
    return [num(k) for k in ks]


def cpu_toml(capacity, policy="lru", events=True):
    return (
        "[primary]\n"
        'type = "cpu"\n'
        f"capacity = {capacity}\n"
        f'eviction = "{policy}"\n'
        f"events = {'true' if events else 'false'}\n"
    )


def cpu_manager(capacity, policy="lru", chunk_bytes=64):
    return kvtier.TieringManager.from_toml(cpu_toml(capacity, policy), chunk_bytes)


@pytest.fixture
def manager():
    m = cpu_manager(4)
    yield m
    m.shutdown()


def store(step, ctx, ns, success=True):
    """prepare_store + complete_store of keys `ns`; returns the PrepareStoreOutput."""
    out = step.prepare_store(keys(*ns), ctx)
    assert out is not None
    if out.keys_to_store:
        step.complete_store(out.keys_to_store, ctx, success)
    return out
