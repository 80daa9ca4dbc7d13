"""Plans and their lowering to sGraphs.

A `Plan` cuts a Program's primitive ops (composites expanded, in program order)
into segments; each segment is a library kernel (one op) or a graph-defined
kernel described by a `BlockChoice`: which index labels the grid partitions,
which label a for-loop runs over, whether the loop's label is also split across
the grid (split-K / split-KV, with a combine kernel), and whether loop-invariant
factors are hoisted out of the loop's reductions first (`rewrite.loop_form`).

Lowering is mechanical. Inside the loop, a reduction over the loop label becomes a
tile reduction plus an accumulator; a value that depends on a running max is
accumulated with online rescaling. A reduction whose result is needed again
inside the loop cannot be accumulated, so it is lowered over the tile only: the
kernel is then wrong, and the search's abstract-expression rule discards it.
Lowering never substitutes a size: grid dims, loop range and split are symbols.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir import NUM_TOKENS, Node, Program, node
from prism_serve.optimize.labels import Labels, index_labels
from prism_serve.optimize.reference import expand_composites
from prism_serve.optimize.rewrite import loop_form
from prism_serve.optimize.sgraph import BlockKernel, GridAxis, Kernel, LibraryKernel, SGraph, TensorDecl, to_expr

PLAN_VERSION = 1


class Unschedulable(SGraphError):
    """The choice cannot be lowered to a valid block graph (a structural dead end)."""


@dataclass(frozen=True)
class BlockChoice:
    grid: tuple[str, ...]  # index labels, one per grid axis, in order
    loop: str | None = None  # the label the for-loop partitions
    split: bool = False  # the loop label is also partitioned across an extra grid axis
    hoist: bool = True  # apply rewrite.loop_form's distributivity first

    def describe(self) -> str:
        parts = [f"grid({','.join(self.grid)})"]
        if self.loop:
            parts.append(f"{'split+' if self.split else ''}loop({self.loop}){'' if self.hoist else ' unhoisted'}")
        return " ".join(parts)


@dataclass(frozen=True)
class SegmentPlan:
    start: int  # op range [start, stop) in `op_order`
    stop: int
    choice: BlockChoice | None  # None: a library kernel

    def describe(self) -> str:
        return f"[{self.start}:{self.stop}] " + ("library" if self.choice is None else self.choice.describe())


@dataclass(frozen=True)
class Plan:
    segments: tuple[SegmentPlan, ...]

    def describe(self) -> str:
        return " | ".join(s.describe() for s in self.segments)

    def to_json(self) -> dict:
        return {"plan_version": PLAN_VERSION, "segments": [asdict(s) for s in self.segments]}

    @staticmethod
    def from_json(data: Any) -> "Plan":
        """Parse stored JSON against the schema (`optimize.schema`); errors name the field."""
        from prism_serve.optimize.schema import plan_from_json
        return plan_from_json(data)


def op_order(flat: Program) -> tuple[str, ...]:
    """The ops a plan cuts into segments: every node but inputs and constants, in program order."""
    return tuple(n.name for n in flat.nodes if n.op not in ("input", "const"))


def segment_program(flat: Program, names: tuple[str, ...]) -> Program:
    """The ops `names` as a Program of their own: tensors they read from outside become inputs,
    tensors read after them (or program outputs) become outputs. Constants travel along."""
    inside = set(names)
    later = {s for n in flat.nodes if n.name not in inside for s in n.inputs} | set(flat.outputs)
    nodes: list[Node] = []
    for n in flat.nodes:
        if n.name not in inside:
            continue
        for s in n.inputs:
            src = flat.by_name[s]
            if s in inside or any(m.name == s for m in nodes):
                continue
            t = flat.types[s]
            nodes.append(src if src.op in ("input", "const") else node(s, "input", shape=t.shape, dtype=t.dtype))
        nodes.append(n)
    ordered = [n for n in nodes if n.op == "input"] + [n for n in nodes if n.op != "input"]
    return Program(flat.name, tuple(ordered), tuple(n for n in names if n in later))


def ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def grid_symbol(label: str, tag: int) -> str:
    return f"BT{tag}" if label == NUM_TOKENS else f"G{tag}_{ident(label)}"


def lower_segment(seg: Program, labels: Labels, choice: BlockChoice, tag: int
                  ) -> tuple[tuple[TensorDecl, ...], tuple[BlockKernel, ...]]:
    """One segment (a Program of its own) as one block kernel, or two with a split.
    `labels` label the segment's inputs; returns (partial tensors, kernels)."""
    if choice.loop:
        seg = loop_form(seg, choice.loop, labels, hoist=choice.hoist)
        labels = index_labels(seg, {n.name: labels.dims[n.name] for n in seg.inputs})
    elif choice.split:
        raise Unschedulable("a split needs a for-loop over the split label")
    stages, accums = _stages(seg, labels, choice.loop)
    if choice.loop and not accums:
        raise Unschedulable(f"nothing reduces the loop label {choice.loop}")
    axes = tuple(GridAxis(grid_symbol(lb, tag), lb == NUM_TOKENS) for lb in choice.grid)
    split_axis = (GridAxis(f"S{tag}"),) if choice.split else ()
    loop_sym = f"F{tag}" if choice.loop else None
    imap = lambda t, extra=split_axis: tuple(labels.dim_of(t, lb) for lb in choice.grid) + tuple(  # noqa: E731
        labels.dim_of(t, choice.loop) for _ in extra)

    running: dict[str, frozenset[str]] = {}  # loop values: the max accumulators whose running value they use
    body: list[Node] = []
    for n in seg.nodes:
        b = ident(n.name)
        if n.op == "input":
            body.append(node(b, "load", tensor=n.name, imap=imap(n.name),
                             fmap=labels.dim_of(n.name, choice.loop) if choice.loop else None))
            continue
        if n.op == "const":
            body.append(node(b, "const", value=n.attr("value")))
            continue
        ins = tuple(ident(s) for s in n.inputs)
        uses = frozenset().union(*(running.get(s, frozenset()) for s in n.inputs)) | {
            ident(s) for s in n.inputs if accums.get(s) == "max" and stages[n.name] == "loop"}
        if n.name in accums:
            body.append(Node(b + "_tile", n.op, ins, n.attrs))
            if accums[n.name] == "max" and uses or len(uses) > 1:
                raise Unschedulable(f"'{n.name}' reduces a value rescaled by {sorted(uses)}")
            rescale = next(iter(uses)) if uses else None
            kind = "max" if accums[n.name] == "max" else "rescaled_sum" if rescale else "sum"
            body.append(node(b, "accum", b + "_tile", *([rescale] if rescale else []), kind=kind))
        else:
            body.append(Node(b, n.op, ins, n.attrs))
            if stages[n.name] == "loop":
                running[n.name] = uses
    for o in seg.outputs:  # a loop-body output is written tile by tile, unless it is only a running value
        if stages[o] == "loop" and (labels.dim_of(o, choice.loop) is None or running.get(o)):
            raise Unschedulable(f"output '{o}' varies along the loop label {choice.loop} but cannot be "
                                f"written tile by tile")
    if not choice.split:
        stores = [_store(o, imap(o), labels.dim_of(o, choice.loop) if stages[o] == "loop" else None)
                  for o in seg.outputs]
        return (), (BlockKernel(f"k{tag}", axes + split_axis, loop_sym, tuple(body + stores)),)
    return _split(seg, labels, choice, tag, axes, split_axis[0], loop_sym, body, stages, accums)


def _store(tensor: str, omap: tuple, fmap: int | None) -> Node:
    """The store of a segment output; `fmap` only for a loop-body value (the attr is absent otherwise)."""
    extra = {} if fmap is None else {"fmap": fmap}
    return node(f"st_{ident(tensor)}", "store", ident(tensor), tensor=tensor, omap=omap, **extra)


def _stages(seg: Program, labels: Labels, loop: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """Stage ('pre', 'loop', 'post') per node and the reductions accumulated over the loop
    ('sum' or 'max'). A reduction whose result is needed inside the loop is lowered over the tile."""
    tile_only: set[str] = set()
    while True:
        stages: dict[str, str] = {}
        accums: dict[str, str] = {}
        blocked: set[str] = set()
        for n in seg.nodes:
            if n.op == "input":
                stages[n.name] = "loop" if loop and loop in labels.dims[n.name] else "pre"
            elif n.op == "const":
                stages[n.name] = "pre"
            elif loop and loop in labels.reduced.get(n.name, ()) and n.name not in tile_only:
                stages[n.name], accums[n.name] = "post", ("max" if n.op == "max" else "sum")
            else:
                ins = [stages[s] for s in n.inputs]
                stages[n.name] = "loop" if "loop" in ins else "post" if "post" in ins else "pre"
                if stages[n.name] == "loop":
                    for s in n.inputs:
                        if stages[s] == "post" and accums.get(s) != "max":
                            blocked |= _accum_ancestors(seg, s, accums)
        if not blocked:
            return stages, accums
        tile_only |= blocked


def _accum_ancestors(seg: Program, name: str, accums: dict[str, str]) -> set[str]:
    if name in accums:
        return {name}
    return set().union(*(_accum_ancestors(seg, s, accums) for s in seg.by_name[name].inputs))


def _split(seg: Program, labels: Labels, choice: BlockChoice, tag: int, axes: tuple[GridAxis, ...],
           split_axis: GridAxis, loop_sym: str, body: list[Node], stages: dict[str, str], accums: dict[str, str]
           ) -> tuple[tuple[TensorDecl, ...], tuple[BlockKernel, ...]]:
    """Split-K / split-KV: every accumulator is stored per split (a leading dim of size S);
    a combine kernel reduces the splits (rescaling to the global max where needed) and runs the epilogue."""
    grid_dims = lambda t: tuple(labels.dim_of(t, lb) for lb in choice.grid)  # noqa: E731
    by_block = {n.name: n for n in body}
    partial_nodes, decls, combine = [], [], []
    stores_k1 = [_store(o, grid_dims(o) + (labels.dim_of(o, choice.loop) if stages[o] == "loop" else None,),
                        labels.dim_of(o, choice.loop) if stages[o] == "loop" else None)
                 for o in seg.outputs if stages[o] in ("pre", "loop")]
    for a in (n.name for n in seg.nodes if n.name in accums):
        b, t = ident(a), f"{a}.part"
        decls.append(TensorDecl(t, (to_expr(split_axis.symbol),) + tuple(to_expr(d) for d in seg.types[a].shape),
                                "float32"))
        partial_nodes.append(node(f"st_{b}_part", "store", b, tensor=t,
                                  omap=tuple(None if d is None else d + 1 for d in grid_dims(a)) + (0,)))
        combine.append(node(f"{b}_parts", "load", tensor=t,
                            imap=tuple(None if d is None else d + 1 for d in grid_dims(a)), fmap=None))
    for a in (n.name for n in seg.nodes if accums.get(n.name) == "max"):
        b = ident(a)
        combine += [node(f"{b}_gmax", "max", f"{b}_parts", dim=0, keepdim=True),
                    node(f"{b}_dm", "sub", f"{b}_parts", f"{b}_gmax"), node(f"{b}_w", "exp", f"{b}_dm"),
                    node(b, "max", f"{b}_parts", dim=0)]
    for a in (n.name for n in seg.nodes if accums.get(n.name) == "sum"):
        b = ident(a)
        acc = by_block[b]
        if acc.attr("kind") == "rescaled_sum":
            combine += [node(f"{b}_rs", "mul", f"{b}_parts", f"{acc.inputs[1]}_w"), node(b, "sum", f"{b}_rs", dim=0)]
        else:
            combine.append(node(b, "sum", f"{b}_parts", dim=0))
    post = [n for n in seg.nodes if stages[n.name] == "post" and n.name not in accums]
    need = {s for n in post for s in n.inputs}
    pre = []
    for n in reversed(seg.nodes):  # the pre-loop values the epilogue reads, reloaded without the split
        if stages[n.name] == "pre" and n.name in need:
            need.update(n.inputs)
            pre.append(n)
    for n in reversed(pre):
        m = by_block[ident(n.name)]
        combine.insert(0, node(m.name, "load", tensor=m.attr("tensor"), imap=m.attr("imap")[:-1], fmap=None)
                       if m.op == "load" else m)
    combine += [by_block[ident(n.name)] for n in post]
    combine += [node(f"st_{ident(o)}", "store", ident(o), tensor=o, omap=grid_dims(o))
                for o in seg.outputs if stages[o] == "post"]
    epilogue = {ident(n.name) for n in post}
    k1_nodes = tuple(n for n in body if n.name not in epilogue) + tuple(stores_k1 + partial_nodes)
    return tuple(decls), (BlockKernel(f"k{tag}", axes + (split_axis,), loop_sym, k1_nodes),
                          BlockKernel(f"k{tag}_combine", axes, None, tuple(combine)))


def segment_kernels(flat: Program, labels: Labels, s: SegmentPlan, tag: int
                    ) -> tuple[Program, tuple[TensorDecl, ...], tuple[Kernel, ...]]:
    """Segment `s` of the expanded program `flat`: its sub-Program, partial tensors and kernels."""
    seg = segment_program(flat, op_order(flat)[s.start:s.stop])
    if s.choice is None:
        op = next(n for n in seg.nodes if n.op not in ("input", "const"))
        if s.stop - s.start != 1 or any(seg.by_name[i].op == "const" for i in op.inputs):
            raise Unschedulable(f"a library kernel runs one op on tensors; segment {s.describe()} cannot")
        return seg, (), (LibraryKernel(op),)
    seg_labels = Labels({n.name: labels.dims[n.name] for n in seg.nodes}, labels.reduced)
    decls, kernels = lower_segment(seg, seg_labels, s.choice, tag)
    return seg, decls, kernels


def segment_sgraph(flat: Program, labels: Labels, s: SegmentPlan) -> SGraph:
    """Segment `s` as an sGraph of its own sub-Program: what search ranks and proves per segment.
    Its symbols are tagged with the segment's start, as in the whole plan's sGraph."""
    seg, decls, kernels = segment_kernels(flat, labels, s, tag=s.start)
    return SGraph(f"{flat.name}_{s.start}_{s.stop}", seg, decls, kernels)


def build(prog: Program, plan: Plan) -> SGraph:
    """The sGraph a plan describes for `prog` (pure; raises SGraphError / Unschedulable)."""
    flat = expand_composites(prog)
    labels = index_labels(flat)
    n_ops = len(op_order(flat))
    bounds = [(s.start, s.stop) for s in plan.segments]
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != n_ops or any(
            a[1] != b[0] or a[0] >= a[1] for a, b in zip(bounds, bounds[1:])) or bounds[-1][0] >= bounds[-1][1]:
        raise SGraphError(f"plan {bounds} does not cut the {n_ops} ops of '{prog.name}' into consecutive segments")
    decls: list[TensorDecl] = []
    kernels: list[Kernel] = []
    for s in plan.segments:
        seg, part_decls, ks = segment_kernels(flat, labels, s, tag=s.start)
        decls += [TensorDecl(o, tuple(to_expr(d) for d in seg.types[o].shape), seg.types[o].dtype)
                  for o in seg.outputs if o not in prog.outputs] + list(part_decls)
        kernels += ks
    digest = hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode()).hexdigest()[:8]
    return SGraph(f"{prog.name}_{digest}", prog, tuple(decls), tuple(kernels))
