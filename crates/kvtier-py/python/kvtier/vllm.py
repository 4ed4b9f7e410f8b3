"""kvtier as vLLM's KV-offloading implementation.

vLLM's ``OffloadingConnector`` loads an offloading spec by module path::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_module_path": "kvtier.vllm",
        "spec_name": "KvtierOffloadingSpec", "kvtier_chain": "/etc/kvtier/chain.toml",
        "block_size": 64}}'

Scheduler side, :meth:`KvtierOffloadingSpec.get_manager` returns a
:class:`KvtierOffloadingManager`: vLLM's ``OffloadingManager`` methods over a kvtier manager built
from the chain file (whose ``[primary]`` must set ``shared_memory``). vLLM's CPU block ids *are*
the arena's row ids, so load and store specs carry arena rows unchanged.

Worker side, :meth:`KvtierOffloadingSpec.get_transfer_handler` returns a
:class:`KvtierTransferHandler` per rank: it opens the arena, copies between the rank's KV tensors
(torch, imported lazily; numpy arrays work too) and its slice of each arena row, and reports
finished stores on the manager's completion channel, so the manager cascades them while the
model runs. A row holds every rank's slice, rank-major.

Under vLLM the classes derive from vLLM's ``OffloadingSpec`` / ``OffloadingManager`` /
``OffloadingWorker`` (its factory checks the spec's base class); without vLLM installed they are
plain classes with the same methods, so the adapter is testable without torch. torch is imported
only by a worker copying torch tensors.
"""


from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

from . import _kvtier as _k
from ._vllm_stats import (
    VllmStatsState,
    config_info_for_vllm,
    config_info_keys_for_vllm,
    metric_definitions_for_vllm,
    stats_for_vllm,
)
from ._vllm_types import ChunkSpec, RowKeys, StoreOutput, _vllm, _vllm_types
from ._vllm_worker import KvtierOffloadingWorker, KvtierTransferHandler

_ManagerBase = _vllm("OffloadingManager")
_SpecBase = _vllm("OffloadingSpec")

__all__ = [
    "ChunkSpec",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "KvtierTransferHandler",
    "RowKeys",
    "StoreOutput",
    "hit_source_name",
]


class _StepLock:
    """vLLM's ``OffloadingManager.lock``: entering takes a kvtier step for the calling thread
    (waiting, GIL released, while another thread holds one), leaving releases it; not
    reentrant."""

    def __init__(self, owner: "KvtierOffloadingManager"):
        self.owner = owner

    def __enter__(self):
        if self.owner._step is not None:
            raise _k.StepError("the manager lock is not reentrant")
        self.owner._held.step = self.owner.manager.step()
        return self.owner

    def __exit__(self, *exc):
        self.owner.end_step()
        return False


class KvtierOffloadingManager(_ManagerBase):
    """vLLM's ``OffloadingManager`` over a kvtier manager.

    vLLM 0.33.0's connector holds ``manager.lock`` around every sequence of calls that relies on
    an earlier answer (a lookup HIT, then the prepare_load that pins it); here the lock is a
    kvtier step, so the control thread runs only while no caller holds it (the model's
    execution). A call made without the lock runs in a step of its own. The lock is held per
    thread: another thread entering it waits, and its calls never use this thread's step.
    """

    def __init__(
        self,
        manager: _k.TieringManager,
        row_keys: Optional[RowKeys] = None,
        offloading_config: Any = None,
        blocks_per_chunk: Optional[int] = None,
    ):
        self.manager = manager
        self.row_keys = row_keys
        # vLLM's OffloadingConfig and the chunk geometry label the config_info series.
        self._offloading_config = offloading_config
        self._blocks_per_chunk = blocks_per_chunk
        self._stats_state = VllmStatsState()
        self._held = threading.local()
        self._contexts: dict = {}
        self._types = _vllm_types()

    @property
    def lock(self) -> _StepLock:
        return _StepLock(self)

    @property
    def _step(self) -> Optional[_k.Step]:
        """The step the calling thread holds, if any."""
        return getattr(self._held, "step", None)

    def _call(self, name: str, *args):
        if self._step is not None:
            return getattr(self._step, name)(*args)
        with self.manager.step() as s:
            return getattr(s, name)(*args)

    def _ctx(self, req_context: Any, remember: bool = True) -> _k.ReqContext:
        """The kvtier context of a vLLM ``ReqContext`` (or a request id), one per request.
        ``remember=False`` for calls that may come after the request finished (completions):
        a context made then is not kept, or finished requests would pile up here."""
        if isinstance(req_context, _k.ReqContext):
            return req_context
        req_id = req_context if isinstance(req_context, str) else req_context.req_id
        entry = self._contexts.get(req_id)
        if entry is None or (entry[0] is not req_context and not isinstance(req_context, str)):
            params = getattr(req_context, "kv_transfer_params", None)
            try:
                ctx = _k.ReqContext(
                    req_id,
                    params if isinstance(params, dict) else None,
                    _tier_filter(getattr(req_context, "load_tier_filter", None)),
                )
            except (TypeError, ValueError):  # parameters that are not JSON: drop them
                ctx = _k.ReqContext(req_id)
            entry = (req_context, ctx)
            if remember:
                self._contexts[req_id] = entry
        return entry[1]

    def _ctx_with_positions(self, req_context: Any, keys: Sequence[bytes]) -> _k.ReqContext:
        """The kvtier context, with the end-token positions vLLM's scheduler recorded for `keys`
        copied over (the LRU policy orders a request's keys by them)."""
        ctx = self._ctx(req_context)
        get = getattr(req_context, "get_offload_key_position", None)
        if get is not None and not isinstance(req_context, _k.ReqContext):
            for key in keys:
                pos = get(key)
                if pos is not None:
                    ctx.set_offload_key_position(key, pos)
        return ctx

    def end_step(self) -> None:
        """Releases the calling thread's step if it holds one."""
        step = self._step
        if step is not None:
            self._held.step = None
            step.release()

    # -- vLLM's OffloadingManager -----------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any) -> Any:
        r = self._call("lookup", key, self._ctx(req_context))
        v = self._types
        return v.lookup[r] if v.base is not None else r

    def get_load_source(self, key: bytes, req_context: Any) -> Any:
        """vLLM's ``CacheHitSource`` of a chunk ``lookup`` answered HIT for: the tier whose
        promotion brought it into the CPU tier for this request, else the CPU tier (``host``).
        See :func:`hit_source_name` for the mapping."""
        name = hit_source_name(self._call("load_source", key, self._ctx(req_context, remember=False)))
        v = self._types
        return v.hit_source(name) if v.base is not None and v.hit_source is not None else name

    def _spec(self, ids: list) -> Any:
        v = self._types
        return v.spec(ids) if v.base is not None else ChunkSpec(ids)

    def prepare_load(self, keys: Sequence[bytes], req_context: Any) -> Any:
        return self._spec(self._call("prepare_load", keys, self._ctx_with_positions(req_context, keys)))

    def touch(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        ctx = self._ctx_with_positions(req_context if req_context is not None else "__touch__", keys)
        self._call("touch", keys, ctx)

    def complete_load(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        self._call("complete_load", keys, self._ctx(req_context, remember=False))

    def prepare_store(self, keys: Sequence[bytes], req_context: Any) -> Optional[StoreOutput]:
        out = self._call("prepare_store", keys, self._ctx_with_positions(req_context, keys))
        if out is None:
            return None
        if self.row_keys is not None:
            self.row_keys.record(out.keys_to_store, out.chunk_ids)
        v = self._types
        if v.base is not None:
            return v.base.PrepareStoreOutput(
                keys_to_store=out.keys_to_store, store_spec=v.spec(out.chunk_ids), evicted_keys=out.evicted
            )
        return StoreOutput(out.keys_to_store, ChunkSpec(out.chunk_ids), out.evicted)

    def complete_store(self, keys: Sequence[bytes], req_context: Any, success: bool = True) -> None:
        self._call("complete_store", keys, self._ctx(req_context, remember=False), success)

    def on_new_request(self, req_context: Any) -> Any:
        policy = self._call("on_new_request", self._ctx(req_context))
        v = self._types
        if v.base is not None:
            return v.base.RequestOffloadingContext(policy=v.policy[policy])
        return policy

    def on_request_finished(self, req_context: Any) -> None:
        ctx = self._ctx(req_context)
        self._call("on_request_finished", ctx)
        self._contexts.pop(ctx.req_id, None)

    def on_schedule_end(self, ctx: Any = None) -> None:
        end = None
        if ctx is not None:
            end = _k.ScheduleEndContext(
                list(getattr(ctx, "new_req_ids", ()) or ()),
                list(getattr(ctx, "preempted_req_ids", ()) or ()),
            )
        self._call("on_schedule_end", end)

    def take_events(self) -> list:
        events = self._step.take_events() if self._step is not None else self.manager.take_events()
        v = self._types
        return [v.event(e) for e in events] if v.base is not None else events

    def has_pending_work(self) -> bool:
        if self._step is not None:
            return self._step.has_pending_work()
        return self.manager.has_pending_work()

    def get_stats(self) -> Any:
        """vLLM's per-step offloading metrics: kvtier's counters since the previous call as
        vLLM's ``OffloadingConnectorStats`` (under vLLM's tiering and CPU metric names where vLLM
        has one, ``vllm:kv_offload_kvtier_*`` for the rest), or ``None`` when nothing changed
        or vLLM is not importable. See :mod:`kvtier._vllm_stats` for the mapping."""
        return stats_for_vllm(self._stats_state, self)

    def config_info(self) -> list:
        """vLLM's ``config_info``: one series of labels per tier of the chain (name, type,
        medium, locality, capacity), the primary's with vLLM's CPU geometry labels."""
        return config_info_for_vllm(
            self, offloading_config=self._offloading_config, blocks_per_chunk=self._blocks_per_chunk
        )

    def kvtier_stats(self) -> dict:
        """kvtier's counters (``TieringManager.stats``)."""
        if self._step is not None:
            return self._step.stats()
        return self.manager.stats()

    def reset_cache(self) -> None:
        """Forgets every chunk of the CPU tier. vLLM's connector calls it holding the lock: the
        step is left for the reset (which takes the manager's lock itself) and taken again,
        so the rest of the caller's locked region still runs in a step."""
        held = self._step is not None
        self.end_step()
        try:
            # vLLM submits a step's store copies at the next step, so a copy prepared before
            # the reset may still write its row: such rows stay out of allocation (and their
            # row-key entries unchanged) until on_reset_flushed.
            self.manager.reset_cache_fencing_writes()
        finally:
            if held:
                self._held.step = self.manager.step()

    def on_reset_flushed(self) -> None:
        """vLLM: the workers finished every job in flight at the last reset, so the rows the
        reset fenced can be handed out again. (Their reports found no store to complete and
        were counted as unmatched.)"""
        self._call("release_reset_fence")

    def shutdown(self) -> None:
        self.end_step()
        self.manager.shutdown()


def hit_source_name(source: _k.LoadSource) -> str:
    """The value of vLLM's ``CacheHitSource`` for a kvtier tier: ``host`` for the primary (and
    any local CPU tier), ``p2p`` for a peer tier, ``disk`` for local storage, and
    ``external_unspecified`` for the rest (a remote store such as a Redis server, plugins that
    do not say)."""
    if source.secondary is None:
        return "host"
    if source.tier_type == "p2p":
        return "p2p"
    if source.locality == "LOCAL" and source.medium == "STORAGE":
        return "disk"
    if source.locality == "LOCAL" and source.medium == "CPU":
        return "host"
    return "external_unspecified"


def _tier_filter(f: Any) -> Optional[list]:
    """vLLM's ``TierFilter`` as kvtier's list of matchers; ``None`` (every tier) for ``ALL``."""
    matchers = getattr(f, "matchers", None)
    if f is None or matchers is None or getattr(type(f), "ALL", None) is f:
        return None

    def name(v: Any) -> Optional[str]:
        return None if v is None else str(getattr(v, "value", v))

    return [{"medium": name(m.medium), "locality": name(m.locality)} for m in matchers]


def _check_block_hashes() -> None:
    """kvtier keys hold 32-byte block hashes; vLLM's ``xxhash`` prefix-caching hashes are 16
    bytes. Refused here, when vLLM's configuration is in scope, rather than at the first key."""
    try:
        from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found]

        config = get_current_vllm_config_or_none()
    except Exception:  # vLLM absent (or without that helper): the key parser still refuses
        return
    algo = getattr(getattr(config, "cache_config", None), "prefix_caching_hash_algo", None)
    if algo is not None and not str(algo).startswith("sha256"):
        raise _k.ConfigError(
            f"kvtier needs 32-byte block hashes, but --prefix-caching-hash-algo is {algo!r} "
            "(16-byte hashes); use sha256 or sha256_cbor"
        )


class KvtierOffloadingSpec(_SpecBase):
    """The offloading spec vLLM loads (``spec_name = "KvtierOffloadingSpec"``).

    Extra-config keys (``kv_connector_extra_config``): ``kvtier_chain`` (chain file, required),
    ``kvtier_channel`` (completion socket; default ``<arena>.sock``), ``kvtier_arena`` (the
    arena file; default the chain's ``[primary] shared_memory``). With data parallelism each
    engine needs its own chain: ``{dp_index}`` in these paths becomes the engine's index.

    From vLLM's ``OffloadingConfig`` it reads ``extra_config``, ``parallel.world_size`` and
    ``parallel.rank``, ``worker_kv_bytes_per_block``, ``cache.blocks_per_chunk`` and
    ``replicated_layout``. A row holds every rank's slice of a chunk, rank-major, as vLLM's CPU
    spec lays its region out (one slice under the replicated layout).
    """

    def __init__(self, config: Any):
        if _SpecBase is not object:
            super().__init__(config)
        self.config = config
        self.extra_config = dict(config.extra_config or {})
        chain = self.extra_config.get("kvtier_chain")
        if not chain:
            raise _k.ConfigError("kv_connector_extra_config needs kvtier_chain (a chain file path)")
        # Data-parallel engines each run a manager, which owns its arena (and tiers' files):
        # each needs its own chain, named by the engine's index.
        dp_size = int(getattr(config.parallel, "data_parallel_size", 1) or 1)
        dp_index = str(int(getattr(config.parallel, "data_parallel_index", 0) or 0))
        if dp_size > 1 and "{dp_index}" not in str(chain):
            raise _k.ConfigError(
                f"{dp_size} data-parallel engines cannot share the chain {chain}: each owns its "
                "arena; put {dp_index} in kvtier_chain (e.g. /etc/kvtier/chain-{dp_index}.toml)"
            )
        for name in ("kvtier_chain", "kvtier_arena", "kvtier_channel"):
            if self.extra_config.get(name):
                self.extra_config[name] = str(self.extra_config[name]).replace("{dp_index}", dp_index)
        self.chain_path = self.extra_config["kvtier_chain"]
        self.arena_path = self.extra_config.get("kvtier_arena") or _k.chain_arena_path(self.chain_path)
        if not self.arena_path:
            raise _k.ConfigError(
                f"{self.chain_path}: [primary] needs shared_memory (the arena workers open), "
                "or set kvtier_arena"
            )
        self.channel_path = self.extra_config.get("kvtier_channel") or f"{self.arena_path}.sock"
        self.world_size = int(config.parallel.world_size)
        self.rank = int(getattr(config.parallel, "rank", 0))
        self.blocks_per_chunk = int(config.cache.blocks_per_chunk)
        self.rank_chunk_bytes = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
        if self.rank_chunk_bytes <= 0:
            raise _k.ConfigError("worker_kv_bytes_per_block must be positive")
        if getattr(config, "canonical_layout", False):
            # Canonical pages remap each rank's bytes into a parallelism-free layout; the
            # workers here copy a rank's pages as they are.
            raise _k.ConfigError("kvtier does not support vLLM's canonical KV layout; turn it off")
        _check_block_hashes()
        # vLLM's replicated layout (pure-MLA models under tensor parallelism alone): every rank's
        # KV is byte-identical, so a row holds one copy; vLLM submits stores to rank 0 only
        # (reading this attribute), which alone writes and reports them, and every rank loads
        # from that copy.
        self.replicated_layout = bool(getattr(config, "replicated_layout", False))
        self._manager: Optional[KvtierOffloadingManager] = None
        self._worker: Optional[KvtierOffloadingWorker] = None

    @classmethod
    def from_settings(
        cls,
        extra_config: dict,
        worker_kv_bytes_per_block: int,
        world_size: int = 1,
        rank: int = 0,
        blocks_per_chunk: int = 1,
        replicated_layout: bool = False,
    ) -> "KvtierOffloadingSpec":
        """A spec without vLLM's config object (engines other than vLLM, and tests)."""
        from types import SimpleNamespace

        # Every field vLLM's own OffloadingSpec.__init__ reads, for when vLLM is importable and
        # the spec derives from it.
        return cls(
            SimpleNamespace(
                extra_config=extra_config,
                groups=(),
                enable_kv_cache_events=False,
                parallel=SimpleNamespace(world_size=world_size, rank=rank),
                cache=SimpleNamespace(blocks_per_chunk=blocks_per_chunk, tokens_per_hash=1),
                worker_kv_bytes_per_block=worker_kv_bytes_per_block,
                replicated_layout=replicated_layout,
            )
        )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict) -> dict:
        """The metrics :meth:`KvtierOffloadingManager.get_stats` may send (vLLM's Prometheus
        logger accepts only declared names)."""
        return metric_definitions_for_vllm(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict) -> tuple:
        """The label names of :meth:`KvtierOffloadingManager.config_info`'s series."""
        return config_info_keys_for_vllm(extra_config)

    @property
    def copies(self) -> int:
        """Rank slices per row: one per rank, or one in all under the replicated layout."""
        return 1 if self.replicated_layout else self.world_size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one arena row's data: every rank's slice of one chunk (one slice under the
        replicated layout)."""
        return self.rank_chunk_bytes * self.copies

    def get_manager(self) -> KvtierOffloadingManager:
        """The scheduler-side manager (built once), with its completion channel open."""
        if self._manager is None:
            m = _k.TieringManager.from_config(self.chain_path, self.chunk_bytes, reporters=self.copies)
            try:
                # The row-key table exists before the channel opens: a worker that reached the
                # channel finds the table of this manager, not one an earlier run left.
                row_keys = RowKeys(f"{self.arena_path}.keys", m.num_chunks, create=True)
                if os.path.exists(self.channel_path):
                    os.unlink(self.channel_path)
                m.open_completion_channel(self.channel_path)
            except BaseException:
                m.shutdown()
                raise
            self._manager = KvtierOffloadingManager(
                m, row_keys, offloading_config=self.config, blocks_per_chunk=self.blocks_per_chunk
            )
        return self._manager

    def get_transfer_handler(
        self,
        kv_tensors: Sequence[Any],
        rank: Optional[int] = None,
        group_tensors: Optional[Sequence[Sequence[int]]] = None,
    ) -> KvtierTransferHandler:
        """The copy engine of one rank over its KV tensors (each indexed by block id);
        ``group_tensors[g]``: the tensors KV-cache group ``g`` uses (default: one group, all).
        Under the replicated layout every rank copies the row's one slice (slot 0) and only
        rank 0, the one writer, opens the completion channel."""
        rank = self.rank if rank is None else rank
        writer = not self.replicated_layout or rank == 0
        return KvtierTransferHandler(
            self.arena_path,
            kv_tensors,
            rank=rank,
            world_size=self.copies,
            blocks_per_chunk=self.blocks_per_chunk,
            channel_path=self.channel_path if writer else None,
            rank_stride=self.rank_chunk_bytes,
            group_tensors=group_tensors,
            slot=0 if self.replicated_layout else rank,
        )

    def get_worker(self, kv_caches: Any, rank: Optional[int] = None) -> KvtierOffloadingWorker:
        """vLLM's worker for this rank; ``kv_caches`` is vLLM's ``CanonicalKVCaches`` (or a list
        of tensors indexed by block id). vLLM builds workers before the scheduler's manager
        exists, so the arena, the channel and the row-key table are opened at the first job."""
        if self._worker is None:
            tensors = getattr(kv_caches, "tensors", kv_caches)
            tensors = [getattr(t, "tensor", t) for t in tensors]
            refs = getattr(kv_caches, "group_data_refs", None)
            groups = None if refs is None else [[r.tensor_idx for r in g] for g in refs]
            handler = self.get_transfer_handler(tensors, rank, groups)
            self._worker = KvtierOffloadingWorker(handler, f"{self.arena_path}.keys")
        return self._worker
