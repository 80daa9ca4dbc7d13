"""Algebraic rewrites that put a Program into loop form for one reduction label.

A for-loop over a label can only accumulate a reduction whose operand is
computed inside the loop; a factor that needs the whole reduced dim first (the
1/rms of an RMSNorm feeding a projection, the 1/sum of a softmax feeding P@V)
blocks it. Two identities unblock it, and both are applied here as pure passes:

- ``mean_d(x) = sum_d(x) * (1/size_d)``, so a mean accumulates as a sum;
- ``sum_d(x * f) = sum_d(x) * f`` and ``(a * f) @ b = (a @ b) * f`` when ``f`` is
  constant along the reduced dim (distributivity), so such factors leave the loop.

Everything else (the online-softmax rescaling) is the lowering's business.
"""

from __future__ import annotations

from prism_serve.optimize.ir import Node, Program, node
from prism_serve.optimize.labels import Labels, index_labels


def loop_form(prog: Program, loop: str, labels: Labels, *, hoist: bool = True) -> Program:
    """`prog` with means over `loop` as sums times a constant and, if `hoist`, loop-invariant
    factors moved out of the reductions over `loop`. Same function, same outputs."""
    nodes: list[Node] = []
    for n in prog.nodes:
        if n.op == "mean" and loop in labels.reduced.get(n.name, ()):
            size = prog.types[n.inputs[0]].shape[n.attr("dim")]
            nodes += [node(f"{n.name}.sum", "sum", n.inputs[0], dim=n.attr("dim"), keepdim=n.attr("keepdim")),
                      node(f"{n.name}.inv", "const", value=1.0 / size),
                      node(n.name, "mul", f"{n.name}.sum", f"{n.name}.inv")]
        else:
            nodes.append(n)
    out = Program(prog.name, tuple(nodes), prog.outputs)
    if hoist:
        out = _hoist(out, loop, index_labels(out, {n.name: labels.dims[n.name] for n in out.inputs}))
    return dead_code(common_subexpressions(out))


def _factors(prog: Program, name: str) -> tuple[list[str], list[str]]:
    """`name` as a product: (numerator factors, denominator factors), through mul / div nodes."""
    n = prog.by_name[name]
    if n.op == "mul":
        (an, ad), (bn, bd) = _factors(prog, n.inputs[0]), _factors(prog, n.inputs[1])
        return an + bn, ad + bd
    if n.op == "div":
        (an, ad), (bn, bd) = _factors(prog, n.inputs[0]), _factors(prog, n.inputs[1])
        return an + bd, ad + bn
    return [name], []


def _invariant(prog: Program, labels: Labels, name: str, loop: str, along: int) -> bool:
    """Constant along the reduced dim: no `loop` label, and size 1 (or absent) at `along` (from the right)."""
    shape = prog.types[name].shape
    return loop not in labels.dims[name] and (len(shape) < -along or shape[along] == 1)


def _hoist(prog: Program, loop: str, labels: Labels) -> Program:
    nodes: list[Node] = []
    for n in prog.nodes:
        operand, along = None, 0
        if n.op == "sum" and loop in labels.reduced.get(n.name, ()) and n.attr("keepdim"):
            operand, along = 0, n.attr("dim") % len(prog.types[n.inputs[0]].shape) - len(prog.types[n.inputs[0]].shape)
        elif n.op == "matmul" and loop in labels.reduced.get(n.name, ()):
            operand, along = 0, -1
        if operand is None:
            nodes.append(n)
            continue
        nums, dens = _factors(prog, n.inputs[operand])
        inv = {f for f in nums + dens if _invariant(prog, labels, f, loop, along)}
        out_nums, out_dens = [f for f in nums if f in inv], [f for f in dens if f in inv]
        in_nums, in_dens = [f for f in nums if f not in inv], [f for f in dens if f not in inv]
        if not (out_nums or out_dens) or not in_nums:
            nodes.append(n)
            continue
        chain = _product(f"{n.name}.in", in_nums, in_dens)
        nodes += chain
        inputs = list(n.inputs)
        inputs[operand] = chain[-1].name if chain else in_nums[0]
        core = Node(f"{n.name}.core", n.op, tuple(inputs), n.attrs)
        nodes += [core] + _product(n.name, [core.name] + out_nums, out_dens, last=n.name)
    return Program(prog.name, tuple(nodes), prog.outputs)


def _product(prefix: str, nums: list[str], dens: list[str], last: str | None = None) -> list[Node]:
    """Nodes computing prod(nums) / prod(dens); the final one is named `last` if given."""
    steps = [("mul", f) for f in nums[1:]] + [("div", f) for f in dens]
    out, acc = [], nums[0]
    for i, (op, f) in enumerate(steps):
        name = last if (last and i == len(steps) - 1) else f"{prefix}.{i}"
        out.append(node(name, op, acc, f))
        acc = name
    return out


def common_subexpressions(prog: Program) -> Program:
    """Merge nodes that compute the same op of the same inputs (a pure pass)."""
    rename: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    nodes = []
    for n in prog.nodes:
        n = Node(n.name, n.op, tuple(rename.get(s, s) for s in n.inputs), n.attrs)
        key = (n.op, n.inputs, n.attrs)
        if n.op != "input" and key in seen and n.name not in prog.outputs:
            rename[n.name] = seen[key]
            continue
        seen.setdefault(key, n.name)
        nodes.append(n)
    return Program(prog.name, tuple(nodes), prog.outputs)


def dead_code(prog: Program) -> Program:
    """Drop the nodes no output depends on (inputs stay: they are the signature)."""
    live = set(prog.outputs)
    for n in reversed(prog.nodes):
        if n.name in live:
            live.update(n.inputs)
    return Program(prog.name, tuple(n for n in prog.nodes if n.name in live or n.op == "input"), prog.outputs)
