"""Drives vLLM's real ``Scheduler`` and ``OffloadingConnector`` (scheduler and worker roles) with
a KV "model" whose values follow from the token prefix, on CPU torch tensors.

The engine loop is vLLM's own order: ``schedule()`` → the workers bind the connector metadata,
start loads, run the "forward" (which writes the KV of every scheduled token), defer stores
(``wait_for_save``) and report finished transfers → ``update_from_output``. Before each
forward, every token a scheduled request already holds (from the device prefix cache or loaded
by the connector) is checked against the value the model would have written: a wrong byte
anywhere in a request's computed prefix is counted as a wrong token.

The reference runs use vLLM's own specs (``CPUOffloadingSpec`` here, ``TieringOffloadingSpec``
in :mod:`reference_tiering`) with :class:`TorchCopyWorker`, a plain synchronous copy worker:
vLLM's CPU worker refuses to run without CUDA.
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

EOS = 2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS = 2
HEAD_SIZE = 4

_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}


def write_model_dir(path: str) -> str:
    """A model directory with only a ``config.json`` (no weights, no tokenizer): enough for
    vLLM's ``ModelConfig`` offline."""
    import json

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_MODEL_CONFIG, f)
    return path


@dataclass
class EngineShape:
    """The engine's sizes: device blocks, tokens per block, scheduling limits, ranks."""

    block_size: int = 16
    num_gpu_blocks: int = 48
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    max_model_len: int = 2048
    world_size: int = 1
    async_scheduling: bool = False


def build_configs(model_dir: str, shape: EngineShape, extra_config: dict, rank: int = 0):
    """vLLM's ``VllmConfig`` (OffloadingConnector, kv_both) and the ``KVCacheConfig`` of one
    full-attention group over :data:`LAYERS`."""
    mc = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=shape.max_model_len,
        seed=0,
    )
    sc = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=shape.async_scheduling,
    )
    cc = CacheConfig(
        block_size=shape.block_size,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
    )
    cc.num_gpu_blocks = shape.num_gpu_blocks
    pc = ParallelConfig()
    pc.world_size = shape.world_size
    pc.rank = rank
    kt = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra_config),
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        parallel_config=pc,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(
        block_size=shape.block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    kcc = KVCacheConfig(
        num_blocks=shape.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    return vc, kcc


# -- reference copy worker ---------------------------------------------------------------------


def _chunk_places(gpu_spec: Any, blocks_per_chunk: int):
    """(gpu block, chunk position in the CPU spec, block slot in the chunk) for every GPU block
    of a spec: a group's GPU blocks start at logical block ``block_indices[g]``, so its first
    chunk may be entered mid-way."""
    ids = list(gpu_spec.block_ids)
    sizes = list(gpu_spec.group_sizes) if gpu_spec.group_sizes is not None else [len(ids)]
    starts = list(gpu_spec.block_indices) if gpu_spec.block_indices is not None else [0] * len(sizes)
    out = []
    at = 0
    chunk_base = 0
    for size, start in zip(sizes, starts):
        if size == 0:
            continue
        first = start // blocks_per_chunk
        for k in range(size):
            logical = start + k
            out.append((ids[at + k], chunk_base + logical // blocks_per_chunk - first, logical % blocks_per_chunk))
        chunk_base += (start + size - 1) // blocks_per_chunk - first + 1
        at += size
    return out


class TorchCopyWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` as a plain synchronous torch copy between the rank's KV tensors
    and a host buffer of ``num_chunks`` chunks (vLLM's CPU worker needs CUDA). ``host`` may be
    given (a tensor of ``num_chunks × chunk_bytes`` int8) so a tier reading the same memory sees
    the bytes."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int, host: Optional[torch.Tensor] = None):
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.pages = [t.tensor.shape[1] for t in kv_caches.tensors]
        self.bpc = blocks_per_chunk
        chunk_bytes = sum(self.pages) * blocks_per_chunk
        if host is None:
            host = torch.zeros((num_chunks, chunk_bytes), dtype=torch.int8)
        self.host = host.view(num_chunks, -1)[:, :chunk_bytes]
        self.sections = [sum(self.pages[:i]) * blocks_per_chunk for i in range(len(self.tensors))]
        self.finished: list = []

    def _copy(self, gpu_spec: Any, cpu_ids: list, to_host: bool) -> int:
        n = 0
        for block, pos, slot in _chunk_places(gpu_spec, self.bpc):
            row = self.host[cpu_ids[pos]]
            for t, page, section in zip(self.tensors, self.pages, self.sections):
                lo = section + slot * page
                if to_host:
                    row[lo : lo + page].copy_(t[block])
                else:
                    t[block].copy_(row[lo : lo + page])
                n += page
        return n

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        t0 = time.perf_counter()
        n = self._copy(src_spec, list(dst_spec.block_ids), True)
        self.finished.append(TransferResult(job_id, True, n, time.perf_counter() - t0))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False) -> bool:
        t0 = time.perf_counter()
        n = self._copy(dst_spec, list(src_spec.block_ids), False)
        self.finished.append(TransferResult(job_id, True, n, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list:
        out, self.finished = self.finished, []
        return out

    def wait(self, job_ids) -> None:
        return None


class ReferenceCPUSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with :class:`TorchCopyWorker` as its worker."""

    def get_worker(self, kv_caches):
        if not getattr(self, "_ref_worker", None):
            self._ref_worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._ref_worker


# -- the KV "model" -----------------------------------------------------------------------------


def prefix_values(tokens: list) -> list:
    """The KV value of each position: a float32-exact function of the token prefix up to it."""
    h = hashlib.blake2b(digest_size=8)
    out = []
    for tok in tokens:
        h.update(int(tok).to_bytes(4, "little"))
        out.append(float(int.from_bytes(h.copy().digest()[:3], "little")))
    return out


def next_token(tokens: list) -> int:
    """The "sampled" token: a function of the prefix that is never EOS."""
    h = hashlib.blake2b(bytes(str(len(tokens)) + ":" + ",".join(map(str, tokens[-8:])), "ascii"), digest_size=4)
    return 3 + int.from_bytes(h.digest(), "little") % 990


@dataclass
class RunStats:
    """What a run saw."""

    steps: int = 0
    finished: int = 0
    wrong_tokens: int = 0
    checked_tokens: int = 0
    hit_tokens: int = 0
    connector_tokens: int = 0
    waited_steps: dict = field(default_factory=lambda: defaultdict(int))
    retry_steps: dict = field(default_factory=lambda: defaultdict(int))
    stuck: list = field(default_factory=list)


def _kv_value(rank: int, layer: int, kv: int, v: float) -> float:
    return v + 7.0 * layer + 3.0 * kv + 11.0 * rank


class Runner:
    """One rank's "model runner": the worker-role connector over the rank's KV tensors. It checks
    the computed prefix of every scheduled request, runs the connector in vLLM's order around a
    "forward" that writes the KV of the scheduled tokens, and returns the connector's output."""

    def __init__(self, model_dir: str, shape: EngineShape, extra_config: dict, rank: int, spec_cls: Any = None):
        init_none_hash(sha256)
        if spec_cls is not None:
            _register_spec(spec_cls)
        self.rank = rank
        self.shape = shape
        vc, kcc = build_configs(model_dir, shape, extra_config, rank=rank)
        self.connector = OffloadingConnector(vc, KVConnectorRole.WORKER, kcc)
        self.caches = {
            name: torch.zeros((shape.num_gpu_blocks, 2, shape.block_size, KV_HEADS, HEAD_SIZE), dtype=torch.float32)
            for name in LAYERS
        }
        self.connector.register_kv_caches(self.caches)

    def _expected(self, layer: int, kv: int, values: list, lo: int, hi: int) -> torch.Tensor:
        v = torch.tensor(values[lo:hi], dtype=torch.float32)
        return _kv_value(self.rank, layer, kv, 0.0) + v

    def execute(self, metadata: Any, finished_req_ids: set, work: list) -> tuple:
        """``work``: (req_id, tokens up to the step's end, block ids, computed, end) per scheduled
        request. Returns (KVConnectorOutput, wrong tokens, checked tokens)."""
        c = self.connector
        # As vLLM's model runner: stores of blocks this step reallocates (jobs_to_flush) are
        # submitted before the forward overwrites them.
        c.handle_preemptions(metadata)
        c.bind_connector_metadata(metadata)
        c.start_load_kv(None)
        wrong = checked = 0
        b = self.shape.block_size
        for _rid, tokens, blocks, computed, end in work:
            values = prefix_values(tokens)
            bad = set()
            for li, name in enumerate(LAYERS):
                t = self.caches[name]
                for kv in (0, 1):
                    for pos in range(computed):
                        if pos in bad:
                            continue
                        row = t[blocks[pos // b], kv, pos % b]
                        if not bool((row == _kv_value(self.rank, li, kv, values[pos])).all()):
                            bad.add(pos)
            wrong += len(bad)
            checked += computed
            # The forward: the KV of the step's tokens.
            for li, name in enumerate(LAYERS):
                t = self.caches[name]
                for kv in (0, 1):
                    for pos in range(computed, end):
                        t[blocks[pos // b], kv, pos % b].fill_(_kv_value(self.rank, li, kv, values[pos]))
        c.wait_for_save()
        r = c.get_transfer_results(finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
            invalid_block_ids=c.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=c.build_connector_worker_meta(),
        )
        c.clear_connector_metadata()
        return out, wrong, checked

    def shutdown(self) -> None:
        self.connector.shutdown()


def _runner_process(conn: Any, args: tuple) -> None:
    """A worker process: builds a :class:`Runner` and serves ``execute`` calls from the pipe."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        runner = Runner(*args)
        conn.send(("ready", None))
    except BaseException as e:  # reported to the parent, which fails the test
        conn.send(("error", repr(e)))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            runner.shutdown()
            conn.send(("bye", None))
            return
        try:
            conn.send(("ok", runner.execute(*msg)))
        except BaseException as e:
            conn.send(("error", repr(e)))


class RemoteRunner:
    """A :class:`Runner` in a worker process of its own (vLLM's multiprocess executor shape):
    metadata and results cross a pipe, pickled."""

    def __init__(self, *args):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_runner_process, args=(child, args), daemon=True)
        self.proc.start()
        kind, value = self._recv(600)
        if kind != "ready":
            raise RuntimeError(f"worker process failed to start: {value}")

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise RuntimeError("worker process did not answer")
        return self.conn.recv()

    def execute(self, metadata, finished, work):
        self.conn.send((metadata, finished, work))
        kind, value = self._recv(120)
        if kind != "ok":
            raise RuntimeError(f"worker process failed: {value}")
        return value

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
                self._recv(30)
            except (RuntimeError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


CONNECTOR_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)


class Engine:
    """One vLLM engine: the real scheduler (owning the scheduler-role connector) and one runner
    per rank, in this process or (``worker_processes``) each in a process of its own. The time
    spent in the scheduler-side connector calls is measured per step."""

    def __init__(
        self,
        model_dir: str,
        shape: EngineShape,
        extra_config: dict,
        spec_cls: Any = None,
        worker_processes: bool = False,
    ):
        init_none_hash(sha256)
        self.shape = shape
        if spec_cls is not None:
            _register_spec(spec_cls)
            extra_config = dict(extra_config, spec_name=spec_cls.__name__, spec_module_path=spec_cls.__module__)
        self.vllm_config, self.kv_cache_config = build_configs(model_dir, shape, extra_config)
        self.scheduler = Scheduler(
            self.vllm_config,
            self.kv_cache_config,
            StructuredOutputManager(self.vllm_config),
            block_size=shape.block_size,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self.connector_seconds = 0.0
        self._time_connector()
        self.hasher = get_request_block_hasher(shape.block_size, sha256)
        make = RemoteRunner if worker_processes else Runner
        self.runners = [make(model_dir, shape, extra_config, rank, spec_cls) for rank in range(shape.world_size)]
        self.aggregator = KVOutputAggregator(expected_finished_count=shape.world_size)
        self.requests: dict = {}
        self.arrival_step: dict = {}
        self.first_scheduled: dict = {}
        self.stats = RunStats()
        self.connector_stats: list = []

    def _time_connector(self) -> None:
        """Wraps the scheduler-side connector calls vLLM makes per step with a timer."""
        conn = self.connector

        def timed(fn):
            def call(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.connector_seconds += time.perf_counter() - t0

            return call

        for name in CONNECTOR_CALLS:
            if hasattr(conn, name):
                setattr(conn, name, timed(getattr(conn, name)))
        matched = conn.get_num_new_matched_tokens
        allocated = conn.update_state_after_alloc

        def get_num_new_matched_tokens(request, num_computed_tokens):
            n, is_async = matched(request, num_computed_tokens)
            if n is None:  # RETRY: the request waits a step for the lookup
                self.stats.retry_steps[request.request_id] += 1
            return n, is_async

        def update_state_after_alloc(request, blocks, num_external_tokens):
            self.stats.connector_tokens += num_external_tokens
            return allocated(request, blocks, num_external_tokens)

        conn.get_num_new_matched_tokens = get_num_new_matched_tokens
        conn.update_state_after_alloc = update_state_after_alloc

        # vLLM's scheduler takes the connector's stats inside update_from_output: keep a copy of
        # every non-empty payload.
        stats_fn = conn.get_kv_connector_stats

        def get_kv_connector_stats():
            out = stats_fn()
            if out is not None and not out.is_empty():
                self.connector_stats.append(copy.deepcopy(out))
            return out

        conn.get_kv_connector_stats = get_kv_connector_stats

    @property
    def manager(self) -> Any:
        """The spec's scheduler-side ``OffloadingManager``."""
        return self.connector.connector_scheduler.manager

    # -- requests --
    def add_request(self, req_id: str, prompt: list, max_tokens: int, kv_transfer_params: Optional[dict] = None):
        # kv_transfer_params reach the request as an API server puts them: in the sampling
        # parameters' extra_args.
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        req = Request(req_id, list(prompt), sp, None, block_hasher=self.hasher)
        self.requests[req_id] = req
        self.arrival_step[req_id] = self.stats.steps
        self.scheduler.add_request(req)

    @property
    def busy(self) -> bool:
        return self.scheduler.has_requests() or self.scheduler.has_finished_requests()

    def step(self) -> None:
        out = self.scheduler.schedule()
        num_computed = {}
        for new in out.scheduled_new_reqs:
            num_computed[new.req_id] = new.num_computed_tokens
            self.stats.hit_tokens += new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            num_computed[rid] = cached.num_computed_tokens[i]
        work = []
        for rid, n in out.num_scheduled_tokens.items():
            if rid not in self.first_scheduled:
                self.first_scheduled[rid] = self.stats.steps
                self.stats.waited_steps[rid] = self.stats.steps - self.arrival_step.get(rid, self.stats.steps)
            req = self.requests[rid]
            end = num_computed[rid] + n
            blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
            work.append((rid, list(req.all_token_ids[:end]), blocks, num_computed[rid], end))
        results = [r.execute(out.kv_connector_metadata, set(out.finished_req_ids), work) for r in self.runners]
        outs = []
        for kv_out, wrong, checked in results:
            self.stats.wrong_tokens += wrong
            self.stats.checked_tokens += checked
            outs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(outs) if len(outs) > 1 else outs[0]
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.requests[rid]
            done = num_computed[rid] + out.num_scheduled_tokens[rid]
            sampled.append([next_token(req.all_token_ids[:done])] if done >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=merged.kv_connector_output,
        )
        eco = self.scheduler.update_from_output(out, mro)
        for outputs in eco.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.stats.finished += 1
                    self.requests.pop(o.request_id, None)
        self.stats.steps += 1

    def reset_cache(self) -> bool:
        """vLLM's prefix-cache reset: the device cache and the connector's."""
        return bool(self.scheduler.reset_prefix_cache())

    def shutdown(self) -> None:
        for r in self.runners:
            r.shutdown()
        self.scheduler.shutdown()


def _register_spec(spec_cls: Any) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if spec_cls.__name__ not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(spec_cls.__name__, spec_cls.__module__, spec_cls.__name__)


# -- workloads ----------------------------------------------------------------------------------


def shared_prefix_workload(seed: int, n: int, block_size: int) -> list:
    """(req_id, prompt, max_tokens, step to arrive) for a chat-like workload: a few system
    prompts shared by many requests, conversations that come back with a longer prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 990) for _ in range(block_size * rng.randint(2, 4))] for _ in range(3)]
    convs: list = []
    out = []
    for i in range(n):
        if convs and rng.random() < 0.4:
            j = rng.randrange(len(convs))
            prompt = convs[j] + [rng.randrange(3, 990) for _ in range(rng.randint(4, block_size * 2))]
            convs[j] = prompt
        else:
            prompt = list(rng.choice(systems)) + [rng.randrange(3, 990) for _ in range(rng.randint(8, block_size * 3))]
            convs.append(prompt)
        out.append((f"r{i}", prompt, rng.randint(1, 6), i * 3 + rng.randint(0, 2)))
    return out


def drive(
    engine: Engine,
    workload: list,
    max_steps: int = 5000,
    on_step: Optional[Callable] = None,
    kv_transfer_params: Optional[dict] = None,
) -> RunStats:
    """Adds each request at its arrival step (with ``kv_transfer_params``, if given) and steps
    the engine until all finish or ``max_steps`` pass; requests left then are listed as stuck."""
    pending = sorted(workload, key=lambda r: r[3])
    step = 0
    while step < max_steps and (pending or engine.busy):
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, _ = pending.pop(0)
            engine.add_request(rid, prompt, max_tokens, kv_transfer_params)
        if on_step is not None:
            on_step(engine, step)
        if engine.busy:
            engine.step()
        step += 1
    engine.stats.stuck = sorted(engine.requests) + [r[0] for r in pending]
    return engine.stats


def waves_workload(seed: int, prefixes: int, waves: int, per_wave: int, block_size: int) -> list:
    """Random waves with repeats over ``prefixes`` distinct prompts: the first waves bring each
    prefix once (so later ones push earlier ones out of the device and the CPU tier), then
    waves pick prefixes at random, each prompt extended by a few fresh tokens. Arrivals are
    random within a wave."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 990) for _ in range(block_size * rng.randint(3, 5))] for _ in range(prefixes)]
    order = list(range(prefixes))
    out = []
    step = 0
    i = 0
    for w in range(waves):
        if w * per_wave < prefixes:
            picks = order[w * per_wave : (w + 1) * per_wave]
        else:
            picks = [rng.randrange(prefixes) for _ in range(per_wave)]
        for p in picks:
            tail = [rng.randrange(3, 990) for _ in range(rng.randint(1, block_size))]
            out.append((f"w{i}", bases[p] + tail, rng.randint(1, 4), step + rng.randint(0, 6)))
            i += 1
        step += 12
    return out


def chunk_bytes(shape: EngineShape) -> int:
    """Bytes of one offloaded chunk (one block of every layer, K and V) on one rank."""
    return len(LAYERS) * 2 * shape.block_size * KV_HEADS * HEAD_SIZE * 4


def cpu_bytes_for(shape: EngineShape, chunks: int) -> int:
    """vLLM's ``cpu_bytes_to_use`` for a CPU tier of ``chunks`` chunks (vLLM pads each chunk to
    its block-size alignment)."""
    align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1) or 1)
    per_chunk = -(-chunk_bytes(shape) * shape.world_size // align) * align
    return chunks * per_chunk
