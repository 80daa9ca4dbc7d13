"""Split-K / split-KV of a generated loop kernel: one more grid axis partitions the loop label.

Every accumulator of the kernel is stored per split (a leading dim of size S, fp32); a combine
kernel over the original grid reduces the splits (rescaling online-softmax sums to the global
max) and runs the epilogue, reloading the pre-loop values it needs. The combine kernel is
derived from the generated block graph, not enumerated operator by operator.
"""

from __future__ import annotations

from prism_serve.optimize.generate.axes import own_maps
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import Node, node
from prism_serve.optimize.ir.sgraph import BlockKernel, GridAxis, TensorDecl, to_expr


def split_kernel(k: BlockKernel, spec, i: int, tensors: dict, types: dict
                 ) -> tuple[list[TensorDecl], list[BlockKernel]]:
    s_axis = GridAxis(f"S{i}")
    stage = k.stages
    by = k.by_name
    accs = [n for n in k.nodes if n.op == "accum"]
    k1: list[Node] = []
    for n in k.nodes:
        if n.op == "load":
            fmap = n.attr("fmap")
            k1.append(node(n.name, "load", tensor=n.attr("tensor"), imap=n.attr("imap") + (fmap,), fmap=fmap))
        elif n.op == "store":
            if stage[n.inputs[0]] == "post":
                continue
            fmap = dict(n.attrs).get("fmap")
            extra = {} if fmap is None else {"fmap": fmap}
            k1.append(node(n.name, "store", *n.inputs, tensor=n.attr("tensor"), omap=n.attr("omap") + (fmap,),
                           **extra))
        elif stage[n.name] != "post" or n.op == "accum":
            k1.append(n)
    decls, combine = [], []
    grid_dims = lambda n: tuple(None if d is None else d + 1 for d in n)  # noqa: E731
    for a in accs:
        t, labels = types[a.name]
        part = f"{a.name}.part{i}"
        decls.append(TensorDecl(part, (to_expr(s_axis.symbol),) + tuple(to_expr(d) for d in t.shape), "float32"))
        omap, _ = own_maps(labels, spec.grid, None)
        k1.append(node(f"st_{a.name}_part", "store", a.name, tensor=part, omap=grid_dims(omap) + (0,)))
        combine.append(node(f"{a.name}_parts", "load", tensor=part, imap=grid_dims(omap), fmap=None))
    post = [n for n in k.nodes if stage[n.name] == "post" and n.op not in ("accum", "store")]
    stores = [n for n in k.nodes if n.op == "store" and stage[n.inputs[0]] == "post"]
    read = {s for n in post + stores for s in n.inputs}
    for a in accs:
        b, kind = a.name, a.attr("kind")
        if kind == Op.MAX:  # the rescaling weights; the global max itself only where the epilogue reads it
            combine += [node(f"{b}_gmax", Op.MAX, f"{b}_parts", dim=0, keepdim=True),
                        node(f"{b}_dm", Op.SUB, f"{b}_parts", f"{b}_gmax"), node(f"{b}_w", Op.EXP, f"{b}_dm"),
                        *([node(b, Op.MAX, f"{b}_parts", dim=0)] if b in read else [])]
    for a in accs:
        b, kind = a.name, a.attr("kind")
        if kind == "rescaled_sum":
            combine += [node(f"{b}_rs", Op.MUL, f"{b}_parts", f"{a.inputs[1]}_w"), node(b, Op.SUM, f"{b}_rs", dim=0)]
        elif kind in (Op.SUM, Op.MEAN):
            combine.append(node(b, kind, f"{b}_parts", dim=0))
    need = {s for n in post for s in n.inputs}
    pre = []
    for n in reversed(k.nodes):  # the pre-loop values the epilogue reads, reloaded without the split
        if n.op != "store" and stage[n.name] == "pre" and n.name in need:
            need.update(n.inputs)
            pre.append(n)
    reloaded = [node(n.name, "load", tensor=n.attr("tensor"), imap=n.attr("imap"), fmap=None) if n.op == "load" else n
                for n in reversed(pre)]
    combine = reloaded + combine + post + stores
    del by
    return decls, [BlockKernel(k.name, k.grid + (s_axis,), k.forloop, tuple(k1)),
                   BlockKernel(f"{k.name}_combine", k.grid, None, tuple(combine))]
