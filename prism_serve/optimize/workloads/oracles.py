"""Hand-built sGraphs: the known good fused designs the search must rediscover.

Each builder takes the workload's Program and returns an SGraph for it, plus a
default symbol assignment for small test shapes (`default_assignment`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.program import Node, Program, node
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel, GridAxis, SGraph, TensorDecl, to_expr
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.target.instance import Instance, instantiate

TOKEN_BLOCK = "BT"
ONE_PER_BLOCK = ("B", "H", "K")  # grid axes over batch, heads, top-k choices: one entry per block


def load(name: str, tensor: str, imap: tuple, fmap: int | None = None) -> Node:
    return node(name, "load", tensor=tensor, imap=tuple(imap), fmap=fmap)


def store(name: str, value: str, tensor: str, omap: tuple, fmap: int | None = None) -> Node:
    return node(name, "store", value, tensor=tensor, omap=tuple(omap), **({} if fmap is None else {"fmap": fmap}))


def accum(name: str, value: str, kind: str, rescale_by: str | None = None) -> Node:
    return node(name, "accum", value, *([rescale_by] if rescale_by else []), kind=kind)


def _rms_nodes(x: str, eps: float, prefix: str = "") -> list[Node]:
    """r = rsqrt(mean(x^2) + eps) over the last dim of a whole-row tile."""
    return [node(prefix + "sq", "square", x), node(prefix + "ms", "mean", prefix + "sq", dim=-1, keepdim=True),
            node(prefix + "eps", "const", value=eps), node(prefix + "var", "add", prefix + "ms", prefix + "eps"),
            node(prefix + "r", "rsqrt", prefix + "var")]


def _rstd_of_sum(sum_sq: str, size: int, eps: float, out: str = "r") -> list[Node]:
    """out = rsqrt(sum_sq / size + eps): the rms of a row whose squares a loop has summed."""
    return [node("inv_d", "const", value=1.0 / size), node("ms", "mul", sum_sq, "inv_d"),
            node("eps", "const", value=eps), node("var", "add", "ms", "eps"), node(out, "rsqrt", "var")]


def _eps(prog: Program) -> float:
    return next(n.attr("eps") for n in prog.nodes if n.op == "rms_norm")


def rms_norm(prog: Program) -> SGraph:
    """One block per BT rows, each row whole in the block."""
    nodes = [load("x", "x", (0,)), load("w", "w", (None,)), *_rms_nodes("x", _eps(prog)),
             node("xr", "mul", "x", "r"), node("y", "mul", "xr", "w"), store("out", "y", "y", (0,))]
    k = BlockKernel("rms_norm", (GridAxis(TOKEN_BLOCK, over_tokens=True),), None, tuple(nodes))
    return SGraph("rms_norm_oracle", prog, (), (k,))


def fused_add_rms_norm(prog: Program) -> SGraph:
    nodes = [load("x", "x", (0,)), load("res", "residual", (0,)), load("w", "w", (None,)),
             node("sum_xr", "add", "x", "res"), *_rms_nodes("sum_xr", _eps(prog)),
             node("xr", "mul", "sum_xr", "r"), node("y", "mul", "xr", "w"),
             store("out_y", "y", "y", (0,)), store("out_r", "sum_xr", "r", (0,))]
    k = BlockKernel("fused_add_rms_norm", (GridAxis(TOKEN_BLOCK, over_tokens=True),), None, tuple(nodes))
    return SGraph("fused_add_rms_norm_oracle", prog, (), (k,))


def gemma_rms_norm(prog: Program) -> SGraph:
    """rms_norm's one block per BT rows, scaling by 1 + w in the block."""
    nodes = [load("x", "x", (0,)), load("w", "w", (None,)), node("one", "const", value=1.0),
             node("w1", "add", "w", "one"), *_rms_nodes("x", _eps(prog)),
             node("xr", "mul", "x", "r"), node("y", "mul", "xr", "w1"), store("out", "y", "y", (0,))]
    k = BlockKernel("gemma_rms_norm", (GridAxis(TOKEN_BLOCK, over_tokens=True),), None, tuple(nodes))
    return SGraph("gemma_rms_norm_oracle", prog, (), (k,))


def gemma_fused_add_rms_norm(prog: Program) -> SGraph:
    nodes = [load("x", "x", (0,)), load("res", "residual", (0,)), load("w", "w", (None,)),
             node("one", "const", value=1.0), node("w1", "add", "w", "one"),
             node("sum_xr", "add", "x", "res"), *_rms_nodes("sum_xr", _eps(prog)),
             node("xr", "mul", "sum_xr", "r"), node("y", "mul", "xr", "w1"),
             store("out_y", "y", "y", (0,)), store("out_r", "sum_xr", "r", (0,))]
    k = BlockKernel("gemma_fused_add_rms_norm", (GridAxis(TOKEN_BLOCK, over_tokens=True),), None, tuple(nodes))
    return SGraph("gemma_fused_add_rms_norm_oracle", prog, (), (k,))


def gelu_tanh_and_mul(prog: Program) -> SGraph:
    """silu_and_mul's blocks of BT rows x (intermediate / G) columns, with tanh GELU."""
    nodes = [load("gate", "gate", (0, 1)), load("up", "up", (0, 1)), node("g", "gelu_tanh", "gate"),
             node("y", "mul", "g", "up"), store("out", "y", "y", (0, 1))]
    k = BlockKernel("gelu_tanh_and_mul", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), None, tuple(nodes))
    return SGraph("gelu_tanh_and_mul_oracle", prog, (), (k,))


def silu_and_mul(prog: Program) -> SGraph:
    """Blocks of BT rows x (intermediate / G) columns."""
    nodes = [load("gate", "gate", (0, 1)), load("up", "up", (0, 1)), node("g", "silu", "gate"),
             node("y", "mul", "g", "up"), store("out", "y", "y", (0, 1))]
    k = BlockKernel("silu_and_mul", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), None, tuple(nodes))
    return SGraph("silu_and_mul_oracle", prog, (), (k,))


def rmsnorm_linear(prog: Program) -> SGraph:
    """(x*g) @ W^T and sum(x^2) accumulated in one loop over hidden; divided by the rms at the end."""
    hidden = prog.by_name["x"].attr("shape")[1]
    nodes = [load("x", "x", (0, None), fmap=1), load("g", "g", (None, None), fmap=0),
             load("w", "w", (None, 0), fmap=1),
             node("xg", "mul", "x", "g"), node("p", "matmul", "xg", "w", transpose_b=True),
             node("sq", "square", "x"), node("ss", "sum", "sq", dim=-1, keepdim=True),
             accum("acc_p", "p", "sum"), accum("acc_ss", "ss", "sum"),
             *_rstd_of_sum("acc_ss", hidden, _eps(prog)),
             node("y", "mul", "acc_p", "r"), store("out", "y", "y", (0, 1))]
    k = BlockKernel("rmsnorm_linear", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), "F", tuple(nodes))
    return SGraph("rmsnorm_linear_oracle", prog, (), (k,))


def fused_add_rmsnorm_linear(prog: Program) -> SGraph:
    """rmsnorm_linear's one loop over hidden, on r = x + residual, which each iteration also writes
    (every output-column block writes the same r tile: replicated, so identical values)."""
    hidden = prog.by_name["x"].attr("shape")[1]
    nodes = [load("x", "x", (0, None), fmap=1), load("res", "residual", (0, None), fmap=1),
             load("g", "g", (None, None), fmap=0), load("w", "w", (None, 0), fmap=1),
             node("r", "add", "x", "res"), store("st_r", "r", "r", (0, None), fmap=1),
             node("rg", "mul", "r", "g"), node("p", "matmul", "rg", "w", transpose_b=True),
             node("sq", "square", "r"), node("ss", "sum", "sq", dim=-1, keepdim=True),
             accum("acc_p", "p", "sum"), accum("acc_ss", "ss", "sum"),
             *_rstd_of_sum("acc_ss", hidden, _eps(prog), "rs"),
             node("y", "mul", "acc_p", "rs"), store("out", "y", "y", (0, 1))]
    k = BlockKernel("fused_add_rmsnorm_linear", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), "F", tuple(nodes))
    return SGraph("fused_add_rmsnorm_linear_oracle", prog, (), (k,))


def _with_bias(g: SGraph, name: str) -> SGraph:
    """A projection oracle with the bias added in its epilogue: b's slice of the output columns
    (the grid's G axis), loaded once after the loop, added to y before the store."""
    (k,) = g.kernels
    *body, out = k.nodes
    nodes = (*body, load("bias", "b", (None, 0)), node("yb", "add", out.inputs[0], "bias"),
             store(out.name, "yb", out.attr("tensor"), out.attr("omap")))
    return SGraph(f"{name}_oracle", g.program, (), (BlockKernel(name, k.grid, k.forloop, nodes),))


def _gemma(g: SGraph, name: str) -> SGraph:
    """A norm oracle on Gemma's weight: the loaded g tile becomes 1 + g before its first use."""
    (k,) = g.kernels
    nodes = []
    for n in k.nodes:
        if n.op == "load" and n.attr("tensor") == "g":
            nodes += [n, node("one", "const", value=1.0), node("g1", "add", n.name, "one")]
        else:
            nodes.append(replace(n, inputs=tuple("g1" if i == "g" else i for i in n.inputs)))
    return SGraph(f"{name}_oracle", g.program, g.intermediates, (BlockKernel(name, k.grid, k.forloop, tuple(nodes)),))


def gemma_rmsnorm_linear(prog: Program) -> SGraph:
    """rmsnorm_linear's loop over hidden, on x * (1 + g)."""
    return _gemma(rmsnorm_linear(prog), "gemma_rmsnorm_linear")


def gemma_fused_add_rmsnorm_linear(prog: Program) -> SGraph:
    """fused_add_rmsnorm_linear's loop (writing r), on r * (1 + g)."""
    return _gemma(fused_add_rmsnorm_linear(prog), "gemma_fused_add_rmsnorm_linear")


def rmsnorm_linear_bias(prog: Program) -> SGraph:
    """rmsnorm_linear's loop, the bias added in the epilogue."""
    return _with_bias(rmsnorm_linear(prog), "rmsnorm_linear_bias")


def fused_add_rmsnorm_linear_bias(prog: Program) -> SGraph:
    """fused_add_rmsnorm_linear's loop (writing r), the bias added in the epilogue."""
    return _with_bias(fused_add_rmsnorm_linear(prog), "fused_add_rmsnorm_linear_bias")


def _gated(prog: Program, name: str, act: str) -> SGraph:
    """Both projections accumulated in one loop; act(a) * b in the epilogue."""
    nodes = [load("x", "x", (0, None), fmap=1), load("wg", "w_gate", (None, 0), fmap=1),
             load("wu", "w_up", (None, 0), fmap=1),
             node("a", "matmul", "x", "wg", transpose_b=True), node("b", "matmul", "x", "wu", transpose_b=True),
             accum("acc_a", "a", "sum"), accum("acc_b", "b", "sum"),
             node("ga", act, "acc_a"), node("y", "mul", "ga", "acc_b"), store("out", "y", "y", (0, 1))]
    k = BlockKernel(name, (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), "F", tuple(nodes))
    return SGraph(f"{name}_oracle", prog, (), (k,))


def swiglu(prog: Program) -> SGraph:
    """Both projections accumulated in one loop; silu(a) * b in the epilogue."""
    return _gated(prog, "swiglu", "silu")


def geglu(prog: Program) -> SGraph:
    """swiglu's design: both projections accumulated in one loop; gelu_tanh(a) * b in the epilogue."""
    return _gated(prog, "geglu", "gelu_tanh")


def rmsnorm_mlp(prog: Program) -> SGraph:
    """Both projections of x*g and sum(x^2) in one loop; (u*r) * (v*r) in the epilogue."""
    hidden = prog.by_name["x"].attr("shape")[1]
    nodes = [load("x", "x", (0, None), fmap=1), load("g", "g", (None, None), fmap=0),
             load("wu", "w_up", (None, 0), fmap=1), load("wv", "w_gate", (None, 0), fmap=1),
             node("xg", "mul", "x", "g"),
             node("u", "matmul", "xg", "wu", transpose_b=True), node("v", "matmul", "xg", "wv", transpose_b=True),
             node("sq", "square", "x"), node("ss", "sum", "sq", dim=-1, keepdim=True),
             accum("acc_u", "u", "sum"), accum("acc_v", "v", "sum"), accum("acc_ss", "ss", "sum"),
             *_rstd_of_sum("acc_ss", hidden, _eps(prog)),
             node("ur", "mul", "acc_u", "r"), node("vr", "mul", "acc_v", "r"), node("y", "mul", "ur", "vr"),
             store("out", "y", "y", (0, 1))]
    k = BlockKernel("rmsnorm_mlp", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), "F", tuple(nodes))
    return SGraph("rmsnorm_mlp_oracle", prog, (), (k,))


def rmsnorm_swiglu(prog: Program) -> SGraph:
    """Both projections of x*g and sum(x^2) in one loop; silu(a*r) * (b*r) in the epilogue."""
    hidden = prog.by_name["x"].attr("shape")[1]
    nodes = [load("x", "x", (0, None), fmap=1), load("g", "g", (None, None), fmap=0),
             load("wg", "w_gate", (None, 0), fmap=1), load("wu", "w_up", (None, 0), fmap=1),
             node("xg", "mul", "x", "g"),
             node("a", "matmul", "xg", "wg", transpose_b=True), node("b", "matmul", "xg", "wu", transpose_b=True),
             node("sq", "square", "x"), node("ss", "sum", "sq", dim=-1, keepdim=True),
             accum("acc_a", "a", "sum"), accum("acc_b", "b", "sum"), accum("acc_ss", "ss", "sum"),
             *_rstd_of_sum("acc_ss", hidden, _eps(prog)),
             node("ar", "mul", "acc_a", "r"), node("br", "mul", "acc_b", "r"), node("sa", "silu", "ar"),
             node("y", "mul", "sa", "br"), store("out", "y", "y", (0, 1))]
    k = BlockKernel("rmsnorm_swiglu", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), "F", tuple(nodes))
    return SGraph("rmsnorm_swiglu_oracle", prog, (), (k,))


def rmsnorm_geglu(prog: Program) -> SGraph:
    """rmsnorm_swiglu's loop; gelu_tanh(a*r) * (b*r) in the epilogue."""
    g = rmsnorm_swiglu(prog)
    (k,) = g.kernels
    nodes = tuple(replace(n, op="gelu_tanh") if n.op == "silu" else n for n in k.nodes)
    return SGraph("rmsnorm_geglu_oracle", prog, (), (BlockKernel("rmsnorm_geglu", k.grid, k.forloop, nodes),))


def gemma_rmsnorm_geglu(prog: Program) -> SGraph:
    """rmsnorm_geglu's loop, on x * (1 + g)."""
    return _gemma(rmsnorm_geglu(prog), "gemma_rmsnorm_geglu")


def attention(prog: Program) -> SGraph:
    """Split-KV (flash-decoding): S splits of the KV sequence, each an online-softmax loop of F
    steps writing an unnormalised partial output, its row sum and row max; a combine kernel
    rescales the partials to the global max and normalises."""
    return _split_kv(prog, "attention_split_kv_oracle", [load("q", "q", (0, 1, None))],
                     [load("k", "k", (0, 1, 2), fmap=2)], "q", "k")


def qk_norm_attention(prog: Program) -> SGraph:
    """Split-KV attention with RMSNorm of each Q row before the loop and of each K row inside it."""
    eps = _eps(prog)
    q_side = [load("q", "q", (0, 1, None)), load("q_w", "q_w", (None, None, None)),
              *_rms_nodes("q", eps, "q_"), node("q_xr", "mul", "q", "q_r"), node("qn", "mul", "q_xr", "q_w")]
    k_side = [load("k", "k", (0, 1, 2), fmap=2), load("k_w", "k_w", (None, None, None)),
              *_rms_nodes("k", eps, "k_"), node("k_xr", "mul", "k", "k_r"), node("kn", "mul", "k_xr", "k_w")]
    return _split_kv(prog, "qk_norm_attention_split_kv_oracle", q_side, k_side, "qn", "kn")


def _split_kv(prog: Program, name: str, q_side: list[Node], k_side: list[Node], q: str, k: str) -> SGraph:
    b, hk, gq, hd = prog.by_name["q"].attr("shape")
    scale = prog.by_name["scale"].attr("value")
    split = lambda *dims: tuple(to_expr(d) for d in dims)  # noqa: E731
    inter = (TensorDecl("o_part", split(b, hk, "S", gq, hd), "float32"),
             TensorDecl("l_part", split(b, hk, "S", gq, 1), "float32"),
             TensorDecl("m_part", split(b, hk, "S", gq, 1), "float32"))
    partial = [
        *q_side, *k_side, load("v", "v", (0, 1, 2), fmap=2),
        node("s", "matmul", q, k, transpose_b=True), node("scale", "const", value=scale),
        node("ss", "mul", "s", "scale"), node("rowmax", "max", "ss", dim=-1, keepdim=True),
        accum("m", "rowmax", "max"), node("z", "sub", "ss", "m"), node("e", "exp", "z"),
        node("rowsum", "sum", "e", dim=-1, keepdim=True), accum("l", "rowsum", "rescaled_sum", "m"),
        node("pv", "matmul", "e", "v"), accum("acc", "pv", "rescaled_sum", "m"),
        store("st_o", "acc", "o_part", (0, 1, 2)), store("st_l", "l", "l_part", (0, 1, 2)),
        store("st_m", "m", "m_part", (0, 1, 2))]
    combine = [
        load("op", "o_part", (0, 1)), load("lp", "l_part", (0, 1)), load("mp", "m_part", (0, 1)),
        node("mx", "max", "mp", dim=2, keepdim=True), node("dm", "sub", "mp", "mx"), node("w", "exp", "dm"),
        node("ow", "mul", "op", "w"), node("num", "sum", "ow", dim=2),
        node("lw", "mul", "lp", "w"), node("den", "sum", "lw", dim=2),
        node("o", "div", "num", "den"), store("st", "o", "o", (0, 1))]
    k1 = BlockKernel("split_kv", (GridAxis("B"), GridAxis("H"), GridAxis("S")), "F", tuple(partial))
    k2 = BlockKernel("combine", (GridAxis("B"), GridAxis("H")), None, tuple(combine))
    return SGraph(name, prog, inter, (k1, k2))


HEAD_BLOCK = "HB"  # grid axis over head blocks: a count dividing both q's and k's heads


def _rotary_dims(prog: Program) -> tuple[int, int, bool]:
    """(head_dim, rotary_dim, GPT-J style) of a rotary Program."""
    head_dim = prog.by_name["q"].attr("shape")[2]
    rotary_dim = prog.by_name["cos_sin_cache"].attr("shape")[1]
    return head_dim, rotary_dim, any(n.op == "concat" and n.attr("interleave") for n in prog.nodes)


def _cos_sin_rows(rotary_dim: int) -> list[Node]:
    """cos and sin (BT, 1, R/2): each an indexed load of its half of the cache's rows by the
    position tile, loaded once per block and shared by q's and k's heads."""
    half = rotary_dim // 2
    return [load("pos", "positions", (0, None)), load("cache", "cos_sin_cache", (None, None)),
            node("cos_t", "slice", "cache", dim=1, start=0, stop=half),
            node("sin_t", "slice", "cache", dim=1, start=half, stop=rotary_dim),
            node("cos", "gather", "cos_t", "pos", dim=0), node("sin", "gather", "sin_t", "pos", dim=0)]


def _halves(x: str, dim: int, rotary_dim: int, gptj: bool, prefix: str) -> list[Node]:
    """The two rotated halves of `x` along `dim` as windows: neox's first / second half of the
    rotary part, GPT-J's even / odd elements."""
    if gptj:
        return [node(f"{prefix}1", "slice", x, dim=dim, start=0, stop=rotary_dim, step=2),
                node(f"{prefix}2", "slice", x, dim=dim, start=1, stop=rotary_dim, step=2)]
    return [node(f"{prefix}1", "slice", x, dim=dim, start=0, stop=rotary_dim // 2),
            node(f"{prefix}2", "slice", x, dim=dim, start=rotary_dim // 2, stop=rotary_dim)]


def _rotate(p: str, x1: str, x2: str, passed: str | None, gptj: bool, out: str) -> list[Node]:
    """o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, stored as their concat (interleaved for GPT-J)
    and the pass-through part `passed`: one store per part, at its offset."""
    nodes = [node(f"{p}_a", "mul", x1, "cos"), node(f"{p}_b", "mul", x2, "sin"),
             node(f"{p}_o1", "sub", f"{p}_a", f"{p}_b"),
             node(f"{p}_c", "mul", x2, "cos"), node(f"{p}_d", "mul", x1, "sin"),
             node(f"{p}_o2", "add", f"{p}_c", f"{p}_d"),
             node(f"{p}_rot", "concat", f"{p}_o1", f"{p}_o2", dim=2, interleave=gptj)]
    if passed:
        nodes.append(node(f"{p}_cat", "concat", f"{p}_rot", passed, dim=2))
    return nodes + [store(f"st_{p}", f"{p}_cat" if passed else f"{p}_rot", out, (0, 1))]


def rotary(prog: Program) -> SGraph:
    """One kernel per (token block, head block): cos / sin rows gathered once for q and k alike,
    each half of q's and k's heads a windowed load, the rotated halves (and the pass-through part)
    stored at their offsets: no concat materialised."""
    head_dim, rotary_dim, gptj = _rotary_dims(prog)
    nodes = _cos_sin_rows(rotary_dim)
    for x in ("q", "k"):
        nodes += [load(x, x, (0, 1)), *_halves(x, 2, rotary_dim, gptj, f"{x}_x")]
        passed = None
        if rotary_dim < head_dim:
            passed = f"{x}_pass"
            nodes.append(node(passed, "slice", x, dim=2, start=rotary_dim, stop=head_dim))
        nodes += _rotate(x, f"{x}_x1", f"{x}_x2", passed, gptj, f"{x}_out")
    k = BlockKernel("rotary", (GridAxis(TOKEN_BLOCK, True), GridAxis(HEAD_BLOCK)), None, tuple(nodes))
    return SGraph("rotary_oracle", prog, (), (k,))


def qk_norm_rotary(prog: Program) -> SGraph:
    """rotary's kernel with the norm in the same pass over each head: rsqrt(mean(x^2) + eps) from
    the whole head, then the rotation of the normed halves, x_i * r * w_i, each a windowed load of
    x and of its weight."""
    head_dim, rotary_dim, gptj = _rotary_dims(prog)
    eps = _eps(prog)
    nodes = _cos_sin_rows(rotary_dim)
    for x in ("q", "k"):
        nodes += [load(x, x, (0, 1)), load(f"{x}_w", f"{x}_weight", (None, None)), *_rms_nodes(x, eps, f"{x}_"),
                  *_halves(x, 2, rotary_dim, gptj, f"{x}_x"), *_halves(f"{x}_w", 0, rotary_dim, gptj, f"{x}_w")]
        parts = ["1", "2"] + (["p"] if rotary_dim < head_dim else [])
        if rotary_dim < head_dim:
            nodes += [node(f"{x}_xp", "slice", x, dim=2, start=rotary_dim, stop=head_dim),
                      node(f"{x}_wp", "slice", f"{x}_w", dim=0, start=rotary_dim, stop=head_dim)]
        for i in parts:
            nodes += [node(f"{x}_r{i}", "mul", f"{x}_x{i}", f"{x}_r"), node(f"{x}_n{i}", "mul", f"{x}_r{i}", f"{x}_w{i}")]
        nodes += _rotate(x, f"{x}_n1", f"{x}_n2", f"{x}_np" if rotary_dim < head_dim else None, gptj, f"{x}_out")
    k = BlockKernel("qk_norm_rotary", (GridAxis(TOKEN_BLOCK, True), GridAxis(HEAD_BLOCK)), None, tuple(nodes))
    return SGraph("qk_norm_rotary_oracle", prog, (), (k,))


CHOICE_AXIS = "K"  # grid axis over a token's top-k choices: one choice per block
ONE_PER_STEP = ("FK",)  # loops over a token's top-k choices: one choice per step


def _moe_experts(prog: Program) -> SGraph:
    """Two kernels for the routed experts, each token's chosen experts' rows gathered by id:
    `moe_up` per (token, choice, intermediate block) loops over hidden, accumulating the products
    with the gate and up rows of that block (the two halves of w13's window), and writes
    act(gate) * up as h (T, k, 1, 1, I); `moe_down` per (token, hidden block) loops over the
    choices, each step h times its expert's w2 rows, weighted by its routing weight and
    accumulated. No tile holds a whole expert: the w13 window is 2 x (I / GI) x (H / F), the w2 rows
    (H / G) x I (a whole intermediate row, which Mixtral's 14336 is too long for)."""
    act = next(n.op for n in prog.nodes if n.name == "act")
    inter = prog.by_name["w13"].attr("shape")[2]
    top_k = prog.by_name["topk_ids"].attr("shape")[1]
    h = TensorDecl("h", tuple(to_expr(d) for d in (TOKENS, top_k, 1, 1, inter)), "float32")
    up = [load("ids", "topk_ids", (0, 1, None)), load("x", "x", (0, None, None), fmap=4),
          load("w13", "w13", (None, None, 2), fmap=3),
          node("w1_t", "slice", "w13", dim=1, start=0, stop=1, step=1),
          node("w3_t", "slice", "w13", dim=1, start=1, stop=2, step=1),
          node("w1_e", "gather", "w1_t", "ids", dim=0), node("w3_e", "gather", "w3_t", "ids", dim=0),
          node("g", "matmul", "x", "w1_e", transpose_b=True), node("u", "matmul", "x", "w3_e", transpose_b=True),
          accum("gate", "g", "sum"), accum("upv", "u", "sum"),
          node("a", act, "gate"), node("hv", "mul", "a", "upv"), store("st_h", "hv", "h", (0, 1, 4))]
    down = [load("ids", "topk_ids", (0, None), fmap=1), load("hk", "h", (0, None), fmap=1),
            load("wk", "topk_weights", (0, None), fmap=1), load("w2", "w2", (None, 2)),
            node("w2_e", "gather", "w2", "ids", dim=0), node("y", "matmul", "hk", "w2_e", transpose_b=True),
            node("yw", "mul", "y", "wk"), node("ys", "sum", "yw", dim=1, keepdim=True), accum("o", "ys", "sum"),
            store("st", "o", "out", (0, 4))]
    k1 = BlockKernel("moe_up", (GridAxis(TOKEN_BLOCK, True), GridAxis(CHOICE_AXIS), GridAxis("GI")), "F", tuple(up))
    k2 = BlockKernel("moe_down", (GridAxis(TOKEN_BLOCK, True), GridAxis("G")), ONE_PER_STEP[0], tuple(down))
    return SGraph(f"{prog.name}_oracle", prog, (h,), (k1, k2))


ORACLES: dict[str, Callable[[Program], SGraph]] = {
    "rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, "silu_and_mul": silu_and_mul,
    "rmsnorm_linear": rmsnorm_linear, "fused_add_rmsnorm_linear": fused_add_rmsnorm_linear, "swiglu": swiglu,
    "rmsnorm_mlp": rmsnorm_mlp, "rmsnorm_swiglu": rmsnorm_swiglu, "rmsnorm_geglu": rmsnorm_geglu,
    "rmsnorm_linear_bias": rmsnorm_linear_bias, "fused_add_rmsnorm_linear_bias": fused_add_rmsnorm_linear_bias,
    "gemma_rms_norm": gemma_rms_norm, "gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
    "gelu_tanh_and_mul": gelu_tanh_and_mul, "geglu": geglu,
    "gemma_rmsnorm_linear": gemma_rmsnorm_linear, "gemma_fused_add_rmsnorm_linear": gemma_fused_add_rmsnorm_linear,
    "gemma_rmsnorm_geglu": gemma_rmsnorm_geglu,
    "attention": attention,
    "qk_norm_attention": qk_norm_attention,
    "rotary": rotary, "qk_norm_rotary": qk_norm_rotary,
    "moe_experts": _moe_experts, "moe_experts_gelu_tanh": _moe_experts,
}


def oracle(prog: Program) -> SGraph:
    if prog.name not in ORACLES:
        raise SGraphError(f"no hand-built sGraph for program {prog.name!r}; have: {', '.join(ORACLES)}")
    return ORACLES[prog.name](prog)


def default_assignment(g: SGraph, *, block_tokens: int = 16, target_tile: int = 64,
                       kv_splits: int = 4) -> dict[str, int]:
    """A valid assignment: token blocks of `block_tokens`, one batch entry / head per block,
    `kv_splits` KV splits, other dims split in powers of two while tiles stay >= `target_tile`."""
    out: dict[str, int] = {}
    for k in g.kernels:
        if not isinstance(k, BlockKernel):
            continue
        for axis, dim_size in _axis_sizes(g, k):
            if axis.over_tokens:
                out[axis.symbol] = block_tokens
            elif axis.symbol in ONE_PER_BLOCK:
                out[axis.symbol] = dim_size
            elif axis.symbol == "S":
                out["S"] = kv_splits
            elif axis.symbol not in out:
                out[axis.symbol] = _split(dim_size, target_tile)
        if k.forloop:
            size = _loop_size(g, k) // _grid_share(g, k, out)
            out[k.forloop] = size if k.forloop in ONE_PER_STEP else _split(size, target_tile)
    return {s: v for s, v in out.items() if s in g.symbols}


def fitting_instance(g: SGraph, gpu: GpuSpec, *, target_tile: int = 64, kv_splits: int = 4) -> Instance:
    """The default assignment with the largest token block (16 down to 1) that fits `gpu`."""
    error: SGraphError | None = None
    for block_tokens in (16, 8, 4, 2, 1):
        try:
            return instantiate(g, default_assignment(g, block_tokens=block_tokens, target_tile=target_tile,
                                                     kv_splits=kv_splits), gpu)
        except SGraphError as exc:
            error = exc
    raise error


def _axis_sizes(g: SGraph, k: BlockKernel):
    for a, axis in enumerate(k.grid):
        for n in k.loads + k.stores:
            imap = n.attr("imap") if n.op == "load" else n.attr("omap")
            d = imap[a]
            shape = g.tensors[n.attr("tensor")].shape
            if d is not None and not shape[d].free_symbols:
                yield axis, int(shape[d])
                break
        else:
            yield axis, 1


def _loop_size(g: SGraph, k: BlockKernel) -> int:
    n = next(n for n in k.loads if n.attr("fmap") is not None)
    return int(g.tensors[n.attr("tensor")].shape[n.attr("fmap")])


def _grid_share(g: SGraph, k: BlockKernel, values: dict[str, int]) -> int:
    """How many grid blocks split the loop's data dim before the loop does (split-KV)."""
    n = next(n for n in k.loads if n.attr("fmap") is not None)
    share = 1
    for axis, d in zip(k.grid, n.attr("imap")):
        if d == n.attr("fmap"):
            share *= values[axis.symbol]
    return share


def _split(size: int, target: int) -> int:
    parts = 1
    while size % (parts * 2) == 0 and size // (parts * 2) >= target:
        parts *= 2
    return parts
