"""A verified design's instances: ranked per num_tokens bucket by the cost model, screened by
ptxas where asked (`tune.screen`) and, on a device, the best modeled ones measured. The search
driver (`search.py`) hands each verified design here."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.design import Design
from prism_serve.optimize.instantiate.cost import modeled_us
from prism_serve.optimize.instantiate.static import facts_json
from prism_serve.optimize.instantiate.timing import Timer
from prism_serve.optimize.instantiate.tune import (NEAR_TIE, PROBE_TOKENS, SCALE_PROBE, Candidate, best_modeled,
                                                   enumerate_instances, measure, rank, rank_open, screen,
                                                   symbol_choices, with_neighbours)
from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.verify.proof import ProofResult

# Symbol assignments up to which a verified design's instances are ranked exhaustively. Past it,
# enumerating and ranking them takes longer than the search's budget leaves (a two-kernel
# rmsnorm_linear design with a split: 85,184 assignments, 11,868 valid, 25 s), and the descent
# ranks instead: it can stop at a local optimum (joint moves of two symbols cross the ridges
# one-symbol moves stalled on; `tune.descend`), the price of a verified design within budget.
EXHAUSTIVE_ASSIGNMENTS = 20_000


def rankings(g: SGraph, gpu: GpuSpec, buckets: tuple[int, ...], keep: int = 1) -> list[list[Candidate]]:
    """A verified design's instances ranked per bucket, exhaustively (the descent that costs every
    generated design can stop at a local optimum), the last bucket, which also serves every larger
    size, by `rank_open`. A design of more than EXHAUSTIVE_ASSIGNMENTS has the descent's instance
    (`descended`) first, then, where more than one is kept, the instances one move from it
    (`tune.with_neighbours`)."""
    if math.prod(len(c) for c in symbol_choices(g).values()) > EXHAUSTIVE_ASSIGNMENTS:
        best = [descended(g, gpu, nt, open_=nt == max(buckets)) for nt in buckets]
        return [with_neighbours(g, gpu, d, open_=d.num_tokens == max(buckets)) if keep > 1 else [d] for d in best]
    instances = enumerate_instances(g, gpu)
    return [(rank_open if nt == max(buckets) else rank)(g, gpu, nt, instances) for nt in buckets]


@dataclass(frozen=True)
class Found:
    """A verified sGraph with its best instance per num_tokens bucket."""

    design: Design
    sgraph: SGraph
    proof: ProofResult
    numeric_error: float  # worst over the small-instantiation checks, relative to max |ref|
    kernels: tuple[Candidate, ...]

    def kernel_for(self, num_tokens: int) -> Candidate:
        return next(c for c in self.kernels if c.num_tokens == num_tokens)

    def to_json(self) -> dict:
        return {"design": self.design.to_json(), "describe": self.design.describe(),
                "canonical_hash": canonical_hash(self.sgraph), "sgraph": self.sgraph.to_json(),
                "proof": {"ok": self.proof.ok, "reason": self.proof.reason, "seconds": self.proof.seconds},
                "numeric_error": self.numeric_error,
                "kernels": [{"num_tokens": c.num_tokens, "params": c.assignment, "modeled_us": c.modeled_us,
                             "measured_us": c.measured_us, "ptxas": facts_json(c.facts)} for c in self.kernels]}


@dataclass(frozen=True)
class Verified:
    """A design that passed both checks, with the head of its instances' ranking per bucket."""

    design: Design
    sgraph: SGraph
    proof: ProofResult
    numeric_error: float
    rankings: tuple[tuple[Candidate, ...], ...]


def instantiate(verified: list[Verified], gpu: GpuSpec, timer: Timer | None, top: int, stats,
                static_check: bool) -> list[Found]:
    """Each verified design with its best instance per bucket: with `static_check`, the best-ranked
    ones ptxas does not spill for `gpu`'s architecture (`tune.screen`, every design's buckets in one
    go, counted in the search's `stats`); on a device, the measured best of the `top` modeled ones
    that are left."""
    ranked = [list(r) for v in verified for r in v.rankings]
    if static_check and ranked:
        t0 = time.perf_counter()
        ranked = screen(ranked, gpu.arch, want=top if timer is not None else 1)
        stats.static_s += time.perf_counter() - t0
        stats.static_spilled += sum(bool(r and r[0].facts and any(f.spills for f in r[0].facts)) for r in ranked)
    chosen = iter([(measure(r, timer, top) if timer is not None else None) or r[:1] for r in ranked])
    return [Found(v.design, v.sgraph, v.proof, v.numeric_error, tuple(next(chosen)[0] for _ in v.rankings))
            for v in verified]


def descended(g: SGraph, gpu: GpuSpec, num_tokens: int, open_: bool) -> Candidate:
    """The descent's best instance at `num_tokens`; for the open last bucket (`rank_open`'s rule
    on two candidates) the descent's best at the probe size instead where it models within
    NEAR_TIE of it at `num_tokens` and faster at the probe size."""
    best = best_modeled(g, gpu, num_tokens)
    if best is None:
        raise SGraphError(f"sGraph '{g.name}': no power-of-two assignment fits {gpu.name}")
    probe = max(SCALE_PROBE * num_tokens, PROBE_TOKENS)
    scaled = best_modeled(g, gpu, probe) if open_ else None
    if scaled is not None:
        here = Candidate(scaled.instance, num_tokens, modeled_us(scaled.instance, num_tokens, gpu))
        if here.modeled_us <= best.modeled_us * NEAR_TIE and \
                scaled.modeled_us < modeled_us(best.instance, probe, gpu):
            return here
    return best
