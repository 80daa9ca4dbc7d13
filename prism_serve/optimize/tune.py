"""Instantiation by tuning: enumerate power-of-two assignments, rank by the cost model,
and on a real GPU time the top candidates and keep the measured winner."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from prism_serve.errors import SGraphError
from prism_serve.optimize.cost import modeled_us
from prism_serve.optimize.gpus import GpuSpec
from prism_serve.optimize.sgraph import BlockKernel, Instance, SGraph, instantiate

log = logging.getLogger(__name__)
TOKEN_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_SPLIT = 1024


@dataclass(frozen=True)
class Candidate:
    instance: Instance
    num_tokens: int
    modeled_us: float
    measured_us: float | None = None

    @property
    def assignment(self) -> dict[str, int]:
        return self.instance.values


def symbol_choices(g: SGraph) -> dict[str, tuple[int, ...]]:
    """Candidate values per symbol: token blocks for token axes, powers of two up to MAX_SPLIT else.
    Divisibility and hardware limits are checked by `instantiate`."""
    choices: dict[str, tuple[int, ...]] = {}
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            for a in k.grid:
                choices[a.symbol] = TOKEN_BLOCKS if a.over_tokens else _pow2_upto(MAX_SPLIT)
            if k.forloop:
                choices[k.forloop] = _pow2_upto(MAX_SPLIT)
    return {s: choices.get(s, _pow2_upto(MAX_SPLIT)) for s in g.symbols}


def _pow2_upto(n: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(n.bit_length()) if 1 << i <= n)


def enumerate_instances(g: SGraph, gpu: GpuSpec) -> list[Instance]:
    """Every valid power-of-two instance of `g` on `gpu` (those that divide and fit)."""
    choices = symbol_choices(g)
    names = list(choices)
    out = []
    for values in itertools.product(*(choices[s] for s in names)):
        try:
            out.append(instantiate(g, dict(zip(names, values)), gpu))
        except SGraphError:
            continue
    return out


def rank(g: SGraph, gpu: GpuSpec, num_tokens: int, instances: Sequence[Instance] | None = None) -> list[Candidate]:
    """Valid instances ranked by modeled time at `num_tokens`, fastest first."""
    instances = enumerate_instances(g, gpu) if instances is None else instances
    if not instances:
        raise SGraphError(f"sGraph '{g.name}': no power-of-two assignment divides its shapes and fits {gpu.name}")
    ranked = [Candidate(i, num_tokens, modeled_us(i, num_tokens, gpu)) for i in instances]
    return sorted(ranked, key=lambda c: (c.modeled_us, c.instance.assignment))


def measure(candidates: Sequence[Candidate], timer: Callable[[Instance, int], float], top: int = 5) -> list[Candidate]:
    """Time the `top` modeled candidates with `timer(instance, num_tokens) -> us`; fastest measured first.
    A candidate whose kernel fails to compile or run is dropped with a log line."""
    timed = []
    for c in candidates[:top]:
        try:
            timed.append(Candidate(c.instance, c.num_tokens, c.modeled_us, timer(c.instance, c.num_tokens)))
        except Exception as exc:  # a compile failure of one candidate must not stop tuning
            log.warning("candidate %s failed on the device: %s", c.assignment, exc)
    return sorted(timed, key=lambda c: c.measured_us)
