"""The import graph of prism_serve: no circle, and optimize/'s stages import one way.

Every import counts, at module level or inside a function, relative ones resolved; importing
`a.b.c` also runs the package `a.b`'s `__init__`, so it depends on that too, unless the importer
lies in `a.b` itself (Python ran, or is running, that `__init__` before the importer: the edge
orders nothing). Package `__init__`s of optimize/ import nothing, so no stage depends on another
through one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import prism_serve

ROOT = Path(prism_serve.__file__).parent
# optimize/'s packages, lowest first: each may import only itself and those before it
STAGES = ("ir", "target", "codegen", "instantiate", "verify", "generate", "pipeline")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("prism_serve",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict) -> list[str]:
    """The prism_serve modules an import statement names (a `from m import x` names m.x where x is
    a module, else m)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def _packages(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, path, node, mods):
                while target and target not in mods:  # an attribute of a module: the module
                    target = target.rpartition(".")[0]
                own = _packages(name)
                while target:  # the module and every package above it (their __init__ runs)
                    if target in mods and target != name and target not in own:
                        graph[name].add(target)
                    target = target.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _show(graph: dict[str, set[str]], component: list[str]) -> str:
    return "\n".join(f"  {m} -> {sorted(graph[m] & set(component))}" for m in component)


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n\n".join(_show(graph, c) for c in found)


def test_the_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    # warmup imports the search driver inside a function; every optimize module runs optimize's __init__
    assert "prism_serve.optimize.pipeline.search" in graph["prism_serve.warmup"]
    assert "prism_serve.optimize" in graph["prism_serve.baseline"]
    optimize = "prism_serve.optimize"
    instance = graph[f"{optimize}.target.instance"]
    assert {f"{optimize}.ir", f"{optimize}.ir.sgraph"} <= instance  # the package above the module too
    assert optimize not in instance  # its own package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["prism_serve", "optimize"] or len(parts) < 3 or parts[2] not in STAGES:
        return None
    return STAGES.index(parts[2])


def test_optimize_stages_import_one_way():
    wrong = []
    for module, targets in import_graph().items():
        stage = _stage(module)
        if stage is None:
            continue
        for target in sorted(targets):
            if target == "prism_serve.optimize.workloads" or target.startswith("prism_serve.optimize.workloads."):
                wrong.append(f"{module} -> {target} (workloads are data above every stage)")
            elif target.startswith("prism_serve.optimize.") and _stage(target) is None:
                wrong.append(f"{module} -> {target} (not a stage)")
            elif _stage(target) is not None and _stage(target) > stage:
                wrong.append(f"{module} -> {target} ({STAGES[_stage(target)]} is above {STAGES[stage]})")
            elif not target.startswith("prism_serve.optimize") and target not in ("prism_serve", "prism_serve.errors",
                                                                                  "prism_serve.paths"):
                wrong.append(f"{module} -> {target} (outside the superoptimizer)")
    assert not wrong, "\n".join(wrong)


def test_optimize_package_inits_import_nothing():
    for path in (ROOT / "optimize").rglob("__init__.py"):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], path
