"""kvtier: tiered KV-cache offloading for LLM inference engines.

The scheduler process builds a :class:`TieringManager` from a chain file and makes the engine
calls of each scheduler step on a :class:`Step`::

    manager = kvtier.TieringManager.from_config("chain.toml", chunk_bytes=2 << 20)
    ctx = kvtier.ReqContext("req-1")
    with manager.step() as s:
        s.on_new_request(ctx)
        if s.lookup(key, ctx) is kvtier.LookupResult.HIT:
            rows = s.prepare_load([key], ctx)
        s.on_schedule_end()

Worker processes open the shared arena with :class:`ArenaView` and report finished stores
with :class:`WorkerReporter`. :mod:`kvtier.vllm` is the offloading spec vLLM loads.
"""

from ._kvtier import (
    KEY_BYTES,
    ArenaView,
    ConfigError,
    KvtierError,
    LoadSource,
    LookupResult,
    OffloadingEvent,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    Row,
    ScheduleEndContext,
    Step,
    StepError,
    TieringManager,
    WorkerReporter,
    chain_arena_path,
    make_offload_key,
    split_offload_key,
)

__all__ = [
    "KEY_BYTES",
    "ArenaView",
    "ConfigError",
    "KvtierError",
    "LoadSource",
    "LookupResult",
    "OffloadingEvent",
    "OffloadPolicy",
    "PrepareStoreOutput",
    "ReqContext",
    "Row",
    "ScheduleEndContext",
    "Step",
    "StepError",
    "TieringManager",
    "WorkerReporter",
    "chain_arena_path",
    "make_offload_key",
    "split_offload_key",
]
