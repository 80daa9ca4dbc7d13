"""The cost model: a roofline that sees occupancy, the L2's capacity, tensor cores and launches.

It ranks instantiations of an sGraph for one GPU and num_tokens; it is not a simulator.
Per block kernel:
- memory: unique tensor bytes move from DRAM (in 32-byte sectors); repeated tile loads (a
  weight read by every token block, say) hit the L2 only while the re-read set fits the L2,
  the rest go to DRAM again. Achieved bandwidth follows Little's law: the bytes a resident
  block has in flight (one loop iteration's loads) times the resident blocks (occupancy from
  the resource model's registers, shared memory and warps) over the DRAM latency, capped by
  what each busy SM's L1 can take per clock and by the GPU's peak. However many blocks split
  its bytes, a kernel that reads DRAM takes at least its blocks' chain of dependent loads: one
  DRAM latency, or, for a loop, one per `PIPELINED_STEPS` iterations (a loop of hidden / 1
  steps is never as fast as one whole-row load, though both move few bytes).
- compute: half-precision matmuls codegen emits as `tl.dot` (see `resources.kernel_resources`,
  which pads small token tiles to the MMA minimum where that is cheaper) run on tensor cores
  at their padded size, those on TF32 operands (`ir.TF32`) at the TF32 rate; fp32 dots (IEEE),
  broadcast-and-sum products and everything else on the fp32 units.
- waves: a grid that leaves resident-block slots idle in its last wave wastes them.
- launch: one kernel launch, eager or as one node of a replayed CUDA graph (vLLM decodes
  under CUDA graphs), from the GPU spec (measured on a device, cited constants offline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, REDUCTIONS, Program, is_tf32
from prism_serve.optimize.ir.reference import expand_composites
from prism_serve.optimize.ir.sgraph import BYTES, BlockKernel, Kernel, sym
from prism_serve.optimize.target.gpus import ARCH, GRAPH_LAUNCH_US, GpuSpec
from prism_serve.optimize.target.instance import Instance
from prism_serve.optimize.target.reads import INDEXING, block_reads
from prism_serve.optimize.target.resources import KernelResources, blocks_per_sm

LAUNCH_US = GRAPH_LAUNCH_US  # the default mode's launch cost (CUDA-graph replay), for bounds
SECTOR_BYTES = 32  # DRAM / L2 access granularity (CUDA C++ Best Practices Guide, "Coalesced Access")
# L2 bandwidth over DRAM bandwidth: about 2.5x on A100 and H100 (Jia et al., "Dissecting the
# Ampere GPU Architecture through Microbenchmarking", GTC 2021; Chips and Cheese, "Nvidia's H100:
# Funny L2, and Tons of Bandwidth", 2023). Unchecked: the pages at hand give the articles' opening
# only, not their bandwidth figures.
L2_BANDWIDTH_FACTOR = 2.5
# Share of the L2 a re-read set may count on: A100 / H100 split the L2 in two partitions and an
# SM sees the far one at higher cost (A100 whitepaper, "L2 cache"; the H100 latency step at half
# the L2 in Chips and Cheese 2023, above).
L2_USABLE_FRACTION = 0.5
# Loaded DRAM latency, ns: pointer-chase measurements put the unloaded latency at 400-600 ns on
# A100 and H100 (Jia et al. 2021; Chips and Cheese 2023, above). Little's law with it gives the
# bytes that must be in flight to reach peak bandwidth. Unchecked, like the L2 factor above: the
# latency plots of those articles could not be read this session; a GPU run should measure it.
DRAM_LATENCY_NS = 600.0
# Bytes an SM's L1 returns per clock (A100 and H100 whitepapers: 128 B/clk/SM): a cap on how
# fast one busy SM can pull data, so a small grid cannot reach the GPU's peak.
L1_BYTES_PER_CLOCK = 128
# Loop iterations whose loads one DRAM latency covers: codegen's loops are software-pipelined with
# Triton's num_stages 3 (`resources.py`), which issues the loads of two iterations ahead of the one
# being computed (Triton's "Software pipelining" in its loop pipeliner docs).
PIPELINED_STEPS = 2
# Dense TF32 tensor-core rate over the dense FP16 rate: one half on every data-center GPU from
# Ampere to Blackwell (NVIDIA datasheets: A100 156 / 312 TFLOPS, H100 SXM 495 / 989, L40S 183 /
# 362, L4 60 / 121, B200 1.1 / 2.25 PFLOPS).
TF32_TENSOR_SHARE = 0.5


@dataclass(frozen=True)
class KernelCost:
    name: str
    blocks: int
    dram_bytes: float
    l2_bytes: float
    tensor_flops: float
    fp32_flops: float
    time_us: float
    regs_per_thread: int = 0  # 0 for library kernels
    blocks_per_sm: int = 0
    bandwidth_gbs: float = 0.0  # the achieved DRAM bandwidth the model assumed
    tf32_flops: float = 0.0  # tensor-core work on TF32 operands (`tensor_flops` is on half ones)


def clock_ghz(gpu: GpuSpec) -> float:
    """SM clock implied by the peak fp32 rate and the architecture's FP32 lanes per SM."""
    per_clock = ARCH[gpu.compute_capability].fp32_flops_per_clock_sm if gpu.compute_capability in ARCH else 256
    return gpu.fp32_tflops * 1e3 / (gpu.sms * per_clock)


def launch_us(gpu: GpuSpec, graphs: bool = True) -> float:
    """One kernel launch: a node of a replayed CUDA graph, or an eager launch."""
    return gpu.graph_launch_us if graphs else gpu.eager_launch_us


def achieved_bandwidth_gbs(gpu: GpuSpec, blocks: int, resident_per_sm: int, bytes_in_flight: float) -> float:
    """DRAM bandwidth a grid reaches: Little's law over its resident blocks' bytes in flight,
    each busy SM capped by its L1, the whole by the GPU's peak."""
    busy_sms = min(blocks, gpu.sms)
    per_sm_blocks = min(resident_per_sm, math.ceil(blocks / max(busy_sms, 1)))
    per_sm = min(per_sm_blocks * bytes_in_flight / DRAM_LATENCY_NS, L1_BYTES_PER_CLOCK * clock_ghz(gpu))
    return max(min(gpu.mem_bandwidth_gbs, busy_sms * per_sm), 1e-6)


def _sector_waste(tile_last: int, tensor_last: int, itemsize: int) -> float:
    """DRAM moves whole 32-byte sectors: a tile narrower than its rows reads each run rounded up."""
    if tile_last >= tensor_last:
        return 1.0
    run = tile_last * itemsize
    return math.ceil(run / SECTOR_BYTES) * SECTOR_BYTES / run


def _numel(shape) -> int:
    return math.prod(shape)


def _grid_blocks(inst: Instance, k: BlockKernel, num_tokens: int) -> int:
    values = inst.values
    return math.prod(math.ceil(num_tokens / values[a.symbol]) if a.over_tokens else values[a.symbol]
                     for a in k.grid)


def block_kernel_cost(inst: Instance, k: BlockKernel, num_tokens: int, gpu: GpuSpec,
                      *, graphs: bool = True) -> KernelCost:
    g = inst.sgraph
    values = inst.values
    res: KernelResources = inst.resources(k)
    blocks = _grid_blocks(inst, k, num_tokens)
    steps = values[k.forloop] if k.forloop else 1
    requested: dict[str, float] = {}
    unique: dict[str, float] = {}
    # bytes in flight per stage and tensor: a second load of a tensor in one block (a row load
    # beside its column tile, say) re-reads what the first brings and adds no DRAM request
    in_flight: dict[tuple[str, str], float] = {}
    tc = tf32 = fp32 = 0.0
    types = g.block_types(k)
    token = next((sym(a.symbol) for a in k.grid if a.over_tokens), None)
    # fp32 programs get tl.dot(..., input_precision="ieee") from codegen: FMA units, not tensor cores
    half = any(n.attr("dtype") in ("float16", "bfloat16") for n in g.program.inputs)
    indexed = block_reads(k)
    gathered: set[str] = set()  # tensors read only as rows picked by an index
    for n in k.nodes:
        if n.op == "const" or n.name in indexed.virtual:
            continue
        tile = tuple(inst.concrete(d, num_tokens) for d in types[n.name].shape)
        stage = k.stages[n.name]
        times = steps if stage == "loop" else 1
        if n.op in ("load", "store") or n.name in indexed.reads:  # a windowed or indexed load: its own tile
            decl = g.tensors[(k.by_name[indexed.reads[n.name]] if n.name in indexed.reads else n).attr("tensor")]
            if n.op == Op.GATHER:
                gathered.add(decl.name)
            shape = inst.tensor_shape(decl.name, num_tokens)
            waste = _sector_waste(tile[-1] if tile else 1, shape[-1] if shape else 1, BYTES[decl.dtype])
            writers = blocks
            if n.op == "store":  # along an axis the store does not map, only the first block writes
                writers //= math.prod(values[a.symbol] for a, d in zip(k.grid, n.attr("omap"))
                                      if d is None and not a.over_tokens)
            rows = tuple(min(t, num_tokens) if d == token else t for t, d in zip(tile, types[n.name].shape))
            tile_bytes = _numel(rows) * BYTES[decl.dtype] * waste  # masked rows past num_tokens move nothing
            requested[decl.name] = requested.get(decl.name, 0.0) + writers * times * tile_bytes
            unique[decl.name] = max(unique.get(decl.name, 0.0), _numel(shape) * BYTES[decl.dtype] * waste)
            if n.op != "store":
                key = ("loop" if stage == "loop" else "pre", decl.name)
                in_flight[key] = max(in_flight.get(key, 0.0), tile_bytes)
        elif n.op == Op.MATMUL:
            a_dims = inst.concrete(types[n.inputs[0]].shape[-2], num_tokens)
            kk = inst.concrete(types[n.inputs[0]].shape[-1])
            nn = _numel(tile) // max(a_dims, 1)
            if n.name in res.dots and half:  # tensor cores work on the padded tile
                m = max(1 << (a_dims - 1).bit_length(), 16) if res.mma_padded else a_dims
                if is_tf32(n.attrs):
                    tf32 += 2.0 * m * kk * nn * blocks * times
                else:
                    tc += 2.0 * m * kk * nn * blocks * times
            else:
                fp32 += 2.0 * a_dims * kk * nn * blocks * times
        elif n.op not in INDEXING:
            fp32 += _numel(tile) * blocks * times
    for name in gathered:  # an indexed load's rows come from DRAM once, however large the table
        unique[name] = min(unique[name], requested[name])
    dram, l2 = _split_l2(requested, unique, gpu)
    resident = max(blocks_per_sm(res, gpu), 1)
    per_stage = {st: sum(b for (s, _), b in in_flight.items() if s == st) for st in ("pre", "loop")}
    bandwidth = achieved_bandwidth_gbs(gpu, blocks, resident, max(per_stage.values()))
    chain = math.ceil(steps / PIPELINED_STEPS) if per_stage["loop"] else 1
    time = _time_us(gpu, blocks, resident, dram, l2, tc, fp32, bandwidth, chain, tf32) + launch_us(gpu, graphs)
    return KernelCost(k.name, blocks, dram, l2, tc, fp32, time, res.regs_per_thread, resident, bandwidth, tf32)


def _split_l2(requested: dict[str, float], unique: dict[str, float], gpu: GpuSpec) -> tuple[float, float]:
    """(DRAM bytes, L2 bytes): each tensor's first read comes from DRAM; its re-reads hit the L2
    in the proportion of the re-read set that fits the usable L2, the rest come from DRAM again."""
    capacity = gpu.l2_mb * 2**20 * L2_USABLE_FRACTION
    reread_set = sum(unique[t] for t in unique if requested[t] > unique[t])
    hit = min(1.0, capacity / reread_set) if reread_set else 1.0
    dram = l2 = 0.0
    for t, req in requested.items():
        again = max(req - unique[t], 0.0)
        dram += unique[t] + again * (1 - hit)
        l2 += again * hit
    return dram, l2


def _time_us(gpu: GpuSpec, blocks: int, resident_per_sm: int, dram: float, l2: float, tc: float, fp32: float,
             bandwidth_gbs: float, latency_chain: int = 1, tf32: float = 0.0) -> float:
    """A kernel's time without its launch: the slower of memory and compute; `latency_chain`
    counts the DRAM latencies a block waits for in sequence (see the module docstring), once per
    wave of blocks."""
    slots = gpu.sms * resident_per_sm
    waves = max(1, math.ceil(blocks / slots))
    # the last wave's idle slots: compute stretches by the share of SM-slots left unused
    busy = min(1.0, blocks / (waves * slots)) if blocks > slots else min(blocks, gpu.sms) / gpu.sms
    mem = dram / (bandwidth_gbs * 1e3) + l2 / (gpu.mem_bandwidth_gbs * 1e3 * L2_BANDWIDTH_FACTOR)
    if dram:  # however many blocks share the bytes, none finishes before its chain of loads returns
        mem = max(mem, waves * latency_chain * DRAM_LATENCY_NS / 1e3)
    tensor_tflops = gpu.fp16_tensor_tflops * 1e6
    compute = (tc / tensor_tflops + tf32 / (tensor_tflops * TF32_TENSOR_SHARE) + fp32 / (gpu.fp32_tflops * 1e6)) \
        / max(busy, 1e-9)
    return max(mem, compute)


def _library_cost(prog_types, op, num_tokens: int, gpu: GpuSpec, name: str, graphs: bool = True) -> KernelCost:
    def size(t) -> int:
        return _numel(tuple(num_tokens if d == "num_tokens" else int(d) for d in t.shape))

    def nbytes(t) -> int:
        return size(t) * BYTES.get(t.dtype, 4)

    out = prog_types[name]
    dram = nbytes(out) + sum(nbytes(prog_types[s]) for s in op.inputs if prog_types[s].dtype != "const")
    if op.op in (Op.SLICE, Op.GATHER):  # reads its window / the rows it picks (and the index), not the whole table
        dram = 2 * nbytes(out) + sum(nbytes(prog_types[s]) for s in op.inputs[1:])
    tc = fp32 = 0.0
    if op.op == Op.MATMUL:
        a = prog_types[op.inputs[0]]
        tc = 2.0 * size(out) * int(a.shape[-1])
    elif op.op in ELEMENTWISE_BINARY + ELEMENTWISE_UNARY + REDUCTIONS:
        fp32 = float(max(size(out), *(size(prog_types[s]) for s in op.inputs)))
    blocks = max(gpu.sms, size(out) // 1024)  # library kernels (cuBLAS, torch) are assumed to fill the GPU
    time = _time_us(gpu, blocks, 1, dram, 0.0, tc, fp32, gpu.mem_bandwidth_gbs) + launch_us(gpu, graphs)
    return KernelCost(name, blocks, dram, 0.0, tc, fp32, time, bandwidth_gbs=gpu.mem_bandwidth_gbs)


def instance_cost(inst: Instance, num_tokens: int, gpu: GpuSpec, *, graphs: bool = True) -> list[KernelCost]:
    """Modeled cost of every kernel of an instance at `num_tokens` (launches as graph replay
    unless `graphs=False`)."""
    return [kernel_cost(inst, k, num_tokens, gpu, graphs=graphs) for k in inst.sgraph.kernels]


def kernel_cost(inst: Instance, k: Kernel, num_tokens: int, gpu: GpuSpec, *, graphs: bool = True) -> KernelCost:
    """Modeled cost of one kernel of an instance; it depends only on the symbols that kernel reads
    (`tune.kernel_symbols`), so an instance's time is the sum over its kernels."""
    if isinstance(k, BlockKernel):
        return block_kernel_cost(inst, k, num_tokens, gpu, graphs=graphs)
    tensors = inst.sgraph.tensors
    types = {n: _Type(inst.tensor_shape(n, num_tokens), tensors[n].dtype) for n in (k.op.name, *k.op.inputs)}
    return _library_cost(types, k.op, num_tokens, gpu, k.op.name, graphs)


def modeled_us(inst: Instance, num_tokens: int, gpu: GpuSpec, *, graphs: bool = True) -> float:
    return sum(c.time_us for c in instance_cost(inst, num_tokens, gpu, graphs=graphs))


def tie_key(inst: Instance, gpu: GpuSpec, num_tokens: int) -> tuple:
    """How equal modeled times at `num_tokens` are ordered: fewer bytes requested in all (DRAM and
    L2 together, so a tiling whose blocks re-read what other blocks also read, the normed row of
    each of 256 one-column blocks, say, goes after one that reads it once: equal in time while
    latency bound, not in the work and L2 traffic it adds beside other kernels), then fewer
    registers per thread, more resident blocks per SM, fewer warps, less shared memory (summed
    over block kernels); only instances equal in all of these fall back to their assignment, for
    determinism."""
    requested = sum(c.dram_bytes + c.l2_bytes for c in instance_cost(inst, num_tokens, gpu))
    res = [inst.resources(k) for k in inst.sgraph.kernels if isinstance(k, BlockKernel)]
    return (round(requested), sum(r.regs_per_thread for r in res), -sum(blocks_per_sm(r, gpu) for r in res),
            sum(r.warps for r in res), sum(r.smem for r in res), tuple(sorted(inst.values.items())))


def unfused_us(prog: Program, num_tokens: int, gpu: GpuSpec, *, graphs: bool = True) -> float:
    """The program as one library kernel per primitive op (composites expanded)."""
    flat = expand_composites(prog)
    return sum(_library_cost(flat.types, n, num_tokens, gpu, n.name, graphs).time_us
               for n in flat.nodes if n.op not in ("input", "const"))


@dataclass(frozen=True)
class _Type:
    shape: tuple
    dtype: str
