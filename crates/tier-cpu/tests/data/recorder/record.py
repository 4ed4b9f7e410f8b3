"""Records a hand-written op script through vLLM 0.33.0's manager: `record.py SCRIPT [OUT]`.

Writes the transcript (each op followed by `= <vLLM's output>`) to OUT, or prints it. Comment
lines (`# ...`) of the script are kept in the transcript. Refuses a script on which vLLM asserts.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402


def record(lines):
    text = []
    ops = [l for l in lines if l.strip() and not l.startswith("#")]
    out = []
    oracle.run(ops, out)
    if "assert" in out:
        raise SystemExit(f"vLLM asserted on op {ops[out.index('assert')]!r}")
    outputs = iter(out)
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("#"):
            text.append(line)
        else:
            text.append(line)
            text.append(f"= {next(outputs)}")
    return "\n".join(text) + "\n"


if __name__ == "__main__":
    result = record(open(sys.argv[1]).read().splitlines())
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(result)
    else:
        sys.stdout.write(result)
