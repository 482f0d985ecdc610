#!/usr/bin/env python
"""The import depth of a package: the longest chain of imports between its own modules.

A module's depth is 1 for a module that imports nothing of the package, else 1 + the largest
depth among the package modules it imports. Every import counts: top-level, inside functions
(a lazy import is a dependency all the same) and, unless ``--exclude-type-checking``, under
``if TYPE_CHECKING``. A cycle (modules that import each other, directly or not) is reported and
counted as one level; ``lint-imports`` forbids them anyway.

The graph comes from grimp, the library under import-linter (the ``test`` extra), so this
measures what the import contracts in pyproject.toml see.

Usage::

    python scripts/import_depth.py manager            # depth, the longest chain, the deepest modules
    python scripts/import_depth.py varuna.runtime --top 5

Prints a table; exit 0. One line and exit 2 when the package cannot be imported or import-linter
is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def import_graph(package: str, *, exclude_type_checking: bool) -> dict[str, set[str]]:
    """``{module: modules of package it imports}`` for every module under ``package``."""
    import grimp

    root = package.split(".")[0]
    graph = grimp.build_graph(root, exclude_type_checking_imports=exclude_type_checking, cache_dir=None)
    inside = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    return {m: graph.find_modules_directly_imported_by(m) & inside for m in inside}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def depths(edges: dict[str, set[str]]) -> tuple[dict[str, int], dict[str, str | None], list[list[str]]]:
    """Per module: its depth and the next module on its longest chain; and the cycles found."""
    components = strongly_connected(edges)
    comp_of = {m: i for i, comp in enumerate(components) for m in comp}
    cycles = [c for c in components if len(c) > 1]

    @cache
    def comp_depth(i: int) -> tuple[int, str | None]:
        below = {comp_of[d] for m in components[i] for d in edges[m]} - {i}
        best = max(((comp_depth(j)[0], components[j][0]) for j in below), default=(0, None))
        return best[0] + 1, best[1]

    sys.setrecursionlimit(max(10_000, 4 * len(components)))
    depth = {m: comp_depth(comp_of[m])[0] for m in edges}
    nxt = {m: comp_depth(comp_of[m])[1] for m in edges}
    return depth, nxt, cycles


def longest_chain(depth: dict[str, int], nxt: dict[str, str | None]) -> list[str]:
    """The longest chain, from the deepest module down to a module that imports none."""
    if not depth:
        return []
    m: str | None = max(sorted(depth), key=lambda k: depth[k])
    chain = []
    while m is not None:
        chain.append(m)
        m = nxt[m]
    return chain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", help="a package, e.g. manager or varuna.runtime")
    parser.add_argument("--top", type=int, default=10, help="how many of the deepest modules to list")
    parser.add_argument("--exclude-type-checking", action="store_true",
                        help="leave out imports under `if TYPE_CHECKING:`")
    args = parser.parse_args(argv)
    try:
        edges = import_graph(args.package, exclude_type_checking=args.exclude_type_checking)
    except ImportError as exc:
        print(f"import_depth: {exc}; pip install -e '.[test]' (grimp comes with import-linter)",
              file=sys.stderr)
        return 2
    if not edges:
        print(f"import_depth: no modules under {args.package!r}; name an importable package", file=sys.stderr)
        return 2
    depth, nxt, cycles = depths(edges)
    chain = longest_chain(depth, nxt)
    print(f"package {args.package}: {len(edges)} modules, "
          f"{sum(len(v) for v in edges.values())} imports between them, depth {len(chain)}")
    print("\nlongest chain (each imports the next):")
    for level, m in enumerate(chain, start=1):
        print(f"  {level:>3}  {m}")
    print(f"\n{'depth':>5}  deepest modules")
    for m in sorted(depth, key=lambda k: (-depth[k], k))[: args.top]:
        print(f"{depth[m]:>5}  {m}")
    for cycle in cycles:
        print(f"cycle (counted as one level): {' <-> '.join(cycle)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
