"""The workloads as Programs: the five Prism workloads and vLLM's per-layer ops.

Weights use vLLM's layout (out_features, in_features), so projections are
``x @ W^T`` (matmul with transpose_b); norm weights are vectors of the hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.program import NUM_TOKENS as N
from prism_serve.optimize.ir.program import Node, Program, node

EPS = 1e-6


def rms_norm(hidden: int = 4096, dtype: str = "float16", eps: float = EPS) -> Program:
    return Program("rms_norm", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("w", "input", shape=(hidden,), dtype=dtype),
        node("y", "rms_norm", "x", "w", eps=eps),
    ), ("y",))


def fused_add_rms_norm(hidden: int = 4096, dtype: str = "float16", eps: float = EPS) -> Program:
    """vLLM's fused op: residual' = x + residual; y = rms_norm(residual') * w. Outputs (y, residual')."""
    return Program("fused_add_rms_norm", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("residual", "input", shape=(N, hidden), dtype=dtype),
        node("w", "input", shape=(hidden,), dtype=dtype),
        node("r", "add", "x", "residual"),
        node("y", "rms_norm", "r", "w", eps=eps),
    ), ("y", "r"))


def silu_and_mul(intermediate: int = 4096, dtype: str = "float16") -> Program:
    """vLLM's SiluAndMul on the two halves of gate_up's output, passed as two (strided) views."""
    return Program("silu_and_mul", (
        node("gate", "input", shape=(N, intermediate), dtype=dtype),
        node("up", "input", shape=(N, intermediate), dtype=dtype),
        node("g", "silu", "gate"),
        node("y", "mul", "g", "up"),
    ), ("y",))


def _offset_weight(w: str) -> list[Node]:
    """Gemma's norm scale `1 + w` (vLLM's GemmaRMSNorm: `weight.float() + 1.0`)."""
    return [node("one", "const", value=1.0), node("w1", "add", w, "one")]


def gemma_rms_norm(hidden: int = 4096, dtype: str = "float16", eps: float = EPS) -> Program:
    """vLLM's GemmaRMSNorm: y = rms_norm(x) * (1 + w), all in float32, rounded once to x's dtype
    (vLLM adds 1 to the float32 weight and runs its RMSNorm with that weight)."""
    return Program("gemma_rms_norm", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("w", "input", shape=(hidden,), dtype=dtype),
        *_offset_weight("w"),
        node("y", "rms_norm", "x", "w1", eps=eps),
    ), ("y",))


def gemma_fused_add_rms_norm(hidden: int = 4096, dtype: str = "float16", eps: float = EPS) -> Program:
    """GemmaRMSNorm with a residual: r = x + residual; y = rms_norm(r) * (1 + w). Outputs (y, r)."""
    return Program("gemma_fused_add_rms_norm", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("residual", "input", shape=(N, hidden), dtype=dtype),
        node("w", "input", shape=(hidden,), dtype=dtype),
        node("r", "add", "x", "residual"),
        *_offset_weight("w"),
        node("y", "rms_norm", "r", "w1", eps=eps),
    ), ("y", "r"))


def gelu_tanh_and_mul(intermediate: int = 4096, dtype: str = "float16") -> Program:
    """vLLM's GeluAndMul(approximate="tanh") on the two halves of gate_up's output: gelu_tanh(gate) * up."""
    return Program("gelu_tanh_and_mul", (
        node("gate", "input", shape=(N, intermediate), dtype=dtype),
        node("up", "input", shape=(N, intermediate), dtype=dtype),
        node("g", "gelu_tanh", "gate"),
        node("y", "mul", "g", "up"),
    ), ("y",))


def geglu(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16") -> Program:
    """Gemma's MLP input: gelu_tanh(x @ W_gate^T) * (x @ W_up^T)."""
    inter = intermediate or hidden
    return Program("geglu", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("w_gate", "input", shape=(inter, hidden), dtype=dtype),
        node("w_up", "input", shape=(inter, hidden), dtype=dtype),
        node("a", "matmul", "x", "w_gate", transpose_b=True),
        node("b", "matmul", "x", "w_up", transpose_b=True),
        node("ga", "gelu_tanh", "a"),
        node("y", "mul", "ga", "b"),
    ), ("y",))


def rmsnorm_linear(hidden: int = 4096, out: int | None = None, dtype: str = "float16", eps: float = EPS) -> Program:
    out = out or hidden
    return Program("rmsnorm_linear", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("g", "input", shape=(hidden,), dtype=dtype),
        node("w", "input", shape=(out, hidden), dtype=dtype),
        node("xn", "rms_norm", "x", "g", eps=eps),
        node("y", "matmul", "xn", "w", transpose_b=True),
    ), ("y",))


def fused_add_rmsnorm_linear(hidden: int = 4096, out: int | None = None, dtype: str = "float16",
                             eps: float = EPS) -> Program:
    """vLLM's decoder input: r = x + residual; y = rms_norm(r, g) @ W^T. Outputs (y, r): the sum
    is the next layer's residual, so a fused kernel must also write it."""
    out = out or hidden
    return Program("fused_add_rmsnorm_linear", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("residual", "input", shape=(N, hidden), dtype=dtype),
        node("g", "input", shape=(hidden,), dtype=dtype),
        node("w", "input", shape=(out, hidden), dtype=dtype),
        node("r", "add", "x", "residual"),
        node("xn", "rms_norm", "r", "g", eps=eps),
        node("y", "matmul", "xn", "w", transpose_b=True),
    ), ("y", "r"))


def _gemma(prog: Program, name: str) -> Program:
    """A norm + projection Program on Gemma's norm: the norm scales by 1 + g, g the stored weight
    (vLLM's GemmaRMSNorm hands its RMSNorm op `g.float() + 1.0`; in float32, rounded once as there)."""
    inputs = [n for n in prog.nodes if n.op == "input"]
    body = [replace(n, inputs=tuple("g1" if i == "g" else i for i in n.inputs)) for n in prog.nodes if n.op != "input"]
    return Program(name, tuple(inputs + [node("one", "const", value=1.0), node("g1", "add", "g", "one")] + body),
                   prog.outputs)


def gemma_rmsnorm_linear(hidden: int = 4096, out: int | None = None, dtype: str = "float16",
                         eps: float = EPS) -> Program:
    """Gemma's first input norm + qkv: y = rms_norm(x) * (1 + g) @ W^T."""
    return _gemma(rmsnorm_linear(hidden, out, dtype, eps), "gemma_rmsnorm_linear")


def gemma_fused_add_rmsnorm_linear(hidden: int = 4096, out: int | None = None, dtype: str = "float16",
                                   eps: float = EPS) -> Program:
    """Gemma's input side: r = x + residual; y = rms_norm(r) * (1 + g) @ W^T. Outputs (y, r)."""
    return _gemma(fused_add_rmsnorm_linear(hidden, out, dtype, eps), "gemma_fused_add_rmsnorm_linear")


def _with_bias(prog: Program, name: str) -> Program:
    """A norm + projection Program whose projection adds a bias b (as Qwen2's qkv): the input b
    after w, the product renamed p, and y = p + b; the outputs stay as they were."""
    w = prog.by_name["w"]
    nodes = [n for n in prog.nodes if n.op == "input"] + [node("b", "input", shape=(w.attr("shape")[0],),
                                                               dtype=w.attr("dtype"))]
    nodes += [replace(n, name="p") if n.name == "y" else n for n in prog.nodes if n.op != "input"]
    return Program(name, tuple(nodes + [node("y", "add", "p", "b")]), prog.outputs)


def rmsnorm_linear_bias(hidden: int = 4096, out: int | None = None, dtype: str = "float16",
                        eps: float = EPS) -> Program:
    """rmsnorm_linear with the projection's bias: y = rms_norm(x, g) @ W^T + b."""
    return _with_bias(rmsnorm_linear(hidden, out, dtype, eps), "rmsnorm_linear_bias")


def fused_add_rmsnorm_linear_bias(hidden: int = 4096, out: int | None = None, dtype: str = "float16",
                                  eps: float = EPS) -> Program:
    """fused_add_rmsnorm_linear with the projection's bias: r = x + residual;
    y = rms_norm(r, g) @ W^T + b. Outputs (y, r)."""
    return _with_bias(fused_add_rmsnorm_linear(hidden, out, dtype, eps), "fused_add_rmsnorm_linear_bias")


def swiglu(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16") -> Program:
    inter = intermediate or hidden
    return Program("swiglu", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("w_gate", "input", shape=(inter, hidden), dtype=dtype),
        node("w_up", "input", shape=(inter, hidden), dtype=dtype),
        node("a", "matmul", "x", "w_gate", transpose_b=True),
        node("b", "matmul", "x", "w_up", transpose_b=True),
        node("sa", "silu", "a"),
        node("y", "mul", "sa", "b"),
    ), ("y",))


def rmsnorm_mlp(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16",
                eps: float = EPS) -> Program:
    inter = intermediate or hidden
    return Program("rmsnorm_mlp", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("g", "input", shape=(hidden,), dtype=dtype),
        node("w_up", "input", shape=(inter, hidden), dtype=dtype),
        node("w_gate", "input", shape=(inter, hidden), dtype=dtype),
        node("xn", "rms_norm", "x", "g", eps=eps),
        node("u", "matmul", "xn", "w_up", transpose_b=True),
        node("v", "matmul", "xn", "w_gate", transpose_b=True),
        node("y", "mul", "u", "v"),
    ), ("y",))


def rmsnorm_swiglu(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16",
                   eps: float = EPS) -> Program:
    """vLLM's post_attention_layernorm -> gate_up_proj -> SiluAndMul: silu(xn @ W_gate^T) * (xn @ W_up^T)."""
    inter = intermediate or hidden
    return Program("rmsnorm_swiglu", (
        node("x", "input", shape=(N, hidden), dtype=dtype),
        node("g", "input", shape=(hidden,), dtype=dtype),
        node("w_gate", "input", shape=(inter, hidden), dtype=dtype),
        node("w_up", "input", shape=(inter, hidden), dtype=dtype),
        node("xn", "rms_norm", "x", "g", eps=eps),
        node("a", "matmul", "xn", "w_gate", transpose_b=True),
        node("b", "matmul", "xn", "w_up", transpose_b=True),
        node("sa", "silu", "a"),
        node("y", "mul", "sa", "b"),
    ), ("y",))


def rmsnorm_geglu(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16",
                  eps: float = EPS) -> Program:
    """Gemma's pre-MLP RMSNorm -> gate_up_proj -> GeluAndMul(tanh): rmsnorm_swiglu with tanh GELU,
    gelu_tanh(xn @ W_gate^T) * (xn @ W_up^T)."""
    base = rmsnorm_swiglu(hidden, intermediate, dtype, eps)
    renamed = {"sa": "ga"}
    nodes = tuple(replace(n, name=renamed.get(n.name, n.name), op="gelu_tanh" if n.op == "silu" else n.op,
                          inputs=tuple(renamed.get(i, i) for i in n.inputs)) for n in base.nodes)
    return Program("rmsnorm_geglu", nodes, base.outputs)


def gemma_rmsnorm_geglu(hidden: int = 4096, intermediate: int | None = None, dtype: str = "float16",
                        eps: float = EPS) -> Program:
    """rmsnorm_geglu on Gemma's norm, scaling by 1 + g: Gemma's pre-MLP norm + gate_up + GeGLU."""
    return _gemma(rmsnorm_geglu(hidden, intermediate, dtype, eps), "gemma_rmsnorm_geglu")


def _attention_nodes(q: str, k: str, v: str, head_dim: int) -> list[Node]:
    """softmax(q k^T / sqrt(head_dim)) v with the row max subtracted (numerically honest)."""
    return [
        node("s", "matmul", q, k, transpose_b=True),
        node("scale", "const", value=1.0 / math.sqrt(head_dim)),
        node("ss", "mul", "s", "scale"),
        node("m", "max", "ss", dim=-1, keepdim=True),
        node("z", "sub", "ss", "m"),
        node("e", "exp", "z"),
        node("l", "sum", "e", dim=-1, keepdim=True),
        node("p", "div", "e", "l"),
        node("o", "matmul", "p", v),
    ]


def _attention_inputs(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                      kv_heads: int | None, dtype: str) -> list[Node]:
    """GQA packed per KV head: Q is (batch, kv_heads, group * q_len, head_dim)."""
    kv_heads = kv_heads or min(heads, 8)
    if heads % kv_heads:
        raise ProgramError(f"attention: heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    return [
        node("q", "input", shape=(batch, kv_heads, group * q_len, head_dim), dtype=dtype),
        node("k", "input", shape=(batch, kv_heads, kv_len, head_dim), dtype=dtype),
        node("v", "input", shape=(batch, kv_heads, kv_len, head_dim), dtype=dtype),
    ]


def attention(batch: int = 2, heads: int = 8, q_len: int = 1, kv_len: int = 1024, head_dim: int = 128,
              kv_heads: int | None = None, dtype: str = "float16") -> Program:
    nodes = _attention_inputs(batch, heads, q_len, kv_len, head_dim, kv_heads, dtype)
    return Program("attention", tuple(nodes + _attention_nodes("q", "k", "v", head_dim)), ("o",))


def qk_norm_attention(batch: int = 2, heads: int = 8, q_len: int = 1, kv_len: int = 1024, head_dim: int = 128,
                      kv_heads: int | None = None, dtype: str = "float16", eps: float = EPS) -> Program:
    nodes = _attention_inputs(batch, heads, q_len, kv_len, head_dim, kv_heads, dtype) + [
        node("q_w", "input", shape=(head_dim,), dtype=dtype),
        node("k_w", "input", shape=(head_dim,), dtype=dtype),
        node("qn", "rms_norm", "q", "q_w", eps=eps),
        node("kn", "rms_norm", "k", "k_w", eps=eps),
    ]
    return Program("qk_norm_attention", tuple(nodes + _attention_nodes("qn", "kn", "v", head_dim)), ("o",))


ROTARY_STYLES = ("neox", "gptj")


def _rotation(x: str, head_dim: int, rotary_dim: int, style: str, out: str) -> list[Node]:
    """`out` = `x` (T, H, D) rotated by the `cos` / `sin` (T, 1, R/2) nodes: neox rotates the halves
    of x[..., :R], GPT-J its even and odd elements (interleaved back); x[..., R:] passes through."""
    half = rotary_dim // 2
    if style == "neox":
        parts = [node(f"{x}_x1", "slice", x, dim=2, start=0, stop=half),
                 node(f"{x}_x2", "slice", x, dim=2, start=half, stop=rotary_dim)]
    else:
        parts = [node(f"{x}_x1", "slice", x, dim=2, start=0, stop=rotary_dim, step=2),
                 node(f"{x}_x2", "slice", x, dim=2, start=1, stop=rotary_dim, step=2)]
    rot = out if rotary_dim == head_dim else f"{x}_rot"
    nodes = parts + [
        node(f"{x}_a", "mul", f"{x}_x1", "cos"), node(f"{x}_b", "mul", f"{x}_x2", "sin"),
        node(f"{x}_o1", "sub", f"{x}_a", f"{x}_b"),
        node(f"{x}_c", "mul", f"{x}_x2", "cos"), node(f"{x}_d", "mul", f"{x}_x1", "sin"),
        node(f"{x}_o2", "add", f"{x}_c", f"{x}_d"),
        node(rot, "concat", f"{x}_o1", f"{x}_o2", dim=2, interleave=style == "gptj"),
    ]
    if rotary_dim < head_dim:
        nodes += [node(f"{x}_pass", "slice", x, dim=2, start=rotary_dim, stop=head_dim),
                  node(out, "concat", rot, f"{x}_pass", dim=2)]
    return nodes


def _rotary_checked(head_dim: int, rotary_dim: int, style: str) -> None:
    if style not in ROTARY_STYLES:
        raise ProgramError(f"rotary: style {style!r} is not one of {ROTARY_STYLES}")
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ProgramError(f"rotary: rotary_dim {rotary_dim} must be even and in [2, head_dim {head_dim}]")


def _cos_sin(rotary_dim: int) -> list[Node]:
    """cos and sin (T, 1, R/2) of each token: its row of vLLM's cache, cos in the first half, sin in the rest."""
    return [node("cs", "gather", "cos_sin_cache", "positions", dim=0),
            node("cos", "slice", "cs", dim=2, start=0, stop=rotary_dim // 2),
            node("sin", "slice", "cs", dim=2, start=rotary_dim // 2, stop=rotary_dim)]


def _rotary_inputs(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: str) -> list[Node]:
    return [node("q", "input", shape=(N, num_q_heads, head_dim), dtype=dtype),
            node("k", "input", shape=(N, num_kv_heads, head_dim), dtype=dtype)]


def _position_inputs(rotary_dim: int, max_position: int, dtype: str) -> list[Node]:
    return [node("positions", "input", shape=(N, 1), dtype="int64"),
            node("cos_sin_cache", "input", shape=(max_position, rotary_dim), dtype=dtype)]


def rotary(num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, rotary_dim: int | None = None,
           max_position: int = 4096, dtype: str = "float16", style: str = "neox") -> Program:
    """vLLM's RotaryEmbedding on q (T, Hq, D) and k (T, Hk, D): each token's cos / sin row gathered
    from cos_sin_cache (max_position, R) by its position, rotating the first R = rotary_dim of each
    head (neox: rotate_half; gptj: interleaved pairs). Outputs (q_out, k_out)."""
    rotary_dim = rotary_dim or head_dim
    _rotary_checked(head_dim, rotary_dim, style)
    return Program("rotary", tuple(
        _rotary_inputs(num_q_heads, num_kv_heads, head_dim, dtype) + _position_inputs(rotary_dim, max_position, dtype)
        + _cos_sin(rotary_dim) + _rotation("q", head_dim, rotary_dim, style, "q_out")
        + _rotation("k", head_dim, rotary_dim, style, "k_out")), ("q_out", "k_out"))


def qk_norm_rotary(num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, rotary_dim: int | None = None,
                   max_position: int = 4096, eps: float = EPS, dtype: str = "float16",
                   style: str = "neox") -> Program:
    """Qwen3's QK-norm then rotary: per-head rms_norm of q and k over D (times q_weight / k_weight,
    as vLLM's RMSNorm), then `rotary` of the normed heads. Outputs (q_out, k_out)."""
    rotary_dim = rotary_dim or head_dim
    _rotary_checked(head_dim, rotary_dim, style)
    return Program("qk_norm_rotary", tuple(
        _rotary_inputs(num_q_heads, num_kv_heads, head_dim, dtype)
        + [node("q_weight", "input", shape=(head_dim,), dtype=dtype),
           node("k_weight", "input", shape=(head_dim,), dtype=dtype)]
        + _position_inputs(rotary_dim, max_position, dtype)
        + [node("qn", "rms_norm", "q", "q_weight", eps=eps), node("kn", "rms_norm", "k", "k_weight", eps=eps)]
        + _cos_sin(rotary_dim) + _rotation("qn", head_dim, rotary_dim, style, "q_out")
        + _rotation("kn", head_dim, rotary_dim, style, "k_out")), ("q_out", "k_out"))


EXPERTS_PROGRAMS = {"silu": "moe_experts", "gelu_tanh": "moe_experts_gelu_tanh"}  # activation -> Program name


def moe_experts(num_experts: int = 128, top_k: int = 8, hidden: int = 2048, intermediate: int = 768,
                dtype: str = "float16", activation: str = "silu") -> Program:
    """The routed experts of a mixture-of-experts layer, as vLLM's fused MoE computes them: for
    each token t and each of its top-k choices j, expert e = topk_ids[t, j] runs its gated MLP,
    act(x W1_e^T) * (x W3_e^T) W2_e^T, and the outputs are summed weighted by topk_weights[t, j].
    Every tensor is a view of vLLM's, with unit dims so that each choice is a matmul batch dim:
    w13 (E, 2, I, H) is its stacked (E, 2I, H), gate rows then up rows, so that a window of the
    intermediate dim reads both halves; w2 (E, 1, H, I) its (E, H, I); x (T, 1, 1, 1, H), the
    weights (T, k, 1, 1, 1) and the output (T, 1, 1, 1, H) its (T, H) and (T, k) tensors."""
    if activation not in EXPERTS_PROGRAMS:
        raise ProgramError(f"moe_experts activation must be one of {sorted(EXPERTS_PROGRAMS)}, got {activation!r}")
    if not 1 <= top_k <= num_experts:
        raise ProgramError(f"moe_experts needs 1 <= top_k <= num_experts, got top_k {top_k} of {num_experts} experts")
    return Program(EXPERTS_PROGRAMS[activation], (
        node("x", "input", shape=(N, 1, 1, 1, hidden), dtype=dtype),
        node("topk_ids", "input", shape=(N, top_k), dtype="int32"),
        node("topk_weights", "input", shape=(N, top_k, 1, 1, 1), dtype=dtype),
        node("w13", "input", shape=(num_experts, 2, intermediate, hidden), dtype=dtype),
        node("w2", "input", shape=(num_experts, 1, hidden, intermediate), dtype=dtype),
        node("w13_e", "gather", "w13", "topk_ids", dim=0),  # (T, k, 2, I, H): each choice's expert rows
        node("w1_e", "slice", "w13_e", dim=2, start=0, stop=1, step=1),
        node("w3_e", "slice", "w13_e", dim=2, start=1, stop=2, step=1),
        node("gate", "matmul", "x", "w1_e", transpose_b=True),  # (T, k, 1, 1, I)
        node("up", "matmul", "x", "w3_e", transpose_b=True),
        node("act", activation, "gate"),
        node("h", "mul", "act", "up"),
        node("w2_e", "gather", "w2", "topk_ids", dim=0),  # (T, k, 1, H, I)
        node("y", "matmul", "h", "w2_e", transpose_b=True),  # (T, k, 1, 1, H)
        node("weighted", "mul", "y", "topk_weights"),
        node("out", "sum", "weighted", dim=1, keepdim=True),
    ), ("out",))


def moe_experts_gelu_tanh(num_experts: int = 128, top_k: int = 8, hidden: int = 2048, intermediate: int = 768,
                          dtype: str = "float16") -> Program:
    """`moe_experts` with tanh-approximated GELU (vLLM's GELU_TANH activation)."""
    return moe_experts(num_experts, top_k, hidden, intermediate, dtype, "gelu_tanh")


@dataclass(frozen=True)
class Workload:
    """A named Program family with its default dims and the shapes that define success."""

    name: str
    build: Callable[..., Program]
    default_dims: dict = field(default_factory=dict)
    default_num_tokens: tuple[int, ...] = (8, 16)
    shapes: tuple[dict, ...] = ()

    def program(self, **dims) -> Program:
        return self.build(**(self.default_dims | dims))


_NORM_SHAPES = tuple({"hidden": d} for d in (1024, 2048, 4096))
_ATTN_SHAPES = tuple(dict(zip(("batch", "heads", "q_len", "kv_len", "head_dim"), s)) for s in
                     ((2, 8, 1, 1024, 128), (2, 8, 128, 1024, 128), (2, 32, 1, 1024, 128), (4, 8, 1, 1024, 128)))

# Llama-3-8B's and Qwen3-8B's attention heads; full and partial (GLM-4's half) rotary dims, both styles
_ROTARY_DIMS = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
_ROTARY_SHAPES = ({"style": "neox"}, {"style": "gptj"}, {"rotary_dim": 64})

# Qwen3-30B-A3B's experts are the defaults; Mixtral-8x7B's
_MOE_SHAPES = ({"num_experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336},)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("rmsnorm_linear", rmsnorm_linear, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("rmsnorm_mlp", rmsnorm_mlp, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("fused_add_rmsnorm_linear", fused_add_rmsnorm_linear, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("swiglu", swiglu, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("rmsnorm_linear_bias", rmsnorm_linear_bias, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("fused_add_rmsnorm_linear_bias", fused_add_rmsnorm_linear_bias, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("rmsnorm_swiglu", rmsnorm_swiglu, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("rmsnorm_geglu", rmsnorm_geglu, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("attention", attention, {}, default_num_tokens=(), shapes=_ATTN_SHAPES),
    Workload("qk_norm_attention", qk_norm_attention, {}, default_num_tokens=(), shapes=_ATTN_SHAPES),
    Workload("rms_norm", rms_norm, {"hidden": 4096}, default_num_tokens=(1, 16, 256, 4096)),
    Workload("fused_add_rms_norm", fused_add_rms_norm, {"hidden": 4096}, default_num_tokens=(1, 16, 256, 4096)),
    Workload("silu_and_mul", silu_and_mul, {"intermediate": 4096}, default_num_tokens=(1, 16, 256, 4096)),
    Workload("geglu", geglu, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("gemma_rms_norm", gemma_rms_norm, {"hidden": 4096}, default_num_tokens=(1, 16, 256, 4096)),
    Workload("gemma_fused_add_rms_norm", gemma_fused_add_rms_norm, {"hidden": 4096},
             default_num_tokens=(1, 16, 256, 4096)),
    Workload("gelu_tanh_and_mul", gelu_tanh_and_mul, {"intermediate": 4096}, default_num_tokens=(1, 16, 256, 4096)),
    Workload("gemma_rmsnorm_linear", gemma_rmsnorm_linear, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("gemma_fused_add_rmsnorm_linear", gemma_fused_add_rmsnorm_linear, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("gemma_rmsnorm_geglu", gemma_rmsnorm_geglu, {"hidden": 4096}, shapes=_NORM_SHAPES),
    Workload("rotary", rotary, _ROTARY_DIMS, default_num_tokens=(1, 16, 256), shapes=_ROTARY_SHAPES),
    Workload("qk_norm_rotary", qk_norm_rotary, _ROTARY_DIMS, default_num_tokens=(1, 16, 256), shapes=_ROTARY_SHAPES),
    Workload("moe_experts", moe_experts, {}, default_num_tokens=(1, 16, 64, 256), shapes=_MOE_SHAPES),
    Workload("moe_experts_gelu_tanh", moe_experts_gelu_tanh, {}, default_num_tokens=(1, 16, 64, 256),
             shapes=_MOE_SHAPES),
)}
PRISM_WORKLOADS = ("rmsnorm_linear", "rmsnorm_mlp", "swiglu", "attention", "qk_norm_attention")


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ProgramError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
