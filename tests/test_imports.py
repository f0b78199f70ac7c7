"""The house has no import cycle: read from the source with ast, nothing imported.

Every module of the installed package (probes/ is `trainprobes`, reference/ is
`trainprobes.reference`, as pyproject's package-dir says) is parsed; each `import
trainprobes.x` and `from trainprobes.x import y` is an edge to trainprobes.x (and to
trainprobes.x.y when y is a submodule). Imports inside functions count too: a lazy import
hides a cycle from the interpreter, not from the design (distributed/probe.py and
worker.py imported each other that way). A cycle is a strongly connected component of
more than one module.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (("probes", "trainprobes"), ("reference", "trainprobes.reference"))

# Cycles tolerated for now, each with its reason; the last test fails when one is no
# longer real, so the list cannot go stale. None today.
KNOWN_CYCLES = []


@functools.lru_cache(maxsize=None)
def module_files() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                edges.add(node.module)
                edges |= {f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in files}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def a_path(graph: dict[str, set[str]], comp: set[str]) -> str:
    """One cycle through the component, as 'a -> b -> a', for the failure message."""
    start = min(comp)
    seen, path = {start}, [start]
    while True:
        nxt = sorted(graph[path[-1]] & comp)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return " -> ".join(path + [start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return " -> ".join(path + [nxt[0]])
        seen.add(fresh[0])
        path.append(fresh[0])


def test_every_module_is_found_under_its_import_name():
    files = module_files()
    for name in ("trainprobes", "trainprobes.validation", "trainprobes.reference.formats",
                 "trainprobes.distributed.worker", "trainprobes.reference.models.lm"):
        assert name in files, name
    assert "trainprobes.reference.formats" in house_graph()["trainprobes.reference.collectives"]


def test_the_cycle_finder_finds_lazy_and_package_cycles():
    graph = {"p": {"p.a"}, "p.a": {"p"}, "q": {"q.x"}, "q.x": {"q.y"}, "q.y": set(),
             "r.a": {"r.b"}, "r.b": {"r.c"}, "r.c": {"r.a"}}
    assert sorted(map(sorted, cycles(graph))) == [["p", "p.a"], ["r.a", "r.b", "r.c"]]
    assert a_path(graph, {"r.a", "r.b", "r.c"}) == "r.a -> r.b -> r.c -> r.a"


@functools.lru_cache(maxsize=None)
def house_graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_no_import_cycle_in_the_house():
    graph = house_graph()
    found = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(a_path(graph, c) for c in found)


def test_known_cycles_are_still_real():
    found = cycles(house_graph())
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"remove from KNOWN_CYCLES, no longer a cycle: {stale}"
