"""Each IR op has one definition, its entry in the op registry: outside the registry and the
workloads, at most one other module (the region table, whose forms name an activation) spells an
op's name as a string; every other module names it through `Op` or iterates the registry. (Region
kinds are held to the region table alone by tests/test_region_table.py.)"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import prism_serve
from prism_serve.optimize.ir.ops import OPS
from prism_serve.region_table import VLLM_OPS

ROOT = Path(prism_serve.__file__).parent
WORKLOADS = ROOT / "optimize" / "workloads"
MAX_MODULES = 2  # the registry and one other


def _string_literals() -> dict[str, set[str]]:
    """Each string constant of prism_serve/ (outside optimize/workloads/) -> the modules holding it."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        if WORKLOADS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                where[node.value].add(str(path.relative_to(ROOT)))
    return where


LITERALS = _string_literals()
# names that are also vLLM's own ops are spelled wherever vLLM's op is matched or called
OWN_NAMES = sorted(set(OPS) - {"input", "const"} - set(VLLM_OPS))


@pytest.mark.parametrize("name", OWN_NAMES)
def test_an_op_is_named_in_at_most_two_modules(name):
    modules = sorted(LITERALS.get(name, ()))
    assert len(modules) <= MAX_MODULES, f"op {name!r} is spelled in {modules}"


def test_the_scan_sees_the_registry():
    assert all("optimize/ir/ops.py" in LITERALS[name] for name in OWN_NAMES)
