"""Hand-built designs outside the plan space of the old search (issue 11): each a different block
graph, kernel split or grid for a workload the oracles already cover.

- `rms_then_projection` (b): a small kernel computes 1/rms per row once; the projection kernel
  consumes the normalised operand x * r * g before the dot (safe in fp16: the dot never sees the
  unnormalised x * g, whose outlier channels overflow).
- `rms_recomputed` (c): no rms kernel; each projection kernel recomputes 1/rms from the whole
  row before its loop (for rmsnorm_mlp two kernels, the second multiplying in the first's output;
  for rmsnorm_linear one kernel, the fp16-safe counterpart of the oracle).
- `gqa_decode` (a): split-KV attention over 4 logical grid axes (batch x kv head x q block x KV
  split): one block takes every q head of its kv head, so K/V tiles are loaded once per group.
- `attention_whole_row` (d): one block per (batch, kv head) holds the whole KV row and divides by
  the softmax sum before (`divide_first=True`) or after the PV product.
- `rms_over_split_columns`: rms_norm / fused_add_rms_norm with a grid over hidden as well as tokens:
  each block loads its rows whole, replicated over the hidden axis, for the rms, and normalises and
  writes its own column tile (the residual sum recomputed on that tile): more blocks for few tokens.
- `on_tf32`: any sGraph with its block matmuls on TF32 operands (`ir.TF32`): the oracles' rms
  pulled past the dot, made safe in fp16 (x * g keeps fp32's range).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.program import TF32, Node, Program, node
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel, GridAxis, SGraph, TensorDecl, to_expr
from prism_serve.optimize.workloads.oracles import _eps, _rms_nodes, _rstd_of_sum, accum, load, store

PROJECTIONS = {"rmsnorm_linear": ("w",), "rmsnorm_mlp": ("w_up", "w_gate")}


def _weights(prog: Program) -> tuple[str, ...]:
    if prog.name not in PROJECTIONS:
        raise SGraphError(f"design for {prog.name!r}: needs one of {', '.join(PROJECTIONS)}")
    return PROJECTIONS[prog.name]


def _project(weights: tuple[str, ...], operand: str) -> list[Node]:
    """Each weight's tile loaded in the loop, multiplied into `operand` and accumulated."""
    nodes: list[Node] = []
    for i, w in enumerate(weights):
        nodes += [load(f"w{i}", w, (None, 0), fmap=1), node(f"p{i}", "matmul", operand, f"w{i}", transpose_b=True),
                  accum(f"acc{i}", f"p{i}", "sum")]
    return nodes


def _epilogue(weights: tuple[str, ...]) -> list[Node]:
    if len(weights) == 1:
        return [store("out", "acc0", "y", (0, 1))]
    return [node("y", "mul", "acc0", "acc1"), store("out", "y", "y", (0, 1))]


def rms_then_projection(prog: Program) -> SGraph:
    """(b) 1/rms once per row (a loop over hidden) into `rstd`; then (x * r * g) @ W^T per weight."""
    weights = _weights(prog)
    hidden = prog.by_name["x"].attr("shape")[1]
    rms = [load("x", "x", (0,), fmap=1), node("sq", "square", "x"), node("ss", "sum", "sq", dim=-1, keepdim=True),
           accum("acc_ss", "ss", "sum"), *_rstd_of_sum("acc_ss", hidden, _eps(prog)),
           store("st_r", "r", "rstd", (0,))]
    proj = [load("x", "x", (0, None), fmap=1), load("r", "rstd", (0, None)), load("g", "g", (None, None), fmap=0),
            node("xr", "mul", "x", "r"), node("xn", "mul", "xr", "g"), *_project(weights, "xn"), *_epilogue(weights)]
    kernels = (BlockKernel("rms", (GridAxis("BR", True),), "FR", tuple(rms)),
               BlockKernel("projection", (GridAxis("BT", True), GridAxis("G")), "F", tuple(proj)))
    return SGraph(f"{prog.name}_rms_then_projection", prog, (TensorDecl("rstd", (TOKENS, to_expr(1)), "float32"),),
                  kernels)


def rms_recomputed(prog: Program) -> SGraph:
    """(c) 1/rms recomputed from the whole row before the loop of every projection kernel, whose
    dot then takes the normalised operand: for rmsnorm_mlp two kernels, the second multiplying the
    first's output (`u`) into its own in the epilogue, each tiled on its own (the gate kernel's
    symbols end in 2); for rmsnorm_linear one kernel."""
    weights = _weights(prog)
    eps = _eps(prog)

    def kernel(name: str, weight: str, epilogue: list[Node], suffix: str = "") -> BlockKernel:
        nodes = [load("row", "x", (0, None)), *_rms_nodes("row", eps),
                 load("x", "x", (0, None), fmap=1), load("g", "g", (None, None), fmap=0),
                 node("xr", "mul", "x", "r"), node("xn", "mul", "xr", "g"), *_project((weight,), "xn"), *epilogue]
        return BlockKernel(name, (GridAxis(f"BT{suffix}", True), GridAxis(f"G{suffix}")), f"F{suffix}", tuple(nodes))

    if len(weights) == 1:
        return SGraph(f"{prog.name}_rms_recomputed", prog, (), (kernel("projection", weights[0], _epilogue(weights)),))
    up = kernel("up", "w_up", [store("st_u", "acc0", "u", (0, 1))])
    gate = kernel("gate", "w_gate", [load("u", "u", (0, 1)), node("y", "mul", "u", "acc0"),
                                     store("out", "y", "y", (0, 1))], "2")
    inter = prog.by_name["w_up"].attr("shape")[0]
    return SGraph(f"{prog.name}_rms_recomputed", prog, (TensorDecl("u", (TOKENS, to_expr(inter)), "float32"),),
                  (up, gate))


def gqa_decode(prog: Program) -> SGraph:
    """(a) split-KV attention with grid (batch, kv head, q block, KV split): the q rows of every
    head of a group are split into Q blocks (Q = 1 at decode: the whole group in one block, so each
    K/V tile is loaded once per group), the KV row into S splits of F loop steps; a combine kernel
    over (batch, kv head, q block) rescales the partials to the global max and normalises."""
    if prog.name != "attention":
        raise SGraphError(f"design gqa_decode is for attention, not {prog.name!r}")
    b, hk, gq, hd = prog.by_name["q"].attr("shape")
    dims = lambda *d: tuple(to_expr(x) for x in d)  # noqa: E731
    inter = (TensorDecl("o_part", dims("S", b, hk, gq, hd), "float32"),
             TensorDecl("l_part", dims("S", b, hk, gq, 1), "float32"),
             TensorDecl("m_part", dims("S", b, hk, gq, 1), "float32"))
    parts = (1, 2, 3, 0)  # the KV split leads (as the generator's split-KV lays partials out)
    partial = [
        load("q", "q", (0, 1, 2, None)), load("k", "k", (0, 1, None, 2), fmap=2),
        load("v", "v", (0, 1, None, 2), fmap=2),
        node("s", "matmul", "q", "k", transpose_b=True),
        node("scale", "const", value=prog.by_name["scale"].attr("value")),
        node("ss", "mul", "s", "scale"), node("rowmax", "max", "ss", dim=-1, keepdim=True),
        accum("m", "rowmax", "max"), node("z", "sub", "ss", "m"), node("e", "exp", "z"),
        node("rowsum", "sum", "e", dim=-1, keepdim=True), accum("l", "rowsum", "rescaled_sum", "m"),
        node("pv", "matmul", "e", "v"), accum("acc", "pv", "rescaled_sum", "m"),
        store("st_o", "acc", "o_part", parts), store("st_l", "l", "l_part", parts), store("st_m", "m", "m_part", parts)]
    combine = [
        load("op", "o_part", (1, 2, 3)), load("lp", "l_part", (1, 2, 3)), load("mp", "m_part", (1, 2, 3)),
        node("mx", "max", "mp", dim=0, keepdim=True), node("dm", "sub", "mp", "mx"), node("w", "exp", "dm"),
        node("ow", "mul", "op", "w"), node("num", "sum", "ow", dim=0),
        node("lw", "mul", "lp", "w"), node("den", "sum", "lw", dim=0),
        node("o", "div", "num", "den"), store("st", "o", "o", (0, 1, 2))]
    grid = (GridAxis("B"), GridAxis("H"), GridAxis("Q"), GridAxis("S"))
    return SGraph("attention_gqa_decode", prog, inter, (BlockKernel("split_kv", grid, "F", tuple(partial)),
                                                          BlockKernel("combine", grid[:3], None, tuple(combine))))


def attention_whole_row(prog: Program, *, divide_first: bool) -> SGraph:
    """(d) one block per (batch, kv head) with the whole KV row: p = e / l then p @ v, or
    (e @ v) / l (one division per output element instead of one per score)."""
    if prog.name != "attention":
        raise SGraphError(f"design attention_whole_row is for attention, not {prog.name!r}")
    scale = prog.by_name["scale"].attr("value")
    nodes = [load("q", "q", (0, 1)), load("k", "k", (0, 1)), load("v", "v", (0, 1)),
             node("s", "matmul", "q", "k", transpose_b=True), node("scale", "const", value=scale),
             node("ss", "mul", "s", "scale"), node("m", "max", "ss", dim=-1, keepdim=True),
             node("z", "sub", "ss", "m"), node("e", "exp", "z"), node("l", "sum", "e", dim=-1, keepdim=True)]
    if divide_first:
        nodes += [node("p", "div", "e", "l"), node("o", "matmul", "p", "v")]
    else:
        nodes += [node("pv", "matmul", "e", "v"), node("o", "div", "pv", "l")]
    nodes.append(store("st", "o", "o", (0, 1)))
    k = BlockKernel("attention", (GridAxis("B"), GridAxis("H")), None, tuple(nodes))
    return SGraph(f"attention_divide_{'before' if divide_first else 'after'}_pv", prog, (), (k,))


# issue 11's designs outside the old plan space: name -> (the workload it implements, builder)
DESIGNS: dict[str, tuple[str, Callable[[Program], SGraph]]] = {
    "a_gqa_decode": ("attention", gqa_decode),
    "b_rms_then_projection": ("rmsnorm_mlp", rms_then_projection),
    "c_rms_recomputed": ("rmsnorm_mlp", rms_recomputed),
    "d_divide_before_pv": ("attention", partial(attention_whole_row, divide_first=True)),
    "d_divide_after_pv": ("attention", partial(attention_whole_row, divide_first=False)),
}


def rms_over_split_columns(prog: Program) -> SGraph:
    """Blocks of BT rows x (hidden / G) columns; x (and the residual) loaded twice: the block's rows
    whole (imap None on the hidden axis: replicated) for 1/rms, and its column tile to normalise."""
    if prog.name not in ("rms_norm", "fused_add_rms_norm"):
        raise SGraphError(f"design for {prog.name!r}: needs rms_norm or fused_add_rms_norm")
    nodes = [load("x_rows", "x", (0, None)), load("x", "x", (0, 1))]
    rows, tile = "x_rows", "x"
    if prog.name == "fused_add_rms_norm":
        nodes += [load("res_rows", "residual", (0, None)), load("res", "residual", (0, 1)),
                  node("sum_rows", "add", "x_rows", "res_rows"), node("sum", "add", "x", "res"),
                  store("st_r", "sum", "r", (0, 1))]
        rows, tile = "sum_rows", "sum"
    nodes += [load("w", "w", (None, 0)), *_rms_nodes(rows, _eps(prog)), node("xn", "mul", tile, "r"),
              node("y", "mul", "xn", "w"), store("out", "y", "y", (0, 1))]
    k = BlockKernel(prog.name, (GridAxis("BT", True), GridAxis("G")), None, tuple(nodes))
    return SGraph(f"{prog.name}_over_split_columns", prog, (), (k,))


def on_tf32(g: SGraph) -> SGraph:
    """`g` with every block matmul on TF32 operands, as the generator offers it in fp16 programs."""
    kernels = []
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            k = dataclasses.replace(k, nodes=tuple(
                Node(n.name, n.op, n.inputs, tuple(sorted(dict(n.attrs, precision=TF32).items())))
                if n.op == "matmul" else n for n in k.nodes))
        kernels.append(k)
    return dataclasses.replace(g, kernels=tuple(kernels))
