"""Which nodes of a block graph read memory, where slices and gathers sit on loads.

The sGraph places a ``slice`` on a ``load`` (or on a slice of one) and a ``gather`` on a load of
its table (`ir/sgraph.py`); codegen renders each as one windowed, strided or indexed load, so the
load under it never exists as a tile. The resource model and the cost model read these facts:
a *virtual* node (a load, or a slice of one, whose every consumer is a slice or reads it as a
gather's table) holds no registers and moves no bytes; a *read* (a slice or gather on a virtual
node) holds its own tile and moves its own elements, once: the rows of a gathered table, the
window of a slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.sgraph import BlockKernel

INDEXING = (Op.SLICE, Op.GATHER, Op.CONCAT)  # ops that move elements, computing nothing


@dataclass(frozen=True)
class Reads:
    virtual: frozenset[str]  # loads (and slices of them) that are rendered inside their consumers
    reads: dict[str, str]  # read node -> the load under it (whose tensor it reads)


@lru_cache(maxsize=4096)
def block_reads(k: BlockKernel) -> Reads:
    consumers: dict[str, list[tuple[str, int]]] = {}
    for n in k.nodes:
        for i, s in enumerate(n.inputs):
            consumers.setdefault(s, []).append((n.name, i))
    by_name = k.by_name
    virtual: set[str] = set()
    under: dict[str, str] = {}  # a load, or a slice of one: the load it reads
    for n in k.nodes:
        if n.op == "load":
            under[n.name] = n.name
        elif n.op == Op.SLICE and n.inputs[0] in under:
            under[n.name] = under[n.inputs[0]]
    for name in under:
        uses = consumers.get(name, [])
        if uses and all(by_name[c].op == Op.SLICE or (by_name[c].op == Op.GATHER and i == 0) for c, i in uses):
            virtual.add(name)
    reads = {n.name: under[n.inputs[0]] for n in k.nodes
             if n.op in (Op.SLICE, Op.GATHER) and n.inputs[0] in virtual and n.name not in virtual}
    return Reads(frozenset(virtual), reads)
