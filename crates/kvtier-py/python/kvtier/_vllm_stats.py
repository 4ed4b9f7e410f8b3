"""kvtier's counters as vLLM 0.33's offloading metrics.

vLLM's ``OffloadingConnector`` asks its manager, once per scheduler step and holding
``manager.lock``, for ``get_stats()``: an ``OffloadingConnectorStats`` of what happened since the
previous call (or ``None``). It merges that payload into its own (the load/store bytes and times
the workers reported, lookup delays, store allocation failures), and on the first call adds
``manager.config_info()``: one mapping of label values per series of
``vllm:kv_offload_config_info``. The frontend sums the payloads of an interval for the
"KV Transfer metrics" log line (``reduce``) and feeds each payload to the Prometheus logger,
which accepts only the metric names and label names the offloading spec declared
(``build_metric_definitions`` and ``config_info_keys``, both classmethods of the spec taking the
connector's extra config). This module produces all four for a kvtier manager:

- :func:`stats_for_vllm` (``OffloadingManager.get_stats``): kvtier's counters since the previous
  call, as deltas, under vLLM's own metric names where vLLM has one (the names of vLLM's tiering
  and CPU managers, so their dashboards work with kvtier) and under ``vllm:kv_offload_kvtier_*``
  names for the rest;
- :func:`config_info_for_vllm` (``OffloadingManager.config_info``): one series per tier;
- :func:`metric_definitions_for_vllm` (``OffloadingSpec.build_metric_definitions``);
- :func:`config_info_keys_for_vllm` (``OffloadingSpec.config_info_keys``).

Without vLLM importable, :func:`stats_for_vllm` returns ``None`` (what vLLM's contract allows),
:func:`metric_definitions_for_vllm` an empty dict, and the others plain values; the deltas of
every call stay available as a plain dict in :attr:`VllmStatsState.last_delta`.

Tiers are labelled as vLLM's tiering manager labels them (label ``tier``): ``0:primary`` for
the primary tier, ``<n>:<type>`` for the n-th secondary tier (1-based, chain order, ``type`` as in
the chain file: ``disk``, ``redis``, ``p2p``, a plugin's).

What maps to what (``d(x)``: the increase of kvtier's cumulative ``x`` since the previous call):

=================================================  ===============================================
vLLM metric (label)                                kvtier
=================================================  ===============================================
``vllm:kv_offload_tiering_chunk_queries`` (tier)   ``d(hits + misses)`` of the tier's stats
``vllm:kv_offload_tiering_chunk_hits`` (tier)      ``d(hits)`` (the primary counts ``HitPending``
                                                   answers as hits)
``vllm:kv_offload_tiering_read_bytes`` (tier)      ``d(bytes_read)`` of a secondary tier (its
                                                   promotions into the primary; a peer tier:
                                                   bytes received)
``vllm:kv_offload_tiering_write_bytes`` (tier)     ``d(bytes_written)`` of a secondary tier (its
                                                   cascades; a peer tier: bytes sent)
``vllm:kv_offload_tiering_promotion_allocation_    ``d(manager.promotion_alloc_failures)``
failures``
``vllm:kv_offload_tiering_backpressure_stores_     ``d(gates[i].backpressure_dropped_jobs)``
dropped`` / ``..._blocks_dropped`` (tier)          / ``d(..._dropped_chunks)``
``vllm:kv_offload_tiering_backpressure_store_      ``gates[i].store_seconds_per_mib`` (the same
latency_ema`` (tier)                               unit, s/MiB)
``vllm:kv_offload_cpu_cache_usage_perc`` and its   the CPU primary's ``extra`` ``usage_perc``,
``write_`` / ``read_`` variants                    ``write_usage_perc``, ``read_usage_perc``
``vllm:kv_offload_load_bytes`` /                   only with ``report_transfers=True``:
``vllm:kv_offload_store_bytes``                    ``d(primary.loads)`` / ``d(primary.stores)``
                                                   times the chunk size
=================================================  ===============================================

kvtier-specific (every number of ``TieringManager.stats()``, so nothing is lost):

- ``vllm:kv_offload_kvtier_manager`` (counter, label ``counter``): ``d`` of every field of
  ``stats["manager"]`` (promotion_jobs, promoted_keys, failed_promotion_keys, cascade_jobs,
  off_step_store_completions, tiers_quarantined, ...; new fields appear without a change here);
- ``vllm:kv_offload_kvtier_tier`` (counter, labels ``tier``, ``counter``): ``d`` of each tier's
  hits, misses, stores, loads, evictions, failures, bytes_written, bytes_read, of its gate's
  counters (admission_rejections, late_admissions, backpressure_*) and of its promotion
  decisions (``decision_started``, ``decision_declined_by_cost``, ...);
- ``vllm:kv_offload_kvtier_tier_figure`` (gauge, labels ``tier``, ``figure``): each tier's
  resident_chunks, capacity_chunks, the tier-specific ``extra`` figures, backpressure_active,
  store_seconds_per_mib and the fitted cost estimates (``decision_load_fixed_secs``, ...);
- ``vllm:kv_offload_kvtier_jobs_in_flight`` (gauge): primary↔secondary jobs in flight.

Counters are emitted only when they grew and gauges only when they changed (a Prometheus gauge
keeps its last value), so an idle engine's payload is empty and its log line silent. A counter
that went down (kvtier's counters restart with ``reset``) counts from zero again.

Not in kvtier's stats, so not reported (vLLM's series stay absent):

- ``vllm:kv_offload_tiering_read_time`` / ``write_time``: kvtier keeps no cumulative transfer
  time per tier (the disk tier has moving averages, in the tier figures
  ``load_secs_per_mib_ema`` / ``store_secs_per_mib_ema``);
- ``vllm:kv_offload_tiering_lookup_sync_delay_seconds`` / ``..._async_delay_seconds`` per tier,
  ``..._promotion_latency_seconds``: no per-lookup or per-job timings (vLLM's connector still
  reports its own ``vllm:kv_offload_lookup_*_delay_seconds`` around the manager's lookups);
- ``vllm:kv_offload_tiering_promotion_job_failures`` / ``cascade_job_failures`` per tier: a
  tier's ``failures`` does not say which direction failed (it is in ``kvtier_tier{counter=
  "failures"}``; ``failed_promotion_keys`` in ``kvtier_manager`` counts promotion keys);
- ``vllm:kv_offload_tiering_active_promotion_jobs`` / ``active_cascade_jobs`` and the primary
  read/write usage per tier: kvtier has the total (``kvtier_jobs_in_flight``) only;
- ``vllm:kv_offload_cpu_allocation_size``: kvtier counts allocation batches and chunks
  (``allocation_batches``, ``allocation_chunks`` figures), not each batch's size.

GPU↔CPU load and store bytes and times: vLLM's connector counts them itself from the transfer
sizes and times kvtier's worker returns (``KvtierOffloadingWorker``), as
``vllm:kv_offload_load_bytes`` / ``load_time`` / ``store_bytes`` / ``store_time`` and the size
histograms; adding kvtier's own count would count them twice, so :func:`stats_for_vllm` adds
them only with ``report_transfers=True`` (an engine whose workers report no sizes), and then
without times (the manager does not see the copies). Store allocation failures likewise: the
connector counts a ``prepare_store`` that returned ``None`` in
``vllm:kv_offload_allocation_failure``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "PRIMARY_TIER_LABEL",
    "TIER_LABEL",
    "VllmStatsState",
    "config_info_for_vllm",
    "config_info_keys_for_vllm",
    "metric_definitions_for_vllm",
    "stats_delta",
    "stats_for_vllm",
    "tier_descriptions",
    "tier_labels",
]

TIER_LABEL = "tier"
"""vLLM's tier label (``vllm.v1.kv_offload.tiering.base.TIER_LABEL``)."""
PRIMARY_TIER_LABEL = "0:primary"
"""vLLM's label of the primary tier."""


class _Vllm:
    """vLLM 0.33's metric names kvtier reports under (the tiering and CPU managers')."""

    CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
    CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
    READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
    WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
    PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
    BACKPRESSURE_STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
    BACKPRESSURE_STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
    BACKPRESSURE_BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
    CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
    CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
    CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
    # Declared by the connector itself (get_connector_metric_definitions): not redeclared.
    LOAD_BYTES = "vllm:kv_offload_load_bytes"
    STORE_BYTES = "vllm:kv_offload_store_bytes"


class _Kvtier:
    """kvtier's own metric names."""

    MANAGER = "vllm:kv_offload_kvtier_manager"
    TIER = "vllm:kv_offload_kvtier_tier"
    TIER_FIGURE = "vllm:kv_offload_kvtier_tier_figure"
    JOBS_IN_FLIGHT = "vllm:kv_offload_kvtier_jobs_in_flight"


_COUNTER, _GAUGE = "counter", "gauge"

# name -> (kind, label names, documentation)
_DEFINITIONS: dict = {
    _Vllm.CHUNK_QUERIES: (_COUNTER, (TIER_LABEL,), "Number of chunk lookups a tier answered (hit or miss), labeled by tier."),
    _Vllm.CHUNK_HITS: (_COUNTER, (TIER_LABEL,), "Number of chunk lookup hits in a tier, labeled by tier."),
    _Vllm.READ_BYTES: (
        _COUNTER,
        (TIER_LABEL,),
        "Total bytes read from secondary tiers into the primary tier, labeled by tier "
        "(kvtier: the tier's bytes_read; a peer tier's bytes received).",
    ),
    _Vllm.WRITE_BYTES: (
        _COUNTER,
        (TIER_LABEL,),
        "Total bytes written from the primary tier to secondary tiers, labeled by tier "
        "(kvtier: the tier's bytes_written; a peer tier's bytes sent).",
    ),
    _Vllm.PROMOTION_ALLOCATION_FAILURES: (
        _COUNTER,
        (),
        "Number of promotion attempts that failed because the primary tier could not allocate space.",
    ),
    _Vllm.BACKPRESSURE_STORE_LATENCY_EMA: (
        _GAUGE,
        (TIER_LABEL,),
        "Average cascade time of a secondary tier, in s/MiB (kvtier: the tier gate's store_seconds_per_mib).",
    ),
    _Vllm.BACKPRESSURE_STORES_DROPPED: (
        _COUNTER,
        (TIER_LABEL,),
        "Number of store operations dropped due to back-pressure on a secondary tier.",
    ),
    _Vllm.BACKPRESSURE_BLOCKS_DROPPED: (
        _COUNTER,
        (TIER_LABEL,),
        "Number of chunks dropped due to back-pressure on a secondary tier.",
    ),
    _Vllm.CPU_CACHE_USAGE_PERC: (
        _GAUGE,
        (),
        "Fraction of the CPU primary tier pinned by transfers (kvtier's usage_perc).",
    ),
    _Vllm.CPU_CACHE_WRITE_USAGE_PERC: (
        _GAUGE,
        (),
        "Fraction of the CPU primary tier held by writes in flight (kvtier's write_usage_perc).",
    ),
    _Vllm.CPU_CACHE_READ_USAGE_PERC: (
        _GAUGE,
        (),
        "Fraction of the CPU primary tier pinned by reads (kvtier's read_usage_perc).",
    ),
    _Kvtier.MANAGER: (
        _COUNTER,
        ("counter",),
        "kvtier's manager counters (TieringManager.stats()['manager']), by counter name.",
    ),
    _Kvtier.TIER: (
        _COUNTER,
        (TIER_LABEL, "counter"),
        "kvtier's per-tier counters (tier stats, cascade gate, promotion decisions as "
        "decision_*), labeled by tier and counter name.",
    ),
    _Kvtier.TIER_FIGURE: (
        _GAUGE,
        (TIER_LABEL, "figure"),
        "kvtier's per-tier figures (resident_chunks, capacity_chunks, the tier's own figures, "
        "backpressure state, fitted cost estimates as decision_*), labeled by tier and name.",
    ),
    _Kvtier.JOBS_IN_FLIGHT: (_GAUGE, (), "kvtier's primary-to-secondary jobs in flight."),
}

_TIER_COUNTERS = ("hits", "misses", "stores", "loads", "evictions", "failures", "bytes_written", "bytes_read")
_TIER_GAUGES = ("resident_chunks", "capacity_chunks")
_CPU_GAUGES = (
    ("usage_perc", _Vllm.CPU_CACHE_USAGE_PERC),
    ("write_usage_perc", _Vllm.CPU_CACHE_WRITE_USAGE_PERC),
    ("read_usage_perc", _Vllm.CPU_CACHE_READ_USAGE_PERC),
)

# The chain's media when a tier does not say (issue 32 §4's defaults).
_DEFAULT_PLACEMENT = {
    "cpu": ("CPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"),
    "redis": ("STORAGE", "REMOTE"),
    "p2p": ("CPU", "REMOTE"),
}

_CONFIG_INFO_KEYS = (
    TIER_LABEL,
    "tier_name",
    "tier_type",
    "medium",
    "locality",
    "capacity_chunks",
    "chunk_bytes",
    "capacity_bytes",
    # vLLM's CPUOffloadingInfo labels, on the primary's series only.
    "cpu_num_chunks",
    "cpu_blocks_per_chunk",
    "cpu_kv_cache_size_bytes",
    "cpu_kv_cache_size_tokens",
)


def _vllm_stats_cls() -> Any:
    """vLLM's ``OffloadingConnectorStats``, or ``None`` without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
            OffloadingConnectorStats,
        )
    except Exception:  # vLLM absent, or a vLLM without offloading metrics
        return None
    return OffloadingConnectorStats


@dataclass
class VllmStatsState:
    """What :func:`stats_for_vllm` remembers between calls: keep one per manager.

    ``report_transfers``: also report GPU↔CPU load/store bytes from kvtier's primary counters
    (only for engines whose workers return no transfer sizes; kvtier's own worker does, and
    vLLM's connector counts those). ``chunk_bytes``: bytes of one chunk, for those bytes (read
    from the manager when it has ``chunk_bytes``).
    """

    report_transfers: bool = False
    chunk_bytes: Optional[int] = None
    previous: Optional[dict] = None
    """The stats snapshot of the previous call."""
    tiers: Optional[list] = None
    """The tier descriptions (:func:`tier_descriptions`), read at the first call."""
    gauges: dict = field(default_factory=dict)
    """The gauge values last reported: ``(name, labels) -> value``."""
    last_delta: Optional[dict] = None
    """The numbers of the last call as a plain dict, with or without vLLM:
    ``{"counters": {(name, labels): increase}, "gauges": {(name, labels): value}}``."""


def _handle(manager: Any) -> Any:
    """The ``kvtier.TieringManager`` behind `manager` (itself, or a ``KvtierOffloadingManager``'s
    ``.manager``), or ``None``."""
    if hasattr(manager, "tiers") and hasattr(manager, "step"):
        return manager
    inner = getattr(manager, "manager", None)
    if inner is not None and hasattr(inner, "step"):
        return inner
    return None


def _snapshot(manager: Any) -> dict:
    """kvtier's stats dict from a stats dict, a ``KvtierOffloadingManager`` (``kvtier_stats``,
    which works while the calling thread holds the manager's lock), a ``Step`` or a
    ``TieringManager`` (``stats``)."""
    if isinstance(manager, Mapping):
        return dict(manager)
    get = getattr(manager, "kvtier_stats", None) or getattr(manager, "stats", None)
    if get is None:
        raise TypeError(f"no kvtier stats in {type(manager).__name__}")
    return get()


def tier_descriptions(source: Any) -> list:
    """The chain's tiers, primary first: ``[{"name", "type", "medium", "locality", "secondary",
    "capacity_chunks"}]``. From a manager (``TieringManager.tiers``, exact) or a stats dict
    (names only: ``type`` is the name, medium and locality ``None``), or a chain file (see
    :func:`config_info_for_vllm`)."""
    if isinstance(source, (str, os.PathLike)):
        return _chain_file_tiers(source)
    handle = _handle(source)
    tiers = None
    if handle is not None:
        try:
            tiers = [dict(t) for t in handle.tiers]
        except Exception:  # an older binding without `tiers`, or a manager shut down
            tiers = None
    stats = None
    try:
        stats = _snapshot(source)
    except Exception:
        stats = None
    if tiers is None:
        if stats is None:
            raise TypeError(f"cannot describe the tiers of {type(source).__name__}")
        names = [stats.get("primary", {}).get("name", "primary")]
        names += [s.get("name", f"tier{i + 1}") for i, s in enumerate(stats.get("secondaries", []))]
        tiers = [
            {"name": n, "type": n, "medium": None, "locality": None, "secondary": (i - 1 if i else None)}
            for i, n in enumerate(names)
        ]
    if stats is not None:
        per_tier = [stats.get("primary", {})] + list(stats.get("secondaries", []))
        for t, s in zip(tiers, per_tier):
            t.setdefault("capacity_chunks", s.get("capacity_chunks"))
    return tiers


def tier_labels(tiers: Sequence[Mapping]) -> list:
    """vLLM's ``tier`` label of each tier: ``0:primary``, then ``<n>:<type>``."""
    return [PRIMARY_TIER_LABEL] + [f"{i}:{t.get('type') or t.get('name')}" for i, t in enumerate(tiers[1:], 1)]


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    return None


def _rise(cur: Any, prev: Any) -> float:
    """The increase of a cumulative counter (from zero again if it went down)."""
    c = _number(cur) or 0
    p = _number(prev)
    if p is None or c < p:
        return c
    return c - p


def _tier_numbers(stats: dict, i: int) -> tuple:
    """(tier stats, gate, decisions) of tier `i` (0: primary; gates and decisions exist for
    secondaries only)."""
    if i == 0:
        return stats.get("primary") or {}, {}, {}
    j = i - 1
    secs = stats.get("secondaries") or []
    gates = stats.get("gates") or []
    decisions = stats.get("decisions") or []
    return (
        secs[j] if j < len(secs) else {},
        gates[j] if j < len(gates) else {},
        decisions[j] if j < len(decisions) else {},
    )


def stats_delta(previous: Optional[dict], current: dict, tiers: Sequence[Mapping], chunk_bytes: Optional[int] = None, report_transfers: bool = False) -> dict:
    """The numbers of :func:`stats_for_vllm` as a plain dict: ``{"counters": {(metric, labels):
    increase}, "gauges": {(metric, labels): value}}`` between two ``TieringManager.stats()``
    snapshots (``previous=None``: since construction). Counters with no increase are left
    out; every gauge is in."""
    prev = previous or {}
    counters: dict = {}
    gauges: dict = {}

    def count(name: str, labels: tuple, v: float) -> None:
        if v > 0:
            counters[(name, labels)] = counters.get((name, labels), 0) + v

    labels = tier_labels(tiers)
    n_tiers = 1 + len(current.get("secondaries") or [])
    for i in range(n_tiers):
        label = labels[i] if i < len(labels) else f"{i}:tier"
        cur_t, cur_g, cur_d = _tier_numbers(current, i)
        prev_t, prev_g, prev_d = _tier_numbers(prev, i) if prev else ({}, {}, {})
        if prev and prev_t.get("name") != cur_t.get("name"):
            prev_t, prev_g, prev_d = {}, {}, {}
        d = {k: _rise(cur_t.get(k), prev_t.get(k)) for k in _TIER_COUNTERS}
        count(_Vllm.CHUNK_QUERIES, (label,), d["hits"] + d["misses"])
        count(_Vllm.CHUNK_HITS, (label,), d["hits"])
        for k in _TIER_COUNTERS:
            count(_Kvtier.TIER, (label, k), d[k])
        for k in _TIER_GAUGES:
            if _number(cur_t.get(k)) is not None:
                gauges[(_Kvtier.TIER_FIGURE, (label, k))] = cur_t[k]
        for k, v in (cur_t.get("extra") or {}).items():
            if _number(v) is not None:
                gauges[(_Kvtier.TIER_FIGURE, (label, str(k)))] = v
        if i == 0:
            extra = cur_t.get("extra") or {}
            for k, metric in _CPU_GAUGES:
                if _number(extra.get(k)) is not None:
                    gauges[(metric, ())] = extra[k]
            if report_transfers and chunk_bytes:
                count(_Vllm.LOAD_BYTES, (), d["loads"] * chunk_bytes)
                count(_Vllm.STORE_BYTES, (), d["stores"] * chunk_bytes)
            continue
        count(_Vllm.READ_BYTES, (label,), d["bytes_read"])
        count(_Vllm.WRITE_BYTES, (label,), d["bytes_written"])
        for k, v in cur_g.items():
            if k in ("tier", "admission") or (v is not None and _number(v) is None):
                continue
            if k == "store_seconds_per_mib":
                if v is not None:
                    gauges[(_Vllm.BACKPRESSURE_STORE_LATENCY_EMA, (label,))] = v
                    gauges[(_Kvtier.TIER_FIGURE, (label, k))] = v
            elif isinstance(v, bool):
                gauges[(_Kvtier.TIER_FIGURE, (label, k))] = int(v)
            elif v is not None:
                rise = _rise(v, prev_g.get(k))
                count(_Kvtier.TIER, (label, k), rise)
                if k == "backpressure_dropped_jobs":
                    count(_Vllm.BACKPRESSURE_STORES_DROPPED, (label,), rise)
                elif k == "backpressure_dropped_chunks":
                    count(_Vllm.BACKPRESSURE_BLOCKS_DROPPED, (label,), rise)
        for k, v in cur_d.items():
            if k == "name" or v is None or _number(v) is None:
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                count(_Kvtier.TIER, (label, f"decision_{k}"), _rise(v, prev_d.get(k)))
            else:
                gauges[(_Kvtier.TIER_FIGURE, (label, f"decision_{k}"))] = v

    cur_m = current.get("manager") or {}
    prev_m = prev.get("manager") or {}
    for k, v in cur_m.items():
        if _number(v) is None:
            continue
        rise = _rise(v, prev_m.get(k))
        count(_Kvtier.MANAGER, (k,), rise)
        if k == "promotion_alloc_failures":
            count(_Vllm.PROMOTION_ALLOCATION_FAILURES, (), rise)
    if _number(current.get("jobs_in_flight")) is not None:
        gauges[(_Kvtier.JOBS_IN_FLIGHT, ())] = current["jobs_in_flight"]
    return {"counters": counters, "gauges": gauges}


def stats_for_vllm(state: VllmStatsState, manager: Any) -> Any:
    """``OffloadingManager.get_stats()``: kvtier's numbers since the previous call with the same
    `state`, as vLLM 0.33's ``OffloadingConnectorStats`` (``None`` when nothing changed, and
    always without vLLM; the numbers are in ``state.last_delta`` either way).

    `manager`: the ``KvtierOffloadingManager`` (its ``kvtier_stats()`` works while the calling
    thread holds the manager's lock, as vLLM's connector does around ``get_stats``), a
    ``kvtier.TieringManager`` or ``Step``, or a ``stats()`` dict.
    """
    current = _snapshot(manager)
    if state.tiers is None:
        try:
            state.tiers = tier_descriptions(manager)
        except Exception:
            state.tiers = tier_descriptions(current)
    if state.chunk_bytes is None:
        handle = _handle(manager)
        try:
            state.chunk_bytes = int(handle.chunk_bytes) if handle is not None else None
        except Exception:
            state.chunk_bytes = None
    delta = stats_delta(state.previous, current, state.tiers, state.chunk_bytes, state.report_transfers)
    state.previous = current
    changed = {key: v for key, v in delta["gauges"].items() if state.gauges.get(key) != v}
    state.gauges.update(changed)
    state.last_delta = {"counters": delta["counters"], "gauges": changed}
    cls = _vllm_stats_cls()
    if cls is None or not (delta["counters"] or changed):
        return None
    stats = cls()
    for (name, labels), v in delta["counters"].items():
        stats.increase_counter(name, v, labels)
    for (name, labels), v in changed.items():
        stats.set_gauge(name, v, labels)
    return stats


def metric_definitions_for_vllm(extra_config: Optional[Mapping] = None) -> dict:
    """``OffloadingSpec.build_metric_definitions(extra_config)``: vLLM's metadata of every metric
    :func:`stats_for_vllm` reports (vLLM's Prometheus logger refuses undeclared names). Empty
    without vLLM. The connector's own metrics (``vllm:kv_offload_load_bytes``, ...) are declared
    by vLLM and not repeated here."""
    try:
        from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
            OffloadingCounterMetadata,
            OffloadingGaugeMetadata,
        )
    except Exception:
        return {}
    out = {}
    for name, (kind, labels, doc) in _DEFINITIONS.items():
        cls = OffloadingCounterMetadata if kind == _COUNTER else OffloadingGaugeMetadata
        out[name] = cls(documentation=doc, labelnames=tuple(labels))
    return out


def config_info_keys_for_vllm(extra_config: Optional[Mapping] = None) -> tuple:
    """``OffloadingSpec.config_info_keys(extra_config)``: the label names of kvtier's
    ``vllm:kv_offload_config_info`` series (:func:`config_info_for_vllm` fills them)."""
    return _CONFIG_INFO_KEYS


def _chain_file_tiers(path: Any) -> list:
    """Tier descriptions from a chain file, without building it: types and names as written,
    medium and locality as written (``medium`` / ``locality`` keys) or the type's default,
    capacity as written when it is a chunk count."""
    try:
        import tomllib as toml  # type: ignore[import-not-found]
    except ImportError:  # CPython < 3.11
        try:
            import tomli as toml  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return []
    with open(path, "rb") as f:
        doc = toml.load(f)
    tables = [doc.get("primary") or {}] + list(doc.get("secondary") or [])
    out = []
    for i, t in enumerate(tables):
        kind = str(t.get("type", ""))
        medium, locality = _DEFAULT_PLACEMENT.get(kind, (None, None))
        cap = t.get("capacity")
        out.append(
            {
                "name": str(t.get("name") or kind),
                "type": kind,
                "medium": str(t.get("medium", medium)).upper() if t.get("medium", medium) else None,
                "locality": str(t.get("locality", locality)).upper() if t.get("locality", locality) else None,
                "secondary": i - 1 if i else None,
                "capacity_chunks": cap if isinstance(cap, int) and not isinstance(cap, bool) else None,
            }
        )
    return out


def _kv_cache_size_tokens(config: Any, num_chunks: int) -> Optional[int]:
    """KV tokens `num_chunks` chunks hold for requests of ``max_model_len`` tokens (vLLM's
    ``cpu_kv_cache_size_tokens``), from vLLM's ``OffloadingConfig``; ``None`` when unknown."""
    try:
        max_len = int(config.model.max_model_len)
        groups = list(config.groups)
        per_chunk_blocks = int(config.cache.blocks_per_chunk)
    except Exception:
        return None
    if max_len <= 0 or not groups:
        return None
    chunks = 0
    for g in groups:
        span = int(g.tokens_per_block) * per_chunk_blocks
        n = -(-max_len // span)
        window = getattr(g, "sliding_window_size_in_chunks", None)
        if window is not None:
            n = min(n, int(window))
        chunks += n
    return num_chunks * max_len // chunks if chunks else None


def config_info_for_vllm(
    source: Any,
    *,
    chunk_bytes: Optional[int] = None,
    blocks_per_chunk: Optional[int] = None,
    offloading_config: Any = None,
) -> list:
    """``OffloadingManager.config_info()``: one mapping of label values per tier, primary first
    (the shape of vLLM's tiering manager: each series has the ``tier`` label), filling the
    names :func:`config_info_keys_for_vllm` declares. A value kvtier does not know is
    ``"None"`` (vLLM's ``ConfigInfo`` convention); the ``cpu_*`` labels of vLLM's CPU tier are on
    the primary's series only.

    `source`: the ``KvtierOffloadingManager`` or ``kvtier.TieringManager`` (exact: the tiers as
    built, their capacities and the chunk size), a ``stats()`` dict (tier names and
    capacities only), or a chain file path (types, names, media as written or the type's
    default; capacities when given as chunk counts). `chunk_bytes` (default: the manager's),
    `blocks_per_chunk` (default: ``offloading_config.cache.blocks_per_chunk``) and vLLM's
    `offloading_config` (for ``cpu_kv_cache_size_tokens``) fill the rest.
    The result is plain data, the same with or without vLLM.
    """
    tiers = tier_descriptions(source)
    if chunk_bytes is None:
        handle = _handle(source)
        try:
            chunk_bytes = int(handle.chunk_bytes) if handle is not None else None
        except Exception:
            chunk_bytes = None
    if blocks_per_chunk is None and offloading_config is not None:
        try:
            blocks_per_chunk = int(offloading_config.cache.blocks_per_chunk)
        except Exception:
            blocks_per_chunk = None

    def value(v: Any) -> Any:
        return "None" if v is None else v

    series = []
    for label, t in zip(tier_labels(tiers), tiers):
        cap = t.get("capacity_chunks")
        cap = cap if isinstance(cap, int) and cap > 0 else None
        info = {
            TIER_LABEL: label,
            "tier_name": value(t.get("name")),
            "tier_type": value(t.get("type")),
            "medium": value(t.get("medium")),
            "locality": value(t.get("locality")),
            "capacity_chunks": value(cap),
            "chunk_bytes": value(chunk_bytes),
            "capacity_bytes": value(cap * chunk_bytes if cap is not None and chunk_bytes else None),
        }
        if t.get("secondary") is None:
            tokens = _kv_cache_size_tokens(offloading_config, cap) if offloading_config is not None and cap else None
            info.update(
                cpu_num_chunks=value(cap),
                cpu_blocks_per_chunk=value(blocks_per_chunk),
                cpu_kv_cache_size_bytes=info["capacity_bytes"],
                cpu_kv_cache_size_tokens=value(tokens),
            )
        series.append(info)
    return series
