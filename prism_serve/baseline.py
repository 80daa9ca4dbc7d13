"""vLLM's path for a region: the yardstick of every speedup prism prints or stores.

For each region kind, the region table names the vLLM kernels that run it today (`vllm_path`:
its fused RMSNorm kernels, its GEMM, its `silu_and_mul`). Here that path is

- modeled (`vllm_modeled_us`) with the same cost model that prices prism's kernels: vLLM's norm
  and activation kernels as one fused kernel with one token row per block (how vLLM launches
  them), its GEMM as one library kernel;
- run (`baseline`), on the Program's inputs, with vLLM's own ops where vLLM is installed, so a
  GPU can time it. Without vLLM, eager torch stands in, and the baseline is named so.

The served path (`served_modeled_us`) is prism's kernel plus what the plugin runs beside it: a
`SERVED_ADD` region adds the residual in one elementwise kernel that vLLM folds into its norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from prism_serve.optimize.instantiate.cost import modeled_us, unfused_us
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.reference import as_torch_function
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads import programs
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.region_table import KINDS, SERVED_ADD


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


def _path_programs(prog: Program) -> list[tuple[str, Program]]:
    """vLLM's kernels for `prog`'s kind, each as the Program it computes."""
    kind = KINDS[prog.name]
    dims = kind.dims_of(prog)
    dtype = prog.inputs[0].attr("dtype")
    eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
    hidden = dims.get("hidden")
    out = dims.get("out") or 2 * dims.get("intermediate", 0)  # an MLP's merged gate_up projection
    build = {"rms_norm": lambda: programs.rms_norm(hidden, dtype, eps),
             "fused_add_rms_norm": lambda: programs.fused_add_rms_norm(hidden, dtype, eps),
             "silu_and_mul": lambda: programs.silu_and_mul(dims["intermediate"], dtype),
             "gemma_rms_norm": lambda: programs.gemma_rms_norm(hidden, dtype, eps),
             "gemma_fused_add_rms_norm": lambda: programs.gemma_fused_add_rms_norm(hidden, dtype, eps),
             "gelu_tanh_and_mul": lambda: programs.gelu_tanh_and_mul(dims["intermediate"], dtype),
             "linear": lambda: _linear(hidden, out, dtype)}
    return [(op, build[op]()) for op in kind.vllm_path]


def vllm_modeled_us(prog: Program, num_tokens: int, gpu: GpuSpec) -> float:
    """vLLM's path for `prog`'s region at `num_tokens`, modeled by prism's cost model."""
    return sum(unfused_us(p, num_tokens, gpu) if op == "linear" else _row_kernel_us(p, num_tokens, gpu)
               for op, p in _path_programs(prog))


def served_modeled_us(prog: Program, kernel_us: float, num_tokens: int, gpu: GpuSpec) -> float:
    """What the plugin runs for the region: the kernel (`kernel_us`, modeled) and what runs beside it."""
    if prog.name not in SERVED_ADD:
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
    if vops is None or prog.name not in _VLLM:
        return Baseline("torch-eager", list, as_torch_function(prog))
    eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
    prepare, run = _VLLM[prog.name](vops, eps)
    return Baseline("vllm", prepare, run)


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


def _project_first(normed, w):
    """(y, residual') of a residual add + norm -> (y @ w^T, residual')."""
    y, r = normed
    return torch.nn.functional.linear(y, w), r


def _clone_first_two(inputs):
    return [inputs[0].clone(), inputs[1].clone(), *inputs[2:]]


def _merged(inputs):  # (x, [g,] w_gate, w_up) -> (x, [g,] [w_gate; w_up]): vLLM's gate_up layout
    return [*inputs[:-2], torch.cat(inputs[-2:], dim=0)]


_VLLM = {
    "rms_norm": lambda v, eps: (list, lambda x, w: (_norm(v, eps, x, w),)),
    # vLLM's op adds into `residual` and normalises `x` in place: (y, residual') are x and residual
    "fused_add_rms_norm": lambda v, eps: (_clone_first_two, lambda x, r, w: (v.fused_add_rms_norm(x, r, w, eps),
                                                                             (x, r))[1]),
    "silu_and_mul": lambda v, eps: (lambda i: [torch.cat(i, dim=-1)], lambda gu: (_silu(v, gu),)),
    "rmsnorm_linear": lambda v, eps: (list, lambda x, g, w: (torch.nn.functional.linear(_norm(v, eps, x, g), w),)),
    "fused_add_rmsnorm_linear": lambda v, eps: (
        _clone_first_two, lambda x, r, g, w: (v.fused_add_rms_norm(x, r, g, eps),
                                              (torch.nn.functional.linear(x, w), r))[1]),
    "rmsnorm_linear_bias": lambda v, eps: (
        list, lambda x, g, w, b: (torch.nn.functional.linear(_norm(v, eps, x, g), w, b),)),
    "fused_add_rmsnorm_linear_bias": lambda v, eps: (
        _clone_first_two, lambda x, r, g, w, b: (v.fused_add_rms_norm(x, r, g, eps),
                                                 (torch.nn.functional.linear(x, w, b), r))[1]),
    "swiglu": lambda v, eps: (_merged, lambda x, w: (_silu(v, torch.nn.functional.linear(x, w)),)),
    # GemmaRMSNorm.forward_native: vLLM's RMSNorm ops on the float32 weight + 1 (functional, not in place)
    "gemma_rms_norm": lambda v, eps: (list, lambda x, w: (_vllm_ir().rms_norm(x, _gemma_weight(w), eps),)),
    "gemma_fused_add_rms_norm": lambda v, eps: (
        list, lambda x, r, w: tuple(_vllm_ir().fused_add_rms_norm(x, r, _gemma_weight(w), eps))),
    "gelu_tanh_and_mul": lambda v, eps: (lambda i: [torch.cat(i, dim=-1)], lambda gu: (_gelu_tanh(gu),)),
    "geglu": lambda v, eps: (_merged, lambda x, w: (_gelu_tanh(torch.nn.functional.linear(x, w)),)),
    "rmsnorm_geglu": lambda v, eps: (
        lambda i: [i[0].clone(), torch.zeros_like(i[0]), *_merged(i[1:])],
        lambda x, r, g, w: (v.fused_add_rms_norm(x, r, g, eps), (_gelu_tanh(torch.nn.functional.linear(x, w)),))[1]),
    # Gemma's regions on the stored norm weight g: vLLM's RMSNorm ops on g.float() + 1, then its GEMM
    "gemma_rmsnorm_linear": lambda v, eps: (
        list, lambda x, g, w: (torch.nn.functional.linear(_vllm_ir().rms_norm(x, _gemma_weight(g), eps), w),)),
    "gemma_fused_add_rmsnorm_linear": lambda v, eps: (
        list, lambda x, r, g, w: _project_first(_vllm_ir().fused_add_rms_norm(x, r, _gemma_weight(g), eps), w)),
    "gemma_rmsnorm_geglu": lambda v, eps: (
        lambda i: [i[0], torch.zeros_like(i[0]), *_merged(i[1:])],
        lambda x, r, g, w: (_gelu_tanh(torch.nn.functional.linear(
            _vllm_ir().fused_add_rms_norm(x, r, _gemma_weight(g), eps)[0], w)),)),
    # at its site vLLM adds the residual inside its norm: the sum arrives as x with a zero residual
    "rmsnorm_swiglu": lambda v, eps: (
        lambda i: [i[0].clone(), torch.zeros_like(i[0]), *_merged(i[1:])],
        lambda x, r, g, w: (v.fused_add_rms_norm(x, r, g, eps), (_silu(v, torch.nn.functional.linear(x, w)),))[1]),
}


def served(prog: Program, kernel: Callable) -> tuple[Callable, Callable]:
    """(prepare, run) of what the plugin runs for the region on the Program's inputs, as `Baseline`:
    the kernel, after the residual add for a `SERVED_ADD` region (the sum of x and a zero residual)."""
    if prog.name not in SERVED_ADD:
        return list, kernel
    return (lambda i: [i[0], torch.zeros_like(i[0]), *i[1:]]), (lambda x, r, *rest: kernel(x + r, *rest))
