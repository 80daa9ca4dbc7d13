"""The sGraph-level pruning rules of the search, as predicates over a built design.

Each returns None when the sGraph passes, or the reason it is pruned. They are sound in the
sense the tests check: every hand-built design passes them. (The generator's per-tensor rules,
abstract expressions among them, are in `generate/block.py`.)
"""

from __future__ import annotations

from prism_serve.errors import SGraphError
from prism_serve.optimize.instantiate.tune import finest_assignment
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel, SGraph, to_expr
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.target.instance import instantiate


def shape(g: SGraph) -> str | None:
    """Symbolic shapes (sympy): every tile is bounded (no num_tokens in a tile dim), and a block
    matmul's batch dims can be 1 (each is 1 or divided by a grid symbol or the loop's: a loop over
    MoE's top-k choices, one choice per step)."""
    for k in g.kernels:
        if not isinstance(k, BlockKernel):
            continue
        types = g.block_types(k)
        for n in k.nodes:
            if n.op != "store" and any(TOKENS in to_expr(d).free_symbols for d in types[n.name].shape):
                return f"kernel '{k.name}' node '{n.name}': tile {types[n.name].shape} holds every token"
            if n.op == Op.MATMUL:
                for s in n.inputs:
                    for d in types[s].shape[:-2]:
                        splits = {a.symbol for a in k.grid} | ({k.forloop} if k.forloop else set())
                        if d != 1 and not any(str(x) in splits for x in to_expr(d).free_symbols):
                            return f"kernel '{k.name}' matmul '{n.name}': batch dim {d} cannot be 1"
    return None


def hardware(g: SGraph, gpu: GpuSpec) -> str | None:
    """The finest tiles fit `gpu` (resources only grow from there)."""
    try:
        instantiate(g, finest_assignment(g), gpu)
    except SGraphError as exc:
        return str(exc)
    return None
