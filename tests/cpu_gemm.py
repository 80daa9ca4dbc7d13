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
