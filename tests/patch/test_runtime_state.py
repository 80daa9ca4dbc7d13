"""The plugin's state lives in a `Runtime` (see `prism_serve.patch.runtime`): no module of the
plugin holds a mutable dict, list or set at module level, and each runtime owns its own counters."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import prism_serve.patch
from prism_serve.patch import ops, runtime
from prism_serve.patch.table import Buckets, Table

MUTABLE_CALLS = {"dict", "list", "set", "Counter", "defaultdict", "deque", "OrderedDict", "WeakValueDictionary",
                 "WeakKeyDictionary", "WeakSet", "bytearray"}
MUTABLE_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in MUTABLE_CALLS or (name == "fromkeys" and isinstance(f, ast.Attribute))
    return False


def test_no_module_level_mutable_state_in_the_plugin():
    found = []
    for path in sorted(Path(prism_serve.patch.__file__).parent.glob("*.py")):
        for stmt in ast.parse(path.read_text()).body:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if _mutable(value):
                found.append(f"{path.name}:{stmt.lineno}")
    assert not found, found


def test_each_runtime_counts_its_own_calls_and_the_ops_follow_the_current_one():
    x, w = torch.randn(3, 16), torch.rand(16)
    tab = Table("cpu")
    tab.ops["rms_norm"] = {(torch.float32, 16, 1e-6): Buckets()}  # a key without kernels: every call misses
    first = ops.open_runtime(tab)
    torch.ops.prism.rms_norm(x, w, 1e-6)
    second = ops.open_runtime(tab)  # closes the first
    assert runtime.current() is second and first.library is None
    torch.ops.prism.rms_norm(x, w, 1e-6)
    torch.ops.prism.rms_norm(x, w, 1e-6)
    assert (first.misses["rms_norm"], second.misses["rms_norm"]) == (1, 2)
    second.close()
    assert runtime.current() is None
