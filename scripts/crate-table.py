#!/usr/bin/env python3
"""Size and dependencies of every crate of the workspace, without its tests.

For each crate, the source files reachable from `src/lib.rs` (or `src/main.rs`) through `mod`
declarations, leaving out test-only modules (`#[cfg(test)] mod x;`, `#[cfg(any(test, ...))]`,
inline `#[cfg(test)] mod tests { ... }` blocks), `tests/`, `benches/` and `examples/`. Three
counts: all lines, non-blank lines, and code lines (non-blank, not a comment). The dependencies
are the crate's normal (non-dev) dependencies from `Cargo.toml`, optional ones marked `?`.

Usage: scripts/crate-table.py   (prints a Markdown table)
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("structure_check", ROOT / "scripts" / "structure-check.py")
structure_check = importlib.util.module_from_spec(_spec)
sys.modules["structure_check"] = structure_check
_spec.loader.exec_module(structure_check)

TEST_CFG = re.compile(r"#\[cfg\((?:test|all\(test|any\(test)")


def module_file(parent: Path, name: str) -> Path | None:
    base = parent.parent if parent.name in ("lib.rs", "main.rs", "mod.rs") else parent.with_suffix("")
    for candidate in (base / f"{name}.rs", base / name / "mod.rs"):
        if candidate.exists():
            return candidate
    return None


def count(file: Path, totals: list[int]) -> None:
    raw = file.read_text()
    text = structure_check.drop_inline_test_modules(raw)
    lines = [line for line in text.splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    # Blanked test blocks are not lines of the crate.
    kept = [line for line, orig in zip(lines, raw.splitlines()) if line or not orig.strip()]
    totals[0] += len(kept)
    totals[1] += sum(1 for line in kept if line.strip())
    totals[2] += sum(1 for line in kept if line.strip() and not line.strip().startswith("//"))
    raw_lines = raw.splitlines()
    for i, line in enumerate(raw_lines):
        m = structure_check.MOD_DECL_RE.match(line)
        if not m:
            continue
        j, test_only = i - 1, False
        while j >= 0 and raw_lines[j].strip().startswith("#["):
            test_only |= bool(TEST_CFG.search(raw_lines[j]))
            j -= 1
        if test_only:
            continue
        child = module_file(file, m.group(1))
        if child is not None:
            count(child, totals)


def main() -> None:
    manifest = tomllib.loads((ROOT / "Cargo.toml").read_text())
    print("| crate | lines | non-blank | code | dependencies |")
    print("| --- | ---: | ---: | ---: | --- |")
    for member in manifest["workspace"]["members"]:
        crate_dir = ROOT / member
        cargo = tomllib.loads((crate_dir / "Cargo.toml").read_text())
        root = next((crate_dir / "src" / f for f in ("lib.rs", "main.rs") if (crate_dir / "src" / f).exists()), None)
        if root is None:
            continue
        totals = [0, 0, 0]
        count(root, totals)
        deps = []
        for name, spec in sorted(cargo.get("dependencies", {}).items()):
            optional = isinstance(spec, dict) and spec.get("optional", False)
            deps.append(f"{name}{'?' if optional else ''}")
        name = cargo["package"]["name"]
        print(f"| `{name}` | {totals[0]} | {totals[1]} | {totals[2]} | {', '.join(deps)} |")


if __name__ == "__main__":
    main()
