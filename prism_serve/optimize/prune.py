"""The pruning rules of the search, as predicates over sGraphs.

Each returns None when the sGraph passes, or the reason it is pruned. They are
sound in the sense the tests check: every hand-built design passes all of them.
Search applies the cheap ones to every candidate and `abstract_expression` lazily.
"""

from __future__ import annotations

from prism_serve.errors import SGraphError
from prism_serve.optimize.gpus import GpuSpec
from prism_serve.optimize.ir import Program
from prism_serve.optimize.labels import Labels
from prism_serve.optimize.reference import expand_composites
from prism_serve.optimize.sgraph import TOKENS, BlockKernel, SGraph, instantiate, to_expr
from prism_serve.optimize.tune import finest_assignment
from prism_serve.optimize.verify import check_subterms


def label_order(prog: Program, labels: Labels) -> list[str]:
    """Labels in order of first appearance: the canonical order of grid axes."""
    order: list[str] = []
    for n in prog.nodes:
        for lb in labels.dims.get(n.name, ()):
            if lb and lb not in order:
                order.append(lb)
    return order


def canonical(g: SGraph, labels: Labels) -> str | None:
    """Grid axes partition distinct labels in canonical order (a split axis, which partitions a
    reduced label, comes last), so one order is built per set of labels."""
    order = label_order(expand_composites(g.program), labels)
    for k in g.kernels:
        if not isinstance(k, BlockKernel):
            continue
        axes = []
        for a, axis in enumerate(k.grid):
            dims = {labels.dims[n.attr("tensor")][m[a]] for n in k.loads + k.stores
                    if n.attr("tensor") in labels.dims and (m := n.attr("imap" if n.op == "load" else "omap"))[a]
                    is not None}
            axes.append(next(iter(dims)) if len(dims) == 1 else None)
        known = [lb for lb in axes if lb in order]
        parallel = [lb for lb in known if not _reduced_in(g, labels, lb)]
        if parallel != sorted(parallel, key=order.index) or len(set(known)) != len(known):
            return f"kernel '{k.name}': grid labels {axes} are not in canonical order {order}"
    return None


def _reduced_in(g: SGraph, labels: Labels, label: str) -> bool:
    return any(label in labels.reduced.get(n.name, ()) for n in expand_composites(g.program).nodes)


def shape(g: SGraph) -> str | None:
    """Symbolic shapes (sympy): every tile is bounded (no num_tokens in a tile dim), and a block
    matmul's batch dims can be 1 (each is 1 or divided by a grid symbol)."""
    for k in g.kernels:
        if not isinstance(k, BlockKernel):
            continue
        types = g.block_types(k)
        for n in k.nodes:
            if n.op != "store" and any(TOKENS in to_expr(d).free_symbols for d in types[n.name].shape):
                return f"kernel '{k.name}' node '{n.name}': tile {types[n.name].shape} holds every token"
            if n.op == "matmul":
                for s in n.inputs:
                    for d in types[s].shape[:-2]:
                        if d != 1 and not any(str(x) in {a.symbol for a in k.grid} for x in to_expr(d).free_symbols):
                            return f"kernel '{k.name}' matmul '{n.name}': batch dim {d} cannot be 1"
    return None


def hardware(g: SGraph, gpu: GpuSpec) -> str | None:
    """The finest tiles fit `gpu` (resources only grow from there)."""
    try:
        instantiate(g, finest_assignment(g), gpu)
    except SGraphError as exc:
        return str(exc)
    return None


def abstract_expression(g: SGraph) -> str | None:
    """Every accumulator and intermediate is a subexpression of the target (egglog, cached)."""
    result = check_subterms(g)
    return None if result.ok else f"not subexpressions of the target: {', '.join(result.failed)}"
