"""The resource model: registers, shared memory and warps of one block kernel of an instance.

Registers per thread follow what Triton (3.x, NVIDIA backend) makes of the generated kernel and
what ptxas then keeps live. Each term below counts 32-bit registers of one thread for one kind
of value, in the layout Triton gives that value; `REG_WEIGHTS` says how much of it ptxas keeps
live at the peak (1.0: all of it):
  - base: program ids, the token mask, base pointers and strides, loop counter;
  - pipeline: a `for` loop of more than one step is software-pipelined (num_stages 3): loads
    become `cp.async` copies into shared-memory ring buffers, and the loop carries buffer
    indices, stage predicates and the next stages' offsets;
  - addresses: every thread addresses its share of a loaded tile in 16-byte vectors, one 64-bit
    pointer (two registers) per vector;
  - loads: a tile loaded into registers (outside a pipelined loop, or too narrow for `cp.async`,
    which moves at least 4 bytes per thread) at its storage width, spread over the block's
    threads (at least one register each). A pipelined tile lives in shared memory and is read
    into registers piecewise where it is used;
  - accumulators of a `tl.dot`: the MMA layout (mma.sync m16n8k16) gives each warp a
    (M / warps_m) x (N / warps_n) piece of the tile, at least one 16 x 8 instruction tile, and
    each thread a 32nd of it in fp32 (`mma_warps` splits the warps as Triton does);
  - other accumulators, in fp32, spread over the threads;
  - the left operand of a `tl.dot`: read from shared memory one k-step at a time when it is a
    plain load (Triton: repM x 4 x repK registers for the whole operand, of which ptxas keeps a
    part live); computed in registers when it is an elementwise chain (x * g of RMSNorm): every
    value of the chain is formed in the operand layout (each warp holds all K columns of its rows)
    in fp32 and converted to half precision as it is packed. ptxas forms the chain k-step by
    k-step just ahead of the MMAs (`CHAIN_K_WINDOW` columns live), except where a tile of the
    chain is too narrow for `cp.async`: it is then loaded into registers and moved into the
    operand layout through shared memory behind a barrier, and the whole K of the chain is live.
    B operands stream from shared memory a k-step at a time (a term for them was fitted to 0);
  - a broadcast-and-sum matmul (`tl.sum(a[:, :, None] * b[None, :, :], axis=1)`): each product
    is added into the sum as it is formed, so what stays live are the operands copied into the
    m x k x n product's layout (Triton's default blocked layout, `blocked_per_thread`): a thread
    holds the a values of its (m, k) positions and the b values of its (k, n) positions (a term
    for the product elements themselves was fitted to 0);
  - inputs of a reduction along a row, in fp32, outside a pipelined loop (inside one, the input
    is read piecewise from its shared-memory stage and folded into the sum: fitted to ~0);
  - a dot on TF32 operands (`ir.TF32`) holds its operands in fp32, one value a register where
    half values pack two: the rows of its left operand a warp holds, over `CHAIN_K_WINDOW` columns
    at most, a 32nd per thread. Its weight is the median of (TF32 - half registers) / term over
    60 non-spilling pairs of the fp16 rmsnorm_linear / rmsnorm_mlp oracles compiled both ways at
    equal warps for sm_90 and sm_80 (`scripts/bench_static.py --tf32-pairs
    bench/results/static-tf32-pairs-2026-12-05.jsonl`; single pairs range from -0.89 to 2.75: ptxas
    allocates unevenly); `--fit` keeps it.
The weights are one non-negative least-squares fit (relative error) against ptxas 12.x under
Triton 3.9, `scripts/bench_static.py --fit bench/results/static-fit-sample-2026-12-03.jsonl`:
968 non-spilling kernels (a random share of the cases of bench_static at their 4 best-ranked and
8 random tilings, 4 and 8 warps, sm_90 and sm_80) plus 510 kernels bench_static runs chose while
the model was built, weighed 3x as they are the
ones the tuner stores; spilling kernels left out. Accumulators and addresses keep their physical
weights (1 and 2 registers). The model does not know the target: on sm_90 the tiniest kernels
compile to ~30 % fewer registers than estimated, and wgmma (sm_90, M >= 64) keeps operands in
shared memory.

A token tile below the MMA minimum is padded to 16 rows (masked) where that is cheaper than
the broadcast product (see `kernel_resources`): codegen then emits `tl.dot`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import REDUCTIONS, is_tf32
from prism_serve.optimize.ir.sgraph import BYTES, BlockKernel, SGraph, _exact, sym
from prism_serve.optimize.target.reads import block_reads

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
# Registers per thread = sum over the terms of the module doc of weight x registers of the term.
REG_WEIGHTS = {
    "base": 8.85,  # registers, whatever the tiles
    "pipeline": 13.04,  # registers, when the loop is software-pipelined
    "addresses": 2.0,  # per 16-byte vector a thread loads (a 64-bit pointer)
    "loads": 0.29,  # per 32-bit word of a tile loaded into registers
    "dot_accumulators": 1.0,  # per fp32 accumulator register of the MMA layout
    "accumulators": 1.0,  # per fp32 element of another accumulator
    "operand_loads": 0.76,  # per register of a plain-load left operand (repM x 4 x repK)
    "operand_chains": 0.3,  # per fp32 element of a value computed in a left operand's layout
    "reduced": 0.5,  # per fp32 element of a reduction's input
    "product_operands": 0.6,  # per operand element held in a broadcast product's layout
    "tf32_operands": 0.25,  # per fp32 value of a TF32 dot's left operand window (fitted apart, below)
}
# ptxas forms an operand chain k-step by k-step just ahead of the MMAs that read it: of a long K
# it keeps about this many columns live (fitted with the weights: 64, 128, 256 and unbounded
# were tried; 128 fits best, and an unbounded chain overestimates K = 512 tiles 2.5x).
CHAIN_K_WINDOW = 128
MMA_M, MMA_N = 16, 8  # mma.sync m16n8k16: one warp instruction's output tile
MMA_MIN = 16  # tl.dot needs every dim >= 16 on GPUs; smaller products use broadcast-and-sum
CP_ASYNC_MIN_BYTES = 4  # cp.async moves 4, 8 or 16 bytes per thread (PTX ISA, cp.async)
VECTOR_BYTES = 16  # widest load per thread (ld.global.v4.b32 / cp.async 16 bytes)
# The estimate may use this share of a thread's register cap. Where the estimate leaves ptxas
# room, ptxas fills it: in bench_static (2026-12-03) kernels estimated at 64 % and 73 % of the cap
# (164 and 187 of 255 registers) compiled to exactly 255, and at 75 % the tuner chose them; at 65 %
# it does not, and no chosen kernel spills.
SPILL_HEADROOM = 0.65


def pow2(n: int) -> int:
    """The power of two Triton pads a tile dim of `n` to."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class DotTile:
    """One `tl.dot` of a block: its padded M x K x N tile and how its left operand reaches registers."""

    m: int
    k: int
    n: int
    chain: int  # values computed in the left operand's layout; 0: the operand is a plain load
    chain_loads: tuple[int, ...]  # bytes of each tile loaded every loop step that feeds the chain
    first_use: bool  # the first dot of this left operand (later dots share its registers)
    accumulated: bool  # its result is a loop accumulator, kept in the MMA layout
    tf32: bool = False  # on TF32 operands (`ir.TF32`): held in fp32, one value per register


@dataclass(frozen=True)
class RegisterDemand:
    """What a block holds in registers, before it is spread over the block's threads (see the
    module doc for the terms)."""

    loads: tuple[tuple[int, bool], ...]  # (bytes of the tile, loaded every step of a multi-step loop)
    accumulators: tuple[int, ...]  # fp32 elements of each accumulator outside the MMA layout
    dots: tuple[DotTile, ...]
    products: tuple[tuple[int, int, int], ...]  # m, k, n of each broadcast product
    reduced: tuple[int, ...]  # elements of each reduction's input
    pipelined: bool  # the kernel has a loop of more than one step

    def terms(self, warps: int) -> dict[str, float]:
        """Registers per thread of each term at `warps` warps, before weighting."""
        threads = warps * 32
        spread = lambda elements: max(1, math.ceil(elements / threads))  # noqa: E731
        t = dict.fromkeys(REG_WEIGHTS, 0.0)
        t["base"] = 1.0
        t["pipeline"] = float(self.pipelined)
        for size, in_loop in self.loads:
            t["addresses"] += spread(size / VECTOR_BYTES)
            if not self._staged(size, in_loop, threads):
                t["loads"] += spread(size / 4)
        t["accumulators"] = sum(spread(e) for e in self.accumulators)
        for d in self.dots:
            wm, wn = mma_warps(d.m, d.n, warps)
            rows = max(MMA_M, d.m // wm)
            if d.accumulated:
                t["dot_accumulators"] += rows * max(MMA_N, d.n // wn) / 32
            if d.first_use and d.chain:
                narrow = any(not self._staged(b, True, threads) for b in d.chain_loads)
                t["operand_chains"] += d.chain * rows * (d.k if narrow else min(d.k, CHAIN_K_WINDOW)) / 32
            elif d.first_use:
                t["operand_loads"] += rows * d.k / 64  # two halves per register
            if d.first_use and d.tf32:
                t["tf32_operands"] += rows * min(d.k, CHAIN_K_WINDOW) / 32
        for m, k, n in self.products:
            rm, rk, rn = blocked_per_thread((m, k, n), warps)
            t["product_operands"] += rm * rk + rk * rn
        if not self.pipelined:  # a pipelined loop folds its staged tiles into the sums piecewise
            t["reduced"] = sum(spread(e) for e in self.reduced)
        return t

    def _staged(self, size: int, in_loop: bool, threads: int) -> bool:
        """Whether a tile loaded every loop step is staged through shared memory by cp.async."""
        return in_loop and self.pipelined and size >= CP_ASYNC_MIN_BYTES * threads

    def per_thread(self, warps: int) -> float:
        return sum(REG_WEIGHTS[name] * v for name, v in self.terms(warps).items())


def blocked_per_thread(shape: tuple[int, ...], warps: int) -> tuple[int, ...]:
    """Elements per thread along each dim of Triton's default blocked layout for `shape`: one
    element per thread per step, a warp's 32 lanes and then the warps laid along the innermost
    dims first, lanes or warps left over repeating along the outermost dim."""
    lanes, left = [1] * len(shape), 32
    for d in reversed(range(len(shape))):
        lanes[d] = max(1, min(left, shape[d]))
        left //= lanes[d]
    wpc, left = [1] * len(shape), warps
    for d in reversed(range(len(shape))):
        wpc[d] = max(1, min(left, shape[d] // lanes[d]))
        left //= wpc[d]
    return tuple(max(1, s // (lanes[d] * wpc[d])) for d, s in enumerate(shape))


def mma_warps(m: int, n: int, warps: int) -> tuple[int, int]:
    """How Triton splits a block's warps over a tl.dot's M x N tile (`warpsPerTileV2` in
    lib/Dialect/TritonGPU/Transforms/AccelerateMatmul.cpp, Triton 3.x): keep doubling the warps
    along the dim with more 16 x 8 instruction tiles left per warp, M on ties."""
    wm = wn = 1
    rm, rn = -(-m // MMA_M), -(-n // MMA_N)
    while wm * wn < warps:
        if rm >= rn:
            wm *= 2
            rm = rm // 2 if rm != 1 else 1
        else:
            wn *= 2
            rn //= 2
    return wm, wn


@dataclass(frozen=True)
class KernelResources:
    """What one block of a kernel holds, for an instance's assignment."""

    smem: int  # bytes of shared memory per block
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
        return regs_per_thread(self.demand, self.warps)

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


def regs_per_thread(demand: RegisterDemand, warps: int) -> int:
    return math.ceil(demand.per_thread(warps))


def choose_warps(demand: RegisterDemand) -> int:
    """The fewest warps (from Triton's default 4) whose threads hold the tiles without
    spilling; 32 when none can (the kernel is then infeasible, see `check`)."""
    for w in WARP_CHOICES:
        if regs_per_thread(demand, w) <= usable_regs(w):
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
    values = dict(values)
    for n in k.nodes:
        if n.op in ("store", "const"):
            continue
        shape = types[n.name].shape
        dims = [_exact(g.name, f"kernel '{k.name}' node '{n.name}'", d, values) for d in shape]
        dims_of[n.name] = dims
        padded_of[n.name] = [max(pow2(v), MMA_MIN) if pad and tok and d == sym(tok) else pow2(v)
                             for d, v in zip(shape, dims)]
    return types, dims_of, padded_of


def _dots(k: BlockKernel, padded_of: dict) -> tuple[str, ...]:
    return tuple(n.name for n in k.nodes if n.op == Op.MATMUL and min(_matmul_dims(padded_of, n)) >= MMA_MIN)


def _register_demand(k: BlockKernel, types, padded_of: dict, dots: tuple[str, ...],
                     values: Mapping[str, int]) -> RegisterDemand:
    """The tiles a block holds (see the module doc for the terms)."""
    loads, accums, tiles, products, reduced = [], [], [], [], []
    by_name = {n.name: n for n in k.nodes}
    seen_operands: set[str] = set()
    indexed = block_reads(k)
    for n in k.nodes:
        if n.name not in padded_of or n.name in indexed.virtual:
            continue
        size = math.prod(padded_of[n.name])
        if n.op == "load" or n.name in indexed.reads:  # a windowed or indexed load holds its own tile
            loads.append((size * BYTES.get(types[n.name].dtype, 4), k.stages[n.name] == "loop"))
        elif n.op == "accum" and n.inputs[0] not in dots:
            accums.append(size)
        elif n.op in REDUCTIONS:
            reduced.append(math.prod(padded_of[n.inputs[0]]))
        elif n.op == Op.MATMUL:
            m, kk, nn = _matmul_dims(padded_of, n)
            if n.name not in dots:
                products.append((m, kk, nn))
                continue
            a = n.inputs[0]
            chain = set() if by_name[a].op == "load" else _operand_chain(by_name, padded_of, a, m * kk)
            in_loop = lambda name: by_name[name].op == "load" and k.stages[name] == "loop"  # noqa: E731
            feeds = {s for c in chain for s in by_name[c].inputs if s in by_name and in_loop(s)}
            feeds |= {c for c in chain if in_loop(c)}
            chain_loads = tuple(math.prod(padded_of[s]) * BYTES.get(types[s].dtype, 4) for s in sorted(feeds))
            accumulated = any(x.op == "accum" and x.inputs[0] == n.name for x in k.nodes)
            tiles.append(DotTile(m, kk, nn, len(chain), chain_loads, a not in seen_operands, accumulated,
                                 is_tf32(n.attrs)))
            seen_operands.add(a)
    pipelined = bool(k.forloop) and values.get(k.forloop, 1) > 1
    return RegisterDemand(tuple(loads), tuple(accums), tuple(tiles), tuple(products), tuple(reduced), pipelined)


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
        if by_name[name].op not in ("load", Op.MATMUL, "accum"):
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
        elif n.op in REDUCTIONS and n.inputs[0] in padded_of:
            smem = max(smem, 4 * warps * math.prod(padded_of[n.name]))
    return smem


def _resources(g: SGraph, k: BlockKernel, values: Mapping[str, int], pad: bool) -> KernelResources:
    types, dims_of, padded_of = _analyse(g, k, values, pad)
    dots = _dots(k, padded_of)
    demand = _register_demand(k, types, padded_of, dots, values)
    virtual = block_reads(k).virtual
    largest = max(((n, math.prod(p)) for n, p in padded_of.items() if n not in virtual), key=lambda t: t[1],
                  default=("", 0))
    batched = next((n.name for n in k.nodes if n.op == Op.MATMUL
                    and any(d != 1 for s in n.inputs for d in dims_of[s][:-2])), None)
    warps = choose_warps(demand)
    return KernelResources(_smem(g, k, types, padded_of, dots, warps), demand, largest, batched, pad, dots, warps)


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
    if tok is None or values.get(tok, MMA_MIN) >= MMA_MIN or not any(n.op == Op.MATMUL for n in k.nodes):
        return plain
    types = g.block_types(k)
    if any(n.op in REDUCTIONS and types[n.inputs[0]].shape[n.attr("dim")] == sym(tok)
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
