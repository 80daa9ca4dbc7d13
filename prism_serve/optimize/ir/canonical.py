"""A canonical hash of an sGraph: equal for sGraphs that differ only by names and by the order in
which independent kernels or block ops were added; different for any semantic difference.

The form is topological. Every value is keyed by what defines it, never by its name:

- a Program input by its position in the signature (with shape and dtype), a Program output by
  its position among the outputs: these names are the Program's own, shared by every design;
- a block node by its op, its attributes and the keys of its inputs (as a multiset for the
  commutative add and mul: x * r and r * x are one design); a load by the key of the
  tensor it reads (the keys of the stores that wrote it so far) and its maps; a store by its
  value, its maps and what it writes (an output's position, or an intermediate's shape and dtype);
- a kernel by its grid (axis order, token axes, symbols), its loop and the multiset of its nodes;
- the sGraph by its Program and the multiset of its kernels.

Symbols (grid extents, loop ranges, split sizes in intermediate shapes) are named by the user,
but which symbols are shared between kernels and shapes is semantic. So the key is computed
twice: first with every symbol anonymous, then with each symbol named by the multiset of places
(kernel key and role, tensor and dim) where it occurs in that first pass.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Callable

import sympy

from prism_serve.optimize.ir.ops import OPS
from prism_serve.optimize.ir.program import NUM_TOKENS, Node
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph, TensorDecl, to_expr


COMMUTATIVE = tuple(op for op, d in OPS.items() if d.commutative)


def _digest(payload) -> str:
    """Payloads are nested lists of str, int, float, bool and None: their repr is canonical."""
    return hashlib.sha256(repr(payload).encode()).hexdigest()


def canonical_hash(g: SGraph) -> str:
    """The name- and order-independent hash of `g` (32 hex digits)."""
    _, places = _keys(g, lambda s: "_")
    names = {s: _digest(sorted(p)) for s, p in places.items()}
    key, _ = _keys(g, lambda s: names[s])
    return key[:32]


def _keys(g: SGraph, symbol_name: Callable[[str], str]) -> tuple[str, dict[str, list]]:
    """The sGraph's key with symbols named by `symbol_name`, and where each symbol occurs."""
    places: dict[str, list] = defaultdict(list)
    outputs = {o: i for i, o in enumerate(g.program.outputs)}
    decls = {t.name: t for t in g.intermediates}
    subs = {sympy.Symbol(s, positive=True, integer=True): sympy.Symbol(f"s_{symbol_name(s)}", positive=True,
                                                                       integer=True) for s in g.symbols}

    targets: dict[str, list] = {}

    def target(name: str) -> list:
        """What a store or library op writes: a Program output by position, else the declaration."""
        if name in outputs:
            return ["output", outputs[name]]
        if name not in targets:
            decl: TensorDecl = decls[name]
            targets[name] = ["intermediate", [sympy.srepr(to_expr(d).xreplace(subs)) for d in decl.shape], decl.dtype]
        return targets[name]

    tensors: dict[str, list[str]] = {}  # tensor -> keys of the writes so far, in order
    for i, n in enumerate(g.program.inputs):
        tensors[n.name] = [_digest(["input", i, [str(d) for d in n.attr("shape")], n.attr("dtype")])]

    def tensor_key(name: str) -> str:
        return _digest(tensors[name])

    kernel_keys = []
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            key, stores = _block_key(k, tensor_key, target, symbol_name)
            for tensor, store_key in stores:
                tensors.setdefault(tensor, []).append(_digest([key, store_key]))
            for a, axis in enumerate(k.grid):
                places[axis.symbol].append(["grid", key, a])
            if k.forloop:
                places[k.forloop].append(["loop", key])
        else:
            n = k.op
            ins = [tensor_key(s) for s in n.inputs]
            key = _digest(["library", n.op, sorted(ins) if n.op in COMMUTATIVE else ins, _attrs(n), target(n.name)])
            tensors.setdefault(n.name, []).append(key)
        kernel_keys.append(key)
    for t in g.intermediates:
        for d, dim in enumerate(t.shape):
            for s in to_expr(dim).free_symbols:
                if str(s) != NUM_TOKENS:
                    places[str(s)].append(["shape", tensor_key(t.name) if t.name in tensors else "unwritten", d])
    whole = _digest([g.program.canonical_hash, sorted(kernel_keys),
                     [tensor_key(o) for o in g.program.outputs]])
    return whole, places


def _attrs(n: Node) -> list:
    return [[k, list(v) if isinstance(v, tuple) else v] for k, v in n.attrs]


def _block_key(k: BlockKernel, tensor_key: Callable[[str], str], target: Callable[[str], list],
               symbol_name: Callable[[str], str]) -> tuple[str, list[tuple[str, str]]]:
    """A block kernel's key and, per store, (tensor written, the store's key)."""
    local: dict[str, str] = {}
    stores: list[tuple[str, str]] = []
    for n in k.nodes:
        ins = [local[s] for s in n.inputs]
        attrs = dict(n.attrs)
        if n.op == "load":
            payload = ["load", tensor_key(attrs["tensor"]), list(attrs["imap"]), attrs.get("fmap")]
        elif n.op == "store":
            payload = ["store", ins, list(attrs["omap"]), attrs.get("fmap"), target(attrs["tensor"])]
        else:  # + and * commute exactly (IEEE too): their operands are a multiset
            payload = [n.op, sorted(ins) if n.op in COMMUTATIVE else ins, _attrs(n)]
        local[n.name] = _digest(payload)
        if n.op == "store":
            stores.append((attrs["tensor"], local[n.name]))
    grid = [[a.over_tokens, symbol_name(a.symbol)] for a in k.grid]
    loop = symbol_name(k.forloop) if k.forloop else None
    key = _digest(["block", grid, loop, sorted(local.values())])
    return key, stores

