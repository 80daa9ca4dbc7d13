"""vLLM's path for a region: the yardstick of every speedup prism prints or stores.

For each region kind, the region table names the vLLM kernels that run it today (`vllm_path`:
its fused RMSNorm kernels, its GEMM, its `silu_and_mul`, its `rotary_embedding` and the QK-norm's
RMSNorm of q and of k before it, its fused MoE for the routed experts). Here that path is

- modeled (`vllm_modeled_us`) with the same cost model that prices prism's kernels: vLLM's norm
  and activation kernels as one fused kernel with one token row per block (how vLLM launches
  them), its GEMM as one library kernel; its fused MoE (`_fused_moe_us`) as its two grouped GEMMs and
  the activation between them;
- run (`baseline`), on the Program's inputs, with vLLM's own ops where vLLM is installed, so a
  GPU can time it. Without vLLM, eager torch stands in, and the baseline is named so.

The served path (`served_modeled_us`) is prism's kernel plus what the plugin runs beside it: a
region whose kind has `add_beside` adds the residual in one elementwise kernel that vLLM folds into its norm.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from prism_serve.optimize.instantiate.cost import modeled_us, unfused_us
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.reference import as_torch_function
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.region_table import KINDS, MOE_ACTIVATIONS, STYLE_DIM, Form, RegionKind, kind_of


def _linear(hidden: int, out: int, dtype: str) -> Program:
    return Program("linear", (node("x", "input", shape=(NUM_TOKENS, hidden), dtype=dtype),
                              node("w", "input", shape=(out, hidden), dtype=dtype),
                              node("y", "matmul", "x", "w", transpose_b=True)), ("y",))


def _add(hidden: int, dtype: str) -> Program:
    return Program("residual_add", (node("x", "input", shape=(NUM_TOKENS, hidden), dtype=dtype),
                                    node("residual", "input", shape=(NUM_TOKENS, hidden), dtype=dtype),
                                    node("r", "add", "x", "residual")), ("r",))


def _row_kernel_us(prog: Program, num_tokens: int, gpu: GpuSpec) -> float:
    """One vLLM row kernel (rms_norm, fused_add_rms_norm, silu_and_mul): one token per block, the
    whole row in the block, modeled as the equivalent one-kernel sGraph."""
    g = oracle(prog)
    return modeled_us(instantiate(g, dict.fromkeys(g.symbols, 1), gpu), num_tokens, gpu)


def _path_programs(prog: Program) -> list[tuple[str, Program, int]]:
    """vLLM's kernels for `prog`'s kind (`RegionKind.parts`), each as the Program it computes and its
    rows per token (a QK-norm's RMSNorm runs once per (token, head): its q's, then its k's)."""
    kind = KINDS[prog.name]
    dims = kind.dims_of(prog)
    dtype = prog.inputs[0].attr("dtype")
    eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
    if kind.form.rotary:
        norms = [(kind.norm_op.name, kind.norm_op.program({"hidden": dims["head_dim"]}, dtype, eps), dims[h])
                 for h in ("heads", "kv_heads")] if kind.form.norm else []
        rotary = kind.parts[-1]
        return norms + [(rotary.name, rotary.program(dims, dtype), 1)]
    hidden = dims.get("hidden")
    out = dims.get("out") or 2 * dims.get("intermediate", 0)  # an MLP's merged gate_up projection
    return [("linear", _linear(hidden, out, dtype), 1) if part == "linear"
            else (part.name, part.program(dims, dtype, eps), 1) for part in kind.parts]


def _fused_moe_us(prog: Program, num_tokens: int, gpu: GpuSpec) -> float:
    """vLLM's fused MoE (`fused_moe.py`: tokens sorted into per-expert blocks, one grouped GEMM for w13,
    the activation, one grouped GEMM for w2 and the weighted sum) at `num_tokens`: each grouped GEMM
    priced as one library GEMM that reads every expert the tokens choose once, the expected number
    under uniform routing (fewer than the T * k choices where they repeat, so vLLM is not overpriced),
    over the T * k rows; the activation as vLLM's row kernel on those rows."""
    kind = KINDS[prog.name]
    dims = kind.dims_of(prog)
    dtype = prog.inputs[0].attr("dtype")
    e, k, hidden, inter = (dims[n] for n in ("num_experts", "top_k", "hidden", "intermediate"))
    rows = num_tokens * k
    touched = max(1, min(rows, math.ceil(e * (1 - (1 - 1 / e) ** rows))))
    per_expert = math.ceil(rows / touched)
    act = kind_of(Form(act=kind.form.act))
    return (unfused_us(_linear(hidden, touched * 2 * inter, dtype), per_expert, gpu)
            + _row_kernel_us(act.program({"intermediate": inter}, dtype), rows, gpu)
            + unfused_us(_linear(inter, touched * hidden, dtype), per_expert, gpu))


def vllm_modeled_us(prog: Program, num_tokens: int, gpu: GpuSpec) -> float:
    """vLLM's path for `prog`'s region at `num_tokens`, modeled by prism's cost model."""
    if KINDS[prog.name].form.experts:
        return _fused_moe_us(prog, num_tokens, gpu)
    return sum(unfused_us(p, num_tokens, gpu) if op == "linear" else _row_kernel_us(p, num_tokens * rows, gpu)
               for op, p, rows in _path_programs(prog))


def served_modeled_us(prog: Program, kernel_us: float, num_tokens: int, gpu: GpuSpec) -> float:
    """What the plugin runs for the region: the kernel (`kernel_us`, modeled) and what runs beside it."""
    if not KINDS[prog.name].add_beside:
        return kernel_us
    x = prog.inputs[0]
    return kernel_us + unfused_us(_add(int(x.attr("shape")[-1]), x.attr("dtype")), num_tokens, gpu)


@dataclass(frozen=True)
class Baseline:
    """vLLM's path run on a Program's inputs: `run(*prepare(inputs))` returns its outputs in the
    Program's order. `prepare` (not timed) lays the inputs out as vLLM holds them (merged gate_up
    weight, [gate | up] activations, fresh copies of what vLLM's ops update in place)."""

    name: str  # "vllm" or "torch-eager"
    prepare: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    run: Callable[..., tuple[torch.Tensor, ...]]


def baseline(prog: Program) -> Baseline:
    """vLLM's own ops where vLLM is installed, else eager torch (named so)."""
    try:
        import vllm._custom_ops as vops
    except Exception:  # noqa: BLE001 - vLLM absent or unusable here: eager torch is the yardstick
        vops = None
    if vops is None or prog.name not in KINDS:
        return Baseline("torch-eager", list, as_torch_function(prog))
    eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
    kind = KINDS[prog.name]
    if kind.form.rotary:
        return Baseline("vllm", _prepare(kind), functools.partial(_vllm_rotary, kind.dims_of(prog), vops, eps))
    if kind.form.experts:
        return Baseline("vllm", functools.partial(_prepare_experts, vops),
                        functools.partial(_vllm_experts, vops, MOE_ACTIVATIONS[kind.form.act]))
    return Baseline("vllm", _prepare(kind), _vllm_run(kind, vops, eps))


def _prepare_experts(vops, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The experts Program's inputs as vLLM's fused MoE takes them: x [T, H], the routing weights
    [T, k] in float32, int32 ids, and on the CPU the stacked weights packed as its CPU experts pack
    them (`cpu_prepack_moe_weight`, portable "vec" layout)."""
    x, ids, weights, w13, w2 = inputs
    tokens, (e, _, inter, hidden) = x.shape[0], w13.shape
    w13, w2 = w13.reshape(e, 2 * inter, hidden), w2.reshape(e, hidden, inter)  # vLLM's (E, 2I, H), (E, H, I)
    if not x.is_cuda:
        w13, w2 = vops.cpu_prepack_moe_weight(w13, "vec"), vops.cpu_prepack_moe_weight(w2, "vec")
    return [x.reshape(tokens, -1).contiguous(), ids.to(torch.int32), weights.reshape(tokens, -1).float(), w13, w2]


def _vllm_experts(vops, activation: str, x, ids, weights, w13, w2) -> tuple[torch.Tensor]:
    """vLLM's fused MoE on prepared inputs: its CPU experts' `cpu_fused_moe`, or on CUDA its Triton
    `fused_experts`; the output [T, 1, 1, 1, H], as the Program's."""
    if x.is_cuda:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        out = fused_experts(x, w13, w2, weights, ids, activation=MoEActivation(activation))
    else:
        out = torch.empty_like(x)
        vops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, activation, "vec")
    return (out.reshape(x.shape[0], 1, 1, 1, -1),)


def _norm(vops, eps, x, g):
    out = torch.empty_like(x)
    vops.rms_norm(out, x, g, eps)
    return out


def _silu(vops, gate_up):
    """vLLM's SiluAndMul as it runs on this device: its CUDA kernel, or its torch path on the CPU."""
    if not gate_up.is_cuda:
        from vllm.model_executor.layers.activation import SiluAndMul
        return SiluAndMul.forward_native(gate_up)
    out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    torch.ops._C.silu_and_mul(out, gate_up)
    return out


def _gelu_tanh(gate_up):
    """vLLM's GeluAndMul(approximate="tanh") as it runs on this device: its CUDA kernel, or on the CPU
    its forward_native body (an instance method needing a vLLM config to build, so written out here)."""
    d = gate_up.shape[-1] // 2
    if not gate_up.is_cuda:
        return torch.nn.functional.gelu(gate_up[..., :d], approximate="tanh") * gate_up[..., d:]
    out = torch.empty((*gate_up.shape[:-1], d), dtype=gate_up.dtype, device=gate_up.device)
    torch.ops._C.gelu_tanh_and_mul(out, gate_up)
    return out


def _gemma_weight(w):
    """GemmaRMSNorm's weight as vLLM passes it to its RMSNorm op: float32, plus one."""
    return w.float() + 1.0


def _vllm_ir():
    from vllm import ir
    return ir.ops


def _prepare(kind: RegionKind) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The Program's inputs as vLLM's path takes them: a zero residual where vLLM adds the residual in
    its norm (the sum arrives as x), fresh x and residual where its RMSNorm op updates them in place,
    the merged gate_up weight [w_gate; w_up], and [gate | up] activations; rotary's q and k as fresh
    [tokens, heads * head_dim] rows (its kernel rotates them in place) and positions as [tokens]."""
    f = kind.form

    def prepare(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if f.rotary:
            q, k, *rest, positions, cache = inputs
            return [q.reshape(q.shape[0], -1).clone(), k.reshape(k.shape[0], -1).clone(), *rest,
                    positions.reshape(-1), cache]
        if kind.add_beside:
            inputs = [inputs[0], torch.zeros_like(inputs[0]), *inputs[1:]]
        if f.norm == "rms" and (f.residual or kind.add_beside):
            inputs = [inputs[0].clone(), inputs[1].clone(), *inputs[2:]]
        if f.act:  # the two halves: gate_up's weights, or the activation's inputs
            inputs = [*inputs[:-2], torch.cat(inputs[-2:], dim=0 if f.projection else -1)]
        return inputs
    return prepare


def _vllm_run(kind: RegionKind, vops, eps: float | None) -> Callable[..., tuple[torch.Tensor, ...]]:
    """vLLM's path for `kind` on the prepared inputs: its norm (its fused RMSNorm kernels, in place;
    Gemma's: its RMSNorm ops on the float32 weight + 1, functional), its GEMM (with the bias), its
    activation; the outputs in the Program's order."""
    f = kind.form
    residual_in = f.residual or kind.add_beside

    def run(*args):
        rest = list(args)
        y, r = rest.pop(0), None
        if f.norm is not None:
            r = rest.pop(0) if residual_in else None
            g = rest.pop(0)
            if f.norm == "gemma":
                w = _gemma_weight(g)
                y, r = _vllm_ir().fused_add_rms_norm(y, r, w, eps) if residual_in else (_vllm_ir().rms_norm(y, w, eps),
                                                                                        None)
            elif residual_in:
                vops.fused_add_rms_norm(y, r, g, eps)  # residual += x, x = rms_norm(residual) * g
            else:
                y = _norm(vops, eps, y, g)
        if f.projection:
            w = rest.pop(0)
            y = torch.nn.functional.linear(y, w, rest.pop(0) if f.bias else None)
        if f.act:
            y = _silu(vops, y) if f.act == Op.SILU else _gelu_tanh(y)
        return (y, r) if f.residual else (y,)
    return run


def _vllm_rotary(dims: dict, vops, eps: float | None, q, k, *rest) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rotary path on prepared inputs: its RMSNorm kernel on q's and k's heads (QK-norm, where the
    weights are given), then its `rotary_embedding` kernel in place on q and k; the outputs
    [tokens, heads, head_dim], as the Program's."""
    *weights, positions, cache = rest
    d = dims["head_dim"]
    if weights:
        q = _norm(vops, eps, q.reshape(-1, d), weights[0]).reshape(q.shape)
        k = _norm(vops, eps, k.reshape(-1, d), weights[1]).reshape(k.shape)
    vops.rotary_embedding(positions, q, k, d, cache, bool(dims[STYLE_DIM]))
    return q.reshape(q.shape[0], -1, d), k.reshape(k.shape[0], -1, d)


def served(prog: Program, kernel: Callable) -> tuple[Callable, Callable]:
    """(prepare, run) of what the plugin runs for the region on the Program's inputs, as `Baseline`:
    the kernel, after the residual add for an `add_beside` kind (the sum of x and a zero residual)."""
    if not KINDS[prog.name].add_beside:
        return list, kernel
    return (lambda i: [i[0], torch.zeros_like(i[0]), *i[1:]]), (lambda x, r, *rest: kernel(x + r, *rest))
