"""A lower bound on the modeled time of every design that extends a partial one (the ``cost`` rule).

The cost model (`cost.py`) charges each kernel one launch plus at least the time to move, at the
GPU's peak DRAM bandwidth, every tensor it loads or stores in full once (a tensor's first read
comes from DRAM, sector waste is >= 1, the achieved bandwidth is at most the peak; compute only
adds, through a max). A split kernel also launches its combine kernel. The kernels still to
come launch each, and together they write the outputs not written yet. Summed over the
num_tokens buckets, this is never more than the modeled time of any completion, so the
generator may drop a partial design whose bound exceeds the best complete design already
modeled and verified (`search._Costed.best_us`) without losing the fastest design (it loses
slower ones: only a search that ranks, not one that lists every design, uses it).
"""

from __future__ import annotations

import math
from typing import Iterable

from prism_serve.optimize.generate.design import BlockSpec, KernelSpec, reads, writes
from prism_serve.optimize.instantiate.cost import launch_us
from prism_serve.optimize.ir.program import NUM_TOKENS, TensorType
from prism_serve.optimize.ir.sgraph import BYTES
from prism_serve.optimize.target.gpus import GpuSpec


def touched(spec: KernelSpec) -> frozenset[str]:
    """The kernel tensors a kernel loads or stores."""
    return reads(spec) | writes(spec)


def _bytes(t: TensorType, num_tokens: int) -> int:
    return math.prod(num_tokens if str(d) == NUM_TOKENS else int(d) for d in t.shape) * BYTES[t.dtype]


class DesignBound:
    """`lower_us(kernels, types, unwritten, more)`: the bound, summed over `buckets`, for a design
    that starts with `kernels`, adds `more` kernels and still has to write the outputs `unwritten`
    (`types` gives every tensor's type by name)."""

    def __init__(self, gpu: GpuSpec, buckets: tuple[int, ...]):
        self.buckets = buckets
        self.launch = launch_us(gpu)
        self.us_per_byte = 1.0 / (gpu.mem_bandwidth_gbs * 1e3)

    def lower_us(self, kernels: Iterable[KernelSpec], types: dict[str, TensorType],
                 unwritten: Iterable[str], more: int) -> float:
        launches, moved = more, list(unwritten)
        for k in kernels:
            launches += 2 if isinstance(k, BlockSpec) and k.split else 1
            moved += touched(k)
        return sum(launches * self.launch + self.us_per_byte * sum(_bytes(types[t], nt) for t in moved)
                   for nt in self.buckets)
