"""Side by side inside vLLM 0.33.0's real scheduler: kvtier (a cpu + disk chain, off-step
completions on) vs vLLM's own CPUOffloadingSpec vs vLLM's own TieringOffloadingSpec (cpu + its
fs tier), on the same workloads, through the vLLM-in-the-loop harness of tests/vllm (real
Scheduler and OffloadingConnector in both roles, a KV "model" derived from the token prefix,
every held token checked before each step).

Run it in the pinned vLLM environment (scripts/vllm-env.sh prints its path). It builds kvtier's
extension as a release wheel into its scratch directory and imports that one (the venv's editable
install from scripts/vllm-tests.sh is a debug build, several times slower per call; a run with
it measures the build, not the design); ``--debug-build`` uses the installed one instead:

    $VENV/bin/python bench/vllm_side_by_side.py [--runs 3] [--requests 320] [--seeds 3]
        [--gpu-blocks 64] [--cpu-chunks 128] [--max-num-seqs 8] [--max-steps N]

Per spec and workload it reports, summed over the seeds of a run, then the median and min–max
over ``--runs`` runs (specs interleaved, their order rotated each run):
- connector µs/step: time inside the scheduler-side connector calls vLLM makes
  (get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
  update_connector_output, request_finished) per scheduler step (harness Engine.connector_seconds);
- tokens the connector served, split by the tier vLLM attributes them to (its
  get_external_cache_hit_sources: host = CPU tier, disk = kvtier's disk / vLLM's fs tier);
- steps requests waited (arrival to first schedule) and lookups answered RETRY (a step each);
- bytes moved: GPU<->CPU loads and stores (the connector's own counters) and CPU<->secondary
  promotions and cascades (vllm:kv_offload_tiering_read_bytes / write_bytes, which both
  kvtier and vLLM's tiering report per tier);
- wrong tokens, requests stuck at the step bound (a livelock or stall is reported, never waited
  out).

Every run is bounded by --max-steps. The bench works in a temporary directory (model config,
chain files, disk and fs tiers, torch's scratch files) that it removes, and vLLM's shared region
in /dev/shm is unlinked when each engine shuts down: it leaves no files behind.

Each runner calls the connector's handle_preemptions before its forward, as vLLM's model runner
does (tests/vllm/harness.py).
"""

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

if os.environ.get("PYTHONHASHSEED") != "0":
    # vLLM iterates sets of request ids: a fixed hash seed gives every spec the same order.
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests", "vllm")

# Everything this process writes (torch's scratch files included) lands in one directory.
# Short names: kvtier binds a Unix socket next to its arena (paths are limited to ~100 bytes).
SCRATCH = tempfile.mkdtemp(prefix="kvsbs-")
os.environ["TMPDIR"] = SCRATCH
tempfile.tempdir = SCRATCH
atexit.register(shutil.rmtree, SCRATCH, True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, TESTS)


def _import_release_build() -> None:
    """Builds kvtier's extension as a release wheel into the scratch directory and puts it first
    on sys.path (worker processes started with spawn inherit the path)."""
    import glob
    import subprocess
    import zipfile

    crate = os.path.join(HERE, "..")
    wheels = os.path.join(SCRATCH, "wheels")
    print("building kvtier (release) ...", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--quiet", "--out", wheels],
        cwd=crate,
        check=True,
    )
    site = os.path.join(SCRATCH, "kvtier-release")
    with zipfile.ZipFile(glob.glob(os.path.join(wheels, "kvtier-*.whl"))[0]) as whl:
        whl.extractall(site)
    sys.path.insert(0, site)


if "--debug-build" not in sys.argv:
    _import_release_build()

import harness  # noqa: E402
import reference_tiering as rt  # noqa: E402

SPECS = ("kvtier", "vllm-cpu", "vllm-tiering")
TITLES = {
    "kvtier": "kvtier cpu+disk",
    "vllm-cpu": "vLLM CPUOffloading",
    "vllm-tiering": "vLLM Tiering cpu+fs",
}


def kvtier_chain(path: str, capacity: int) -> str:
    """A cpu + disk chain with the control thread and off-step completions on."""
    toml = os.path.join(path, "chain.toml")
    with open(toml, "w") as f:
        f.write(
            f"""
[primary]
type = "cpu"
capacity = {capacity}
eviction = "lru"
shared_memory = "{path}/a"

[[secondary]]
type = "disk"
name = "disk"
path = "{path}/disk"
capacity = "256MiB"
admission = "always"

[control_plane]
thread = true
idle_wait = "1ms"
off_step = true
"""
        )
    return toml


CALLS = (
    ("get_num_new_matched_tokens", "matched"),
    ("update_state_after_alloc", "after_alloc"),
    ("build_connector_meta", "build_meta"),
    ("update_connector_output", "update_output"),
    ("request_finished", "finished"),
)


def time_calls(engine, inside: dict) -> dict:
    """Seconds inside each of the five scheduler-side connector calls (wrapped around the
    harness's own timers, which sum them into Engine.connector_seconds); ``inside["conn"]``
    counts the calls in progress, so the manager timers below count only time within them."""
    conn = engine.connector
    spent = {short: 0.0 for _, short in CALLS}
    for name, short in CALLS:
        fn = getattr(conn, name)

        def call(*args, _fn=fn, _short=short, **kw):
            inside["conn"] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                spent[_short] += time.perf_counter() - t0
                inside["conn"] -= 1

        setattr(conn, name, call)
    return spent


MANAGER_CALLS = (
    "lookup", "get_load_source", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store",
    "on_new_request", "on_request_finished", "on_schedule_end", "take_events", "has_pending_work",
)


class _TimedLock:
    def __init__(self, inner, spent):
        self.inner, self.spent = inner, spent

    def _count(self, t0):
        if self.spent["conn"] and not self.spent["depth"]:
            self.spent["lock"] += time.perf_counter() - t0

    def __enter__(self):
        t0 = time.perf_counter()
        try:
            return self.inner.__enter__()
        finally:
            self._count(t0)

    def __exit__(self, *exc):
        t0 = time.perf_counter()
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._count(t0)


def time_manager(engine, spent: dict) -> None:
    """Seconds the scheduler thread spends, within the five connector calls, inside the spec's
    manager (its OffloadingManager methods, outermost calls only) and entering/leaving its
    ``lock`` outside them (for kvtier: taking and releasing a step, waiting while its control
    thread holds one)."""
    m = engine.manager
    spent.update(manager=0.0, lock=0.0, depth=0)
    for name in MANAGER_CALLS:
        fn = getattr(m, name, None)
        if fn is None:
            continue

        def call(*args, _fn=fn, **kw):
            spent["depth"] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                spent["depth"] -= 1
                if spent["depth"] == 0 and spent["conn"]:
                    spent["manager"] += time.perf_counter() - t0

        setattr(m, name, call)
    base = type(m)
    lock = base.__dict__.get("lock") or next((c.__dict__["lock"] for c in base.__mro__ if "lock" in c.__dict__), None)
    if isinstance(lock, property):
        timed = type(base.__name__, (base,), {"lock": property(lambda self: _TimedLock(lock.fget(self), spent))})
        m.__class__ = timed


def make_engine(spec: str, model_dir: str, shape, cpu_chunks: int, workdir: str):
    if spec == "kvtier":
        from kvtier.vllm import KvtierOffloadingSpec

        cfg = {"kvtier_chain": kvtier_chain(workdir, cpu_chunks), "block_size": shape.block_size}
        return harness.Engine(model_dir, shape, cfg, KvtierOffloadingSpec)
    if spec == "vllm-cpu":
        cfg = {"cpu_bytes_to_use": harness.cpu_bytes_for(shape, cpu_chunks), "block_size": shape.block_size}
        return harness.Engine(model_dir, shape, cfg, harness.ReferenceCPUSpec)
    # vLLM's fs tier in a directory of its own under the scratch directory.
    return rt.tiering_engine(model_dir, shape, cpu_chunks, [rt.fs_tier(os.path.join(workdir, "fs"))])


def workload(kind: str, seed: int, requests: int, block_size: int) -> list:
    if kind == "waves":
        per_wave = 8
        prefixes = max(8, requests // 7)
        return harness.waves_workload(seed, prefixes=prefixes, waves=-(-requests // per_wave), per_wave=per_wave, block_size=block_size)
    return harness.shared_prefix_workload(seed, requests, block_size)


def measure(spec: str, kind: str, seed: int, a, model_dir: str) -> dict:
    shape = harness.EngineShape(
        num_gpu_blocks=a.gpu_blocks, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens
    )
    work = workload(kind, seed, a.requests, shape.block_size)
    max_steps = a.max_steps or (max(r[3] for r in work) + 3000)
    workdir = tempfile.mkdtemp(prefix=spec[:2], dir=SCRATCH)
    engine = make_engine(spec, model_dir, shape, a.cpu_chunks, workdir)
    sources = rt.track_hit_sources(engine)
    kept = engine.connector_stats
    inside = {"conn": 0}
    calls = time_calls(engine, inside)
    time_manager(engine, inside)
    t0 = time.perf_counter()
    try:
        stats = harness.drive(engine, work, max_steps=max_steps)
    finally:
        wall = time.perf_counter() - t0
        engine.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    counters = rt.counters(kept)

    def total(metric, second=None):
        return sum(v for (name, labels), v in counters.items() if name == metric and (second is None or second(labels)))

    secondary = lambda labels: bool(labels) and not str(labels[0]).startswith("0:")  # noqa: E731
    return {
        "steps": stats.steps,
        "wall_s": wall,
        "connector_s": engine.connector_seconds,
        "requests": len(work),
        "finished": stats.finished,
        "stuck": len(stats.stuck),
        "wrong": stats.wrong_tokens,
        "checked": stats.checked_tokens,
        "connector_tokens": stats.connector_tokens,
        "host_tokens": sources.get("host", 0),
        "disk_tokens": sources.get("disk", 0),
        "other_tokens": sum(v for k, v in sources.items() if k not in ("host", "disk")),
        "waited": sum(stats.waited_steps.values()),
        "max_wait": max(stats.waited_steps.values(), default=0),
        "retry": sum(stats.retry_steps.values()),
        "load_bytes": total("vllm:kv_offload_load_bytes"),
        "store_bytes": total("vllm:kv_offload_store_bytes"),
        "promoted_bytes": total("vllm:kv_offload_tiering_read_bytes", secondary),
        "cascaded_bytes": total("vllm:kv_offload_tiering_write_bytes", secondary),
        **{f"call_{k}": v for k, v in calls.items()},
        "manager_s": inside["manager"],
        "lock_s": inside["lock"],
    }


def pooled(results: list) -> dict:
    """One run's figure for a spec and workload: totals over the seeds."""
    out = {k: sum(r[k] for r in results) for k in results[0]}
    out["max_wait"] = max(r["max_wait"] for r in results)
    out["us_per_step"] = 1e6 * out["connector_s"] / max(1, out["steps"])
    out["ms_per_step"] = 1e3 * out["wall_s"] / max(1, out["steps"])
    out["us_manager"] = 1e6 * out["manager_s"] / max(1, out["steps"])
    out["us_lock"] = 1e6 * out["lock_s"] / max(1, out["steps"])
    out["us_connector_own"] = out["us_per_step"] - out["us_manager"] - out["us_lock"]
    for _, short in CALLS:
        out[f"us_{short}"] = 1e6 * out[f"call_{short}"] / max(1, out["steps"])
    return out


ROWS = (
    ("connector µs/step", "us_per_step", "{:.1f}"),
    *((f"  {name}", f"us_{short}", "{:.1f}") for name, short in CALLS),
    ("  = in the spec's manager", "us_manager", "{:.1f}"),
    ("  + manager lock enter/exit", "us_lock", "{:.1f}"),
    ("  + vLLM connector's own", "us_connector_own", "{:.1f}"),
    ("engine ms/step (wall)", "ms_per_step", "{:.2f}"),
    ("steps", "steps", "{:.0f}"),
    ("finished / requests", None, None),
    ("stuck at bound", "stuck", "{:.0f}"),
    ("wrong tokens", "wrong", "{:.0f}"),
    ("connector tokens", "connector_tokens", "{:.0f}"),
    ("  from CPU (host)", "host_tokens", "{:.0f}"),
    ("  from disk/fs", "disk_tokens", "{:.0f}"),
    ("  other", "other_tokens", "{:.0f}"),
    ("waited steps (sum)", "waited", "{:.0f}"),
    ("longest wait (steps)", "max_wait", "{:.0f}"),
    ("RETRY answers", "retry", "{:.0f}"),
    ("GPU<-CPU load KiB", "load_bytes", "{:.0f}", 1024),
    ("GPU->CPU store KiB", "store_bytes", "{:.0f}", 1024),
    ("CPU<-disk promote KiB", "promoted_bytes", "{:.0f}", 1024),
    ("CPU->disk cascade KiB", "cascaded_bytes", "{:.0f}", 1024),
)


def fmt(values: list, pattern: str, scale: float = 1) -> str:
    xs = [v / scale for v in values]
    med = statistics.median(xs)
    if min(xs) == max(xs):
        return pattern.format(med)
    return f"{pattern.format(med)} [{pattern.format(min(xs))}–{pattern.format(max(xs))}]"


def table(kind: str, per_spec: dict, specs: list) -> None:
    width = 30
    print(f"{'':<30}" + "".join(f"{TITLES[s]:>{width}}" for s in specs))
    for row in ROWS:
        label, key, pattern = row[:3]
        scale = row[3] if len(row) > 3 else 1
        cells = []
        for s in specs:
            runs = per_spec[s]
            if key is None:
                cells.append(f"{fmt([r['finished'] for r in runs], '{:.0f}')} / {runs[0]['requests']}")
            else:
                cells.append(fmt([r[key] for r in runs], pattern, scale))
        print(f"{label:<30}" + "".join(f"{c:>{width}}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--debug-build", action="store_true", help="use the installed kvtier (no release build)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3, help="workload seeds per run (summed)")
    p.add_argument("--requests", type=int, default=320, help="requests per workload")
    p.add_argument("--gpu-blocks", type=int, default=64)
    p.add_argument("--cpu-chunks", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-steps", type=int, default=0, help="step bound per run (0: last arrival + 3000)")
    p.add_argument("--workloads", default="waves,chat", help="comma list of waves, chat")
    p.add_argument("--specs", default=",".join(SPECS))
    a = p.parse_args()
    specs = [s for s in a.specs.split(",") if s]
    kinds = [k for k in a.workloads.split(",") if k]
    for s in specs:
        if s not in SPECS:
            p.error(f"unknown spec {s!r} (one of {', '.join(SPECS)})")

    import vllm

    model_dir = harness.write_model_dir(os.path.join(SCRATCH, "model"))
    print(
        f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
        f"{a.requests} requests per workload x {a.seeds} seeds per run, {a.runs} runs; "
        f"device cache {a.gpu_blocks} blocks, CPU tier {a.cpu_chunks} chunks, "
        f"max_num_seqs {a.max_num_seqs}, max_num_batched_tokens {a.max_num_batched_tokens}, "
        f"block {harness.EngineShape().block_size} tokens, chunk {harness.chunk_bytes(harness.EngineShape())} B"
    )
    # results[kind][spec] = one pooled dict per run; pairs[kind] = (run, seed, kvtier, tiering)
    results = {k: {s: [] for s in specs} for k in kinds}
    pairs: dict = {k: [] for k in kinds}
    for run in range(a.runs):
        order = specs[run % len(specs):] + specs[: run % len(specs)]
        for kind in kinds:
            per_seed = {s: [] for s in specs}
            for seed in range(a.seeds):
                for s in order:
                    per_seed[s].append(measure(s, kind, 1000 * run + seed, a, model_dir))
                if "kvtier" in per_seed and "vllm-tiering" in per_seed:
                    pairs[kind].append((run, seed, per_seed["kvtier"][-1], per_seed["vllm-tiering"][-1]))
            for s in specs:
                results[kind][s].append(pooled(per_seed[s]))
            line = ", ".join(
                f"{s} {results[kind][s][-1]['us_per_step']:.0f} µs/step, {results[kind][s][-1]['stuck']} stuck"
                for s in specs
            )
            print(f"run {run + 1}/{a.runs} {kind}: {line}", flush=True)

    for kind in kinds:
        print()
        print(f"== workload {kind}: medians of {a.runs} runs [min–max], each run summed over {a.seeds} seeds ==")
        table(kind, results[kind], specs)

    print()
    print("== verdicts ==")
    for kind in kinds:
        r = results[kind]
        for other, name in (("vllm-cpu", "vLLM's CPUOffloadingSpec"), ("vllm-tiering", "vLLM's TieringOffloadingSpec")):
            if "kvtier" not in r or other not in r:
                continue
            ratios = [k["us_per_step"] / max(1e-9, o["us_per_step"]) for k, o in zip(r["kvtier"], r[other])]
            med = statistics.median(ratios)
            verdict = "MET" if med <= 1 / 3 else "NOT MET"
            print(
                f"VERDICT [{kind}] kvtier connector time per step <= 1/3 of {name}: {verdict} "
                f"(ratio {med:.2f} [{min(ratios):.2f}–{max(ratios):.2f}], target <= 0.33)"
            )
            floor = [o["us_connector_own"] / max(1e-9, o["us_per_step"]) for o in r[other]]
            inner = [(k["us_manager"] + k["us_lock"]) / max(1e-9, o["us_manager"] + o["us_lock"]) for k, o in zip(r["kvtier"], r[other])]
            print(
                f"  [{kind}] of {name}'s connector time, {statistics.median(floor):.0%} is vLLM's connector code itself "
                f"(common to every spec), so a manager costing nothing would still give a ratio of about "
                f"{statistics.median(floor):.2f}; manager + lock time alone, kvtier / {name}: "
                f"{statistics.median(inner):.2f} [{min(inner):.2f}–{max(inner):.2f}]"
            )
        if pairs[kind]:
            worse = [(run, seed, k["waited"], t["waited"]) for run, seed, k, t in pairs[kind] if k["waited"] > t["waited"]]
            hit_ratio = [k["connector_tokens"] / max(1, t["connector_tokens"]) for _, _, k, t in pairs[kind]]
            kw, kt = sum(k["waited"] for _, _, k, _ in pairs[kind]), sum(k["connector_tokens"] for _, _, k, _ in pairs[kind])
            tw, tt = sum(t["waited"] for _, _, _, t in pairs[kind]), sum(t["connector_tokens"] for _, _, _, t in pairs[kind])
            verdict = "MET" if not worse else "NOT MET"
            detail = (
                f"{len(pairs[kind])} paired runs (same workload, seed and run); kvtier waited {kw} steps for {kt} "
                f"connector tokens ({1000 * kw / max(1, kt):.1f} per 1k tokens), vLLM tiering {tw} steps for {tt} tokens "
                f"({1000 * tw / max(1, tt):.1f} per 1k); kvtier/vLLM hit tokens per pair "
                f"{statistics.median(hit_ratio):.2f} [{min(hit_ratio):.2f}–{max(hit_ratio):.2f}]"
            )
            if worse:
                detail += f"; kvtier waited more in (run, seed, kvtier, vLLM): {worse[:5]}"
            print(f"VERDICT [{kind}] kvtier never more waiting steps than vLLM's tiering spec for the same hits: {verdict} ({detail})")
            fewer = [(run, seed, k["connector_tokens"], t["connector_tokens"]) for run, seed, k, t in pairs[kind]
                     if k["connector_tokens"] < t["connector_tokens"]]
            if fewer:
                print(f"  [{kind}] kvtier served fewer connector tokens than vLLM's tiering in {len(fewer)} of "
                      f"{len(pairs[kind])} pairs (run, seed, kvtier, vLLM): {fewer[:5]}")
        for s in specs:
            stuck = sum(x["stuck"] for x in r[s])
            wrong = sum(x["wrong"] for x in r[s])
            if stuck or wrong:
                print(f"NOTE [{kind}] {TITLES[s]}: {stuck} requests stuck at the step bound, {wrong} wrong tokens over all runs")
    print()
    print(
        "What the ratios depend on: the connector time is the scheduler thread's time in the five calls: vLLM's\n"
        "connector code (the same for every spec: request state, store jobs, metadata) plus the spec's manager\n"
        "and its lock, split in the table; it\n"
        "scales with lookups per step (chunks per prompt x requests admitted per step: block size, prompt length,\n"
        "max_num_seqs) and with Python call overhead (vLLM's managers are Python; kvtier pays one FFI crossing per\n"
        "manager call and does the rest in Rust, its promotions, cascades and completions on its control thread,\n"
        "off the scheduler thread, whose CPU time is not counted here but shares the machine's cores). The\n"
        "waiting steps depend on how many scheduler steps a promotion spans: these steps run no model (a few ms\n"
        "each), so a disk read spans more steps here than under a real forward (tens of ms), which shrinks both\n"
        "sides' waits on a GPU; and on the CPU tier's size relative to the revisited prefixes (promotions that\n"
        "evict each other). Times also depend on the CPU, its other load, and the Python version."
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
