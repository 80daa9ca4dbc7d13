"""The cost model: a roofline with L2 reuse, wave quantisation and launch overhead.

It ranks instantiations of an sGraph for one GPU and num_tokens; it is not a
simulator. Unique tensor bytes move from DRAM (in 32-byte sectors), repeated tile loads (weights read
by every token block, say) hit L2; matmuls with every dim >= 16 run on tensor
cores, everything else on the fp32 units; a grid smaller than a wave leaves SMs idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.optimize.codegen import MIN_DOT, pow2
from prism_serve.optimize.gpus import GpuSpec
from prism_serve.optimize.ir import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, REDUCTIONS, Program
from prism_serve.optimize.reference import expand_composites
from prism_serve.optimize.sgraph import BYTES, BlockKernel, Instance

LAUNCH_US = 3.0  # per kernel launch on the host, as commonly measured for CUDA + Triton
SECTOR_BYTES = 32  # the DRAM access granularity
L2_BANDWIDTH_FACTOR = 2.5  # L2 serves repeated loads this many times faster than DRAM


@dataclass(frozen=True)
class KernelCost:
    name: str
    blocks: int
    dram_bytes: float
    l2_bytes: float
    tensor_flops: float
    fp32_flops: float
    time_us: float


def _time_us(gpu: GpuSpec, blocks: int, dram: float, l2: float, tc: float, fp32: float) -> float:
    waves = max(1, math.ceil(blocks / gpu.sms))
    busy = blocks / (waves * gpu.sms)  # fraction of SM-slots doing work across the waves
    mem = dram / (gpu.mem_bandwidth_gbs * 1e3) + l2 / (gpu.mem_bandwidth_gbs * 1e3 * L2_BANDWIDTH_FACTOR)
    compute = tc / (gpu.fp16_tensor_tflops * 1e6) + fp32 / (gpu.fp32_tflops * 1e6)
    return max(mem, compute) / max(busy, 1e-9) + LAUNCH_US


def _sector_waste(tile_last: int, tensor_last: int, itemsize: int) -> float:
    """DRAM moves whole 32-byte sectors: a tile narrower than its rows reads each run rounded up."""
    if tile_last >= tensor_last:
        return 1.0
    run = tile_last * itemsize
    return math.ceil(run / SECTOR_BYTES) * SECTOR_BYTES / run


def _numel(shape) -> int:
    return math.prod(shape)


def block_kernel_cost(inst: Instance, k: BlockKernel, num_tokens: int, gpu: GpuSpec) -> KernelCost:
    g = inst.sgraph
    values = inst.values
    blocks = math.prod(math.ceil(num_tokens / values[a.symbol]) if a.over_tokens else values[a.symbol]
                       for a in k.grid)
    steps = values[k.forloop] if k.forloop else 1
    requested = unique = tc = fp32 = 0.0
    types = g.block_types(k)
    for n in k.nodes:
        if n.op == "const":
            continue
        tile = tuple(inst.concrete(d, num_tokens) for d in types[n.name].shape)
        times = steps if k.stages[n.name] == "loop" else 1
        if n.op in ("load", "store"):
            decl = g.tensors[n.attr("tensor")]
            shape = inst.tensor_shape(decl.name, num_tokens)
            waste = _sector_waste(tile[-1] if tile else 1, shape[-1] if shape else 1, BYTES[decl.dtype])
            writers = blocks
            if n.op == "store":  # along an axis the store does not map, only the first block writes
                writers //= math.prod(values[a.symbol] for a, d in zip(k.grid, n.attr("omap"))
                                      if d is None and not a.over_tokens)
            requested += writers * times * _numel(tile) * BYTES[decl.dtype] * waste
            unique += _numel(shape) * BYTES[decl.dtype] * waste
        elif n.op == "matmul":
            a, b = (types[s].shape for s in n.inputs)
            m = inst.concrete(a[-2], num_tokens)
            kk = inst.concrete(a[-1])
            nn = _numel(tile) // max(m, 1)
            flops = 2.0 * m * kk * nn * blocks * times
            if min(pow2(m), pow2(kk), pow2(max(nn, 1))) >= MIN_DOT:
                tc += flops
            else:
                fp32 += flops
        else:
            fp32 += _numel(tile) * blocks * times
    l2 = max(requested - unique, 0.0)
    time = _time_us(gpu, blocks, unique, l2, tc, fp32)
    return KernelCost(k.name, blocks, unique, l2, tc, fp32, time)


def _library_cost(prog_types, op, num_tokens: int, gpu: GpuSpec, name: str) -> KernelCost:
    def size(t) -> int:
        return _numel(tuple(num_tokens if d == "num_tokens" else int(d) for d in t.shape))

    def nbytes(t) -> int:
        return size(t) * BYTES.get(t.dtype, 4)

    out = prog_types[name]
    dram = nbytes(out) + sum(nbytes(prog_types[s]) for s in op.inputs if prog_types[s].dtype != "const")
    tc = fp32 = 0.0
    if op.op == "matmul":
        a = prog_types[op.inputs[0]]
        tc = 2.0 * size(out) * int(a.shape[-1])
    elif op.op in ELEMENTWISE_BINARY + ELEMENTWISE_UNARY + REDUCTIONS:
        fp32 = float(max(size(out), *(size(prog_types[s]) for s in op.inputs)))
    blocks = max(gpu.sms, size(out) // 1024)  # library kernels (cuBLAS, torch) are assumed to fill the GPU
    return KernelCost(name, blocks, dram, 0.0, tc, fp32, _time_us(gpu, blocks, dram, 0.0, tc, fp32))


def instance_cost(inst: Instance, num_tokens: int, gpu: GpuSpec) -> list[KernelCost]:
    """Modeled cost of every kernel of an instance at `num_tokens`."""
    costs = []
    for k in inst.sgraph.kernels:
        if isinstance(k, BlockKernel):
            costs.append(block_kernel_cost(inst, k, num_tokens, gpu))
        else:
            types = {n: _Type(inst.tensor_shape(n, num_tokens), t.dtype) for n, t in inst.sgraph.tensors.items()}
            costs.append(_library_cost(types, k.op, num_tokens, gpu, k.op.name))
    return costs


def modeled_us(inst: Instance, num_tokens: int, gpu: GpuSpec) -> float:
    return sum(c.time_us for c in instance_cost(inst, num_tokens, gpu))


def unfused_us(prog: Program, num_tokens: int, gpu: GpuSpec) -> float:
    """The program as one library kernel per primitive op (composites expanded): the baseline."""
    flat = expand_composites(prog)
    return sum(_library_cost(flat.types, n, num_tokens, gpu, n.name).time_us
               for n in flat.nodes if n.op not in ("input", "const"))


@dataclass(frozen=True)
class _Type:
    shape: tuple
    dtype: str
