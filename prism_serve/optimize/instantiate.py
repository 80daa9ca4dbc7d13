"""Instantiation of plans: the best modeled instances of a plan's sGraph, chosen per segment.

Segments share no symbols and the modeled time is a sum over kernels, so ranking each
segment's instances on its own is exact and avoids the product of their search spaces.
Needs no egglog: the GPU check instantiates searched plans with this alone.
"""

from __future__ import annotations

from typing import Sequence

from prism_serve.errors import SGraphError
from prism_serve.optimize.cost import modeled_us
from prism_serve.optimize.gpus import GpuSpec
from prism_serve.optimize.ir import Program
from prism_serve.optimize.labels import index_labels
from prism_serve.optimize.lower import Plan, build, segment_sgraph
from prism_serve.optimize.reference import expand_composites
from prism_serve.optimize.sgraph import Instance, SGraph, instantiate
from prism_serve.optimize.tune import Candidate, enumerate_instances, rank


def segment_instances(prog: Program, plan: Plan, gpu: GpuSpec) -> list[tuple[SGraph, list[Instance]]]:
    """Every valid instance of each segment of `plan`, as (segment sGraph, instances)."""
    flat = expand_composites(prog)
    labels = index_labels(flat)
    out = []
    for s in plan.segments:
        g = segment_sgraph(flat, labels, s)
        instances = enumerate_instances(g, gpu)
        if not instances:
            raise SGraphError(f"segment {s.describe()} of '{prog.name}' has no instance that fits {gpu.name}")
        out.append((g, instances))
    return out


def instantiate_plan(prog: Program, plan: Plan, gpu: GpuSpec, buckets: Sequence[int],
                     g: SGraph | None = None) -> tuple[Candidate, ...]:
    """The best modeled instance of a plan per num_tokens bucket, ranked exhaustively per segment."""
    g = g or build(prog, plan)
    segments = segment_instances(prog, plan, gpu)
    out = []
    for nt in buckets:
        values: dict[str, int] = {}
        for seg_g, instances in segments:
            values |= rank(seg_g, gpu, nt, instances)[0].assignment
        inst = instantiate(g, values, gpu)
        out.append(Candidate(inst, nt, modeled_us(inst, nt, gpu)))
    return tuple(out)


def rank_plan(prog: Program, plan: Plan, gpu: GpuSpec, num_tokens: int, top: int = 5) -> list[Candidate]:
    """The best instance of the plan, then alternatives that swap one segment for its next best
    instances: the candidates to time on a device, fastest modeled first."""
    g = build(prog, plan)
    ranked = [(seg_g, rank(seg_g, gpu, num_tokens, instances)[:top]) for seg_g, instances in
              segment_instances(prog, plan, gpu)]
    best = {s: v for _, cands in ranked for s, v in cands[0].assignment.items()}
    combos = [best] + [best | c.assignment for _, cands in ranked for c in cands[1:]]
    out = []
    for values in combos:
        inst = instantiate(g, values, gpu)
        out.append(Candidate(inst, num_tokens, modeled_us(inst, num_tokens, gpu)))
    return sorted(out, key=lambda c: (c.modeled_us, c.instance.assignment))[:top]
