"""The resource model: registers, shared memory and warps of one block kernel of an instance.

Registers: what each thread of a block holds, in 32-bit words, as Triton lays tiles out (each
thread holds its share of a tile, at least one element) and ptxas keeps them live:
  - loaded tiles, at their storage width (fp16 packed two to a register);
  - loop accumulators, in fp32;
  - the m x k x n product of a broadcast-and-sum matmul (`tl.sum(a[:, :, None] * b[None, :, :],
    axis=1)`): every thread forms its share of the products before reducing over k;
  - the values feeding a `tl.dot`'s left operand: Triton computes them in the MMA operand layout,
    where every warp holds all K columns of its rows (rows are split over at most M / 16 warps,
    the other warps hold copies), so such a chain costs rows-per-warp x K / 32 per value.
Each kind has one weight (below), the same for every kernel; scripts/bench_static.py prints the
estimate beside ptxas's count for every kernel warmup would store.

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
# Registers per thread = REG_BASE + sum over the kinds of weight x words a thread holds. The
# weights are one least-squares fit (relative error) against ptxas 12.x under Triton 3.9 over the
# 302 kernels of the three best-ranked instances per bucket of scripts/bench_static.py's cases,
# sm_90 and sm_80, with the base fixed at what the smallest kernels need; they read as: a loaded
# word is nearly always live (loads are issued up front); an accumulator element costs itself plus
# part of the partial result added to it; a broadcast product element about one register; a
# dot-operand chain element a third (it is converted to half precision and packed as it is
# formed). A fit that also weighed values live across a reduction gave them 0.02: ptxas
# re-materialises them.
REG_BASE = 11  # program ids, row masks, base pointers and strides, the loop counter
W_LOADS = 0.88  # per 32-bit word of a loaded tile
W_ACCUMS = 1.35  # per fp32 accumulator element
W_PRODUCT = 0.94  # per element of an m x k x n broadcast product
W_DOT_CHAIN = 0.31  # per fp32 element of a value computed in a tl.dot's operand layout
MMA_ROWS = 16  # rows of one warp's MMA tile (mma.sync m16n8k16; Triton splits M over warps by it)
# The estimate may use this share of a thread's register cap: ptxas may need up to a third more
# than an estimate that is 25 % low (bench_static's tolerance), so an estimate over 75 % of the cap
# risks spilling; and where the estimate leaves ptxas room, ptxas fills it (kernels estimated near
# the cap compile to exactly 255 registers), which the estimate cannot follow.
SPILL_HEADROOM = 0.75


@dataclass(frozen=True)
class RegisterDemand:
    """What a block holds in registers, before it is spread over the block's threads."""

    tiles: tuple[tuple[float, float], ...]  # (weight, 32-bit words the whole block holds) per tile
    dot_chains: tuple[tuple[int, int, int], ...]  # (values, M, K) per distinct tl.dot left operand

    def per_thread(self, warps: int) -> float:
        threads = warps * 32
        held = sum(w * max(1.0, math.ceil(words / threads)) for w, words in self.tiles)
        for values, m, k in self.dot_chains:
            rows = max(MMA_ROWS, m // max(1, min(warps, m // MMA_ROWS)))
            held += W_DOT_CHAIN * values * rows * k / 32
        return held


@dataclass(frozen=True)
class KernelResources:
    """What one block of a kernel holds, for an instance's assignment."""

    smem: int  # bytes of shared memory per block
    base_registers: int  # per thread, whatever the tiles
    demand: RegisterDemand
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
        return regs_per_thread(self.base_registers, self.demand, self.warps)

    @property
    def block_registers(self) -> int:
        """Registers one block holds (the two designs of a padding choice may differ in warps)."""
        return self.regs_per_thread * self.threads

    @property
    def spills(self) -> bool:
        """Whether ptxas would likely spill: the estimate leaves less than SPILL_HEADROOM of the cap."""
        return self.regs_per_thread > usable_regs(self.warps)


def reg_cap(warps: int) -> int:
    """Registers a thread may use when a block of `warps` must fit the register file."""
    return min(MAX_REGS_PER_THREAD, REGS_PER_SM // (warps * 32) // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


def usable_regs(warps: int) -> int:
    return int(reg_cap(warps) * SPILL_HEADROOM)


def regs_per_thread(base: int, demand: RegisterDemand, warps: int) -> int:
    return math.ceil(base + demand.per_thread(warps))


def choose_warps(base: int, demand: RegisterDemand) -> int:
    """The fewest warps (from Triton's default 4) whose threads hold the tiles without
    spilling; 32 when none can (the kernel is then infeasible, see `check`)."""
    for w in WARP_CHOICES:
        if regs_per_thread(base, demand, w) <= usable_regs(w):
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


def _register_demand(k: BlockKernel, types, padded_of: dict, dots: tuple[str, ...]) -> RegisterDemand:
    """The tiles a block holds (see the module doc for the kinds and their weights)."""
    tiles: list[tuple[float, float]] = []
    chains: dict[str, tuple[int, int, int]] = {}
    by_name = {n.name: n for n in k.nodes}
    for n in k.nodes:
        if n.name not in padded_of:
            continue
        size = math.prod(padded_of[n.name])
        if n.op == "accum":
            tiles.append((W_ACCUMS, size))
        elif n.op == "load":
            tiles.append((W_LOADS, size * BYTES.get(types[n.name].dtype, 4) / 4))
        elif n.op == "matmul":
            m, kk, nn = _matmul_dims(padded_of, n)
            if n.name not in dots:
                tiles.append((W_PRODUCT, m * kk * nn))
            elif n.inputs[0] not in chains:
                chains[n.inputs[0]] = (len(_operand_chain(by_name, padded_of, n.inputs[0], m * kk)), m, kk)
    return RegisterDemand(tuple(tiles), tuple(chains.values()))


def _operand_chain(by_name: dict, padded_of: dict, start: str, elements: int) -> set[str]:
    """The full-size values a dot's left operand is computed from in the kernel (back to its
    loads, a matmul or an accumulator): Triton moves that elementwise chain into the operand
    layout. Smaller tiles (a broadcast row of weights) are not counted."""
    chain: set[str] = set()
    stack = [start]
    while stack:
        name = stack.pop()
        if name in chain or name not in padded_of or math.prod(padded_of[name]) < elements:
            continue
        chain.add(name)
        if by_name[name].op not in ("load", "matmul", "accum"):
            stack.extend(by_name[name].inputs)
    return chain


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
    demand = _register_demand(k, types, padded_of, dots)
    largest = max(((n, math.prod(p)) for n, p in padded_of.items()), key=lambda t: t[1], default=("", 0))
    batched = next((n.name for n in k.nodes if n.op == "matmul"
                    and any(d != 1 for s in n.inputs for d in dims_of[s][:-2])), None)
    base = REG_BASE
    warps = choose_warps(base, demand)
    return KernelResources(_smem(g, k, types, padded_of, dots, warps), base, demand, largest, batched, pad, dots,
                           warps)


def kernel_resources(g: SGraph, k: BlockKernel, values: Mapping[str, int]) -> KernelResources:
    """Resources of `k` under `values`, with the token tile padded to the MMA minimum where a
    matmul would otherwise fall back to broadcast-and-sum and padding is cheaper: it needs no
    more registers a block, or the tile has at least PAD_MIN_ROWS rows (see there); never where the
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
    cheaper = padded.block_registers <= plain.block_registers or values[tok] >= PAD_MIN_ROWS
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
        raise SGraphError(f"{where}: tiles need about {r.regs_per_thread} registers per thread over "
                          f"{r.threads} threads, over the {usable_regs(r.warps)} a thread may hold without spilling")
    return r


def blocks_per_sm(r: KernelResources, gpu) -> int:
    """Resident blocks per SM, limited by registers, shared memory, warps and the block slots
    (the CUDA occupancy calculation; per-SM limits from the GPU spec)."""
    per_thread = -(-r.regs_per_thread // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = gpu.regs_per_sm // (per_thread * r.threads)
    by_smem = gpu.smem_per_sm // r.smem if r.smem else gpu.max_blocks_per_sm
    by_warps = gpu.max_warps_per_sm // r.warps
    return max(0, min(by_regs, by_smem, by_warps, gpu.max_blocks_per_sm))
