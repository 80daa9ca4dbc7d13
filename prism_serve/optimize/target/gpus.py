"""GPU specifications: the hardware limits instantiation checks and the cost model reads.

Two sources. On a device, `spec_from_device` reads the driver (SM count, shared memory,
registers, L2, clock) and takes memory bandwidth and launch latency from a short
microbenchmark (`prism_serve.optimize.instantiate.devbench`). Offline (`--device h100`), `KNOWN` below is
the one table of published figures, each row citing its datasheet; per-architecture limits
come from `ARCH`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from prism_serve.errors import SGraphError

log = logging.getLogger(__name__)

# Launch cost per kernel, in us. Eager: a Triton kernel launched from Python pays the host
# launcher and the driver call (NVIDIA, "Getting Started with CUDA Graphs", A. Gray 2019: ~3.8 us
# per short kernel launched back to back on a stream, including ~2.9 us of kernel work and the
# driver; Triton's Python launcher adds more on the host). Graph replay: the same blog measured
# the per-kernel cost falling by about 0.5 us when the launches are one graph; the remaining GPU-side
# launch gap is of the order of 1 us. Not checked against a public page this session (the blog's
# figures could not be retrieved); the warmup microbenchmark (`devbench`) measures both on a GPU.
EAGER_LAUNCH_US = 3.0
GRAPH_LAUNCH_US = 1.0


@dataclass(frozen=True)
class Arch:
    """Per compute capability limits (CUDA C++ Programming Guide, "Technical Specifications per
    Compute Capability") and per-SM per-clock peak rates (NVIDIA's architecture whitepapers:
    A100 GA100, GA102, AD102, H100 GH100, Blackwell), dense, fp32 accumulate."""

    smem_per_block: int  # bytes, with opt-in
    smem_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    tensor_flops_per_clock_sm: int  # fp16 / bf16 dense
    fp32_flops_per_clock_sm: int  # 2 x FP32 lanes


ARCH: dict[tuple[int, int], Arch] = {
    (8, 0): Arch(166912, 167936, 64, 32, 2048, 128),
    (8, 6): Arch(101376, 102400, 48, 16, 1024, 256),
    (8, 9): Arch(101376, 102400, 48, 24, 1024, 256),
    (9, 0): Arch(232448, 233472, 64, 32, 4096, 256),
    (10, 0): Arch(232448, 233472, 64, 32, 8192, 256),
}


# A GPU's name as stored and rendered (a comment of generated source names it): a slug, never code.
GPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")


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
    smem_per_sm: int = 233472
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    eager_launch_us: float = EAGER_LAUNCH_US
    graph_launch_us: float = GRAPH_LAUNCH_US
    source: str = ""  # where the figures come from

    @property
    def arch(self) -> int:
        """The compute capability as Triton's `GPUTarget` and ptxas's sm_XY name it: (9, 0) -> 90."""
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    def to_json(self) -> dict:
        return {"name": self.name, "compute_capability": list(self.compute_capability), "sms": self.sms,
                "mem_bandwidth_gbs": self.mem_bandwidth_gbs, "l2_mb": self.l2_mb,
                "smem_per_block": self.smem_per_block, "smem_per_sm": self.smem_per_sm,
                "regs_per_sm": self.regs_per_sm, "fp16_tensor_tflops": self.fp16_tensor_tflops,
                "fp32_tflops": self.fp32_tflops, "eager_launch_us": self.eager_launch_us,
                "graph_launch_us": self.graph_launch_us, "source": self.source}

    @staticmethod
    def from_json(data: dict) -> GpuSpec:
        """A spec stored by `to_json` (untrusted: every field typed and range-checked)."""
        try:
            cc = tuple(int(v) for v in data["compute_capability"])
            floats = {k: float(data[k]) for k in ("mem_bandwidth_gbs", "l2_mb", "fp16_tensor_tflops", "fp32_tflops",
                                                  "eager_launch_us", "graph_launch_us")}
            ints = {k: int(data[k]) for k in ("sms", "smem_per_block", "smem_per_sm", "regs_per_sm")}
            name, source = str(data["name"]), str(data.get("source", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise SGraphError(f"stored GPU spec is malformed: {type(exc).__name__}: {exc}") from None
        if not GPU_NAME.fullmatch(name):
            raise SGraphError(f"stored GPU spec has a malformed name {name[:40]!r}")
        if len(cc) != 2 or cc not in ARCH or any(v <= 0 for v in (*floats.values(), *ints.values())):
            raise SGraphError(f"stored GPU spec {name!r} has an unknown architecture or a non-positive figure")
        arch = ARCH[cc]
        return GpuSpec(name, cc, ints["sms"], floats["mem_bandwidth_gbs"], floats["l2_mb"], ints["smem_per_block"],
                       1024, ints["regs_per_sm"], floats["fp16_tensor_tflops"], floats["fp32_tflops"],
                       smem_per_sm=ints["smem_per_sm"], max_warps_per_sm=arch.max_warps_per_sm,
                       max_blocks_per_sm=arch.max_blocks_per_sm, eager_launch_us=floats["eager_launch_us"],
                       graph_launch_us=floats["graph_launch_us"], source=source)


def _known(name: str, cc: tuple[int, int], sms: int, bandwidth_gbs: float, l2_mb: float, tensor_tflops: float,
           fp32_tflops: float, source: str) -> GpuSpec:
    a = ARCH[cc]
    return GpuSpec(name, cc, sms, bandwidth_gbs, l2_mb, a.smem_per_block, 1024, 65536, tensor_tflops, fp32_tflops,
                   smem_per_sm=a.smem_per_sm, max_warps_per_sm=a.max_warps_per_sm,
                   max_blocks_per_sm=a.max_blocks_per_sm, source=source)


# The one table of known GPUs: (name, cc, SMs, DRAM GB/s, L2 MB, dense fp16 tensor TFLOPS, fp32 TFLOPS).
# Tensor rates are the datasheets' dense figures (half the "with sparsity" ones). Each row's source
# names where its figures were checked (2026-12-03, with public pages); "unchecked" marks what no
# public source at hand confirmed. On a device, the driver's figures and the warmup microbenchmark
# replace every one of them (`spec_from_device`).
KNOWN: tuple[GpuSpec, ...] = (
    _known("h100", (9, 0), 132, 3350.0, 50.0, 989.4, 66.9,
           "NVIDIA H100 datasheet, SXM5 (3,350 GB/s; FP16 tensor 1,979 TF sparse; FP32 67 TF) as tabulated at "
           "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html; 132 SMs, 50 MB L2, 989.4 / 66.9 TF: "
           "glennklockwood.com/garden/processors/h100"),
    _known("h200", (9, 0), 132, 4800.0, 50.0, 989.4, 66.9,
           "NVIDIA H200 datasheet (2024), SXM, 4.8 TB/s; same GH100 configuration as H100 SXM5 "
           "(glennklockwood.com/garden/processors/h100: H200 is H100 with HBM3e)"),
    _known("a100", (8, 0), 108, 2039.0, 40.0, 312.0, 19.5,
           "NVIDIA A100 datasheet (2021), SXM4 80GB, 2,039 GB/s; 108 SMs, 40 MB L2, 312 TF FP16 tensor, 19.5 TF "
           "FP32: A100 whitepaper (as in fudzilla.com A100 launch report and datacrunch.io A100 specs)"),
    _known("l40s", (8, 9), 142, 864.0, 96.0, 362.0, 91.6,
           "NVIDIA L40S datasheet: 864 GB/s, 91.6 TF FP32, 733 TF FP16 tensor sparse, 142 SMs (568 tensor cores) "
           "(grokipedia 'NVIDIA L4 vs L40S'; store.sourcecode.com L4/L40S comparison); 96 MB L2: "
           "hmc-tech.com L40 (98.3 MB = 96 MiB)"),
    _known("h100-pcie", (9, 0), 114, 2000.0, 50.0, 756.0, 51.2,
           "NVIDIA H100 datasheet, PCIe 80GB (114 SMs, 2,000 GB/s, 50 MB L2, FP16 tensor 1,513 TF sparse, FP32 "
           "51 TF) as tabulated at archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html; 114 SMs and 50 MB L2 "
           "also in Chips and Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth' (2023)"),
    _known("a10g", (8, 6), 80, 600.0, 6.0, 70.0, 35.0,
           "600 GB/s GDDR6: Baseten, 'NVIDIA A10 vs A10G for ML model inference' (which also says the A10G has "
           "less tensor compute than the A10's 125 TF dense and more FP32); rates as 80 SMs x 1.71 GHz x 512 "
           "(fp16 with fp32 accumulate, half the A10's per-SM rate) / 256 FLOP per clock; 80 SMs and 6 MB L2 "
           "unchecked"),
    _known("l4", (8, 9), 58, 300.0, 48.0, 121.0, 30.3,
           "NVIDIA L4 datasheet: 300 GB/s, FP16 tensor 242 TF sparse (grokipedia 'NVIDIA L4 vs L40S'); 48 MB L2, "
           "30.3 TF FP32 (fpsbench.com L4); 58 SMs = 7,424 CUDA cores / 128 (pages disagree: some list 60)"),
    _known("b200", (10, 0), 148, 8000.0, 65.5, 2250.0, 75.0,
           "NVIDIA B200 datasheet, 8 TB/s (knlb.pages.dev/ai/numbers); 148 SMs, 65.5 MB L2, FP16 tensor 2.25 PF "
           "dense, FP32 75 TF: hmc-tech.com 'NVIDIA B200 vs B100' (other pages give 96-126 MB of L2: the smaller "
           "figure is kept, so L2 reuse is not overstated)"),
)
GPUS: dict[str, GpuSpec] = {g.name: g for g in KNOWN}
ALIASES = {"h100-sxm": "h100", "nvidia h100 80gb hbm3": "h100", "nvidia h100 pcie": "h100-pcie",
           "nvidia h200": "h200", "nvidia a100-sxm4-80gb": "a100", "a100-80gb": "a100", "nvidia a10g": "a10g",
           "nvidia l4": "l4", "nvidia l40s": "l40s", "nvidia b200": "b200"}


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise SGraphError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (on a device the spec comes from the driver)")
    return GPUS[key]


def canonical_name(device_name: str) -> str:
    """The table's name for a driver's device name, or a slug of it for a GPU the table lacks."""
    key = device_name.strip().lower()
    key = ALIASES.get(key, key)
    if key in GPUS:
        return key
    slug = re.sub(r"[^a-z0-9_.]+", "-", key.replace("nvidia", "")).strip("-._")[:100]
    return slug or "gpu"


def spec_from_device(props, *, bandwidth_gbs: float, eager_launch_us: float, graph_launch_us: float,
                     clock_khz: int | None = None) -> GpuSpec:
    """A spec for the device described by `props` (torch.cuda.get_device_properties: name, major,
    minor, multi_processor_count, L2_cache_size, regs_per_multiprocessor, shared memory sizes,
    clock_rate where this torch has them) with the measured bandwidth and launch latencies.

    Peak rates are SMs x clock x ARCH's per-SM rate; without a clock from the driver they are the
    table's for a known GPU, else the architecture's at 1.5 GHz, logged as an assumption."""
    cc = (int(props.major), int(props.minor))
    if cc not in ARCH:
        raise SGraphError(f"GPU {props.name!r} has compute capability {cc[0]}.{cc[1]}, which the cost model "
                          f"does not know (known: {', '.join(f'{a}.{b}' for a, b in ARCH)})")
    arch = ARCH[cc]
    name = canonical_name(str(props.name))
    sms = int(props.multi_processor_count)
    clock_khz = clock_khz or getattr(props, "clock_rate", None)
    if clock_khz:
        tensor = sms * arch.tensor_flops_per_clock_sm * clock_khz * 1e3 / 1e12
        fp32 = sms * arch.fp32_flops_per_clock_sm * clock_khz * 1e3 / 1e12
        how = f"clock {clock_khz / 1e6:.2f} GHz from the driver"
    elif name in GPUS:
        tensor, fp32, how = GPUS[name].fp16_tensor_tflops, GPUS[name].fp32_tflops, "peak rates from the table"
    else:
        tensor = sms * arch.tensor_flops_per_clock_sm * 1.5e9 / 1e12
        fp32 = sms * arch.fp32_flops_per_clock_sm * 1.5e9 / 1e12
        how = "no clock from the driver: peak rates assume 1.5 GHz"
        log.warning("%s: %s", props.name, how)
    l2 = getattr(props, "L2_cache_size", None) or (GPUS[name].l2_mb * 2**20 if name in GPUS else 0)
    if not l2:
        raise SGraphError(f"GPU {props.name!r}: the driver reports no L2 size and the table does not know it")
    return GpuSpec(name, cc, sms, float(bandwidth_gbs), l2 / 2**20,
                   int(getattr(props, "shared_memory_per_block_optin", 0) or arch.smem_per_block), 1024,
                   int(getattr(props, "regs_per_multiprocessor", 0) or 65536), tensor, fp32,
                   smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0) or arch.smem_per_sm),
                   max_warps_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0) or
                                        arch.max_warps_per_sm * 32) // 32,
                   max_blocks_per_sm=arch.max_blocks_per_sm, eager_launch_us=float(eager_launch_us),
                   graph_launch_us=float(graph_launch_us),
                   source=f"driver ({props.name}); bandwidth and launch measured; {how}")

