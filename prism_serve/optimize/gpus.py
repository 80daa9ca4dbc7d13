"""GPU specifications: the hardware limits instantiation checks and the cost model reads.

Figures are vendors' published dense (non-sparse) rates for the SXM / PCIe parts named.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.errors import SGraphError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    compute_capability: tuple[int, int]
    sms: int
    mem_bandwidth_gbs: float
    l2_mb: float
    smem_per_block: int  # bytes a block may use, with opt-in
    max_threads_per_block: int
    regs_per_sm: int  # 32-bit registers
    fp16_tensor_tflops: float
    fp32_tflops: float
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_regs_per_thread: int = 255
    max_block_elements: int = 2**20  # Triton's limit on elements of one tile


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("h100", (9, 0), 132, 3350.0, 50.0, 232448, 1024, 65536, 989.0, 67.0),
    GpuSpec("h200", (9, 0), 132, 4800.0, 50.0, 232448, 1024, 65536, 989.0, 67.0),
    GpuSpec("a100", (8, 0), 108, 2039.0, 40.0, 166912, 1024, 65536, 312.0, 19.5),
    GpuSpec("l40s", (8, 9), 142, 864.0, 96.0, 101376, 1024, 65536, 362.0, 91.6),
)}
ALIASES = {"h100-sxm": "h100", "nvidia h100 80gb hbm3": "h100", "nvidia h200": "h200",
           "nvidia a100-sxm4-80gb": "a100", "a100-80gb": "a100", "nvidia l40s": "l40s"}


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise SGraphError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
