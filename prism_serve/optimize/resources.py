"""The resource model: registers, shared memory and warps of one block kernel of an instance.

Registers: a walk over the block graph in the order codegen emits it (before the loop, the
loop body, after it) weighs what a block must hold: its loaded tiles, values live across a
reduction, matmul or the loop, accumulators, the m x k x n product of a broadcast-and-sum
matmul (`tl.sum(a[:, :, None] * b[None, :, :], axis=1)`), the operands of a `tl.dot`. Spread
over the block's threads, plus a base, that is the per-thread estimate (weights fitted to
ptxas; scripts/bench_static.py prints model beside ptxas for every kernel).

A token tile below the MMA minimum is padded to 16 rows (masked) where that is cheaper than
the broadcast product (see `kernel_resources`): codegen then emits `tl.dot`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

from prism_serve.errors import SGraphError
from prism_serve.optimize.codegen import MIN_DOT as MMA_MIN
from prism_serve.optimize.codegen import pow2
from prism_serve.optimize.sgraph import BYTES, BlockKernel, SGraph, _exact, sym

# Architectural limits of every NVIDIA GPU from compute capability 5.0 to 10.0 (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"): 64 K 32-bit
# registers per SM, at most 255 per thread, 1024 threads per block; registers are allocated
# to a warp in units of 256 (8 per thread).
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255
MAX_THREADS_PER_BLOCK = 1024
REG_ALLOC_UNIT = 8
# A token tile of at least this many rows is padded to 16 whenever that fits: the padding wastes
# at most 4x the tensor-core work, and dense fp16 tensor-core peak is 4x (GA10x, AD10x) to 32x
# (Blackwell) the fp32 peak on every architecture in gpus.ARCH, so tl.dot is never slower.
PAD_MIN_ROWS = 4
WARP_CHOICES = (4, 8, 16, 32)  # Triton's default is 4; fewer leave a wide tile's loads to few threads
# Registers per thread = REG_BASE (+ LOOP_REGS with a for-loop) + weighted tile elements / threads.
# The weights were chosen by a grid search against ptxas 12.x under Triton 3.9 on the kernels
# scripts/bench_static.py compiles (the five workloads' and the embedded models' chosen
# instances, sm_90 and sm_80), then the broadcast-product weight raised from the fitted 0.25
# to 0.75 because 1-token broadcast designs spilled with it. As committed: median error 19 %,
# 80 of 132 kernels within 25 %, worst 96 % (bench_static prints the table). Loaded tiles are
# held at their storage width (all loads are issued up front); values live across a reduction,
# matmul or the loop are partly re-materialised; a tl.dot's fp16 operands sit in registers.
REG_BASE = 12
LOOP_REGS = 8  # loop counter, advanced pointers, pipelining state
BARRIERS = ("sum", "mean", "max", "matmul")
W_LOADS = 1.0  # per 32-bit word of a loaded tile
W_SPANNING = 0.5  # per fp32 element of a computed value live across a barrier or the loop
W_ACCUMS = 0.5  # per fp32 accumulator element
W_PRODUCT = 0.75  # per element of the largest m x k x n broadcast product
W_OPERANDS = 1.0  # per fp16 operand pair of the largest tl.dot, packed two per register
# The estimate may use this share of a thread's register cap: in bench_static every decode
# kernel ptxas spilled had an estimate within 10 % of the cap (the estimate errs by ~15-20 %).
SPILL_HEADROOM = 0.9


@dataclass(frozen=True)
class KernelResources:
    """What one block of a kernel holds, for an instance's assignment."""

    smem: int  # bytes of shared memory per block
    base_registers: int  # per thread, whatever the tiles
    tile_registers: int  # registers the whole block holds for its tiles (weighted, see REG_BASE)
    largest: tuple[str, int]  # the largest tile: (node, padded elements)
    batched_matmul: str | None  # a matmul whose tile keeps batch dims, if any
    mma_padded: bool  # token tiles padded to 16 rows so matmuls run as tl.dot
    dots: tuple[str, ...]  # matmul nodes codegen emits as tl.dot
    warps: int

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def regs_per_thread(self) -> int:
        return regs_per_thread(self.base_registers, self.tile_registers, self.warps)

    @property
    def spills(self) -> bool:
        """Whether ptxas would likely spill: the estimate leaves less than SPILL_HEADROOM of the cap."""
        return self.regs_per_thread > usable_regs(self.warps)


def reg_cap(warps: int) -> int:
    """Registers a thread may use when a block of `warps` must fit the register file."""
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // (warps * 32) // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


def usable_regs(warps: int) -> int:
    return int(reg_cap(warps) * SPILL_HEADROOM)


def regs_per_thread(base: int, tile_registers: int, warps: int) -> int:
    return math.ceil(base + tile_registers / (warps * 32))


def choose_warps(base: int, tile_registers: int) -> int:
    """The fewest warps (from Triton's default 4) whose threads hold the tiles without
    spilling; 32 when none can (the kernel is then infeasible, see `check`)."""
    for w in WARP_CHOICES:
        if regs_per_thread(base, tile_registers, w) <= usable_regs(w):
            return w
    return WARP_CHOICES[-1]


def token_symbol(k: BlockKernel) -> str | None:
    return next((a.symbol for a in k.grid if a.over_tokens), None)


def _matmul_dims(dims_of: dict, n) -> tuple[int, int, int]:
    a, b = dims_of[n.inputs[0]], dims_of[n.inputs[1]]
    nn = b[-2] if n.attr("transpose_b") else b[-1]
    return pow2(a[-2]), pow2(a[-1]), pow2(nn)


def _analyse(g: SGraph, k: BlockKernel, values: Mapping[str, int], pad: bool):
    types = g.block_types(k)
    tok = token_symbol(k)
    dims_of: dict[str, list[int]] = {}
    padded_of: dict[str, list[int]] = {}
    for n in k.nodes:
        if n.op in ("store", "const"):
            continue
        shape = types[n.name].shape
        dims = [_exact(g.name, f"kernel '{k.name}' node '{n.name}'", d, dict(values)) for d in shape]
        dims_of[n.name] = dims
        padded_of[n.name] = [max(pow2(v), MMA_MIN) if pad and tok and d == sym(tok) else pow2(v)
                             for d, v in zip(shape, dims)]
    return types, dims_of, padded_of


def _dots(k: BlockKernel, padded_of: dict) -> tuple[str, ...]:
    return tuple(n.name for n in k.nodes if n.op == "matmul" and min(_matmul_dims(padded_of, n)) >= MMA_MIN)


def _tile_registers(k: BlockKernel, types, padded_of: dict, dots: tuple[str, ...]) -> float:
    """Registers a whole block holds for its tiles (see the module doc for the weights)."""
    stages = k.stages
    order = ([n for n in k.nodes if stages[n.name] == "pre" and n.op != "accum"]
             + [n for n in k.nodes if stages[n.name] == "loop" or n.op == "accum"]
             + [n for n in k.nodes if stages[n.name] == "post" and n.op != "accum"])
    pos = {n.name: i for i, n in enumerate(order)}
    last: dict[str, int] = {}
    for n in order:
        for s in n.inputs:
            last[s] = max(last.get(s, -1), pos[n.name])
    barriers = [pos[n.name] for n in order if n.op in BARRIERS]
    loads = spanning = accums = product = operands = 0.0
    for n in order:
        if n.name not in padded_of:
            continue
        size = math.prod(padded_of[n.name])
        if n.op == "accum":
            accums += size
        elif n.op == "load":
            loads += size * BYTES.get(types[n.name].dtype, 4) / 4
        else:
            carried = stages[n.name] == "pre" and any(stages[u.name] == "loop" for u in order if n.name in u.inputs)
            if carried or any(pos[n.name] < b < last.get(n.name, -1) for b in barriers):
                spanning += size
        if n.op == "matmul":
            m, kk, nn = _matmul_dims(padded_of, n)
            if n.name in dots:
                operands = max(operands, (m * kk + kk * nn) / 2)
            else:
                product = max(product, m * kk * nn)
    return (W_LOADS * loads + W_SPANNING * spanning + W_ACCUMS * accums + W_PRODUCT * product
            + W_OPERANDS * operands)


def _smem(g: SGraph, k: BlockKernel, types, padded_of: dict, dots: tuple[str, ...], warps: int) -> int:
    """tl.dot operands are staged through shared memory (twice in a pipelined loop); reductions
    across warps exchange one fp32 per row per warp."""
    smem = 0
    for n in k.nodes:
        if n.name in dots:
            for s in n.inputs:
                stages = 2 if k.stages[s] == "loop" else 1
                smem += math.prod(padded_of[s]) * BYTES.get(types[s].dtype, 4) * stages
        elif n.op in ("sum", "mean", "max") and n.inputs[0] in padded_of:
            smem = max(smem, 4 * warps * math.prod(padded_of[n.name]))
    return smem


def _resources(g: SGraph, k: BlockKernel, values: Mapping[str, int], pad: bool) -> KernelResources:
    types, dims_of, padded_of = _analyse(g, k, values, pad)
    dots = _dots(k, padded_of)
    live = math.ceil(_tile_registers(k, types, padded_of, dots))
    largest = max(((n, math.prod(p)) for n, p in padded_of.items()), key=lambda t: t[1], default=("", 0))
    batched = next((n.name for n in k.nodes if n.op == "matmul"
                    and any(d != 1 for s in n.inputs for d in dims_of[s][:-2])), None)
    base = REG_BASE + (LOOP_REGS if k.forloop else 0)
    warps = choose_warps(base, live)
    return KernelResources(_smem(g, k, types, padded_of, dots, warps), base, live, largest, batched, pad, dots,
                           warps)


def kernel_resources(g: SGraph, k: BlockKernel, values: Mapping[str, int]) -> KernelResources:
    """Resources of `k` under `values`, with the token tile padded to the MMA minimum where a
    matmul would otherwise fall back to broadcast-and-sum and padding is cheaper: it needs no
    more registers, or the tile has at least PAD_MIN_ROWS rows (see there); never where the
    padded kernel would spill."""
    return _kernel_resources(g, k, tuple(sorted(values.items())))


@functools.lru_cache(maxsize=65536)
def _kernel_resources(g: SGraph, k: BlockKernel, assignment: tuple[tuple[str, int], ...]) -> KernelResources:
    values = dict(assignment)
    plain = _resources(g, k, values, False)
    tok = token_symbol(k)
    if tok is None or values.get(tok, MMA_MIN) >= MMA_MIN or not any(n.op == "matmul" for n in k.nodes):
        return plain
    types = g.block_types(k)
    if any(n.op in ("sum", "mean", "max") and types[n.inputs[0]].shape[n.attr("dim")] == sym(tok)
           for n in k.nodes):
        return plain  # padded rows must never enter a reduction over tokens
    padded = _resources(g, k, values, True)
    if len(padded.dots) <= len(plain.dots) or padded.spills:
        return plain
    cheaper = padded.regs_per_thread <= plain.regs_per_thread or values[tok] >= PAD_MIN_ROWS
    return padded if cheaper else plain


def check(g: SGraph, k: BlockKernel, values: Mapping[str, int], gpu) -> KernelResources:
    """The resources of `k`, or SGraphError naming the limit of `gpu` a block would break:
    tile size, batched matmul tiles, shared memory, registers without spilling."""
    r = kernel_resources(g, k, values)
    where = f"sGraph '{g.name}' kernel '{k.name}'"
    if r.largest[1] > gpu.max_block_elements:
        raise SGraphError(f"{where}: tile of '{r.largest[0]}' has {r.largest[1]} elements, over the "
                          f"{gpu.max_block_elements} one block may hold")
    if r.batched_matmul:
        raise SGraphError(f"{where}: matmul '{r.batched_matmul}' has a batched tile; map its batch dims to the grid")
    if r.smem > gpu.smem_per_block:
        raise SGraphError(f"{where}: tiles need {r.smem} bytes of shared memory, {gpu.name} allows "
                          f"{gpu.smem_per_block} per block")
    if r.spills:
        raise SGraphError(f"{where}: tiles need about {r.tile_registers} registers, "
                          f"{r.regs_per_thread} per thread over {r.threads} threads, over the {usable_regs(r.warps)} "
                          f"a thread may hold without spilling")
    return r


def blocks_per_sm(r: KernelResources, gpu) -> int:
    """Resident blocks per SM, limited by registers, shared memory, warps and the block slots
    (the CUDA occupancy calculation; per-SM limits from the GPU spec)."""
    per_thread = -(-r.regs_per_thread // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = gpu.regs_per_sm // (per_thread * r.threads)
    by_smem = gpu.smem_per_sm // r.smem if r.smem else gpu.max_blocks_per_sm
    by_warps = gpu.max_warps_per_sm // r.warps
    return max(0, min(by_regs, by_smem, by_warps, gpu.max_blocks_per_sm))
