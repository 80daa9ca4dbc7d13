"""Instances: an sGraph with every symbol assigned, checked against a GPU's limits (exact
divisibility, the resource model's registers and shared memory, the grid's launch limits)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.program import NUM_TOKENS
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel, Expr, SGraph, _exact, evaluate_dim, launch_dims
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.target.resources import KernelResources, check, kernel_resources


@dataclass(frozen=True)
class Instance:
    """An sGraph with every symbol assigned, checked against a GPU spec."""

    sgraph: SGraph
    assignment: tuple[tuple[str, int], ...]
    gpu: str

    @property
    def values(self) -> dict[str, int]:
        return dict(self.assignment)

    def concrete(self, expr: Expr, num_tokens: int | None = None) -> int:
        """A tile or tensor dim as an int; a dim of num_tokens needs `num_tokens`."""
        values = self.values | ({NUM_TOKENS: num_tokens} if num_tokens is not None else {})
        return int(evaluate_dim(expr, values))

    def tile(self, kernel: BlockKernel, name: str) -> tuple[int, ...]:
        return tuple(self.concrete(d) for d in self.sgraph.block_types(kernel)[name].shape)

    def tensor_shape(self, name: str, num_tokens: int) -> tuple[int, ...]:
        return tuple(self.concrete(d, num_tokens) for d in self.sgraph.tensors[name].shape)

    def warps(self, kernel: BlockKernel) -> int:
        """The warps a block of `kernel` launches with (the resource model's choice)."""
        return self.resources(kernel).warps

    def resources(self, kernel: BlockKernel) -> KernelResources:
        """The resource model's `KernelResources` of a block of `kernel`."""
        return kernel_resources(self.sgraph, kernel, self.values)


def instantiate(g: SGraph, assignment: Mapping[str, int], gpu: GpuSpec) -> Instance:
    """Assign every symbol; check exact divisibility and the limits of `gpu`."""
    missing = [s for s in g.symbols if s not in assignment]
    if missing:
        raise SGraphError(f"sGraph '{g.name}': symbols left unassigned: {missing}")
    extra = sorted(set(assignment) - set(g.symbols))
    if extra:
        raise SGraphError(f"sGraph '{g.name}': assignment names unknown symbols {extra}")
    bad = {s: v for s, v in assignment.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise SGraphError(f"sGraph '{g.name}': symbol values must be positive ints, got {bad}")
    values = dict(assignment)
    _check_intermediates(g, g.intermediates, values)
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            _check_limits(g, k, values, gpu)
    return Instance(g, tuple(sorted(values.items())), gpu.name)


def check_kernel(g: SGraph, k: BlockKernel, values: Mapping[str, int], gpu: GpuSpec) -> None:
    """`instantiate`'s checks that concern one kernel (the intermediates it reads or writes, its
    tiles and its grid), which hold or fail independently of the other kernels' symbols; an
    assignment that passes them for every kernel instantiates. SGraphError when one fails."""
    touched = {n.attr("tensor") for n in k.loads + k.stores}
    _check_intermediates(g, [t for t in g.intermediates if t.name in touched], values)
    _check_limits(g, k, values, gpu)


def _check_intermediates(g: SGraph, decls, values: Mapping[str, int]) -> None:
    for t in decls:
        for d in t.shape:
            if TOKENS not in d.free_symbols:  # token dims are bound at launch
                _exact(g.name, f"intermediate '{t.name}'", d, values)


def _check_limits(g: SGraph, k: BlockKernel, values: Mapping[str, int], gpu: GpuSpec) -> None:
    """Tile size, 2-D block matmuls, shared memory and registers without spilling (the resource
    model), and the grid's launch limits."""
    check(g, k, values, gpu)
    for i, dims in enumerate(launch_dims(len(k.grid))):
        extent = math.prod(values[k.grid[a].symbol] for a in dims if not k.grid[a].over_tokens)
        if extent > gpu.max_grid[i]:
            raise SGraphError(f"sGraph '{g.name}' kernel '{k.name}': grid dim {i} = "
                              f"{extent} exceeds {gpu.name}'s limit {gpu.max_grid[i]}")
