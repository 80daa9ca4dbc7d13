"""Stage 1 of the search alone, for the generator's tests: every design of a Program handed to
a `_Costed`, through the driver that `optimize` runs (`search._generate`)."""

from __future__ import annotations

import math
import time

from prism_serve.optimize.generate.bound import DesignBound
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import build
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.ir.program import Program
from prism_serve.optimize.pipeline.search import MAX_GRID, SearchStats, _Costed, _generate
from prism_serve.optimize.pipeline.workers import Config, InlinePool, Pool
from prism_serve.optimize.target.gpus import GpuSpec


def generate(prog: Program, gpu: GpuSpec, buckets: tuple[int, ...], *, max_kernels: int, max_block_ops: int,
             bound: DesignBound | None = None, abstract_rule: bool = True, work: float = math.inf,
             workers: int = 1, seconds: float = 600.0) -> _Costed:
    """The designs `optimize` would cost for `work` steps (default: every one), with `workers`
    processes (1: this one); each kept design with its sGraph (the driver rebuilds those that
    stage 2 needs only)."""
    ctx = make_context(prog)
    ctx.oracle.enabled = abstract_rule
    costed = _Costed(prog, gpu, buckets, SearchStats(workers=workers))
    gen = KernelGenerator(ctx, max_kernels=max_kernels, max_block_ops=max_block_ops, max_grid=MAX_GRID, bound=bound)
    config = Config(prog, gpu, buckets, max_kernels, max_block_ops, MAX_GRID, abstract_rule, bound)
    with (Pool(workers, config) if workers > 1 else InlinePool(config, ctx)) as pool:
        _generate(pool, gen, gen.choices(), costed, work, time.perf_counter() + seconds, bound, None)
    costed.items = [(us, d, g or build(prog, d)) for us, d, g in costed.items]
    return costed
