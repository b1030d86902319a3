"""No import circle among kda_dhu's modules: every `import` of one module by another,
at module level or inside a function, read from the source (the package's __init__,
which exposes the others lazily, aside). A circle makes the import order matter."""

from __future__ import annotations

import ast
from pathlib import Path

import kda_dhu

PACKAGE = Path(kda_dhu.__file__).parent


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph = {m: set() for m in mods}
    for m in mods:
        for node in ast.walk(ast.parse((PACKAGE / f"{m}.py").read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                elif node.module == "kda_dhu":
                    names = [a.name for a in node.names]
                elif node.module and node.module.startswith("kda_dhu."):
                    names = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("kda_dhu.")]
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph = _graph()
    assert "_dispatch" in graph and graph["_dispatch"], graph  # the reader sees the imports
    assert _circles(graph) == []


def test_the_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
