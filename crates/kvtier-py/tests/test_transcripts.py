"""Replays the transcripts recorded from vLLM 0.33.0's CPUOffloadingManager (the data the Rust
test `tier-cpu/tests/vllm033_transcripts.rs` replays against the CPU tier) through the binding:
a manager over a CPU-only chain, driven with keys as bytes, must give op-for-op the same answers.

Two op kinds have no counterpart on the engine-facing manager: `order` (the policy's internal
list order, observable only on the tier itself) is skipped, and `read` (`prepare_read`, the pin
the manager takes internally for cascades) cannot be issued by an engine, so a transcript is
replayed up to its first `read` (its remaining ops depend on that pin)."""

import pathlib

import pytest

import kvtier
from conftest import cpu_manager, key, num

DATA = pathlib.Path(__file__).resolve().parents[2] / "tier-cpu" / "tests" / "data" / "vllm033"
FILES = sorted(DATA.glob("*.txt"))
NAMES = {
    kvtier.LookupResult.HIT: "HIT",
    kvtier.LookupResult.HIT_PENDING: "HIT_PENDING",
    kvtier.LookupResult.MISS: "MISS",
    kvtier.LookupResult.RETRY: "RETRY",
}


def parse_key(tok):
    n, _, g = tok.partition("g")
    return key(int(n), int(g) if g else 0)


def name(k):
    _, g = kvtier.split_offload_key(k)
    return str(num(k)) if g == 0 else f"{num(k)}g{g}"


def join(ks):
    return " ".join(name(k) for k in ks)


class Replay:
    """Interprets the transcript op language on a manager (see tests/data/README.md of tier-cpu)."""

    def __init__(self):
        self.manager = None
        self.step = None
        self.ctxs = {}
        # id -> context; holding the contexts keeps their ids from being reused.
        self.announced = {}

    def close(self):
        if self.step is not None:
            self.step.release()
        if self.manager is not None:
            self.manager.shutdown()

    def ctx(self, r):
        if r not in self.ctxs:
            self.ctxs[r] = kvtier.ReqContext(r)
        c = self.ctxs[r]
        if id(c) not in self.announced:
            self.step.on_new_request(c)
            self.announced[id(c)] = c
        return c

    def run(self, line):
        t = line.split()
        op, args = t[0], t[1:]
        ks = lambda i: [parse_key(x) for x in args[i:]]  # noqa: E731
        s = self.step
        if op == "new":
            self.close()
            self.manager = cpu_manager(int(args[0]), args[1])
            self.step = self.manager.step()
            self.ctxs, self.announced = {}, {}
            return "ok"
        if op == "newctx":
            self.ctxs[args[0]] = kvtier.ReqContext(args[0])
            return "ok"
        if op == "pos":
            self.ctxs.setdefault(args[0], kvtier.ReqContext(args[0]))
            self.ctxs[args[0]].set_offload_key_position(parse_key(args[1]), int(args[2]))
            return "ok"
        if op == "lookup":
            return NAMES[s.lookup(parse_key(args[1]), self.ctx(args[0]))]
        if op == "load":
            return "chunks " + " ".join(map(str, s.prepare_load(ks(1), self.ctx(args[0]))))
        if op == "cload":
            s.complete_load(ks(1), self.ctx(args[0]))
            return "ok"
        if op == "touch":
            s.touch(ks(1), self.ctx(args[0]))
            return "ok"
        if op == "store":
            out = s.prepare_store(ks(1), self.ctx(args[0]))
            if out is None:
                return "none"
            return "keys {} | chunks {} | evicted {}".format(
                join(out.keys_to_store), " ".join(map(str, out.chunk_ids)), join(out.evicted)
            )
        if op == "cstore":
            s.complete_store(ks(2), self.ctx(args[0]), args[1] == "1")
            return "ok"
        if op == "finish":
            s.on_request_finished(self.ctx(args[0]))
            return "ok"
        if op == "events":
            parts = [
                "{}{} {}".format("-" if e.removed else "+", "m" if e.metadata_only else "", join(e.keys))
                for e in s.take_events()
            ]
            return "events " + " ; ".join(parts)
        if op == "reset":
            s.release()
            self.manager.reset_cache()
            self.step = self.manager.step()
            return "ok"
        raise AssertionError(f"unknown op {op!r}")


def replay(path):
    """Replays `path`; returns (ops compared, ops left after the first `read`)."""
    lines = [l for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]
    pairs = list(zip(lines[0::2], lines[1::2]))
    r = Replay()
    compared = 0
    history = []
    try:
        for i, (op, expected) in enumerate(pairs):
            assert expected.startswith("= "), f"{path.name}: {op!r} has no expected line"
            kind = op.split()[0]
            if kind == "order":
                continue
            if kind == "read":
                return compared, len(pairs) - i
            got = r.run(op)
            history.append(f"{op}  => {got}")
            if got.rstrip() != expected[2:].rstrip():
                recent = "\n    ".join(history[-12:])
                pytest.fail(
                    f"{path.name}: op #{i + 1} {op!r}\n  expected: {expected[2:]}\n  got:      {got}\n"
                    f"  recent ops:\n    {recent}"
                )
            compared += 1
        return compared, 0
    finally:
        r.close()


def test_transcripts_are_present():
    assert len(FILES) >= 10, f"transcripts missing from {DATA}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_transcript_replays_identically_through_the_binding(path):
    compared, _ = replay(path)
    assert compared > 0


def test_replay_covers_most_of_the_recorded_ops():
    compared = left = 0
    for p in FILES:
        c, l = replay(p)
        compared += c
        left += l
    # Figures of the committed set; a drop means transcripts were cut short unexpectedly.
    assert compared >= 1000, (compared, left)
