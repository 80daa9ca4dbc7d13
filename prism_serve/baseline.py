"""vLLM's own path for a captured Program, called with the Program's inputs: what warmup times a
kernel against on a GPU (a kernel is enabled only if it is faster).

vLLM's custom ops serve where they take the Program's inputs as they are: its RMSNorm ops, and
RMSNorm then the projection GEMM. Where they cannot (SiLU*mul wants gate and up as one tensor,
the MLPs a merged weight), eager torch stands in, and the baseline is named so.
"""

from __future__ import annotations

from typing import Callable

import torch

from prism_serve.optimize.ir import Program
from prism_serve.optimize.reference import as_torch_function


def baseline(prog: Program) -> tuple[str, Callable[..., tuple[torch.Tensor, ...]]]:
    """(name, fn): "vllm" with vLLM's ops where they apply (fused_add_rms_norm updates its inputs
    in place, as vLLM's op does), else "torch-eager"."""
    try:
        import vllm._custom_ops as vops
    except Exception:  # noqa: BLE001 - vLLM absent or unusable here: eager torch is the yardstick
        vops = None
    eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
    if vops is not None and prog.name in _VLLM:
        return "vllm", _VLLM[prog.name](vops, eps)
    return "torch-eager", as_torch_function(prog)


def _rms_norm(vops, eps: float):
    def run(x, w):
        out = torch.empty_like(x)
        vops.rms_norm(out, x, w, eps)
        return (out,)
    return run


def _fused_add_rms_norm(vops, eps: float):
    def run(x, residual, w):
        vops.fused_add_rms_norm(x, residual, w, eps)
        return x, residual
    return run


def _rmsnorm_linear(vops, eps: float):
    def run(x, g, w):
        xn = torch.empty_like(x)
        vops.rms_norm(xn, x, g, eps)
        return (torch.nn.functional.linear(xn, w),)
    return run


_VLLM = {"rms_norm": _rms_norm, "fused_add_rms_norm": _fused_add_rms_norm, "rmsnorm_linear": _rmsnorm_linear}
