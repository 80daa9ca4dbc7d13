"""Index labels: which dims of a Program's tensors are the same loop index.

Every dim of every tensor gets a label (or None for a size-1, broadcast dim), as
in einsum notation: elementwise ops and matmul operands unify the labels of the
dims they align. A label is named after the first input dim it reaches (`x1`
is dim 1 of input `x`), so labels do not depend on the sizes, and the
``num_tokens`` dim is always the label ``num_tokens``. Search uses labels to
map a grid axis or a for-loop onto every tensor of a kernel consistently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, NUM_TOKENS, REDUCTIONS, Program

Label = str | None


@dataclass(frozen=True)
class Labels:
    """Per tensor, a label per dim; per node, the labels it reduces over."""

    dims: dict[str, tuple[Label, ...]]
    reduced: dict[str, tuple[str, ...]]

    def dim_of(self, tensor: str, label: str) -> int | None:
        """The dim of `tensor` carrying `label`, or None."""
        labels = self.dims[tensor]
        return labels.index(label) if label in labels else None


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.order: dict[str, int] = {}

    def add(self, x: str) -> str:
        if x not in self.parent:
            self.parent[x], self.order[x] = x, len(self.order)
        return x

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        # num_tokens always names its class; otherwise the older label does
        keep = ra if ra == NUM_TOKENS or (rb != NUM_TOKENS and self.order[ra] < self.order[rb]) else rb
        self.parent[rb if keep == ra else ra] = keep


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def index_labels(prog: Program, seed: dict[str, tuple[Label, ...]] | None = None) -> Labels:
    """Label every dim of every tensor of `prog` (composites must be expanded first).
    `seed` gives the labels of some inputs (a segment's boundary tensors)."""
    uf = _UnionFind()
    uf.add(NUM_TOKENS)
    raw: dict[str, tuple[Label, ...]] = {}
    reduced_raw: dict[str, tuple[str, ...]] = {}
    seed = seed or {}
    for n in prog.nodes:
        t = prog.types[n.name]
        ins = [raw[s] for s in n.inputs]
        if n.op == "input":
            if n.name in seed:
                labels = tuple(uf.add(lb) if lb else None for lb in seed[n.name])
            else:
                labels = tuple(NUM_TOKENS if d == NUM_TOKENS else None if d == 1 else uf.add(f"{_ident(n.name)}{i}")
                               for i, d in enumerate(t.shape))
        elif n.op == "const":
            labels = ()
        elif n.op in ELEMENTWISE_BINARY:
            labels = _align(uf, ins[0], ins[1])
        elif n.op in ELEMENTWISE_UNARY:
            labels = ins[0]
        elif n.op in REDUCTIONS:
            x, d = ins[0], n.attr("dim") % len(ins[0])
            reduced_raw[n.name] = (x[d],) if x[d] else ()
            labels = x[:d] + ((None,) if n.attr("keepdim") else ()) + x[d + 1:]
        elif n.op == Op.MATMUL:
            a, b = ins
            bk, bn = (b[-1], b[-2]) if n.attr("transpose_b") else (b[-2], b[-1])
            if a[-1] and bk:
                uf.union(a[-1], bk)
            reduced_raw[n.name] = (a[-1] or bk,) if (a[-1] or bk) else ()
            labels = _align(uf, a[:-2], b[:-2]) + (a[-2], bn)
        elif n.op == Op.GATHER:  # the table's gathered dim gives way to the index's dims
            d = n.attr("dim") % len(ins[0])
            labels = ins[0][:d] + ins[1] + ins[0][d + 1:]
        elif n.op in (Op.SLICE, Op.CONCAT):  # a window or a join is a new index along its dim
            d = n.attr("dim") % len(ins[0])
            new = None if t.shape[d] == 1 else uf.add(f"{_ident(n.name)}{d}")
            kept = [x[:d] + x[d + 1:] for x in ins]
            kept = _align(uf, *kept) if n.op == Op.CONCAT else kept[0]
            labels = kept[:d] + (new,) + kept[d:]
        else:
            raise ProgramError(f"node '{n.name}': op {n.op!r} must be expanded before labelling")
        raw[n.name] = labels
    dims = {k: tuple(uf.find(lb) if lb else None for lb in v) for k, v in raw.items()}
    reduced = {k: tuple(uf.find(lb) for lb in v) for k, v in reduced_raw.items()}
    return Labels(dims, reduced)


def _align(uf: _UnionFind, a: tuple[Label, ...], b: tuple[Label, ...]) -> tuple[Label, ...]:
    """Broadcast two label tuples from the right, unifying the dims both have."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else None
        y = b[-i] if i <= len(b) else None
        if x and y:
            uf.union(x, y)
        out.append(x or y)
    return tuple(reversed(out))
