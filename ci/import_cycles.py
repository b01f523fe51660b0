"""Import cycles between this repository's modules, counting every import statement (module level and inside
functions alike: an import deferred into a function to dodge a cycle is still a cycle in the design).

    python ci/import_cycles.py [PACKAGE ...]     # default: conformance reference_impl fixtures ci benchmarks

Prints each cycle (a strongly connected component of the module graph, as one shortest loop through it) and
exits 1 if there is any. ``from package import name`` counts as importing ``package.name`` when that is a
module, else ``package`` (its ``__init__``); the implicit import of a module's parent packages is not counted
(only what the code names), so ``pkg/__init__`` importing ``pkg.a`` is a cycle only if ``pkg.a`` names ``pkg``.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGES = ("conformance", "reference_impl", "fixtures", "ci", "benchmarks")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts}


def _resolve(mod: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_package else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The repository modules ``mod`` imports (any import statement anywhere in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, path.name == "__init__.py", node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a function-less path: its nearest module
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def graph(root: Path = REPO, packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict[str, set[str]]:
    known = discover(root, packages)
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One shortest loop through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
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
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return [_shortest_loop(g, set(c), c[0]) for c in sorted(comps)]


def _shortest_loop(g: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    prev = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(g[v] & comp):
            if w == start:
                loop = [v]
                while prev[loop[-1]] is not None:
                    loop.append(prev[loop[-1]])
                return [start, *reversed(loop[:-1]), start] if len(loop) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="*", default=list(DEFAULT_PACKAGES))
    args = ap.parse_args(argv)
    found = cycles(graph(REPO, tuple(args.packages)))
    for loop in found:
        print("import cycle: " + " -> ".join(loop))
    print(f"{len(found)} import cycle(s) among {len(graph(REPO, tuple(args.packages)))} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
