"""What every generator step reads: the expanded Program, its labels, the abstract expressions of
its inputs, constants and outputs, and the oracle that answers subexpression queries."""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.optimize.generate.abstract import Oracle, Term
from prism_serve.optimize.generate.block import Value, new_terms
from prism_serve.optimize.generate.design import program_context
from prism_serve.optimize.generate.windows import Indexing, indexing, program_terms, sliced_labels, term_nodes
from prism_serve.optimize.ir.program import Program, TensorType


@dataclass
class Context:
    prog: Program
    flat: Program
    inputs: dict[str, Value]  # keyed by "@name"
    consts: dict[str, Value]  # keyed by "#name"
    outputs: dict[str, TensorType]
    targets: dict[str, Term]
    labels: tuple[str, ...]  # every index label, in order of first appearance
    oracle: Oracle
    indexing: Indexing  # the Program's slices, gathers and concats, by the labels they read


def make_context(prog: Program) -> Context:
    """A search's generation context (its interned terms start afresh: `block.new_terms`)."""
    new_terms()
    flat, labels, tensors, consts = program_context(prog)
    terms = program_terms(flat, labels)
    inputs = {f"@{n}": Value(f"@{n}", t.type, t.labels, terms[n]) for n, t in tensors.items()}
    const_values = {f"#{c}": Value(f"#{c}", TensorType((), "const"), (), terms.get(c, ("const", c))) for c in consts}
    var_labels = {n: frozenset(lb for lb in t.labels if lb) for n, t in tensors.items()} | sliced_labels(flat, labels)
    targets = {o: terms[o] for o in flat.outputs}
    order: list[str] = []
    for n in flat.nodes:
        for lb in labels.dims.get(n.name, ()):
            if lb and lb not in order:
                order.append(lb)
    nodes = term_nodes(flat, labels)
    oracle = Oracle(targets, var_labels, tuple(consts), nodes)
    return Context(prog, flat, inputs, const_values, {o: flat.types[o] for o in flat.outputs}, targets,
                   tuple(order), oracle, indexing(flat, labels))
