"""Which of vLLM's CPU GEMMs this machine runs, so a test builds the path vLLM itself would take here."""

from __future__ import annotations

from functools import cache

import torch


@cache
def onednn_handles(dtype: torch.dtype) -> bool:
    """Whether vLLM's `create_onednn_mm` makes a handle for `dtype` weights on this CPU. Where it
    cannot (float16 on a CPU without AVX512-FP16 or AMX-FP16: "could not create a primitive
    descriptor"), vLLM's `dispatch_cpu_unquantized_gemm` falls back to torch's linear."""
    from vllm import _custom_ops as vops

    try:
        vops.create_onednn_mm(torch.zeros(16, 16, dtype=dtype), 32)
    except RuntimeError:
        return False
    return True


@cache
def packs_weights(dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU build packs a tiny model's projection weights of `dtype` on this CPU: for
    its AMX GEMM (small bf16 weights with AMX tiles, fp16 with AMX-FP16; `check_cpu_sgl_kernel`),
    else for its oneDNN GEMM where oneDNN makes a handle. Elsewhere it runs torch's linear on the
    plain weight, and nothing is packed."""
    amx = torch.cpu._is_amx_tile_supported() and (
        dtype == torch.bfloat16 or (dtype == torch.float16 and torch.cpu._is_amx_fp16_supported()))
    return amx or onednn_handles(dtype)
