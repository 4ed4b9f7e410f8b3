#!/usr/bin/env python3
"""Structure check of the workspace: file circles and circles between subsystems.

For every crate (each `Cargo.toml` with a `src/lib.rs` or `src/main.rs`), this builds the graph of
its source files: an edge A -> B when A names an item that is defined in B (through `use crate::`,
`use super::`, `use self::` or a `crate::`/`super::` path in code), with imports followed to the
file that defines the item, so a name re-exported by a parent module points at the child that
defines it. A module's `pub use` of its own descendants is its facade, not a dependency, and a
`mod x;` declaration is not an edge. Test-only modules (`#[cfg(test)] mod ...;`) are left out:
a test reaching into the module it tests is not an architectural dependency.

Reported, and a non-zero exit when any exists:
- file circles: strongly connected sets of two or more files;
- upward imports: circles between a crate's subsystems (the first path segment under the crate
  root, e.g. `manager`, `channel`), i.e. a lower subsystem reaching back into one that uses it.

It reads the source as text (no compiler), which is enough for rustfmt-formatted code: items are
found at column 0, `use` trees are expanded, and macros that build paths are not followed.

Usage: scripts/structure-check.py [--verbose] [crate dir ...]
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ITEM_RE = re.compile(
    r"^(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|const\s+|async\s+|extern\s+\"C\"\s+)*"
    r"(struct|enum|trait|fn|type|const|static|union|mod)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MACRO_RE = re.compile(r"^macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)")
MOD_DECL_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")
PATH_ATTR_RE = re.compile(r'#\[path\s*=\s*"([^"]+)"\]')
CODE_PATH_RE = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


@dataclass
class Module:
    """One source file's module."""

    path: tuple[str, ...]
    file: Path
    children: dict[str, tuple[str, ...]] = field(default_factory=dict)
    items: set[str] = field(default_factory=set)
    # name -> (absolute target path, is_pub); "*" entries are globs.
    imports: dict[str, tuple[tuple[str, ...], bool]] = field(default_factory=dict)
    globs: list[tuple[str, ...]] = field(default_factory=list)
    # every path the file names, absolute, with whether it came from a `pub use`
    refs: list[tuple[tuple[str, ...], bool]] = field(default_factory=list)


def strip_comments(text: str) -> str:
    """Removes comments and string literals' contents (keeping line structure)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(?:\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(?:\\.|[^\\'])'", text[i:])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree: str) -> list[tuple[list[str], str | None]]:
    """`a::{b, c::d@e, f::*}` -> [(path segments, None)]; `@` marks an alias, split by the caller."""
    tree = re.sub(r"\s+", "", tree)
    results: list[tuple[list[str], str | None]] = []

    def split_top(s: str) -> list[str]:
        parts, depth, cur = [], 0, []
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append("".join(cur))
                cur = []
            else:
                cur.append(ch)
        if cur:
            parts.append("".join(cur))
        return [p for p in parts if p]

    def walk(prefix: list[str], s: str) -> None:
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = s[:brace].rstrip(":")
            segs = prefix + [x for x in head.split("::") if x]
            for part in split_top(s[brace + 1:-1]):
                walk(segs, part)
            return
        results.append((prefix + [x for x in s.split("::") if x], None))

    walk([], tree)
    return results


def parse_use_statements(text: str) -> list[tuple[bool, list[tuple[list[str], str | None]]]]:
    """Every `use` at column 0: (is_pub, expanded tree)."""
    uses = []
    for m in re.finditer(r"^(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text, re.M):
        raw = m.group(2)
        raw = re.sub(r"\s+as\s+", "@", raw)
        items = []
        for segs, _ in expand_use_tree(raw):
            alias = None
            if segs and "@" in segs[-1]:
                last, alias = segs[-1].split("@", 1)
                segs = segs[:-1] + [last]
            items.append((segs, alias))
        uses.append((m.group(1) is not None and m.group(1).strip() == "pub", items))
    return uses


def drop_inline_test_modules(text: str) -> str:
    """Blanks `#[cfg(test)] mod x { ... }` blocks (rustfmt closes them with `}` at column 0)."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if re.match(r"#\[cfg\((?:test|all\(test|any\(test)", lines[i]):
            j = i + 1
            while j < len(lines) and lines[j].startswith("#["):
                j += 1
            if j < len(lines) and re.match(r"(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", lines[j]):
                k = j
                while k < len(lines) and lines[k] != "}":
                    k += 1
                out.extend("" for _ in range(i, k + 1))
                i = k + 1
                continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def test_only_mods(text: str) -> set[str]:
    """Names of `mod x;` declarations under `#[cfg(test)]` (or another test-only cfg)."""
    names = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = MOD_DECL_RE.match(line)
        if not m:
            continue
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#["):
            if re.search(r"#\[cfg\((?:test|all\(test|any\(test)", lines[j]):
                names.add(m.group(1))
            j -= 1
    return names


class Crate:
    """A crate's module tree and its file graph."""

    def __init__(self, root_file: Path):
        self.root_file = root_file
        self.modules: dict[tuple[str, ...], Module] = {}
        self.load((), root_file)

    def load(self, path: tuple[str, ...], file: Path) -> None:
        raw = file.read_text()
        text = drop_inline_test_modules(strip_comments(raw))
        module = Module(path, file)
        self.modules[path] = module
        skip = test_only_mods(text)
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = MOD_DECL_RE.match(line)
            if not m or line.startswith(" "):
                continue
            name = m.group(1)
            if name in skip:
                continue
            attr = PATH_ATTR_RE.search(lines[i - 1]) if i else None
            child_file = self.child_file(file, name, attr.group(1) if attr else None)
            if child_file is None:
                continue
            module.children[name] = path + (name,)
            self.load(path + (name,), child_file)
        for line in lines:
            m = ITEM_RE.match(line)
            if m and m.group(1) != "mod":
                module.items.add(m.group(2))
            m = MACRO_RE.match(line)
            if m:
                module.items.add(m.group(1))
        module._text = text  # type: ignore[attr-defined]

    @staticmethod
    def child_file(parent: Path, name: str, explicit: str | None) -> Path | None:
        if explicit:
            p = (parent.parent / explicit).resolve()
            return p if p.exists() else None
        owns_dir = parent.name in ("mod.rs", "lib.rs", "main.rs")
        base = parent.parent if owns_dir else parent.parent / parent.stem
        for cand in (base / f"{name}.rs", base / name / "mod.rs"):
            if cand.exists():
                return cand
        return None

    def absolute(self, here: tuple[str, ...], segs: list[str]) -> tuple[str, ...] | None:
        """A path as written in module `here`, made absolute; None for other crates."""
        if not segs:
            return None
        cur = list(here)
        first = segs[0]
        rest = segs
        if first == "crate":
            cur, rest = [], segs[1:]
        elif first in ("super", "self"):
            while rest and rest[0] in ("super", "self"):
                if rest[0] == "super":
                    if not cur:
                        return None
                    cur.pop()
                rest = rest[1:]
        else:
            # `use foo::bar` where foo is a child module of `here` or a local import
            module = self.modules.get(here)
            if module is not None and first in module.children:
                return tuple(cur) + tuple(segs)
            return None
        return tuple(cur) + tuple(rest)

    def collect(self) -> None:
        for module in self.modules.values():
            text = module._text  # type: ignore[attr-defined]
            for is_pub, items in parse_use_statements(text):
                for segs, alias in items:
                    target = self.absolute(module.path, segs)
                    if target is None:
                        continue
                    if target[-1] == "*":
                        module.globs.append(target[:-1])
                        module.refs.append((target[:-1], is_pub))
                        continue
                    name = alias or target[-1]
                    if name == "self":
                        name, target = target[-2], target[:-1]
                    module.imports[name] = (target, is_pub)
                    module.refs.append((target, is_pub))
            for line in text.splitlines():
                if re.match(r"^(pub(\([^)]*\))?\s+)?use\s", line.strip()):
                    continue
                for m in CODE_PATH_RE.finditer(line):
                    target = self.absolute(module.path, m.group(1).split("::"))
                    if target is not None:
                        module.refs.append((target, False))

    def defining_file(self, target: tuple[str, ...], seen: set | None = None) -> Path | None:
        """The file that defines what `target` names (a module's own file when it names a module)."""
        seen = seen or set()
        if target in seen:
            return None
        seen.add(target)
        # walk down modules as far as the path goes
        i = 0
        cur: tuple[str, ...] = ()
        while i < len(target) and target[i] in self.modules.get(cur, Module((), Path())).children:
            cur = cur + (target[i],)
            i += 1
        module = self.modules.get(cur)
        if module is None:
            return None
        if i == len(target):
            return module.file
        name = target[i]
        if name in module.items:
            return module.file
        if name in module.imports:
            dest, _ = module.imports[name]
            found = self.defining_file(dest + target[i + 1:], seen)
            return found
        for glob in module.globs:
            found = self.defining_file(glob + target[i:], seen)
            if found is not None:
                return found
        return module.file

    def edges(self) -> dict[Path, set[Path]]:
        graph: dict[Path, set[Path]] = {m.file: set() for m in self.modules.values()}
        self.why: dict[tuple[Path, Path], str] = {}
        for module in self.modules.values():
            for target, is_pub in module.refs:
                if is_pub and target[: len(module.path)] == module.path and len(target) > len(module.path):
                    continue  # the module's facade over its own descendants
                dest = self.defining_file(target)
                if dest is not None and dest != module.file:
                    graph[module.file].add(dest)
                    self.why.setdefault((module.file, dest), "::".join(target))
        return graph

    def subsystem(self, file: Path) -> str:
        for module in self.modules.values():
            if module.file == file:
                return module.path[0] if module.path else "<root>"
        return "?"


def sccs(graph: dict) -> list[list]:
    """Tarjan's strongly connected components."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out: list[list] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def crate_roots(args: list[str]) -> list[Path]:
    dirs = [ROOT / a for a in args] if args else [
        p.parent for p in sorted(ROOT.glob("**/Cargo.toml")) if "target" not in p.parts and ".venv" not in str(p)
    ]
    roots = []
    for d in dirs:
        for name in ("src/lib.rs", "src/main.rs"):
            if (d / name).exists():
                roots.append(d / name)
    return roots


def main() -> int:
    verbose = "--verbose" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--verbose"]
    problems = 0
    for root in crate_roots(args):
        crate = Crate(root)
        crate.collect()
        graph = crate.edges()
        rel = lambda p: str(p.relative_to(ROOT))  # noqa: E731
        circles = [c for c in sccs(graph) if len(c) > 1]
        sub_graph: dict[str, set[str]] = {}
        witnesses: dict[tuple[str, str], tuple[Path, Path]] = {}
        for a, dests in graph.items():
            sa = crate.subsystem(a)
            for b in dests:
                sb = crate.subsystem(b)
                if sa != sb and "<root>" not in (sa, sb):
                    sub_graph.setdefault(sa, set()).add(sb)
                    witnesses.setdefault((sa, sb), (a, b))
        upward = [c for c in sccs(sub_graph) if len(c) > 1]
        name = rel(root.parent.parent) or "."
        print(f"{name}: {len(graph)} files, {len(circles)} file circle(s), {len(upward)} subsystem circle(s)")
        for c in circles:
            problems += 1
            print("  file circle: " + " <-> ".join(sorted(rel(p) for p in c)))
            if verbose:
                members = set(c)
                for a in sorted(c):
                    for b in sorted(graph[a] & members):
                        print(f"    {rel(a)} -> {rel(b)} (names crate::{crate.why[(a, b)]})")
        for c in upward:
            problems += 1
            print("  subsystem circle: " + " <-> ".join(sorted(c)))
            members = set(c)
            for sa in sorted(c):
                for sb in sorted(sub_graph.get(sa, set()) & members):
                    a, b = witnesses[(sa, sb)]
                    print(f"    {sa} -> {sb} (e.g. {rel(a)} -> {rel(b)})")
    print(f"total: {problems} circle(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
